"""What a pipeline drafter (SPD, PPSD) trains on: one prediction per position from the grouped depth layout
(methods/pipeline/grouped_layout.py), half the sequences simulating a pipeline refilling after prefill or a flush.
The training loop (harness/training/train.py) calls it through the drafter-kind protocol it declares.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from methods.base import Generation
from methods.draft_module import Prediction
from methods.pipeline.grouped_layout import grouped_logits
from methods.pipeline.replay import fill_state_accepts, replay_cycles
from methods.pipeline.speculator import Speculator, SpeculatorConfig, drafter_tag


def segment_starts(size: int, n: int, flush: bool, rng: random.Random) -> torch.Tensor:
    """Per position, where its pipeline segment starts: 0 (full pipeline) or the last simulated flush."""
    starts = torch.zeros(size, dtype=torch.long)
    if flush:
        position = rng.randint(1, 2 * n)
        while position < size:
            starts[position:] = position
            position += rng.randint(1, 2 * n)
    return starts


def fill_levels(starts: torch.Tensor, n: int) -> torch.Tensor:
    """In-flight tokens older than each query, capped at n - 1 (the steady state)."""
    return torch.clamp(torch.arange(starts.shape[-1], device=starts.device) - starts, max=n - 1)


INITS = ("target", "identity")


@dataclass
class PipelineSpec:
    """An SPD or PPSD drafter: n stages, Ls layers, a schedule and a feature policy."""

    method: str
    n: int
    ls: int
    schedule: str
    policy: str
    aggr_bounds: tuple[int, ...] = ()  # shared projections (the reference's aggregation); empty: one per depth
    init: str = "target"  # the layers start as the target's last Ls layers, or as identity (see initialise)
    partial_fill: float = 0.5  # share of training sequences that simulate a pipeline refilling
    group_name = "fill"
    config_name = "speculator"

    @property
    def tag(self) -> str:
        return drafter_tag(self.n, self.ls, self.schedule)

    @property
    def params(self) -> dict:
        return {"n": self.n, "ls": self.ls, "schedule": self.schedule}

    @property
    def groups(self) -> int:
        return self.n

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {', '.join(INITS)}, got {self.init!r}")
        SpeculatorConfig(n=self.n, ls=self.ls, schedule=self.schedule, policy=self.policy,
                         aggr_bounds=self.aggr_bounds)  # a bad shape fails here, as the train command's usage error

    def build(self, target, draft_ids) -> Speculator:
        config = SpeculatorConfig(n=self.n, ls=self.ls, schedule=self.schedule, policy=self.policy,
                                  num_layers=target.num_layers, target=target.identity.to_dict(),
                                  aggr_bounds=self.aggr_bounds,
                                  draft_vocab_size=None if draft_ids is None else len(draft_ids))
        return Speculator(config, target, draft_ids)

    def initialise(self, module: Speculator, target) -> Speculator:
        """`identity`: residual branches at zero (the deepest feature passes to the head); `target`: the layers start
        as copies of the target's last Ls layers (measured better on the embedded model, README)."""
        return module.start_from_target(target) if self.init == "target" else module.start_as_identity()

    def predictions(self, module: Speculator, features: dict, ids: torch.Tensor, rngs: list[random.Random],
                    validating: bool = False) -> list[Prediction]:
        """Half the sequences (by `partial_fill`, each drawn from its row's generator) simulate a pipeline refilling
        after prefill or a flush; validation takes them all that way, so every fill level is measured."""
        partial_fill = 1.0 if validating else self.partial_fill
        size = ids.shape[1]
        starts = torch.stack([segment_starts(size, self.n, rng.random() < partial_fill, rng)
                              for rng in rngs]).to(ids.device)
        return [Prediction(grouped_logits(module, features, starts), 0, 1.0, fill_levels(starts, self.n))]

    def replay(self, module: Speculator, teacher, max_new_tokens: int, stop_ids: set[int]) -> Generation:
        """Decoding's cycles on a trajectory (the exact `--simulate` replay)."""
        return replay_cycles(fill_state_accepts(module, teacher), teacher, self.n, self.schedule, max_new_tokens,
                             stop_ids, None)
