"""The speculator's inference side in the pipeline: the drafter the engine calls each cycle for the next draft
logits of its newest tokens (it reads their states; only the scheduler changes a token's depth)."""

from __future__ import annotations

import torch

from methods.pipeline.speculator import Speculator
from methods.pipeline.tree import Level, Token, is_chain, tree_mask


class Drafter:
    """The speculator's inference side: its own KV cache holds finished rows; in-flight rows are recomputed."""

    def __init__(self, speculator: Speculator, max_len: int):
        self.speculator = speculator
        self.cache = speculator.state_cache(max_len)
        self.final = 0  # rows below this position are final (depth n) in the cache

    def logits(self, finished: list[Token], levels: list[Level]) -> torch.Tensor:
        """Draft logits [leaves, V] (full vocabulary) for the position after each newest-level token.

        `finished` are the finished rows from `self.final` on; with no level in flight the last of them is the leaf.
        """
        spec = self.speculator
        nodes = [t for level in levels for t in level]
        rows = finished + nodes
        if rows[0].position != self.final:
            raise ValueError(f"drafter rows start at {rows[0].position}, but rows below {self.final} are final")
        x = torch.cat([spec.project(r.depth, r.features) for r in rows], dim=1)
        positions = torch.tensor([r.position for r in rows], device=x.device)
        if is_chain(levels):  # rows of consecutive positions: the finished ones, then the in-flight ones
            mask = self.cache.begin(range(rows[0].position, rows[0].position + len(rows)))
        else:
            slots = [r.slot for r in rows]
            base = levels[0][0].position
            keys = torch.arange(max(slots) + 1)
            causal = keys[None, :] <= torch.tensor([r.position for r in finished])[:, None]
            layout = torch.cat([causal, tree_mask(nodes, base, len(keys))])
            mask = self.cache.begin(positions, torch.tensor(slots, device=x.device), layout.to(x.device))
        out = spec.decode(x, positions, mask, self.cache)
        if finished:
            self.final = finished[-1].position + 1
        leaves = len(levels[-1]) if levels else 1
        return spec.full_vocab(spec.head_logits(out[:, -leaves:]))[0]


def oracle_drafter(reference: dict[int, int], hit_rate: float) -> type[Drafter]:
    """A drafter that proposes the reference token of a position with probability `hit_rate`, else its own pick (self-
    checks and tests on random drafters reach the accept paths with it)."""
    rng = torch.Generator().manual_seed(0)

    class Oracle(Drafter):
        def logits(self, finished, levels):
            out = super().logits(finished, levels).clone()
            for i, leaf in enumerate(levels[-1] if levels else finished[-1:]):
                token = reference.get(leaf.position + 1)
                if token is not None and float(torch.rand((), generator=rng, device=rng.device)) < hit_rate:
                    out[i] = -1e4
                    out[i, token] = 1e4
            return out

    return Oracle
