"""Why a T=0 output left greedy AR's: a numerics flip or a logic divergence, with the evidence in the record.

A verify over k rows and a one-token step can take different kernels (a batch-variant matmul, sdpa with or without
a mask): in bf16 their logits differ by a rounding's size, and at a near-tie the argmax can fall the other way. That
is not a bug of the method. Here both forms are replayed at T=0 (deterministic): AR's one-token steps from the
prompt give the step's logits S[j] at each position j up to the first divergence i; the method's own run, watched
through the target's LM head, gives every logits row it computed, and the row it decided position j from is the
one nearest S[j] whose argmax is its token (a row from another prefix is far from S[j]: its context differs). At i
the divergence is a flip when

- the method's token is the argmax of its own row there (it followed its target),
- AR's top-2 gap between its token and the method's is within what the rows' difference d can move (2 d: each
  side's logit moves by at most d), and
- d is of the size the two forms differ by on the sample's earlier, agreeing positions (at most `SPREAD` times the
  largest of them; where there are none, a few roundings of the largest logit).

Anything else (no row of the method has its token as argmax, a difference of another size, a replay that decodes
other tokens) is a logic divergence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from harness.runtime.target import TargetRuntime

# How much larger than on the agreeing positions the two forms' difference may be at the divergence: rounding noise
# varies by position (its size follows the logits' magnitude), a different prefix differs by the logits' own scale.
SPREAD = 2.0
# Where no earlier position measured the two forms' difference: this many roundings of the largest logit.
ROUNDINGS = 4
# Earlier positions kept for the difference's size (each holds one vocabulary row of S).
WINDOW = 64


@dataclass
class Evidence:
    """What decided the verdict, kept in the record."""

    method_token: int
    reference_token: int
    gap: float | None  # AR's one-token step: its token's logit minus the method's token's
    difference: float | None  # d: max |method row - step row| at the divergence
    earlier: float | None  # the largest d over the earlier, agreeing positions (None: none measured)
    bound: float | None  # the largest d a flip may have
    reason: str

    def to_dict(self) -> dict:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


class _Nearest:
    """Watches the target's logits rows; keeps, per wanted position, the nearest row to S whose argmax is the token."""

    def __init__(self, step: torch.Tensor, tokens: list[int]):
        self.step, self.tokens = step, torch.tensor(tokens, device=step.device)
        self.best = torch.full((len(tokens),), float("inf"), device=step.device)

    def __call__(self, logits: torch.Tensor) -> None:
        for row in logits.detach().reshape(-1, logits.shape[-1]).float():
            wanted = (self.tokens == row.argmax()).nonzero().flatten().tolist()
            for j in wanted:
                self.best[j] = torch.minimum(self.best[j], (row - self.step[j]).abs().max())


def _step_rows(target: TargetRuntime, run_ar: Callable[[int], list[int]], tokens: int, first: int
               ) -> tuple[list[int], torch.Tensor]:
    """AR's greedy output over `tokens` tokens and its one-token step's logits rows from position `first` on."""
    rows: list[torch.Tensor] = []
    seen = [0]

    def keep(logits: torch.Tensor) -> None:  # only the window's rows are held (each is a vocabulary row)
        if first <= seen[0] < tokens:
            rows.append(logits[-1].detach().float().clone())
        seen[0] += 1

    with target.watching(keep):
        output = run_ar(tokens)
    return output, torch.stack(rows)


def classify(target: TargetRuntime, run_method: Callable[[], list[int]], run_ar: Callable[[int], list[int]],
             output: list[int], reference: list[int], index: int, ar_target: TargetRuntime | None = None
             ) -> tuple[str, Evidence]:
    """("flip" | "logic", evidence) for a T=0 output that first differs from the greedy `reference` at token
    `index` (< both lengths). `run_method()` decodes the method again on the same prompt through `target`;
    `run_ar(n)` decodes n tokens of greedy AR through `ar_target` (default: `target`)."""
    mine, theirs = output[index], reference[index]
    first = max(0, index + 1 - WINDOW)
    ar_output, step = _step_rows(ar_target or target, run_ar, index + 1, first)
    if ar_output[:index + 1] != reference[:index + 1]:
        return "logic", Evidence(mine, theirs, None, None, None, None, "AR's replay decoded other tokens")
    nearest = _Nearest(step, output[first:index + 1])
    with target.watching(nearest):
        replay = run_method()
    if replay != output:
        return "logic", Evidence(mine, theirs, None, None, None, None,
                                 "the method's replay decoded other tokens: its output is not deterministic")
    s = step[-1]
    gap = float(s[theirs] - s[mine])
    if not torch.isfinite(nearest.best[-1]):
        return "logic", Evidence(mine, theirs, gap, None, None, None,
                                 "no target row the method computed has its token as the argmax")
    difference = float(nearest.best[-1])
    measured = [float(d) for d in nearest.best[:-1] if torch.isfinite(d)]
    earlier = max(measured) if measured else None
    rounding = torch.finfo(target.dtype).eps * float(s.abs().max()) * ROUNDINGS
    bound = SPREAD * earlier if earlier else rounding
    evidence = Evidence(mine, theirs, gap, difference, earlier, bound, "")
    if gap > 2 * difference:
        evidence.reason = "AR's top-2 gap exceeds what the two forms' difference can move"
    elif difference > bound:
        evidence.reason = "the two forms differ here by more than on the sample's agreeing positions"
    else:
        evidence.reason = "a near-tie that the two forms' rounding decided apart"
        return "flip", evidence
    return "logic", evidence
