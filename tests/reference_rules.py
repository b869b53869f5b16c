"""The verification rules one decision at a time, as the papers state them, with a host read per decision: the
reference the device kernels of methods/verify.py are held to (same outcomes on point masses, same distributions
on toy vocabularies)."""

from __future__ import annotations

import torch

from methods.verify import residual


def greedy_accept(draft: list[int], target_argmax: list[int]) -> int:
    """Number of leading draft tokens equal to the target's argmax at their position."""
    accepted = 0
    for token, best in zip(draft, target_argmax):
        if token != best:
            break
        accepted += 1
    return accepted


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _uniform(generator: torch.Generator | None) -> float:
    return float(torch.rand((), generator=generator))


def accept_or_resample(
    token: int, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[bool, int]:
    """One sampled draft x ~ q against target p: accept with min(1, p(x)/q(x)), else draw from the residual."""
    if _uniform(generator) * float(q[token]) < float(p[token]):
        return True, token
    return False, _draw(residual(p, q), generator)


def chain_rejection(
    draft: list[int], q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int, int]:
    """Speculative sampling for a sampled chain: draft[i] ~ q[i]; p has one more row than the draft.

    Accept draft[i] with probability min(1, p[i](x) / q[i](x)); on the first rejection draw the next token from
    normalize(max(0, p[i] - q[i])); if every draft is accepted draw the bonus token from p[k].
    Returns (accepted count, next token).
    """
    for i, token in enumerate(draft):
        accepted, replacement = accept_or_resample(token, q[i], p[i], generator)
        if not accepted:
            return i, replacement
    return len(draft), _draw(p[len(draft)], generator)


def verify_siblings(
    candidates: list[int], p: torch.Tensor, generator: torch.Generator | None = None
) -> tuple[int | None, int]:
    """Lossless test of deterministic sibling candidates against target probabilities p [V].

    Siblings are tried in order; x is accepted with probability p'(x), where p' is the current residual (p' = p
    at first); on rejection p'(x) = 0 and p' is renormalised. If every sibling fails the token is drawn from p'.
    Returns (index of the accepted sibling or None, emitted token).
    """
    residual_p = p.clone()
    for index, token in enumerate(candidates):
        mass = float(residual_p[token])
        if mass > 0 and _uniform(generator) < mass:
            return index, token
        residual_p[token] = 0.0
        total = float(residual_p.sum())
        if total <= 0:  # x held all remaining mass up to rounding: it is the only possible outcome
            return index, token
        residual_p /= total
    return None, _draw(residual_p, generator)


def sampled_tree(parents: list[int], tokens: list[int], p: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[list[int], int]:
    """Walk a draft tree from the root with the sibling rule: at each node its children (in index order) against
    p's row there (row 0: the root, row i + 1: after node i). Returns (accepted node path, next token)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    path, current = [], -1
    while True:
        kids = children.get(current, [])
        index, token = verify_siblings([tokens[k] for k in kids], p[current + 1], generator)
        if index is None:
            return path, token
        path.append(kids[index])
        current = kids[index]
