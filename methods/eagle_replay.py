"""Acceptance simulation of EAGLE-3 rounds on a trajectory (methods/teacher.py).

Chains: the training-time-test forward computes, for every root at once, the head's k-th draft given that drafts
1..k-1 were the trajectory tokens, which is all a chain's verification depends on (the first miss ends the round).
Trees: the real drafting rounds run; only the target forward is replaced by the trajectory, which decides every
branch on it (branches off it are never descended into).
"""

from __future__ import annotations

import torch

from methods.base import Generation, Timer, commit
from methods.eagle_head import EagleHead, ttt_logits
from methods.teacher import Teacher
from methods.verify import verify_tree


def chain_accepts(head: EagleHead, teacher: Teacher, m: int) -> torch.Tensor:
    """[S, m]: acceptance probability of the k-th draft of the round whose newest committed token is at row b
    (it drafts position b + k); NaN past the trajectory."""
    size = teacher.length
    accepts = torch.full((size, m), float("nan"))
    steps = ttt_logits(head, teacher.features, teacher.ids[None], m)
    for k, logits in enumerate(steps, start=1):
        roots = torch.arange(0, size - k - 1)  # root t drafts position t + k + 1 in the round based at t + 1
        if len(roots):
            draft = head.full_vocab(logits[0, roots.to(logits.device)])
            accepts[roots + 1, k - 1] = teacher.accept_probs(roots + k + 1, draft).cpu()
    return accepts


def replay_rounds(accepts: torch.Tensor, teacher: Teacher, m: int, max_new_tokens: int, stop_ids: set[int],
                  shape: dict) -> Generation:
    """EAGLE-3's chain rounds on the trajectory: leading accepted drafts plus one bonus token per round."""
    start, size = teacher.prompt_len, teacher.length
    output = [teacher.token(start)]
    accepted, position_accepts, expected = [], [0] * m, 0.0
    while len(output) < max_new_tokens and output[-1] not in stop_ids:
        base = start + len(output) - 1
        room = min(m, size - base - 1, max_new_tokens - len(output))  # drafts that could still be committed
        expected += _expected_length(accepts[base, : max(0, room)])
        count = 0
        while count < m and base + count + 1 < size and teacher.accepts(float(accepts[base, count])):
            count += 1
        new = commit(output, teacher.ids[base + 1: base + count + 2].tolist(), max_new_tokens, stop_ids)
        accepted.append(len(new))
        for k in range(min(count, len(new))):
            position_accepts[k] += 1
    return Generation(output_ids=output, steps=len(accepted), accepted=accepted, position_accepts=position_accepts,
                      stats={"candidates": m * len(accepted), "expected_accepts": expected, "draft": shape})


def _expected_length(probabilities: torch.Tensor) -> float:
    """Expected number of leading accepted drafts: sum over k of the product of the first k acceptance chances."""
    return float(torch.cumprod(probabilities, dim=0).sum()) if len(probabilities) else 0.0


def trajectory_verifier(teacher: Teacher):
    """Tree verification that reads the trajectory instead of running the target: the accepted path is the branch
    that follows it and the bonus its next token (T=0: the argmax; T>0: the sampled token, see EAGLE3.simulate)."""

    def verify(nodes, last: int, base: int, sampler):
        on_path = []  # is node i's branch the trajectory up to and including it?
        argmax = [teacher.token(base + 1)]
        for node in nodes:
            parent_ok = node.parent < 0 or on_path[node.parent]
            position = base + node.depth
            on_path.append(parent_ok and position < teacher.length and node.token == teacher.token(position))
            argmax.append(teacher.token(position + 1) if on_path[-1] and position + 1 < teacher.length else -1)
        path, bonus = verify_tree([n.parent for n in nodes], [n.token for n in nodes], None, argmax)
        features = {layer: h[:, base: base + len(path) + 1] for layer, h in teacher.features.items()}
        return path, bonus, features

    return verify


def rounds_on_trajectory(rounds, target, prompt_ids: list[int], trajectory: list[int], layers: tuple[int, ...],
                         sampler) -> Generation:
    """A method's real drafting rounds, `rounds(first, prompt_features, timer, verify)`, with the trajectory in place of
    the target's verification forward (trajectory_verifier); the realised acceptance is the expected one."""
    teacher = Teacher.run(target, prompt_ids, trajectory, layers, sampler)
    start = teacher.prompt_len
    prefix = {layer: h[:, :start] for layer, h in teacher.features.items()}
    generation = rounds(teacher.token(start), prefix, Timer(target.device), trajectory_verifier(teacher))
    generation.stats["expected_accepts"] = float(sum(generation.position_accepts))
    return generation
