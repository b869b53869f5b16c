"""Medusa's candidate trees: a list of paths, each [i1, i2, ..., id] naming the node whose token at depth k is head
k's i_k-th best guess (0: its top token), the path's prefix its parent.

The default is the Medusa authors' `mc_sim_7b_63`, the sparse tree their paper decodes with (63 nodes, 4 deep, found
by simulating acceptance on Vicuna-7B); `small_5` is a tree for a CPU; another tree comes from a JSON file of such
paths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from methods.rounds import TreeShape

MC_SIM_7B_63 = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5), (0, 0, 1),
    (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0),
    (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0),
    (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1),
    (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)
# Five nodes, a verify a CPU affords: head 1's top two guesses and the top-1 chain of heads 1-4 (a 64-row verify
# costs a CPU several one-token steps, a GPU about one).
SMALL_5 = ((0,), (1,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
NAMED = {"mc_sim_7b_63": MC_SIM_7B_63, "small_5": SMALL_5}


def read_paths(spec: str) -> tuple[tuple[int, ...], ...]:
    """A tree by name (`mc_sim_7b_63`) or from a JSON file of paths; ValueError naming what is wrong."""
    if spec in NAMED:
        return NAMED[spec]
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"tree must be {' or '.join(NAMED)} or a JSON file of paths, got {spec!r} (no such file)")
    try:
        paths = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"tree file {spec} is not JSON ({str(exc).splitlines()[0]}); write a list of paths such "
                         f"as [[0], [0, 0], [1]]") from None
    if not isinstance(paths, list) or not paths or not all(
            isinstance(p, list) and p and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
            for p in paths):
        raise ValueError(f"tree file {spec} must hold a non-empty list of paths, each a non-empty list of ranks >= 0 "
                         f"(e.g. [[0], [0, 0], [1]])")
    found = {tuple(p) for p in paths}
    if len(found) < len(paths):
        raise ValueError(f"tree file {spec} lists a path twice; list each node once")
    orphan = next((p for p in paths if len(p) > 1 and tuple(p[:-1]) not in found), None)
    if orphan is not None:
        raise ValueError(f"tree file {spec}: path {orphan} has no parent {orphan[:-1]} in the tree; add it")
    return tuple(tuple(p) for p in paths)


@dataclass
class CandidateTree:
    """A tree's nodes in verification order (shallower first, siblings by rank): which head and rank give each
    node's token, and its shape on the device."""

    heads: torch.Tensor  # [N] the head whose guess a node takes (its depth - 1)
    ranks: torch.Tensor  # [N] which of that head's guesses
    shape: TreeShape
    top: int  # guesses needed per head

    @classmethod
    def of(cls, paths: tuple[tuple[int, ...], ...], device) -> CandidateTree:
        ordered = sorted(paths, key=lambda p: (len(p), p))
        index = {p: i for i, p in enumerate(ordered)}
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in ordered]
        heads = torch.tensor([len(p) - 1 for p in ordered], device=device)
        ranks = torch.tensor([p[-1] for p in ordered], device=device)
        return cls(heads, ranks, TreeShape.of_parents(parents, device), max(p[-1] for p in ordered) + 1)
