"""`spd-bench bench train`: training throughput per drafter kind, in target tokens per second.

On the same corpus batches as `spd-bench train`, after one warm-up batch, three parts are timed separately: the
teacher pass (the frozen target's forward with hidden states, written to a scratch feature cache), reading those
outputs back from the cache (what every later epoch and run pays instead), and each drafter's optimiser step. A
drafter trained alone on fresh tokens runs at 1 / (1/teacher + 1/drafter) tokens/s, on cached ones at
1 / (1/read + 1/drafter); several drafters trained together share the teacher's cost.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from harness.runtime.provenance import versions
from harness.runtime.results import ResultStore, config_key
from harness.training.features import FeatureCache
from harness.training.train import TrainConfig, prepare


@dataclass
class TrainBench:
    kind: str
    drafter: str  # method and tag, e.g. spd-n8-ls4-input
    model: dict
    device: str
    threads: int
    seq_len: int
    batch_size: int
    steps: int  # timed steps (after one warm-up)
    teacher_tokens_s: float
    drafter_tokens_s: float
    alone_tokens_s: float  # this drafter trained on its own teacher pass
    read_tokens_s: float  # the teacher's outputs read back from the feature cache
    cached_tokens_s: float  # this drafter trained on cached teacher outputs (later epochs and runs)
    versions: dict
    config_key: str


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds else 0.0


@torch.inference_mode(False)
@torch.enable_grad()
def bench_train(config: TrainConfig, timed_steps: int) -> list[TrainBench]:
    """Time `timed_steps` batches of the teacher and of every drafter in `config` (one warm-up batch first)."""
    config.tokens = (timed_steps + 1) * config.batch_size * config.seq_len
    run = prepare(config)
    loaded, target, chunks, draft_ids, trainers, layers = (run.loaded, run.target, run.chunks, run.draft_ids,
                                                           run.trainers, run.layers)
    teacher_s, read_s, drafter_s = 0.0, 0.0, [0.0] * len(trainers)
    with tempfile.TemporaryDirectory(prefix="spd-bench-features-") as scratch:
        cache = FeatureCache(target, config.corpus, config.seq_len, layers, draft_ids, root=Path(scratch))
        for step in tqdm(range(timed_steps + 1), desc="bench train", unit="batch", dynamic_ncols=True):
            index = config.batch_chunks(step)
            ids = torch.stack([chunks[i].ids for i in index]).to(target.device)
            mask = torch.stack([chunks[i].loss_mask for i in index]).to(target.device)
            with torch.no_grad():
                began = time.perf_counter()
                cache.batch(index, ids)  # computed and written
                computed = time.perf_counter()
                taught = cache.batch(index, ids)  # read back
                teacher_s += (computed - began) * (step > 0)
                read_s += (time.perf_counter() - computed) * (step > 0)
            for position, trainer in enumerate(trainers):
                began = time.perf_counter()
                trainer.train_step(taught.features, ids, taught.p_draft, mask, config.row_rngs(step, range(len(index))))
                drafter_s[position] += (time.perf_counter() - began) * (step > 0)
    tokens = timed_steps * config.batch_size * config.seq_len
    teacher_rate = _rate(tokens, teacher_s)
    results = []
    for trainer, seconds in zip(trainers, drafter_s):
        spec = {"kind": "train", "drafter": f"{trainer.spec.method}-{trainer.spec.tag}",
                "model": loaded.identity.to_dict(), "device": loaded.device.type, "threads": torch.get_num_threads(), "seq_len": config.seq_len,
                "batch_size": config.batch_size}
        results.append(TrainBench(**spec, steps=timed_steps, teacher_tokens_s=teacher_rate,
                                  drafter_tokens_s=_rate(tokens, seconds),
                                  alone_tokens_s=_rate(tokens, teacher_s + seconds),
                                  read_tokens_s=_rate(tokens, read_s), cached_tokens_s=_rate(tokens, read_s + seconds),
                                  versions=versions(), config_key=config_key(spec)))
    return results


def record(results: list[TrainBench], out: Path) -> None:
    store = ResultStore(out)
    for result in results:
        store.append(asdict(result))


def table(results: list[TrainBench]) -> str:
    from tabulate import tabulate

    return tabulate([(r.drafter, r.teacher_tokens_s, r.read_tokens_s, r.drafter_tokens_s, r.alone_tokens_s,
                      r.cached_tokens_s) for r in results],
                    headers=["drafter", "teacher tok/s", "cache read tok/s", "drafter tok/s", "fresh tokens tok/s",
                             "cached tokens tok/s"])
