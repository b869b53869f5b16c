"""SSD's drafter side: a round's drafts when nothing was cached (the fallback) and the speculation cache of the next
round, drafted while the target verifies this one (methods/ssd/method.py has the algorithm). One object owns it, the
driver's in one process and the drafter rank's under `--executor distributed` (methods/ssd/distributed.py), so both
draft the same way; a variant (a test's oracle) subclasses `Speculation` and overrides the public `logits` hook.
"""

from __future__ import annotations

import torch

from methods.base import Timer
from methods.rounds import Node
from methods.sampling import Sampler


def saguaro(probs: torch.Tensor, x: float, fan_out: int) -> torch.Tensor:
    """Draft probabilities [R, V] with each row's top fan_out + 1 scaled by x, renormalised (x = 1: unchanged)."""
    if x == 1.0:
        return probs
    top = torch.topk(probs, min(fan_out + 1, probs.shape[-1]), dim=-1).indices
    scaled = probs.scatter(-1, top, probs.gather(-1, top) * x)
    return scaled / scaled.sum(-1, keepdim=True)


class Speculation:
    """Drafts for SSD's rounds from `drafter` (methods/ssd/drafters.py) under SSDParams `params`."""

    def __init__(self, drafter, params):
        self.drafter, self.params = drafter, params

    def plan_state(self) -> dict:
        """Constructor arguments beyond the drafter and params that rebuild this object on the drafter rank (none
        here; a subclass with state of its own returns it)."""
        return {}

    def fallback(self, head, base: int, sampler: Sampler, timer: Timer) -> list[Node]:
        """The drafts of a round nothing was cached for: k drafted now (jit, with Saguaro's q), or none."""
        if self.params.fallback == "none":
            return []
        return self._chain(head, base, sampler, timer, self.params.saguaro_x)

    def draft(self, head, base: int, sampler: Sampler, timer: Timer) -> list[Node]:
        """A synchronous round's k drafts, from the drafter's own distribution (timed as the fallback's drafting)."""
        return self._chain(head, base, sampler, timer, 1.0)

    def _chain(self, head, base: int, sampler: Sampler, timer: Timer, saguaro_x: float) -> list[Node]:
        with timer("fallback"):
            nodes: list[Node] = []
            self._extend(head, nodes, [-1], base, sampler, saguaro_x)
        return nodes

    def speculate(self, head, base: int, drafts: list[Node], sampler: Sampler) -> dict[tuple, list[Node]]:
        """The speculation cache of the next round: {(accepted count, bonus token): its k drafts}."""
        nodes = [Node(d.token, i - 1, i + 1, q=d.q) for i, d in enumerate(drafts)]
        for i in range(len(nodes)):  # the head's own states for this round's drafts
            nodes[i].state = head.draft_rows(nodes, [i], base)
        states = torch.cat([head.root] + [n.state for n in nodes], dim=1)
        logits = self.logits(states, [base + 1 + a for a in range(len(nodes) + 1)])  # after a accepted drafts
        outcomes, drafted = [], len(nodes)  # the guesses join `nodes` below
        for accepted, row in enumerate(logits):
            if accepted < drafted:  # had the target chosen the draft, it would have been accepted
                row = row.clone()
                row[nodes[accepted].token] = float("-inf")
            guesses = torch.topk(row, min(self.params.fan_outs[accepted], row.shape[-1])).indices.tolist()
            for token in guesses:
                outcomes.append((accepted, token, len(nodes)))
                nodes.append(Node(token, accepted - 1, accepted + 1))
        chains = self._extend(head, nodes, [index for _, _, index in outcomes], base, sampler, self.params.saguaro_x)
        return {(accepted, token): chain for (accepted, token, _), chain in zip(outcomes, chains)}

    def _extend(self, head, nodes: list[Node], frontier: list[int], base: int, sampler: Sampler, saguaro_x: float
                ) -> list[list[Node]]:
        """k drafts below each frontier node (-1: the root), all frontier rows in each drafter call; returns each
        chain as a fresh round of drafts (parents and depths from 1)."""
        chains: list[list[Node]] = [[] for _ in frontier]
        for step in range(self.params.k):
            if step or frontier != [-1]:
                states = head.draft_rows(nodes, frontier, base)
                for i, index in enumerate(frontier):
                    nodes[index].state = states[:, i: i + 1]
            rows = torch.cat([nodes[i].state if i >= 0 else head.root for i in frontier], dim=1)
            positions = [base + 1 + (nodes[i].depth if i >= 0 else 0) for i in frontier]
            tokens, qs = self._draw(self.logits(rows, positions), sampler, saguaro_x)
            children = []
            for chain, parent, token, q in zip(chains, frontier, tokens, qs):
                depth = nodes[parent].depth + 1 if parent >= 0 else 1
                nodes.append(Node(token, parent, depth, q=q))
                children.append(len(nodes) - 1)
                chain.append(Node(token, len(chain) - 1, len(chain) + 1, q=q))
            frontier = children
        return chains

    def logits(self, states: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The drafter's full-vocabulary draft logits [R, V] for its states [1, R, D], row r drafting the token at
        positions[r] (tests steer the drafter by position)."""
        return self.drafter.logits(states)

    def _draw(self, logits: torch.Tensor, sampler: Sampler, saguaro_x: float) -> tuple[list[int], list]:
        """One draft per row of logits [R, V]: the argmax at T=0, else a sample of Saguaro's q (x = 1: the drafter's
        own distribution; kept for the p/q rule)."""
        if sampler.greedy:
            return logits.argmax(-1).tolist(), [None] * len(logits)
        q = saguaro(sampler.probs(logits), saguaro_x, self.params.fan_out)
        tokens = torch.multinomial(q, 1, generator=sampler.generator)[:, 0].tolist()
        return tokens, list(q)


class OracleSpeculation(Speculation):
    """The drafter side drafting, and guessing, a reference token first with probability `hit_rate` per row, so cache
    hits and misses both occur with a random head (self-checks, tests); its state travels to a drafter rank with
    the plan."""

    def __init__(self, drafter, params, reference: dict[int, int], hit_rate: float, rng: torch.Generator | None = None):
        super().__init__(drafter, params)
        self.reference, self.hit_rate = reference, hit_rate
        self.rng = rng or torch.Generator().manual_seed(0)

    def logits(self, states, positions):
        logits = super().logits(states, positions).clone()
        for row, position in enumerate(positions):
            right = self.reference.get(position)
            if right is not None and float(torch.rand((), generator=self.rng)) < self.hit_rate:
                logits[row] = -10.0
                logits[row, right] = 10.0
        return logits

    def plan_state(self) -> dict:
        return {"reference": self.reference, "hit_rate": self.hit_rate, "rng": self.rng}
