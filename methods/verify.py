"""Verification kernels: pure functions that decide which drafted tokens the target accepts.

Every kernel preserves the target distribution p exactly (greedy: the argmax). They take probabilities already
shaped by the sampler (temperature, top-k, top-p) and a torch.Generator, so toy-distribution tests can check them.
The sampled rules decide on the device, every draw at once, so a round reads back only its outcome; their
one-decision-at-a-time forms, as the papers state them, are the tests' reference (tests/reference_rules.py).
"""

from __future__ import annotations

import torch

from methods.sampling import draw


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(0, p - q)); falls back to p where p == q (the residual is then never needed)."""
    r = torch.clamp(p - q, min=0.0)
    total = r.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=1e-30), p)


def greedy_chain(draft: torch.Tensor, target_argmax: torch.Tensor) -> torch.Tensor:
    """Greedy acceptance of a chain on the device: [accepted count (the drafts that equal the target's argmax in a
    row), next token] for draft [k] and the target's argmax [k + 1] at the root and after each draft (nothing read
    back)."""
    count = (draft == target_argmax[:-1]).long().cumprod(0).sum()
    return torch.stack([count, target_argmax[count]])


def chain_rejection_on_device(draft: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """Speculative sampling of a sampled chain with every decision on the device: [accepted count, next token] for
    draft [k] ~ q [k, V] against p [k + 1, V]. The k uniforms are drawn at once (draft i is accepted iff u_i q_i(x) <
    p_i(x) and every draft before it was); the next token comes from the first rejected row's residual
    normalize(max(0, p_i - q_i)), or from p[k] when all are accepted."""
    k = len(draft)
    px = p[:k].gather(1, draft[:, None])[:, 0]
    qx = q.gather(1, draft[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=p.device)
    count = (u * qx < px).long().cumprod(0).sum()
    rows = torch.cat([residual(p[:k], q), p[k:k + 1]])  # the next token's distribution after each outcome
    token = draw(rows[count], generator)
    return torch.stack([count, token])


def siblings_on_device(kids: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sibling rule for deterministic candidates (tried in order, each accepted with its mass under what the
    rejected ones left) for many sibling groups at once, every decision on the device. Group g's candidates are
    tokens[kids[g]] (kids [G, K], -1 pads a short group) against p [G, V]. Returns the accepted slot per group (-1 for
    none) and the token each group emits when none is accepted.

    The sequential rule in closed form: after siblings 1..i-1 are rejected the residual is p with their mass removed,
    so sibling i is accepted iff u_i (1 - sum_{l<i} p(x_l)) < p(x_i), all uniforms drawn at once; a token repeated
    among siblings has no mass left the second time."""
    valid = kids >= 0
    token = tokens[kids.clamp(min=0)] if len(tokens) else torch.zeros_like(kids)
    repeated = ((token[:, :, None] == token[:, None, :]) & valid[:, None, :]).tril(-1).any(-1)
    px = p.gather(1, token) * (valid & ~repeated)
    left = 1 - (px.cumsum(1) - px)  # the mass not yet rejected when sibling i is tried
    u = torch.rand(px.shape, generator=generator, device=p.device)
    accept = (px > 0) & ((u * left < px) | (left <= px))
    slot = torch.where(accept.any(1), accept.int().argmax(1), -1)
    rejected = torch.zeros_like(p).scatter_add(1, token, valid.to(p.dtype)) > 0
    rest = p.masked_fill(rejected, 0.0)
    rest = torch.where(rest.sum(1, keepdim=True) > 0, rest, p)  # all mass rejected: only rounding can get here
    return slot, draw(rest, generator)


def tree_rejection_on_device(parents: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, depth: int,
                             generator: torch.Generator | None = None) -> torch.Tensor:
    """A draft tree walked with the sibling rule, every decision on the device: node i has token tokens[i] and parent
    parents[i] (-1: the root; siblings are tried in index order), row 0 of p [N + 1, V] is the target's distribution
    at the root, row i + 1 the one after node i, and no node lies deeper than `depth`. Every row's sibling test is
    drawn at once (an unvisited row's draw is never used, so the walk's outcome keeps its distribution), then the
    path is walked level by level on the device. Returns [depth + 1]: the accepted node per level (-1 once the walk
    stopped), then the next token."""
    count, device = len(tokens), p.device
    rank = (parents[:, None] == parents[None, :]).tril(-1).sum(1)  # a node's place among its siblings
    kids = torch.full((count + 1, max(1, count)), -1, device=device)
    kids.index_put_((parents + 1, rank), torch.arange(count, device=device))
    slot, emitted = siblings_on_device(kids, tokens, p, generator)
    chosen = torch.where(slot >= 0, kids.gather(1, slot.clamp(min=0)[:, None])[:, 0], -1)  # accepted node per row
    row, path = torch.zeros((), dtype=torch.long, device=device), []
    for _ in range(depth):
        node = chosen[row]
        path.append(node)
        row = torch.where(node >= 0, node + 1, row)  # a stopped walk stays on its row, whose choice is -1
    return torch.cat([torch.stack(path), emitted[row].view(1)]) if path else emitted[:1]


def verify_tree(parents: list[int], tokens: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """Walk a draft tree from the root at T=0, accepting at most one child per level: the first (in index order)
    whose token is the target's argmax there. Node i has token tokens[i] and parent parents[i] (-1 for children of
    the root); argmax[0] is the target's choice at the root, argmax[i + 1] the one after node i. Returns (accepted
    node path, next token)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path: list[int] = []
    current = -1
    while True:
        row = current + 1
        chosen = next((k for k in children.get(current, []) if tokens[k] == argmax[row]), None)
        if chosen is None:
            return path, argmax[row]
        path.append(chosen)
        current = chosen
