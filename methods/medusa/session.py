"""One generation's Medusa heads as the round kit drives them: each round's candidate tree from the hidden state
of the newest verified token; decoding and the training loop's replay share it."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from methods.base import Timer
from methods.medusa.heads import MedusaHeads
from methods.medusa.tree import CandidateTree
from methods.rounds import DraftShape, DraftTree, Outcome, Rounds
from methods.sampling import Sampler
from methods.stats import Stats, same


@dataclass
class MedusaStats(Stats):
    candidates: int | None = None  # draft tokens offered to the verifier
    draft: DraftShape | None = same()


@dataclass
class Oracle:
    """Self-checks on random heads: along one branch, each depth's token is the reference's with probability
    `hit_rate`, placed at a node's second child where it has one, so accepted branches leave the first children."""

    reference: dict[int, int]  # position -> token
    hit_rate: float
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def place(self, tokens: torch.Tensor, tree: CandidateTree, position: int) -> torch.Tensor:
        parents = tree.shape.host[0]
        tokens, node = tokens.clone(), -1
        for depth in range(1, tree.shape.levels + 1):
            children = [i for i, parent in enumerate(parents) if parent == node]
            want = self.reference.get(position + depth)
            if not children or want is None or self.rng.random() >= self.hit_rate:
                break
            node = children[min(1, len(children) - 1)]
            tokens[node] = want
        return tokens


@dataclass
class MedusaSession:
    """The round kit's RoundSession for Medusa heads."""

    heads: MedusaHeads
    tree: CandidateTree
    hidden: torch.Tensor  # h[L] [1, 1, D] of the token before the round's root
    shape: DraftShape | None = None  # what the record's speedup formula reads
    oracle: Oracle | None = None
    candidates: int = 0

    @classmethod
    def started(cls, heads: MedusaHeads, tree: CandidateTree, captured: dict, shape: DraftShape | None = None,
                oracle: Oracle | None = None) -> MedusaSession:
        """After the prefill: the prompt's last row predicts the first token, so the heads guess the ones after."""
        return cls(heads, tree, captured[heads.config.num_layers][:, -1:], shape, oracle)

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        with timer("drafter"):
            logits = self.heads.logits(self.hidden)[:, 0, 0]  # [heads, V']
            guesses = self.heads.target_ids(torch.topk(logits, self.tree.top, dim=-1).indices)
            tokens = guesses[self.tree.heads, self.tree.ranks]
            if self.oracle is not None:
                tokens = self.oracle.place(tokens, self.tree, rounds.position)
        self.candidates += len(tokens)
        return DraftTree(tokens, self.tree.shape)

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        self.hidden = outcome.features[self.heads.config.num_layers][:, -1:]  # the last accepted row (or the root's)

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        return MedusaStats(candidates=self.candidates, draft=self.shape), {}
