"""Verification kernels reproduce the target distribution on toy vocabularies (total-variation bounds)."""

import pytest
import torch
from reference_rules import chain_rejection, greedy_accept, sampled_tree, verify_siblings

from methods.sampling import Sampler, SamplingConfig, draw
from methods.verify import (
    chain_rejection_on_device,
    greedy_chain,
    residual,
    siblings_on_device,
    tree_rejection_on_device,
    verify_tree,
)

V = 6
SAMPLES = 40_000
TV_BOUND = 0.02  # sampling noise here is ~0.005; a broken residual is off by > 0.1


def _dist(seed: int, peaked: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, generator=g) * 2 * peaked, dim=0)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


def _histogram(draw, n=SAMPLES, size=V) -> torch.Tensor:
    counts = torch.zeros(size)
    for _ in range(n):
        counts[draw()] += 1
    return counts


def test_draw_follows_each_row_and_never_draws_a_token_without_mass():
    p = torch.stack([_dist(1), _dist(2)])
    p[1, 2] = 0.0  # a token outside top-k/top-p: mass 0
    p[1] /= p[1].sum()
    g = torch.Generator().manual_seed(0)
    drawn = draw(p.expand(SAMPLES, 2, V), g)  # [SAMPLES, 2]: every row drawn at once
    for row in range(2):
        assert _tv(torch.bincount(drawn[:, row], minlength=V).float(), p[row]) < TV_BOUND
    assert not (drawn[:, 1] == 2).any()
    assert draw(torch.tensor([0.0, 0.0, 1.0]), g).shape == () and int(draw(torch.tensor([0.0, 1.0, 0.0]), g)) == 1


def test_greedy_accept_counts_the_matching_prefix():
    assert greedy_accept([3, 1, 4], [3, 1, 5, 9]) == 2
    assert greedy_accept([3, 1, 4], [3, 1, 4, 9]) == 3
    assert greedy_accept([2], [3, 2]) == 0
    assert greedy_accept([], [7]) == 0


