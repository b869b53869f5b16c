"""A self-check for a machine with no checkpoints and no network (`spd-bench selfcheck`, `make gpu-check`).

Randomly initialised models of real shapes (a Qwen3.5-4B-shaped hybrid of Gated DeltaNet and gated attention
layers, and a Qwen3-4B-shaped one with attention only; `--shapes tiny` for a CPU) run every method at T=0 on random
prompts, checked token by token against the harness's greedy AR; the harness's AR is timed against HF `generate`;
the distributed executor runs its ranks on the same device. Drafters are random too, so to reach the accept paths
an oracle proposes AR's next token part of the time. Random weights leave many near-ties, where two correct kernels
may pick different tokens: a divergence whose top-2 logit margin is below `TIE` is reported as a tie, not a failure.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.ssd.method import SSD
from methods.ssd.speculate import Speculation

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
    ties: int
    tokens_per_step: float
    tokens_s: float
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.identical + self.ties == self.samples


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


def _oracle_class(reference: dict[int, int], hit_rate: float):
    """A pipeline drafter that proposes AR's next token with probability `hit_rate`, else its own pick."""
    from methods.pipeline.drafter import Drafter

    rng = torch.Generator().manual_seed(0)

    class Oracle(Drafter):
        def logits(self, finished, levels):
            out = super().logits(finished, levels).clone()
            for i, leaf in enumerate(levels[-1] if levels else finished[-1:]):
                token = reference.get(leaf.position + 1)
                if token is not None and float(torch.rand((), generator=rng)) < hit_rate:
                    out[i] = -1e4
                    out[i, token] = 1e4
            return out

    return Oracle


class OracleSpeculation(Speculation):
    """SSD's drafter side drafting, and guessing, the greedy reference token first with probability `hit_rate` per
    row, so cache hits and misses both occur with a random head; its state travels to a drafter rank with the plan."""

    def __init__(self, drafter, params, reference: dict[int, int], hit_rate: float, rng: torch.Generator | None = None):
        super().__init__(drafter, params)
        self.reference, self.hit_rate = reference, hit_rate
        self.rng = rng or torch.Generator().manual_seed(0)

    def logits(self, states, positions):
        logits = super().logits(states, positions).clone()
        for row, position in enumerate(positions):
            right = self.reference.get(position)
            if right is not None and float(torch.rand((), generator=self.rng)) < self.hit_rate:
                logits[row] = -10.0
                logits[row, right] = 10.0
        return logits

    def plan_state(self) -> dict:
        return {"reference": self.reference, "hit_rate": self.hit_rate, "rng": self.rng}


def ssd_oracle(method: SSD, reference: dict[int, int], hit_rate: float) -> SSD:
    """`method` with the oracle's drafter side in place of its own (a fresh oracle each call)."""
    method.speculation = OracleSpeculation(method.drafter, method.params, reference, hit_rate)
    return method


def _with_oracle(method, prompt: list[int], reference: list[int]):
    """The method with a drafter that proposes AR's next token 70% of the time (pipeline engines, SSD)."""
    by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
    if hasattr(method, "engine"):
        method.engine.drafter_class = _oracle_class(by_position, 0.7)
    if isinstance(method, SSD):
        return ssd_oracle(method, by_position, 0.7)
    return method


def _methods(target: TargetRuntime) -> list[tuple[str, object]]:
    """Every method the harness runs, with random drafters, as chains and as width-4 trees."""
    from methods.eagle3.head import EagleConfig, EagleHead
    from methods.eagle3.method import EAGLE3, EagleParams
    from methods.pipeline.ppsd import PPSD
    from methods.pipeline.spd import SPD
    from methods.pipeline.speculator import Speculator, SpeculatorConfig
    from methods.ssd.method import SSDParams

    found = []
    widths = (1, 4)
    for cls, schedule in ((SPD, "input"), (SPD, "output"), (PPSD, "output")):
        for width in widths:
            config = SpeculatorConfig(n=4, ls=1, schedule=schedule, policy=cls.policy, num_layers=target.num_layers)
            speculator = Speculator(config, target).eval()
            params = cls.Params(n=4, ls=1, schedule=schedule, width=width)
            found.append((f"{cls.name} n=4 ls=1 {schedule} w={width}", cls(target, params, set(), speculator=speculator)))
    for width in widths:
        head = EagleHead(EagleConfig(ttt=3, num_layers=target.num_layers), target).eval()
        found.append((f"eagle3 m=3 w={width}", EAGLE3(target, EagleParams(m=3, width=width, ttt=3), set(), head=head)))
    head = EagleHead(EagleConfig(ttt=3, num_layers=target.num_layers), target).eval()
    found.append(("ssd k=3 fan_out=2", SSD(target, SSDParams(k=3, fan_out=2, ttt=3), set(), head=head)))
    return found


