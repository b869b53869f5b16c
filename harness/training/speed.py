"""`spd-bench bench train`: training throughput per drafter kind, in target tokens per second, on one process or on
every rank under torchrun.

On the same corpus batches as `spd-bench train`, after one warm-up batch, three parts are timed separately: the
teacher pass (the frozen target's forward with hidden states, written to a scratch feature cache), reading those
outputs back from the cache (what every later epoch and run pays instead), and each drafter's optimiser step. A
drafter trained alone on fresh tokens runs at 1 / (1/teacher + 1/drafter) tokens/s, on cached ones at
1 / (1/read + 1/drafter); several drafters trained together share the teacher's cost. The whole step (teacher and
every drafter, the gradient exchange included) is timed too: per rank, its own tokens over its own time; in total,
the global batch's tokens over the slowest rank's time. Set beside a one-process record of the same global batch,
that total is the data-parallel scaling.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.training.features import FeatureCache
from harness.training.ranks import Ranks, join, rank_device
from harness.training.train import Run, TrainConfig, prepare


@dataclass
class TrainBench:
    kind: str
    drafter: str  # method and tag, e.g. spd-n8-ls4-input
    model: dict
    device: str
    threads: int  # per rank
    seq_len: int
    batch_size: int  # per rank
    world_size: int
    global_batch: int
    steps: int  # timed steps (after one warm-up)
    teacher_tokens_s: float  # rank 0's
    drafter_tokens_s: float
    alone_tokens_s: float  # this drafter trained on its own teacher pass
    read_tokens_s: float  # the teacher's outputs read back from the feature cache
    cached_tokens_s: float  # this drafter trained on cached teacher outputs (later epochs and runs)
    rank_tokens_s: list[float]  # whole steps of every drafter together on fresh tokens, each rank's own tokens
    total_tokens_s: float  # the global batch's tokens over the slowest rank's time
    versions: dict
    config_key: str


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds else 0.0


@torch.inference_mode(False)
@torch.enable_grad()
def bench_train(config: TrainConfig, timed_steps: int) -> list[TrainBench]:
    """Time `timed_steps` batches of the teacher and of every drafter in `config` (one warm-up batch first) on this
    process's rank; the records on rank 0 (none on the others)."""
    ranks = join(config.timeout, config.device)
    try:
        config = replace(config, device=rank_device(config.device),
                         tokens=(timed_steps + 1) * config.batch_size * ranks.world * config.seq_len)
        return _bench(prepare(config, ranks, training=False), timed_steps, ranks)
    finally:
        ranks.leave()


def _bench(run: Run, timed_steps: int, ranks: Ranks) -> list[TrainBench]:
    config, target, chunks, trainers = run.config, run.target, run.chunks, run.trainers
    teacher_s, read_s, drafter_s = 0.0, 0.0, [0.0] * len(trainers)
    with tempfile.TemporaryDirectory(prefix="spd-bench-features-") as scratch:
        cache = FeatureCache(target, config.corpus, config.seq_len, run.layers, run.draft_ids, root=Path(scratch))
        steps = tqdm(range(timed_steps + 1), desc="bench train", unit="batch", dynamic_ncols=True,
                     disable=not ranks.lead)
        for step in steps:
            index, rows = config.rows(step, ranks.rank)
            ids = torch.stack([chunks[i].ids for i in index]).to(target.device)
            mask = torch.stack([chunks[i].loss_mask for i in index]).to(target.device)
            timed = step > 0
            with torch.no_grad():
                began = time.perf_counter()
                cache.batch(index, ids)  # computed and written
                computed = time.perf_counter()
                taught = cache.batch(index, ids)  # read back
                teacher_s += (computed - began) * timed
                read_s += (time.perf_counter() - computed) * timed
            for position, trainer in enumerate(trainers):
                began = time.perf_counter()
                trainer.train_step(taught.features, ids, taught.p_draft, mask, config.row_rngs(step, rows))
                drafter_s[position] += (time.perf_counter() - began) * timed
    step_s = teacher_s + sum(drafter_s)  # a whole step on fresh tokens: the teacher, then every drafter
    rank_seconds = ranks.gather(step_s)
    if not ranks.lead:
        return []
    tokens = timed_steps * config.batch_size * config.seq_len  # this rank's
    rank_rates = [_rate(tokens, seconds) for seconds in rank_seconds]
    total = _rate(tokens * ranks.world, max(rank_seconds))
    results = []
    for trainer, seconds in zip(trainers, drafter_s):
        spec = {"kind": "train", "drafter": f"{trainer.spec.method}-{trainer.spec.tag}",
                "model": run.loaded.identity.to_dict(), "device": run.loaded.device.type,
                "threads": torch.get_num_threads(), "seq_len": config.seq_len, "batch_size": config.batch_size,
                "world_size": ranks.world, "global_batch": config.global_size}
        results.append(TrainBench(**spec, steps=timed_steps, teacher_tokens_s=_rate(tokens, teacher_s),
                                  drafter_tokens_s=_rate(tokens, seconds),
                                  alone_tokens_s=_rate(tokens, teacher_s + seconds),
                                  read_tokens_s=_rate(tokens, read_s), cached_tokens_s=_rate(tokens, read_s + seconds),
                                  rank_tokens_s=rank_rates, total_tokens_s=total,
                                  versions=versions(), config_key=config_key(spec)))
    return results


def record(results: list[TrainBench], out: Path) -> None:
    store = ResultStore(out)
    for result in results:
        store.append(asdict(result))


def scaling(result: TrainBench, records: list[dict]) -> float | None:
    """`result`'s total tokens/s over the latest one-process record of the same drafters, model, device, sequence
    length and global batch in `records` (None without one, or for a one-process result)."""
    same = [r for r in records if r.get("world_size", 1) == 1 and r["drafter"] == result.drafter
            and r["model"] == result.model and r["device"] == result.device and r["seq_len"] == result.seq_len
            and r.get("global_batch", r["batch_size"]) == result.global_batch and r.get("total_tokens_s")]
    if result.world_size == 1 or not same:
        return None
    return round(result.total_tokens_s / same[-1]["total_tokens_s"], 2)


def _times(ratio: float | None) -> str:
    return f"{ratio:.2f}x" if ratio else ""


def table(results: list[TrainBench], records: list[dict] = ()) -> str:
    from tabulate import tabulate

    return tabulate([(r.drafter, f"{r.world_size} x {r.threads}", r.teacher_tokens_s, r.read_tokens_s,
                      r.drafter_tokens_s, r.alone_tokens_s, r.cached_tokens_s,
                      " / ".join(f"{x:g}" for x in r.rank_tokens_s), r.total_tokens_s,
                      _times(scaling(r, list(records)))) for r in results],
                    headers=["drafter", "ranks x threads", "teacher tok/s", "cache read tok/s", "drafter tok/s",
                             "fresh tokens tok/s", "cached tokens tok/s", "step tok/s per rank", "step tok/s total",
                             "vs 1 rank"])
