"""The target's teacher-forced view of one trajectory, for acceptance simulation.

One full forward over prompt + trajectory (the AR output) gives every position's target logits and hidden states.
A token in flight that lies on the trajectory has exactly these states, so a drafter's predictions for every
position can be computed in batched forwards and a method's cycle or round accounting replayed without running
the target again. At T=0 a draft is accepted iff it is the trajectory token; at T>0 the replay accepts with the
lossless verifier's probability sum_x min(p(x), q(x)) and carries on along the trajectory (an expected-acceptance
estimate, not a sample of the executed run).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.target import TargetRuntime
from methods.sampling import Sampler


@dataclass
class Teacher:
    prompt_len: int
    ids: torch.Tensor  # [S] prompt + trajectory
    logits: torch.Tensor  # [S, V] float32: row t is the target's distribution for position t + 1
    features: dict[int, torch.Tensor]  # layer -> [1, S, D] hidden states h[layer]
    sampler: Sampler

    @classmethod
    def run(cls, target: TargetRuntime, prompt_ids: list[int], trajectory: list[int], capture: tuple[int, ...],
            sampler: Sampler, keep_cache: bool = False) -> Teacher:
        """`keep_cache`: leave the trajectory's KV in the target's cache (for forwards of tokens off it)."""
        target.reset()
        ids = torch.tensor(prompt_ids + trajectory, device=target.device)
        logits, features = target.forward(ids, start=0, capture=capture)
        if not keep_cache:
            target.reset()
        return cls(len(prompt_ids), ids, logits, features, sampler)

    @property
    def length(self) -> int:
        return int(self.ids.shape[0])

    def token(self, position: int) -> int:
        return int(self.ids[position])

    def accept_probs(self, positions: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
        """Acceptance probability of a width-1 draft for each of `positions` [R], drafted from full-vocabulary
        logits [R, V]: 1 or 0 at T=0 (is the draft's argmax the trajectory token), sum_x min(p, q) at T>0."""
        positions = positions.to(self.ids.device)
        if self.sampler.greedy:
            return (draft_logits.argmax(-1) == self.ids[positions]).float()
        p = self.sampler.probs(self.logits[positions - 1])
        q = self.sampler.probs(draft_logits.float())
        return torch.minimum(p, q).sum(-1)

    def accepts(self, probability: float) -> bool:
        """One verification outcome in the replay (T=0: deterministic)."""
        if self.sampler.greedy:
            return probability > 0.5
        return self.sampler.uniform() < probability
