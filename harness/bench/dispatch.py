"""`spd-bench bench dispatch`: what a decode step costs the host, counted exactly. Every aten op is at least one kernel
launch on a GPU and every host sync (a value read back: `item`, `int(t)`, `tolist`, `nonzero`, ...) drains the launch
queue, so both per generated token and per step are the engine's host overhead, independent of how fast this machine
is. HF `generate` on the same prompts is the yardstick."""

from __future__ import annotations

import collections
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from harness.runtime.errors import HarnessError

# Reading a value back to the host: Python's conversions of a tensor (counted where Python calls them: under
# inference mode some reach no dispatch mode), and aten ops whose result or output size depends on values.
SYNC_METHODS = {torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.__int__: "int",
                torch.Tensor.__float__: "float", torch.Tensor.__bool__: "bool", torch.Tensor.__index__: "index"}
SYNC_OPS = {"nonzero", "equal", "masked_select", "unique_consecutive", "_unique2", "unique_dim"}
PROJECT = ("harness", "methods")  # the packages whose innermost frame names where a sync comes from


def _site() -> str:
    """Where a read back comes from: the innermost project frame ("path:line"), marked "library code via" it when
    the read happens inside a library it called (HF generate's own checks, say)."""
    stack = [f for f in traceback.extract_stack() if Path(f.filename).name != "dispatch.py"
             and "torch" not in Path(f.filename).parts[-3:]]
    for depth, frame in enumerate(reversed(stack)):
        parts = Path(frame.filename).parts
        if any(p in PROJECT for p in parts):
            start = max(i for i, p in enumerate(parts) if p in PROJECT)
            site = f"{'/'.join(parts[start:])}:{frame.lineno}"
            return site if depth == 0 else f"library code via {site}"
    return "elsewhere"


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.ops += 1
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name == "index" and _bool_index(args)):
            self.counts.sync("boolean mask" if name == "index" else name)
        out = func(*args, **(kwargs or {}))
        self.counts.wrote(_written(out, (args, kwargs)))
        return out


def _written(out, inputs) -> list[int]:
    """The bytes of each tensor an op made anew: not a view of an input nor an input written in place (those share
    an input's storage)."""
    def storage(t) -> int | None:
        try:
            return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else None
        except NotImplementedError:  # a tensor without a storage of its own (oneDNN's opaque ones): not counted
            return None

    held = {storage(t) for t in pytree.tree_leaves(inputs)}
    return [t.nbytes for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and storage(t) not in held]


def _bool_index(args) -> bool:
    """Indexing with a boolean mask: its output size is the mask's count, read back first."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class _Reads(TorchFunctionMode):
    """A tensor read back by Python (`item`, `int(t)`, `tolist`, `if t:`, ...)."""

    def __init__(self, counts: Counts):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (kind := SYNC_METHODS.get(func)) is not None:
            self.counts.sync(kind)
        return func(*args, **(kwargs or {}))


@dataclass
class Counts:
    """aten ops, host syncs and bytes written of one counted region; syncs by kind and by the project line that
    caused them."""

    ops: int = 0
    syncs: int = 0
    kinds: collections.Counter = field(default_factory=collections.Counter)
    sites: collections.Counter = field(default_factory=collections.Counter)
    written: int = 0  # bytes of the tensors ops made anew (a GPU writes them to memory: traffic a step pays)
    largest: int = 0  # the most bytes one op made (a copy of a whole cache shows here)

    def wrote(self, sizes: list[int]) -> None:
        self.written += sum(sizes)
        self.largest = max([self.largest, *sizes])

    def sync(self, kind: str) -> None:
        self.syncs += 1
        self.kinds[kind] += 1
        self.sites[_site()] += 1


class counting:
    """`with counting() as counts:` counts every aten op and host sync inside the block (this thread)."""

    def __enter__(self) -> Counts:
        self.counts = Counts()
        self.modes = [_Reads(self.counts), _Ops(self.counts)]
        for mode in self.modes:
            mode.__enter__()
        return self.counts

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)


@dataclass
class DispatchResult:
    """One configuration's counts over the prompts (each decoded once after a warm-up that is not counted)."""

    kind: str
    label: str
    method: str
    params: dict
    model: dict
    dtype: str
    device: str
    dataset: str
    prompts: int
    max_new_tokens: int
    tokens: int
    steps: int
    ops: int
    syncs: int
    kinds: dict
    sites: dict  # the ten project lines that read back most
    versions: dict

    @property
    def ops_per_token(self) -> float:
        return self.ops / self.tokens

    @property
    def syncs_per_token(self) -> float:
        return self.syncs / self.tokens

    @property
    def syncs_per_step(self) -> float | None:
        return self.syncs / self.steps if self.steps else None