def test_residual_is_the_normalised_positive_part():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.6, 0.2])
    assert torch.allclose(residual(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual(p, p), p)


def test_chain_rejection_single_token_output_follows_p():
    p, q = _dist(1), _dist(2)
    g = torch.Generator().manual_seed(0)

    def draw():
        x = int(torch.multinomial(q, 1, generator=g))
        accepted, nxt = chain_rejection([x], q[None], torch.stack([p, _dist(3)]), g)
        return x if accepted == 1 else nxt

    assert _tv(_histogram(draw), p) < TV_BOUND


def _on_device(draft, q, p, generator):
    return tuple(chain_rejection_on_device(torch.tensor(draft), q, p, generator).tolist())


@pytest.mark.parametrize("rule", [chain_rejection, _on_device], ids=["host", "device"])
def test_chain_rejection_two_token_joint_distribution_follows_p(rule):
    p1, q1 = _dist(4), _dist(5)
    p2 = [_dist(10 + a) for a in range(V)]  # target next-token distribution after first token a
    q2 = [_dist(20 + a) for a in range(V)]
    g = torch.Generator().manual_seed(1)

    def draw():
        x1 = int(torch.multinomial(q1, 1, generator=g))
        x2 = int(torch.multinomial(q2[x1], 1, generator=g))
        p = torch.stack([p1, p2[x1], _dist(99)])
        accepted, nxt = rule([x1, x2], torch.stack([q1, q2[x1]]), p, g)
        if accepted == 0:  # the second token then comes from the target itself
            return nxt * V + int(torch.multinomial(p2[nxt], 1, generator=g))
        return x1 * V + (x2 if accepted == 2 else nxt)

    joint = torch.cat([p1[a] * p2[a] for a in range(V)])
    assert _tv(_histogram(draw, size=V * V), joint) < 2 * TV_BOUND


def test_the_device_chain_rules_decide_as_the_host_ones():
    target = torch.tensor([4, 5, 6, 7])
    for draft in ([4, 5, 6], [4, 9, 6], [1, 5, 6], [4, 5, 7]):
        count = greedy_accept(draft, target.tolist())
        assert greedy_chain(torch.tensor(draft), target).tolist() == [count, int(target[count])]
    p, q = torch.eye(V)[:3], torch.eye(V)[:2]  # point masses: a draft equal to p's token is always accepted
    assert chain_rejection_on_device(torch.tensor([0, 1]), q, p).tolist() == [2, 2]
    assert chain_rejection_on_device(torch.tensor([0, 3]), torch.stack([q[0], torch.eye(V)[3]]), p).tolist() == [1, 1]


def _siblings_device(candidates, p, g):
    kids = torch.arange(len(candidates))[None]
    slot, emitted = siblings_on_device(kids, torch.tensor(candidates), p[None], g)
    return (None, int(emitted[0])) if slot[0] < 0 else (int(slot[0]), candidates[int(slot[0])])


@pytest.mark.parametrize("rule", [verify_siblings, _siblings_device], ids=["host", "device"])
@pytest.mark.parametrize("width", [1, 4])
def test_sibling_rule_output_follows_p_for_deterministic_candidates(width, rule):
    p, q = _dist(6), _dist(7)
    candidates = torch.topk(q, width).indices.tolist()
    g = torch.Generator().manual_seed(2)
    counts = _histogram(lambda: rule(candidates, p, g)[1])
    assert _tv(counts, p) < TV_BOUND


def test_the_device_sibling_rule_decides_point_masses_and_repeats_as_the_host_one():
    p = torch.eye(V)[[2, 4]]  # group 0 wants token 2, group 1 token 4
    kids = torch.tensor([[0, 1, 2], [1, 1, -1]])  # group 1 offers token 3 twice: rejected, then no mass left
    slot, emitted = siblings_on_device(kids, torch.tensor([1, 3, 2]), p)
    assert slot.tolist() == [2, -1] and emitted[1] == 4
    assert verify_siblings([1, 3, 2], p[0]) == (2, 2) and verify_siblings([3, 3], p[1])[0] is None


def _ancestry(parents, node):
    return [node] + (_ancestry(parents, parents[node]) if parents[node] >= 0 else [])


def _tree_device(parents, tokens, p, g):
    depth = 0 if not parents else max(len(_ancestry(parents, node)) for node in range(len(parents)))
    read = tree_rejection_on_device(torch.tensor(parents), torch.tensor(tokens), p, depth, g).tolist()
    return [node for node in read[:-1] if node >= 0], read[-1]


def test_a_broken_residual_would_fail_the_bound():
    """Guard that the bound is tight enough: resampling from p (not the residual) after a rejection is caught."""
    p, q = _dist(6), _dist(7)
    candidates = torch.topk(q, 4).indices.tolist()
    g = torch.Generator().manual_seed(3)

    def broken():
        for token in candidates:
            if float(torch.rand((), generator=g)) < float(p[token]):
                return token
        return int(torch.multinomial(p, 1, generator=g))

    assert _tv(_histogram(broken), p) > 2 * TV_BOUND


@pytest.mark.parametrize("rule", [sampled_tree, _tree_device], ids=["host", "device"])
def test_tree_walk_width_4_two_levels_follows_the_joint_distribution(rule):
    """Root has 4 children, each with 2 children: the first two emitted tokens follow p1(a) p2(b | a)."""
    p1 = _dist(30)
    p2 = [_dist(40 + a) for a in range(V)]
    first = [0, 2, 3, 5]
    parents, tokens = [-1, -1, -1, -1], list(first)
    for i, a in enumerate(first):
        parents += [i, i]
        tokens += [(a + 1) % V, (a + 4) % V]
    rows = [p1] + [p2[t] for t in tokens]
    p = torch.stack(rows)
    g = torch.Generator().manual_seed(4)

    def draw():
        path, nxt = rule(parents, tokens, p, g)
        emitted = [tokens[n] for n in path] + [nxt]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=g)))
        return emitted[0] * V + emitted[1]

    joint = torch.cat([p1[a] * p2[a] for a in range(V)])
    assert _tv(_histogram(draw, size=V * V), joint) < 2 * TV_BOUND


def test_tree_walk_greedy_follows_the_argmax_path():
    parents = [-1, -1, 0, 1, 1]
    tokens = [4, 2, 1, 0, 3]
    argmax = [2, 9, 3, 9, 9, 5]  # row 0: root wants 2 (node 1); row 2: after node 1 wants 3 (node 4); row 5: bonus
    path, nxt = verify_tree(parents, tokens, argmax)
    assert path == [1, 4] and nxt == 5


def test_sampler_top_k_and_top_p_keep_the_expected_support():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top_k = Sampler(SamplingConfig(temperature=1.0, top_k=2)).probs(logits)
    assert torch.allclose(top_k, torch.tensor([4 / 7, 3 / 7, 0, 0]))
    top_p = Sampler(SamplingConfig(temperature=1.0, top_p=0.75)).probs(logits)
    assert torch.allclose(top_p, torch.tensor([0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0]))
    assert Sampler(SamplingConfig()).pick(logits) == 0


def test_the_device_greedy_walk_equals_the_host_walk_on_random_sparse_trees():
    """rounds.greedy_walk (any tree, on the device) against verify_tree (the host walk) on trees of every shape."""
    import random

    from methods.rounds import TreeShape, greedy_walk

    rng = random.Random(0)
    for _ in range(300):
        count = rng.randint(1, 12)
        parents = [rng.randint(-1, i - 1) for i in range(count)]
        tokens = [rng.randint(0, 3) for _ in range(count)]
        argmax = [rng.randint(0, 3) for _ in range(count + 1)]
        shape = TreeShape.of_parents(parents, torch.device("cpu"))
        *walk, bonus = greedy_walk(shape, torch.tensor(tokens), torch.tensor(argmax)).tolist()
        assert ([node for node in walk if node >= 0], bonus) == verify_tree(parents, tokens, argmax)
