"""In-flight tokens of the pipeline and their draft trees: levels, tree masks, pruning and the verified subtree.

In-flight tokens form levels, one per position (oldest first). Width 1 keeps one token per level (a chain);
width W keeps up to W branches ranked by cumulative draft log-probability. A branch's KV lives at its position
when it is alone there, else in a sibling slot (position + b * n) that moves to the position when the target
accepts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Token:
    """A token in the pipeline: its position, id, current hidden state, features so far and place in the tree."""

    position: int
    token: int
    depth: int
    hidden: torch.Tensor | None  # [1, 1, D] while in flight; None for prompt rows
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, 1, D]
    draft_probs: torch.Tensor | None = None  # q of a sampled chain draft (T > 0, width 1)
    fill: int = 0  # in-flight levels older than it when it was drafted (pipeline fill level)
    slot: int = -1  # KV slot in the target and drafter caches (-1: its position)
    parent: Token | None = None  # the in-flight token it continues (None once that one finished)
    score: float = 0.0  # cumulative draft log-probability of its branch

    def __post_init__(self):
        if self.slot < 0:
            self.slot = self.position


Level = list[Token]


def is_chain(levels: list[Level]) -> bool:
    """One token per level, each at its own position: plain causal calls need no mask."""
    return all(len(level) == 1 and level[0].slot == level[0].position for level in levels)


def tree_mask(rows: list[Token], base: int, kv_end: int) -> torch.Tensor:
    """[rows, kv_end]: every slot below `base` (finished tokens) plus the row's in-flight ancestors and itself."""
    mask = torch.zeros(len(rows), kv_end, dtype=torch.bool)
    mask[:, :base] = True
    for i, node in enumerate(rows):
        while node is not None and node.position >= base:
            mask[i, node.slot] = True
            node = node.parent
    return mask


def fill_level(levels: list[Level]) -> int:
    """In-flight levels older than the newest when the drafter runs (0 right after prefill or a flush)."""
    return max(0, len(levels) - 1)


def prune_dead_branches(levels: list[Level]) -> None:
    """Drop (in place) every node with no descendant in the newest level."""
    for older, newer in zip(reversed(levels[:-1]), reversed(levels[1:])):
        parents = {id(t.parent) for t in newer}
        older[:] = [t for t in older if id(t) in parents]


def keep_subtree(chosen: Token, levels: list[Level]) -> None:
    """`chosen` is verified: its level keeps only it, later levels only its descendants (in place)."""
    start = next(i for i, level in enumerate(levels) if any(t is chosen for t in level))
    levels[start][:] = [chosen]
    alive = {id(chosen)}
    for level in levels[start + 1 :]:
        level[:] = [t for t in level if id(t.parent) in alive]
        alive = {id(t) for t in level}
