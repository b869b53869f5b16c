"""The offline teacher's step (`spd-bench train --prepare-features`): the target's outputs for every chunk of a run,
written to the feature cache once and shared out over the ranks, so a later `--teacher offline` run reads only them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from harness.training.ranks import join, rank_device
from harness.training.train import TrainConfig, feature_cache, prepare


@dataclass
class PreparedFeatures:
    """What `prepare_features` left in the cache: the run's chunks, how many it computed, and their size."""

    folder: Path
    chunks: int
    computed: int
    tokens: int
    bytes: int

    @property
    def bytes_per_token(self) -> float:
        return self.bytes / max(1, self.tokens)


@torch.no_grad()
def prepare_features(config: TrainConfig) -> PreparedFeatures | None:
    """The offline teacher's step: the target's outputs for every chunk of the run's budget, at the layers its
    drafters read, written to the feature cache; chunk i on rank i % world. Training with `teacher="offline"`
    then reads only them. Returns the summary on rank 0 (None on the others)."""
    ranks = join(config.timeout, config.device)
    try:
        run = prepare(replace(config, device=rank_device(config.device), teacher="online", feature_cache=True),
                      ranks, training=False)
        cache, size = feature_cache(run), run.config.batch_size
        mine = list(range(ranks.rank, len(run.chunks), ranks.world))
        bar = tqdm(total=len(run.chunks), unit="chunk", desc="teacher features", dynamic_ncols=True,
                   disable=not ranks.lead)
        with bar:
            for start in range(0, len(mine), size):
                index = mine[start:start + size]
                cache.batch(index, torch.stack([run.chunks[i].ids for i in index]).to(run.target.device))
                bar.update(len(index) * ranks.world)
        computed = int(ranks.sum(torch.tensor([cache.computed]))[0])
        if not ranks.lead:
            return None
        everything = range(len(run.chunks))
        return PreparedFeatures(cache.root, len(run.chunks), computed, len(run.chunks) * run.config.seq_len,
                                cache.bytes_on_disk(everything))
    finally:
        ranks.leave()
