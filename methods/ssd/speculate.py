"""SSD's drafter side: a round's drafts when nothing was cached (the fallback) and the speculation cache of the next
round, drafted while the target verifies this one (methods/ssd/method.py has the algorithm). One object owns it, the
driver's in one process and the drafter rank's under `--executor distributed` (methods/ssd/distributed.py), so both
draft the same way; a variant (a test's oracle) subclasses `Speculation` and overrides the public `logits` hook.
"""

from __future__ import annotations

import torch

from methods.base import Timer
from methods.rounds import Node
from methods.sampling import Sampler, draw

UNREAD = -1  # a draft's token while it is still on the device (filled in when `Unread.read` reads it back)


def saguaro(probs: torch.Tensor, x: float, fan_out: int) -> torch.Tensor:
    """Draft probabilities [R, V] with each row's top fan_out + 1 scaled by x, renormalised (x = 1: unchanged)."""
    if x == 1.0:
        return probs
    top = torch.topk(probs, min(fan_out + 1, probs.shape[-1]), dim=-1).indices
    scaled = probs.scatter(-1, top, probs.gather(-1, top) * x)
    return scaled / scaled.sum(-1, keepdim=True)


class Unread:
    """Drafted tokens still on the device, with the nodes they belong to: all read back in one transfer."""

    def __init__(self):
        self.parts: list[tuple[list[Node], torch.Tensor]] = []

    def add(self, nodes: list[Node], tokens: torch.Tensor) -> None:
        self.parts.append((nodes, tokens))

    def read(self) -> None:
        if not self.parts:
            return
        values = iter(torch.cat([tokens.reshape(-1) for _, tokens in self.parts]).tolist())
        for nodes, _ in self.parts:
            for node in nodes:
                node.token = next(values)
        self.parts.clear()


