"""`spd-bench bench train`: training throughput per drafter kind, in target tokens per second.

The teacher pass (the frozen target's forward with hidden states) and each drafter's optimiser step are timed
separately on the same corpus batches as `spd-bench train`, after one warm-up batch; a drafter trained alone runs
at 1 / (1/teacher + 1/drafter) tokens/s, several drafters trained together share the teacher's cost.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from harness.corpus import conversations
from harness.models import load_model
from harness.results import ResultStore, config_key
from harness.runner import versions
from harness.target import TargetRuntime
from harness.train import DrafterTrainer, TrainConfig, draft_vocabulary, teacher, training_chunks


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
    versions: dict
    config_key: str


def _rate(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1) if seconds else 0.0


@torch.inference_mode(False)
@torch.enable_grad()
def bench_train(config: TrainConfig, timed_steps: int) -> list[TrainBench]:
    """Time `timed_steps` batches of the teacher and of every drafter in `config` (one warm-up batch first)."""
    config.tokens = (timed_steps + 1) * config.batch_size * config.seq_len
    loaded = load_model(config.model, config.device, config.dtype)
    target = TargetRuntime(loaded.model, max_len=config.seq_len, identity=loaded.identity)
    convs = list(conversations())[: -config.val_conversations]
    chunks = training_chunks(config, loaded, convs)
    draft_ids = draft_vocabulary(loaded, convs, chunks, config.draft_vocab)
    trainers = [DrafterTrainer(spec, config, target, draft_ids) for spec in config.drafters]
    layers = tuple(sorted({layer for t in trainers for layer in t.module.config.all_feature_layers()}))
    teacher_s, drafter_s = 0.0, [0.0] * len(trainers)
    rng = random.Random(config.seed)
    for step in tqdm(range(timed_steps + 1), desc="bench train", unit="batch", dynamic_ncols=True):
        batch = chunks[step * config.batch_size:(step + 1) * config.batch_size]
        ids = torch.stack([c.ids for c in batch]).to(target.device)
        mask = torch.stack([c.loss_mask for c in batch]).to(target.device)
        began = time.perf_counter()
        with torch.no_grad():
            logits, features = teacher(target, ids, layers)
            p = torch.softmax(logits, dim=-1)
            p_draft = p if draft_ids is None else p[..., draft_ids.to(p.device)]
        teacher_s += (time.perf_counter() - began) * (step > 0)
        for index, trainer in enumerate(trainers):
            began = time.perf_counter()
            trainer.train_step(features, ids, p_draft, mask, rng)
            drafter_s[index] += (time.perf_counter() - began) * (step > 0)
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
                                  versions=versions(), config_key=config_key(spec)))
    return results


def record(results: list[TrainBench], out: Path) -> None:
    store = ResultStore(out)
    for result in results:
        store.append(asdict(result))


def table(results: list[TrainBench]) -> str:
    from tabulate import tabulate

    return tabulate([(r.drafter, r.teacher_tokens_s, r.drafter_tokens_s, r.alone_tokens_s) for r in results],
                    headers=["drafter", "teacher tok/s", "drafter tok/s", "alone tok/s"])