def check_methods(name: str, model, prompts: list[list[int]], new_tokens: int) -> list[Check]:
    from harness.runtime.lossless import compare
    from methods.base import build_method
    from methods.sampling import Sampler, SamplingConfig

    target = TargetRuntime(model, max_len=max(map(len, prompts)) + new_tokens + 64)
    greedy = Sampler(SamplingConfig())
    ar = build_method("autoregressive", target, {}, set())
    references = [ar.generate(p, new_tokens, greedy).output_ids for p in prompts]
    checks = []
    for label, method in [("autoregressive", ar), *_methods(target)]:
        identical = ties = tokens = steps = 0
        seconds = 0.0
        for prompt, reference in zip(prompts, references):
            with torch.inference_mode():
                generation = _with_oracle(method, prompt, reference).generate(prompt, new_tokens, greedy)
                verdict = compare(target, prompt, generation.output_ids, reference)
            identical += verdict["identical"]
            ties += _tie(verdict)
            tokens += len(generation.output_ids) - 1
            steps += generation.steps
            seconds += generation.timing.get("decode", 0.0)
        checks.append(Check(name, label, len(prompts), identical, ties, round(tokens / max(steps, 1), 3),
                            round(tokens / seconds, 1) if seconds else 0.0))
    return checks


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


def check_distributed(device: str, dtype: torch.dtype, prompts: list[list[int]], new_tokens: int) -> list[Check]:
    """SPD n=2 with one process per stage, and SSD with its drafter in a process of its own, on `device` (a tiny
    model: every rank loads it from disk; SSD's random head is saved as its checkpoint for the drafter's rank)."""
    from harness.runtime import checkpoints
    from harness.runtime import distributed as launch
    from harness.runtime.models import load_model
    from methods.base import build_method
    from methods.eagle3.head import EagleConfig, EagleHead
    from methods.pipeline.spd import SPD
    from methods.pipeline.speculator import Speculator, SpeculatorConfig
    from methods.sampling import Sampler, SamplingConfig
    from methods.ssd.method import SSDParams

    dtype_name = str(dtype).removeprefix("torch.")
    checks = []
    with tempfile.TemporaryDirectory() as scratch:
        folder, head = f"{scratch}/target", Path(scratch) / "ssd-head"
        build_model("qwen3_5", "tiny", "cpu", dtype).save_pretrained(folder)
        loaded = load_model(folder, device, dtype_name, tokenizer=False)
        target = TargetRuntime(loaded.model, max_len=max(map(len, prompts)) + new_tokens + 64, identity=loaded.identity)
        ar = build_method("autoregressive", target, {}, set())
        with torch.inference_mode():
            references = [ar.generate(p, new_tokens, Sampler(SamplingConfig())).output_ids for p in prompts]
        speculator = Speculator(SpeculatorConfig(n=2, ls=1, num_layers=target.num_layers), target).eval()
        spd = SPD(target, SPD.Params(n=2, ls=1), set(), speculator=speculator)
        head_config = EagleConfig(ttt=3, num_layers=target.num_layers, target=loaded.identity.to_dict())
        checkpoints.save(head, EagleHead(head_config, target).eval(),
                         {"eagle": head_config.to_dict(), "target": head_config.target, "method": "eagle3"})
        ssd = SSD(target, SSDParams(k=3, fan_out=2, ttt=3), set(), checkpoint=str(head))
        for label, method, ranks in (("spd n=2", spd, 2), ("ssd k=3 fan_out=2", ssd, 1)):
            identical = 0
            for prompt, reference in zip(prompts, references):  # a group per prompt: SSD's oracle travels in the plan
                with launch.stage_group(folder, device, [device] * ranks, timeout_s=300) as group:
                    oracle = _with_oracle(method, prompt, reference)
                    executor = oracle.distribute(group, dtype_name)
                    with torch.inference_mode():
                        output = oracle.generate(prompt, new_tokens, Sampler(SamplingConfig())).output_ids
                    executor.close()
                identical += output == reference
            checks.append(Check("tiny qwen3_5", f"{label} distributed ({group.backend})", len(prompts), identical, 0,
                                0.0, 0.0))
    return checks


def selfcheck(device: str, shape: str, prompts: int, new_tokens: int, dtype: torch.dtype) -> list[Check]:
    if shape not in SHAPES:
        raise HarnessError(f"--shapes must be one of {', '.join(SHAPES)}, got {shape!r}")
    generator = torch.Generator().manual_seed(0)
    checks = []
    for arch in ("qwen3_5", "qwen3"):
        model = build_model(arch, shape, device, dtype)
        vocab = model.config.vocab_size
        batch = [torch.randint(1, vocab, (int(length),), generator=generator).tolist()
                 for length in torch.randint(1, 40, (prompts,), generator=generator)]
        name = f"{arch} ({'random, real shape' if shape == 'real' else 'tiny'})"
        checks += check_methods(name, model, batch, new_tokens)
        checks.append(time_against_hf(name, model, batch, new_tokens))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    checks += check_distributed(device, dtype, [[1, 2, 3], [7]], new_tokens)
    return checks


def table(checks: list[Check]) -> str:
    from tabulate import tabulate

    rows = [(c.model, c.method, f"{c.identical}/{c.samples}", c.ties, c.tokens_per_step or "—", c.tokens_s or "—",
             "ok" if c.ok else "FAIL", c.note) for c in checks]
    return tabulate(rows, headers=["model", "method", "identical to AR", "near-ties", "tokens/step", "tok/s",
                                   "verdict", "note"], disable_numparse=True)


def record(checks: list[Check], device: str) -> list[dict]:
    versions = {"torch": torch.__version__}
    if device.startswith("cuda"):
        versions["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return [{"kind": "selfcheck", "device": device, **asdict(c), "ok": c.ok, "versions": versions} for c in checks]
