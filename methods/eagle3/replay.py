"""Acceptance simulation of EAGLE-3 rounds on a trajectory (methods/teacher.py).

Chains: the training-time-test forward computes, for every root at once, the head's k-th draft given that drafts
1..k-1 were the trajectory tokens, which is all a chain's verification depends on (the first miss ends the round).
Trees: the real drafting rounds run with the trajectory in place of the target forward (methods/rounds.py).
"""

from __future__ import annotations

import torch

from methods.base import Generation
from methods.eagle3.head import EagleHead, ttt_logits
from methods.rounds import Rounds
from methods.stats import Stats
from methods.teacher import Teacher


def chain_accepts(head: EagleHead, teacher: Teacher, m: int) -> torch.Tensor:
    """[S, m]: acceptance probability of the k-th draft of the round whose newest committed token is at row b
    (it drafts position b + k); NaN past the trajectory."""
    size = teacher.length
    accepts = torch.full((size, m), float("nan"))
    steps = ttt_logits(head, teacher.features, teacher.ids[None], m)
    for k, logits in enumerate(steps, start=1):
        roots = torch.arange(0, size - k - 1)  # root t drafts position t + k + 1 in the round based at t + 1
        if len(roots):
            draft = head.full_vocab(logits[0, roots.to(logits.device)])
            accepts[roots + 1, k - 1] = teacher.accept_probs(roots + k + 1, draft).cpu()
    return accepts


def replay_rounds(accepts: torch.Tensor, teacher: Teacher, m: int, max_new_tokens: int, stop_ids: set[int]
                  ) -> Generation:
    """EAGLE-3's chain rounds on the trajectory: leading accepted drafts plus one bonus token per round."""
    start, size = teacher.prompt_len, teacher.length
    rounds = Rounds([teacher.token(start)], m, max_new_tokens, stop_ids)
    expected = 0.0
    while not rounds.done:
        base = start + rounds.base
        room = min(m, size - base - 1, max_new_tokens - len(rounds.output))  # drafts that could still be committed
        expected += _expected_length(accepts[base, : max(0, room)])
        count = 0
        while count < m and base + count + 1 < size and teacher.accepts(float(accepts[base, count])):
            count += 1
        rounds.commit(teacher.ids[base + 1: base + count + 2].tolist(), count)
    return rounds.generation({}, Stats(expected_accepts=expected))


def _expected_length(probabilities: torch.Tensor) -> float:
    """Expected number of leading accepted drafts: sum over k of the product of the first k acceptance chances."""
    return float(torch.cumprod(probabilities, dim=0).sum()) if len(probabilities) else 0.0

