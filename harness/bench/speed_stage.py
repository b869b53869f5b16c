"""`spd-bench bench stage`: the cost of one pipeline stage call on a level of W draft branches against W = 1.

Each stage of an n-stage split runs one level at the position after a prompt, as the pipeline does in steady state:
width 1 as a plain causal call, width W as a tree (sibling slots, tree mask; linear-attention layers take the
branches as rows of a batch, each continuing its parent's state). Per stage and width: median wall time over the
repeats, and the memory a branch adds: its KV (attention layers) and its conv + recurrent state (linear layers).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tabulate import tabulate

from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.runtime.target import TargetRuntime, stage_bounds


@dataclass
class StageCost:
    kind: str
    model: str
    device: str
    dtype: str
    n: int
    stage: int
    layers: int
    linear_layers: int
    width: int
    prompt_len: int
    repeats: int
    median_ms: float
    kv_bytes_per_branch: int  # keys + values of one token in this stage's attention layers
    linear_bytes_per_branch: int  # conv + recurrent state of one branch in this stage's linear layers
    versions: dict
    config_key: str  # the model, split, width, dtype and device measured


def bench_stages(target: TargetRuntime, model_name: str, n: int, widths: list[int], prompt_len: int,
                 repeats: int) -> list[StageCost]:
    """Every stage of the n-stage split, at each width, after a `prompt_len`-token prefill. The widths take turns
    call by call (ABAB), so a machine whose speed drifts during the run slows them alike; the first round warms up.
    Each call reads the prefill and writes only its own slots, so the turns do not disturb one another."""
    results = []
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.config.vocab_size, (prompt_len,), generator=gen, device=gen.device)
    with torch.inference_mode():
        target.reset()
        target.forward(prompt.to(target.device), 0)
        hidden = {width: target.embed(torch.randint(0, target.config.vocab_size, (width,), generator=gen,
                                                    device=gen.device))
                  for width in widths}
        seconds: dict[tuple[int, int], list[float]] = {}
        for stage, (lo, hi) in enumerate(stage_bounds(target.num_layers, n)):
            for round_ in range(repeats + 1):
                for width in widths:
                    elapsed = _timed_call(target, lo, hi, hidden[width], prompt_len, width)
                    if round_:
                        seconds.setdefault((width, stage), []).append(elapsed)
        for width in widths:
            for stage, (lo, hi) in enumerate(stage_bounds(target.num_layers, n)):
                results.append(StageCost(
                    "bench-stage", model_name, target.device.type, str(target.dtype).removeprefix("torch."), n, stage,
                    hi - lo, sum(t == "linear_attention" for t in target.layer_types[lo:hi]), width, prompt_len,
                    repeats, 1000 * statistics.median(seconds[width, stage]), _kv_bytes(target, lo, hi),
                    _linear_bytes(target, lo, hi, prompt_len + width - 1), versions(),
                    config_key({"kind": "bench-stage", "model": model_name, "n": n, "stage": stage, "width": width,
                                "prompt_len": prompt_len, "dtype": str(target.dtype), "device": target.device.type})))
    return results


def _timed_call(target: TargetRuntime, lo: int, hi: int, hidden: torch.Tensor, position: int, width: int) -> float:
    """One level at `position`: a chain call at width 1, a tree of `width` siblings of the last prompt token else."""
    positions, tree = range(position, position + 1), {}
    if width > 1:
        positions = torch.full((width,), position, device=target.device)
        slots = position + torch.arange(width, device=target.device)
        mask = torch.zeros(width, position + width, dtype=torch.bool, device=target.device)
        mask[:, :position] = True
        mask[torch.arange(width), slots] = True
        tree = {"slots": slots, "mask": mask, "parents": torch.full((width,), position - 1, device=target.device)}
    _sync(target)
    start = time.perf_counter()
    target.run_layers(lo, hi, hidden, positions, **tree)
    _sync(target)
    return time.perf_counter() - start


def _sync(target: TargetRuntime) -> None:
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)


def _kv_bytes(target: TargetRuntime, lo: int, hi: int) -> int:
    return target.cache.kv_bytes(range(lo, hi))


def _linear_bytes(target: TargetRuntime, lo: int, hi: int, label: int) -> int:
    """The state one branch keeps per linear layer of the stage: the row filed under the last sibling's slot."""
    total = 0
    for layer, store in target.cache.linear.items():
        if lo <= layer < hi and label in store:
            row = store[label]
            total += row.conv.numel() * row.conv.element_size() + row.recurrent.numel() * row.recurrent.element_size()
    return total


def record(results: list[StageCost], path: Path) -> None:
    store = ResultStore(path)
    for result in results:
        store.append(asdict(result))


def table(results: list[StageCost]) -> str:
    """Per stage: ms at each width, the ratio to width 1, and what a branch costs in memory."""
    base = {(r.stage,): r.median_ms for r in results if r.width == 1}
    rows = [[r.stage, f"{r.layers} ({r.linear_layers} linear)", r.width, f"{r.median_ms:.2f}",
             f"{r.median_ms / base[(r.stage,)]:.2f}x" if (r.stage,) in base else "—",
             f"{r.kv_bytes_per_branch / 2**10:.1f}", f"{r.linear_bytes_per_branch / 2**20:.3f}"] for r in results]
    return tabulate(rows, headers=["stage", "layers", "width", "ms / call", "vs width 1", "KV KiB / branch",
                                   "linear state MiB / branch"], tablefmt="pipe")
