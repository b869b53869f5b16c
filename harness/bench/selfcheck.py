"""A self-check for a machine with no checkpoints and no network (`spd-bench selfcheck`, `make gpu-check`).

Randomly initialised models of real shapes (a Qwen3.5-4B-shaped hybrid of Gated DeltaNet and gated attention
layers, and a Qwen3-4B-shaped one with attention only; `--shapes tiny` for a CPU) run every method at T=0 on random
prompts, checked token by token against the harness's greedy AR; the harness's AR is timed against HF `generate`;
the distributed executor runs its ranks on the same device; with `--compile on` every method runs again through the
compiled step (on CUDA: static shapes replayed as CUDA graphs), checked against the eager AR. Drafters are random too, so to reach the accept paths
an oracle proposes AR's next token part of the time. Random weights leave many near-ties, where two correct kernels
may pick different tokens: a method's divergence is classified by replaying both sides (harness/runtime/verdict.py),
a numerics flip reported as such, not a failure; HF `generate`, whose logits are not replayed here, is allowed a
divergence whose top-2 logit margin is below `TIE`.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.runtime.compiled import warm
from harness.runtime.errors import HarnessError, first_line
from harness.runtime.target import TargetRuntime

TIE = 0.05  # logits: bf16 carries about 3 significant digits, random-init logits are O(1)

QWEN3_5_4B = dict(hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=256, vocab_size=248320, linear_num_key_heads=16,
                  linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, tie_word_embeddings=True)
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
TINY = dict(hidden_size=64, num_hidden_layers=8, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=512, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False)
SHAPES = ("real", "tiny")


@dataclass
class Check:
    model: str
    method: str
    samples: int
    identical: int
    ties: int  # numerics flips (a method's), or near-ties below TIE (HF generate's)
    tokens_per_step: float
    tokens_s: float
    note: str = ""
    error: str = ""  # why the check could not run (then it failed)

    @property
    def ok(self) -> bool:
        return not self.error and self.identical + self.ties == self.samples


def build_model(arch: str, shape: str, device: str, dtype: torch.dtype, seed: int = 0,
                layers: int | None = None) -> torch.nn.Module:
    """A randomly initialised model of real (or tiny) shapes; `layers` keeps only the first few."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig, Qwen3Config

    sizes = dict(TINY if shape == "tiny" else QWEN3_5_4B if arch == "qwen3_5" else QWEN3_4B)
    sizes["num_hidden_layers"] = layers or sizes["num_hidden_layers"]
    if arch == "qwen3_5":
        layers = sizes["num_hidden_layers"]
        config = Qwen3_5TextConfig(**sizes, max_position_embeddings=4096,
                                   layer_types=[("linear_attention", "linear_attention", "linear_attention",
                                                 "full_attention")[i % 4] for i in range(layers)])
    else:
        config = Qwen3Config(**{k: v for k, v in sizes.items() if not k.startswith("linear_")},
                             max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: a 4B model initialises in seconds on a GPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _with_oracle(method, prompt: list[int], reference: list[int]):
    """The method with a drafter that proposes AR's next token 70% of the time (SelfChecks.with_oracle); a method
    without self-check drafters (AR on a compiled runtime) as it is."""
    from methods.capabilities import SelfChecks

    if not isinstance(method, SelfChecks):
        return method
    return method.with_oracle({len(prompt) + i: t for i, t in enumerate(reference)}, 0.7)


def _methods(target: TargetRuntime) -> list[tuple[str, object]]:
    """Every method the harness runs, with random drafters (each family's self-check cases)."""
    from methods.base import REGISTRY
    from methods.capabilities import SelfChecks

    return [case for cls in REGISTRY.values() if issubclass(cls, SelfChecks) for case in cls.selfcheck_cases(target)]


def check_methods(name: str, model, prompts: list[list[int]], new_tokens: int, compile: str = "off"
                  ) -> Iterator[Check]:
    """Every method against the eager AR's tokens, on a runtime compiled as `compile` says (labelled so), each
    method's check yielded as it finishes; a method that fails is one failed check and the others still run."""
    from methods.base import build_method
    from methods.sampling import Sampler, SamplingConfig

    max_len = max(map(len, prompts)) + new_tokens + 64
    eager = TargetRuntime(model, max_len=max_len)
    greedy = Sampler(SamplingConfig())
    eager_ar = build_method("autoregressive", eager, {}, set())
    with torch.inference_mode():
        runs = [eager_ar.generate(p, new_tokens, greedy) for p in prompts]
    target = eager if compile == "off" else TargetRuntime(model, max_len=max_len, compile=compile)
    if compile != "off":
        name = f"{name}, compiled"
    ar = eager_ar if compile == "off" else build_method("autoregressive", target, {}, set())
    for label, method in [("autoregressive", ar), *_methods(target)]:
        yield guarded(name, label, lambda: _check_method(name, label, method, eager_ar, target, prompts, runs,
                                                         new_tokens))


def _check_method(name, label, method, eager_ar, target, prompts, runs, new_tokens) -> Check:
    from harness.runtime.lossless import Replay, compare
    from methods.sampling import Sampler, SamplingConfig

    identical = ties = tokens = steps = 0
    seconds = 0.0
    greedy = Sampler(SamplingConfig())
    for prompt, run in zip(prompts, runs):
        def decode(prompt=prompt, run=run):
            return run if method is eager_ar else \
                _with_oracle(method, prompt, run.output_ids).generate(prompt, new_tokens, greedy)

        replay = Replay(lambda: decode().output_ids, lambda n, prompt=prompt: eager_ar.generate(prompt, n, greedy)
                        .output_ids, eager_ar.target)
        with torch.inference_mode():  # the eager AR's row is the reference runs themselves
            # compiled: decoded again while a decode compiled or recorded a graph, so the timed one holds neither
            generation = warm(target.compiled, decode)
            verdict = compare(target, prompt, generation.output_ids, run.output_ids, replay)
        identical += verdict["identical"]
        ties += verdict["verdict"] == "flip"
        tokens += len(generation.output_ids) - 1
        steps += generation.steps
        seconds += generation.timing.get("decode", 0.0)
    note = _engine_note(target.engine()["compile"]) if label == "autoregressive" and target.compiled else ""
    return Check(name, label, len(prompts), identical, ties, round(tokens / max(steps, 1), 3),
                 round(tokens / seconds, 1) if seconds else 0.0, note)


def guarded(model: str, what: str, run: Callable[[], Check]) -> Check:
    """run(), or where it raises, a failed check that names the error in one line."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - a failed check is one line in its record; the others still run
        return Check(model, what, 0, 0, 0, 0.0, 0.0, error=f"{type(exc).__name__}: {first_line(exc)}")


def _engine_note(compiled: dict) -> str:
    if compiled["engine"] != "inductor":
        return f"ran eager: {compiled['why']}"
    graphs = f", {compiled['cuda_graph_recordings']} CUDA graphs" if compiled["cuda_graphs"] else \
        ", no CUDA graph recorded" if "cuda_graph_recordings" in compiled else ""
    return f"{compiled['shapes']} shapes{graphs}: {compiled['graphs']} graphs in {compiled['compile_s']} s"


def time_against_hf(name: str, model, prompts: list[list[int]], new_tokens: int) -> Check:
    """Harness AR vs HF `generate` (greedy, no stop token) on the same prompts: tokens/s of each."""
    from harness.runtime.lossless import compare
    from methods.base import build_method
    from methods.sampling import Sampler, SamplingConfig

    target = TargetRuntime(model, max_len=max(map(len, prompts)) + new_tokens + 8)
    ar = build_method("autoregressive", target, {}, set())
    ours = theirs = 0.0
    same = ties = 0
    for prompt in prompts:
        with torch.inference_mode():
            generation = ar.generate(prompt, new_tokens, Sampler(SamplingConfig()))
            ours += generation.timing["decode"]
            ids = torch.tensor([prompt], device=target.device)
            _sync(target.device)
            start = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            _sync(target.device)
            theirs += time.perf_counter() - start
            verdict = compare(target, prompt, out[0, len(prompt):].tolist(), generation.output_ids)
        same += verdict["identical"]
        ties += _tie(verdict)
    tokens = len(prompts) * (new_tokens - 1)
    return Check(name, "HF generate", len(prompts), same, ties, 1.0, round(len(prompts) * new_tokens / theirs, 1),
                 note=f"harness AR {tokens / ours:.1f} tok/s (decode after the prefill token)")


def _tie(verdict: dict) -> bool:
    return not verdict["identical"] and verdict["margin"] is not None and verdict["margin"] < TIE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_distributed(device: str, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int
                      ) -> Iterator[Check]:
    """Each family that serves ranks, its ranks in processes of their own on `device` (a tiny model: every rank loads
    it from disk, and what else a rank loads is saved beside it)."""
    from harness.runtime.models import load_model
    from methods.base import REGISTRY, build_method
    from methods.capabilities import Serves
    from methods.sampling import Sampler, SamplingConfig

    dtype_name = str(dtype).removeprefix("torch.")
    with tempfile.TemporaryDirectory() as scratch:
        folder = f"{scratch}/target"
        build_model("qwen3_5", "tiny", "cpu", dtype).save_pretrained(folder)
        loaded = load_model(folder, device, dtype_name, tokenizer=False)
        target = TargetRuntime(loaded.model, max_len=max(map(len, prompts)) + new_tokens + 64, identity=loaded.identity)
        ar = build_method("autoregressive", target, {}, set())
        with torch.inference_mode():
            references = [ar.generate(p, new_tokens, Sampler(SamplingConfig())).output_ids for p in prompts]
        cases = [cls.selfcheck_distributed(target, Path(scratch)) for cls in REGISTRY.values()
                 if issubclass(cls, Serves)]
        for label, method, ranks in (case for case in cases if case is not None):
            yield guarded("tiny qwen3_5", f"{label} distributed", lambda: _check_distributed_case(
                label, method, ranks, folder, device, dtype_name, prompts, references, new_tokens))


def _check_distributed_case(label, method, ranks: int, folder: str, device: str, dtype_name: str,
                            prompts: list[list[int]], references: list[list[int]], new_tokens: int) -> Check:
    from harness.runtime import distributed as launch
    from methods.sampling import Sampler, SamplingConfig

    identical = 0
    for prompt, reference in zip(prompts, references):  # a group per prompt: an oracle travels in the plan
        with launch.stage_group(folder, device, [device] * ranks, timeout_s=300) as group:
            oracle = _with_oracle(method, prompt, reference)
            executor = oracle.distribute(group, dtype_name)
            with torch.inference_mode():
                output = oracle.generate(prompt, new_tokens, Sampler(SamplingConfig())).output_ids
            executor.close()
        identical += output == reference
    return Check("tiny qwen3_5", f"{label} distributed ({group.backend})", len(prompts), identical, 0, 0.0, 0.0)


def selfcheck(device: str, shape: str, prompts: int, new_tokens: int, dtype: torch.dtype, compile: str = "off"
              ) -> Iterator[Check]:
    """Every check, each yielded as it finishes (so a caller writes its record at once and a later crash loses
    nothing before it); a step that fails is one failed check, and the steps after it still run."""
    if shape not in SHAPES:
        raise HarnessError(f"--shapes must be one of {', '.join(SHAPES)}, got {shape!r}")
    generator = torch.Generator().manual_seed(0)
    for arch in ("qwen3_5", "qwen3"):
        name = f"{arch} ({'random, real shape' if shape == 'real' else 'tiny'})"
        built = guarded(name, "build", lambda: build_model(arch, shape, device, dtype))
        if isinstance(built, Check):
            yield built
            continue
        model, vocab = built, built.config.vocab_size
        batch = [torch.randint(1, vocab, (int(length),), generator=generator, device="cpu").tolist()
                 for length in torch.randint(1, 40, (prompts,), generator=generator, device="cpu")]
        yield from _steps(name, "methods", lambda: check_methods(name, model, batch, new_tokens))
        yield guarded(name, "HF generate", lambda: time_against_hf(name, model, batch, new_tokens))
        if compile != "off":
            yield from _steps(name, "methods, compiled", lambda: check_methods(name, model, batch, new_tokens,
                                                                             compile))
        model = built = None  # freed before the next model is built
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    yield from _steps("tiny qwen3_5", "distributed", lambda: check_distributed(device, dtype, [[1, 2, 3], [7]],
                                                                               new_tokens))


def _steps(model: str, what: str, checks: Callable[[], Iterable[Check]]) -> Iterator[Check]:
    """The checks a step yields, and a failed check where the step itself raises (its checks so far kept)."""
    try:
        yield from checks()
    except Exception as exc:  # noqa: BLE001 - one line in the records; the steps after it still run
        yield Check(model, what, 0, 0, 0, 0.0, 0.0, error=f"{type(exc).__name__}: {first_line(exc)}")


def table(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.model, c.method, f"{c.identical}/{c.samples}", c.ties, c.tokens_per_step or "—", c.tokens_s or "—",
             "ok" if c.ok else "FAIL", c.error or c.note) for c in checks]
    return tabulate(rows, headers=["model", "method", "identical to AR", "flips / near-ties", "tokens/step", "tok/s",
                                   "verdict", "note"], disable_numparse=True)


def line(check: Check) -> str:
    """A check as one line, printed as it finishes."""
    ties = f", {check.ties} {'near-ties' if check.method == 'HF generate' else 'numerics flips'}" if check.ties else ""
    said = f" ({check.error or check.note})" if check.error or check.note else ""
    return f"{'ok' if check.ok else 'FAIL'}: {check.model}, {check.method}: {check.identical}/{check.samples} " \
           f"identical to AR{ties}{said}"


def summary(checks: list[Check], device: str, dtype: torch.dtype, compile: str) -> str:
    """One line to paste into an issue beside the table: where it ran, on what, and how it ended."""
    where = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else device
    flips = sum(c.ties for c in checks if c.method != "HF generate")
    return (f"selfcheck on {where}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"{str(dtype).removeprefix('torch.')}, --compile {compile}: {sum(c.ok for c in checks)} of {len(checks)} "
            f"checks pass, {flips} numerics flips")


def record(check: Check, device: str, dtype: torch.dtype) -> dict:
    versions = {"torch": torch.__version__}
    if device.startswith("cuda"):
        versions["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return {"kind": "selfcheck", "device": device, "dtype": str(dtype).removeprefix("torch."), **asdict(check),
            "ok": check.ok, "versions": versions}