def count_generation(generate, prompts: list[list[int]]) -> tuple[Counts, int, int]:
    """Counts of `generate(prompt) -> (output ids, steps)` over the prompts, and the tokens and steps it made."""
    generate(prompts[0][: max(1, len(prompts[0]) // 2)])  # lazily built buffers and caches stay out of the counts
    tokens = steps = 0
    with counting() as counts:
        for prompt in prompts:
            output, made = generate(prompt)
            tokens, steps = tokens + len(output), steps + made
    return counts, tokens, steps


def table(results: list[DispatchResult]) -> str:
    from tabulate import tabulate

    rows = [(r.label, f"{r.ops_per_token:,.0f}", f"{r.syncs_per_token:.2f}",
             "—" if r.syncs_per_step is None else f"{r.syncs_per_step:.2f}",
             ", ".join(f"{site} ({n})" for site, n in list(r.sites.items())[:3]) or "—") for r in results]
    return tabulate(rows, headers=["configuration", "aten ops / token", "host syncs / token", "host syncs / step",
                                   "where the syncs come from (most first)"], tablefmt="pipe",
                    disable_numparse=True) + "\n"


def record(results: list[DispatchResult], out: Path) -> None:
    from harness.runtime.results import ResultStore, config_key

    store = ResultStore(out)
    for r in results:
        row = asdict(r)
        row["config_key"] = config_key({k: row[k] for k in ("kind", "label", "model", "dtype", "device", "dataset",
                                                           "prompts", "max_new_tokens")})
        store.append(row)


def default_configurations() -> list[str]:
    """Every registered method at its defaults, and at width 4 where it offers trees."""
    from methods.base import REGISTRY, offers

    found = []
    for name, cls in sorted(REGISTRY.items()):
        found.append(name)
        if "width" in cls.Params.__dataclass_fields__ and cls.Params().width != 4 and offers(cls, {"width": 4}):
            found.append(f"{name}:width=4")
    return found


def parse_configuration(text: str) -> tuple[str, dict]:
    """"NAME:key=value,key=value" -> (NAME, {key: value}), integers typed (the method's Params check the values)."""
    name, _, rest = text.partition(":")
    params = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise HarnessError(f"--method {text!r}: parameters must look like name:key=value,key=value")
        params[key.replace("-", "_")] = int(value) if value.lstrip("-").isdigit() else value
    return name, params


def bench_dispatch(configurations: list[str], model: str, dataset: str, prompts: int, max_new_tokens: int,
                   device: str, dtype: str | None, data_dir: str | None, skip_missing: bool = False
                   ) -> list[DispatchResult]:
    """Each configuration ("method[:key=value,...]") and HF `generate` counted on the same prompts (greedy); a
    configuration without a drafter for `model` fails, or with `skip_missing` is left out with a note."""
    from harness.bench.config import RunConfig, load_prompts, validate
    from harness.bench.data import render_prompt
    from harness.bench.runner import Runner
    from harness.bench.sweep import missing_drafter
    from harness.runtime.models import load_model, stop_ids
    from harness.runtime.provenance import versions
    from methods.sampling import Sampler, SamplingConfig

    runs = []
    for text in configurations:
        name, params = parse_configuration(text)
        config = RunConfig(method=name, params=params, model=model, datasets=(dataset,), limit=prompts,
                           max_new_tokens=max_new_tokens, device=device, dtype=dtype, data_dir=data_dir)
        validate(config)
        runs.append((text, config))
    loaded = load_model(model, device, dtype)
    samples = load_prompts(runs[0][1])
    prompt_ids = [render_prompt(loaded.tokenizer, s.prompt) for s in samples]
    common = {"model": loaded.identity.to_dict(), "dtype": str(loaded.dtype).removeprefix("torch."),
              "device": loaded.device.type, "dataset": dataset, "prompts": len(prompt_ids),
              "max_new_tokens": max_new_tokens, "versions": versions()}
    results = [_hf_generate(model, device, dtype, prompt_ids, max_new_tokens, sorted(stop_ids(loaded)), common)]
    greedy = Sampler(SamplingConfig())
    for label, config in tqdm(runs, desc="bench dispatch", unit="configuration"):
        command = missing_drafter(config, loaded.identity)
        if command is not None:
            if not skip_missing:
                raise HarnessError(f"{label}: no drafter for {model}; train it with: {command}")
            tqdm.write(f"note: {label} left out: no drafter for {model} (train it with: {command})")
            continue
        method = Runner(config, loaded).load_method(config.method, config.params, max(map(len, prompt_ids)))

        def generate(ids, method=method):
            made = method.generate(ids, max_new_tokens, greedy)
            return made.output_ids, made.steps

        with torch.inference_mode():
            counts, tokens, steps = count_generation(generate, prompt_ids)
        results.append(_result(label, config.method, config.params, counts, tokens, steps, common))
    return results


def _hf_generate(model, device, dtype, prompt_ids, max_new_tokens, stops, common) -> DispatchResult:
    """HF `generate` (greedy, the same stopping rule as ours) on an untouched copy of the model, as a user runs it."""
    from harness.runtime.models import load_model

    reference = load_model(model, device, dtype)

    def generate(ids):
        out = reference.model.generate(torch.tensor([ids], device=reference.device), max_new_tokens=max_new_tokens,
                                       do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        made = out.shape[1] - len(ids)
        return range(made), made - 1  # one forward per token after the prefill's

    with torch.inference_mode():
        counts, tokens, steps = count_generation(generate, prompt_ids)
    return _result("HF generate (greedy)", "hf-generate", {}, counts, tokens, steps, common)


def _result(label, method, params, counts: Counts, tokens, steps, common) -> DispatchResult:
    return DispatchResult(kind="bench-dispatch", label=label, method=method, params=params, tokens=tokens,
                          steps=steps, ops=counts.ops, syncs=counts.syncs, kinds=dict(counts.kinds.most_common()),
                          sites=dict(counts.sites.most_common(10)), **common)