class Speculation:
    """Drafts for SSD's rounds from `drafter` (methods/ssd/drafters.py) under SSDParams `params`."""

    def __init__(self, drafter, params):
        self.drafter, self.params = drafter, params

    def plan_state(self) -> dict:
        """Constructor arguments beyond the drafter and params that rebuild this object on the drafter rank (none
        here; a subclass with state of its own returns it)."""
        return {}

    def fallback(self, head, base: int, sampler: Sampler, timer: Timer, unread: Unread | None = None
                 ) -> tuple[list[Node], torch.Tensor | None]:
        """The drafts of a round nothing was cached for: k drafted now (jit, with Saguaro's q), or none; with their
        tokens on the device [k]. Given `unread`, the tokens are read back with it later (the round's speculation
        reads them with its own), else now."""
        if self.params.fallback == "none":
            return [], None
        return self._chain(head, base, sampler, timer, self.params.saguaro_x, unread)

    def draft(self, head, base: int, sampler: Sampler, timer: Timer) -> list[Node]:
        """A synchronous round's k drafts, from the drafter's own distribution (timed as the fallback's drafting)."""
        return self._chain(head, base, sampler, timer, 1.0)[0]

    def _chain(self, head, base: int, sampler: Sampler, timer: Timer, saguaro_x: float, unread: Unread | None = None
               ) -> tuple[list[Node], torch.Tensor]:
        with timer("fallback"):
            pending = Unread() if unread is None else unread
            chains, tokens = self._extend(head, [], [-1], base, sampler, saguaro_x, pending)
            if unread is None:
                pending.read()
        return chains[0], tokens[:, 0]

    def speculate(self, head, base: int, drafts: list[Node], sampler: Sampler, tokens: torch.Tensor | None = None,
                  unread: Unread | None = None) -> dict[tuple, list[Node]]:
        """The speculation cache of the next round: {(accepted count, bonus token): its k drafts}. `tokens`: the
        drafts' tokens where they are still on the device, read back with the cache's (`unread`) in one transfer."""
        unread = Unread() if unread is None else unread
        if tokens is None:
            tokens = torch.tensor([d.token for d in drafts], dtype=torch.long, device=head.root.device)
        nodes = [Node(d.token, i - 1, i + 1, q=d.q) for i, d in enumerate(drafts)]
        for i in range(len(nodes)):  # the head's own states for this round's drafts
            nodes[i].state = head.draft_rows(nodes, [i], base, tokens[i: i + 1])
        states = torch.cat([head.root] + [n.state for n in nodes], dim=1)
        logits = self.logits(states, [base + 1 + a for a in range(len(nodes) + 1)])  # after a accepted drafts
        drafted, fan_outs = len(nodes), self.params.fan_outs[: len(logits)]
        if drafted:  # had the target chosen the draft, it would have been accepted: never a guess
            logits = logits.clone()
            logits[torch.arange(drafted, device=logits.device), tokens] = float("-inf")
        ranked = torch.topk(logits, min(max(fan_outs), logits.shape[-1])).indices
        outcomes = [(accepted, rank) for accepted, fan_out in enumerate(fan_outs) for rank in range(fan_out)]
        frontier = []
        for accepted, _ in outcomes:  # the guesses join `nodes`, their tokens still on the device
            frontier.append(len(nodes))
            nodes.append(Node(UNREAD, accepted - 1, accepted + 1))
        at = torch.tensor(outcomes, dtype=torch.long, device=ranked.device).reshape(-1, 2)
        guessed = ranked[at[:, 0], at[:, 1]]
        unread.add([nodes[i] for i in frontier], guessed)
        chains, _ = self._extend(head, nodes, frontier, base, sampler, self.params.saguaro_x, unread, guessed)
        unread.read()  # every token of the round at once: the drafts', the guesses' and their chains'
        return {(accepted, nodes[i].token): chain for (accepted, _), i, chain in zip(outcomes, frontier, chains)}

    def _extend(self, head, nodes: list[Node], frontier: list[int], base: int, sampler: Sampler, saguaro_x: float,
                unread: Unread, tokens: torch.Tensor | None = None) -> tuple[list[list[Node]], torch.Tensor]:
        """k drafts below each frontier node (-1: the root), all frontier rows in each drafter call; returns each
        chain as a fresh round of drafts (parents and depths from 1) and the chains' tokens [k, rows] on the device.
        `tokens`: the frontier's tokens where they are still on the device. No token is read back here: each new
        node's is left to `unread`."""
        chains: list[list[Node]] = [[] for _ in frontier]
        drawn = [] if tokens is None else [tokens]  # the frontier's tokens, then each step's drafts
        for step in range(self.params.k):
            if step or frontier != [-1]:
                states = head.draft_rows(nodes, frontier, base, drawn[-1] if drawn else None)
                for i, index in enumerate(frontier):
                    nodes[index].state = states[:, i: i + 1]
            rows = torch.cat([nodes[i].state if i >= 0 else head.root for i in frontier], dim=1)
            positions = [base + 1 + (nodes[i].depth if i >= 0 else 0) for i in frontier]
            drafts, qs = self._draw(self.logits(rows, positions), sampler, saguaro_x)
            drawn.append(drafts)
            children = []
            for chain, parent, q in zip(chains, frontier, qs):
                depth = nodes[parent].depth + 1 if parent >= 0 else 1
                nodes.append(Node(UNREAD, parent, depth, q=q))
                children.append(len(nodes) - 1)
                chain.append(Node(UNREAD, len(chain) - 1, len(chain) + 1, q=q))
            unread.add([nodes[i] for i in children], drafts)
            unread.add([chain[step] for chain in chains], drafts)
            frontier = children
        return chains, torch.stack(drawn[len(drawn) - self.params.k:])

    def logits(self, states: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """The drafter's full-vocabulary draft logits [R, V] for its states [1, R, D], row r drafting the token at
        positions[r] (tests steer the drafter by position)."""
        return self.drafter.logits(states)

    def _draw(self, logits: torch.Tensor, sampler: Sampler, saguaro_x: float) -> tuple[torch.Tensor, list]:
        """One draft per row of logits [R, V] (on the device): the argmax at T=0, else a sample of Saguaro's q (x = 1:
        the drafter's own distribution; kept for the p/q rule)."""
        if sampler.greedy:
            return logits.argmax(-1), [None] * len(logits)
        q = saguaro(sampler.probs(logits), saguaro_x, self.params.fan_out)
        return draw(q, sampler.generator), list(q)


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
            if right is not None and float(torch.rand((), generator=self.rng, device=self.rng.device)) < self.hit_rate:
                logits[row] = -10.0
                logits[row, right] = 10.0
        return logits

    def plan_state(self) -> dict:
        return {"reference": self.reference, "hit_rate": self.hit_rate, "rng": self.rng}
