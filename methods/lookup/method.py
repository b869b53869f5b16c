"""Prompt lookup decoding (Saxena 2023; a row of Spec-Bench's table): the drafter is a search, not a model.

Each round takes the last `max_ngram` committed tokens (then fewer, down to `min_ngram`), finds their latest earlier
occurrence in the prompt and the output so far, and drafts the up to `k` tokens that followed it. The target
verifies the chain in one forward through the round kit (methods/rounds.py) and adds a bonus token; a round with no
match verifies no drafts (one target step, as AR). Drafts are deterministic, so at T>0 the round kit's rule for
deterministic candidates keeps the output a sample of the target's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from methods.base import Method, Timer, param, register
from methods.capabilities import HFPeer, SelfChecks
from methods.lookup.length import DraftLength
from methods.rounds import DraftTree, Outcome, RoundMethod, Rounds
from methods.sampling import Sampler
from methods.stats import Stats


@dataclass(frozen=True)
class LookupParams:
    k: int = param(10, "The most drafts per round.")
    max_ngram: int = param(3, "The longest suffix looked up.")
    min_ngram: int = param(1, "The shortest suffix looked up.")
    length: str = param("all", "Drafts a round offers of those found: 'all' (up to k, as Spec-Bench and HF run it) or "
                        "'cost' (the number whose expected tokens per measured verify cost is highest: "
                        "methods/lookup/length.py).", recorded_when_set=True, choices=("all", "cost"))

    def __post_init__(self):
        if min(self.k, self.min_ngram) < 1 or self.max_ngram < self.min_ngram:
            raise ValueError(f"k and min_ngram must be >= 1 and max_ngram >= min_ngram, got k={self.k}, "
                             f"max_ngram={self.max_ngram}, min_ngram={self.min_ngram}")


def lookup(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of `tokens` (max_ngram
    down to min_ngram tokens) that occurs earlier; [] when none does."""
    return match(tokens, k, max_ngram, min_ngram)[0]


def match(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """lookup's drafts and the length of the suffix that found them (0: none)."""
    for size in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-size:]
        for start in range(len(tokens) - size - 1, -1, -1):  # latest first; the suffix itself is excluded
            if tokens[start: start + size] == suffix:
                return tokens[start + size: start + size + k], size
    return [], 0


@dataclass
class LookupStats(Stats):
    matched_rounds: int | None = None  # rounds whose suffix was found earlier
    candidates: int | None = None  # draft tokens offered to the verifier


@dataclass
class LookupSession:
    """One generation's lookups (the round kit's RoundSession): the search over the prompt and output so far, and
    the cost-aware length's running acceptance."""

    params: LookupParams
    length: DraftLength | None
    device: torch.device
    found: list[int] = field(default_factory=list)
    size: int = 0
    offered: int = 0
    matched: int = 0
    candidates: int = 0

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        params = self.params
        with timer("drafter"):
            room = rounds.max_new_tokens - len(rounds.output)  # drafts past the budget could never be committed
            self.found, self.size = match(rounds.prompt_ids + rounds.output, min(params.k, room), params.max_ngram,
                                          params.min_ngram)
            drafts = self.found if self.length is None else self.found[: self.length.choose(len(self.found),
                                                                                             self.size)]
            self.offered = len(drafts)
            self.matched += bool(self.size)
            self.candidates += len(drafts)
            return DraftTree(torch.tensor(drafts, dtype=torch.long, device=self.device))

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        if self.length is not None and self.found:
            # a round that offered none still learns: its first find judged against the token the step chose
            offered, kept = (self.offered, len(outcome.accepted)) if self.offered else \
                (1, int(self.found[0] == outcome.tokens[-1]))
            self.length.record(self.size, offered, kept)

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        return LookupStats(matched_rounds=self.matched, candidates=self.candidates), {}


@register
class PromptLookup(RoundMethod, SelfChecks, HFPeer):
    name = "lookup"
    Params = LookupParams
    Stats = LookupStats

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # measured once, before any decode, so no generation's timing pays for it
        self.costs = self.target.forward_costs(self.params.k + 1) if self.params.length == "cost" else None

    @property
    def depth(self) -> int:
        return self.params.k

    def session(self, rounds: Rounds, captured: dict, sampler: Sampler, timer: Timer) -> LookupSession:
        return LookupSession(self.params, DraftLength(self.costs) if self.costs else None, self.target.device)

    @classmethod
    def hf_peer(cls, params) -> dict:
        return {"prompt_lookup_num_tokens": params.k}  # as users run it: up to k drafts, its own suffix lengths

    figures_note = ("matched: share of rounds whose suffix was found earlier (the others verify no drafts); "
                    "tokens/forward: tokens committed per target forward; wall-clock: decode tokens/s over AR's, "
                    "measured on the same samples")

    @classmethod
    def figures(cls, summary) -> dict[str, float | None]:
        steps = summary.steps
        matched = (summary.stats.matched_rounds or 0) / steps if steps else None
        return {"matched": matched, "tokens/forward": summary.tokens_per_step,
                "wall-clock x": summary.wall_clock_speedup}

    @classmethod
    def selfcheck_cases(cls, target) -> list[tuple[str, Method]]:
        return [("lookup k=10", cls(target, LookupParams(), set()))]
