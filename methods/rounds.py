"""The draft-then-verify kit EAGLE-3, SSD and prompt lookup share: a round's drafted nodes and their tree mask, the
target's prefill, ONE verification forward over a round's candidates, and the bookkeeping that commits a round.

A round drafts nodes (a chain or a tree, parents before children) after the newest committed token; the target
verifies all of them in one forward with a tree attention mask, keeps the longest accepted path (its KV compacted
into place) and adds one bonus token. `Rounds` commits what a round accepted and counts it the same way for every
method that runs rounds, executed or replayed on a trajectory (methods/teacher.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.runtime.target import TargetRuntime
from methods import drafts as drafts_log
from methods.base import Generation, PositionAxis, Timer, commit
from methods.sampling import Sampler
from methods.stats import Record, Stats
from methods.teacher import Teacher
from methods.verify import chain_rejection_on_device, greedy_chain, tree_rejection_on_device, verify_tree

DRAFT_POSITIONS = PositionAxis("pos", "Acceptance by draft position (share of rounds that accepted position k)",
                               "draft position")


@dataclass
class DraftShape(Record):
    """What a draft-then-verify speedup formula needs: target layers, a drafted token's cost in target layers (Ls),
    drafts per round (m) and the draft width."""

    num_layers: int
    ls: int
    m: int
    width: int = 1


@dataclass(eq=False)
class Node:
    """A drafted token: its parent (index into the round's nodes, -1 for the root), depth and branch score."""

    token: int
    parent: int
    depth: int
    score: float = 0.0
    q: torch.Tensor | None = None  # the distribution it was sampled from (sampled chain, T > 0)
    state: torch.Tensor | None = None  # the drafter's output for this node's row [1, 1, D]


@dataclass
class Chain:
    """A round's drafts as a chain kept on the device: tokens [m] and, when they were sampled (T > 0), the
    distributions q [m, V] they were drawn from."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None


@dataclass
class Beam:
    """A draft tree kept on the device: `levels` levels of `width` nodes, node i at depth i // width + 1,
    its token, its parent node (-1: the root) and its ancestors (ancestors[i, j]: node j is i or above it)."""

    tokens: torch.Tensor  # [N]
    parents: torch.Tensor  # [N]
    ancestors: torch.Tensor  # [N, N] bool
    width: int

    @property
    def levels(self) -> int:
        return len(self.tokens) // self.width


def chain(tokens: list[int]) -> list[Node]:
    """Deterministic drafts as a chain of nodes (no draft distribution: the verifier treats each as a point mass)."""
    return [Node(token, i - 1, i + 1) for i, token in enumerate(tokens)]


def tree_mask(nodes: list[Node], rows: list[int], prefix: int, first_slot: int, kv_end: int) -> torch.Tensor:
    """[rows, kv_end]: slots below `prefix` plus, for row i (-1: the root), node i's ancestors and itself, node j
    sitting in slot first_slot + j."""
    mask = torch.zeros(len(rows), kv_end, dtype=torch.bool)
    mask[:, :prefix] = True
    for r, i in enumerate(rows):
        while i >= 0:
            mask[r, first_slot + i] = True
            i = nodes[i].parent
    return mask


@dataclass
class Rounds:
    """One generation's committed tokens and its per-round counts: tokens committed by each round and accepted drafts
    per draft position (position k counts rounds whose k-th draft was committed)."""

    output: list[int]
    depth: int  # the most drafts a round can accept
    max_new_tokens: int
    stop_ids: set[int]
    accepted: list[int] = field(default_factory=list)
    position_accepts: list[int] = field(init=False)

    def __post_init__(self):
        self.position_accepts = [0] * self.depth

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or self.output[-1] in self.stop_ids

    @property
    def base(self) -> int:
        """Committed tokens after the first: the newest one's position is the prompt length plus this."""
        return len(self.output) - 1

    def commit(self, tokens: list[int], count: int) -> list[int]:
        """Commit a round's tokens, its `count` accepted drafts and the bonus token after them (up to the budget and
        the first stop id); returns the tokens committed."""
        new = commit(self.output, tokens, self.max_new_tokens, self.stop_ids)
        self.accepted.append(len(new))
        for k in range(min(count, len(new))):
            self.position_accepts[k] += 1
        return new

    def commit_path(self, nodes: list[Node], path: list[int], bonus: int) -> list[int]:
        """Commit the accepted path of a round's nodes and its bonus token."""
        return self.commit([nodes[i].token for i in path] + [bonus], len(path))

    def generation(self, timing: dict[str, float], stats: Stats) -> Generation:
        return Generation(output_ids=self.output, steps=len(self.accepted), accepted=self.accepted,
                          position_accepts=self.position_accepts, timing=timing, stats=stats)


def target_prefill(target: TargetRuntime, layers: tuple[int, ...], prompt_ids: list[int], sampler: Sampler,
                   timer: Timer) -> tuple[int, dict]:
    """The prompt's target forward: the first token and the hidden states at `layers` over the prompt."""
    target.reset()
    with timer("prefill"):
        logits, captured = target.forward(torch.tensor(prompt_ids, device=target.device), 0, layers, last=True)
        return sampler.pick(logits[-1]), captured


def verify_round(target: TargetRuntime, layers: tuple[int, ...], nodes: list[Node], last: int, base: int,
                 sampler: Sampler):
    """One target forward over the root and every candidate; returns (accepted node path, next token, target
    features at `layers` of the root and the path rows)."""
    device = target.device
    ids = torch.tensor([last] + [n.token for n in nodes], device=device)
    is_chain = all(n.parent == i - 1 for i, n in enumerate(nodes))
    positions, slots, mask, parents = range(base, base + len(ids)), None, None, None
    # Rows see the prefix plus their own branch; slots base + 1 + i hold the candidates. Linear-attention layers
    # take even a chain level by level, so the state after each accepted candidate is there whatever is accepted.
    if not is_chain or target.has_linear_layers:
        positions = torch.tensor([base] + [base + n.depth for n in nodes], device=device)
        slots = base + torch.arange(len(ids), device=device)
        mask = tree_mask(nodes, [-1] + list(range(len(nodes))), base + 1, base + 1, base + len(ids))
        parents = torch.tensor([base - 1] + [base + 1 + n.parent if n.parent >= 0 else base for n in nodes],
                               device=device)
    h, captured = target.run_layers(0, target.num_layers, target.embed(ids), positions, slots=slots, mask=mask,
                                    parents=parents, capture=layers)
    logits = target.logits(h)
    path, bonus = _accept(nodes, logits, sampler)
    if path and path != list(range(len(path))):  # the accepted branch's KV (and linear states) move
        target.cache.move([base + 1 + i for i in path], base + 1)
    target.truncate(base + 1 + len(path))  # the rejected candidates' linear states go
    rows = [0] + [i + 1 for i in path]
    return path, bonus, {layer: h[:, rows] for layer, h in captured.items()}


def verify_chain(target: TargetRuntime, layers: tuple[int, ...], drafts: Chain, last: int, base: int,
                 sampler: Sampler) -> tuple[int, list[int], dict]:
    """verify_round for a chain kept on the device: one target forward, the decision on the device and one read
    back of it and the drafts. Returns (accepted drafts, the committed tokens: those drafts and the next token,
    target features at `layers` of the root and the accepted rows)."""
    device, m = target.device, len(drafts.tokens)
    ids = torch.cat([torch.tensor([last], device=device), drafts.tokens])
    positions, slots, mask, parents = range(base, base + m + 1), None, None, None
    if target.has_linear_layers:  # level by level, so the state after each draft is there whatever is accepted
        positions = slots = base + torch.arange(m + 1, device=device)
        mask = tree_mask(chain([0] * m), list(range(-1, m)), base + 1, base + 1, base + m + 1)
        parents = base - 1 + torch.arange(m + 1, device=device)
    h, captured = target.run_layers(0, target.num_layers, target.embed(ids), positions, slots=slots, mask=mask,
                                    parents=parents, capture=layers)
    logits = target.logits(h)
    if sampler.greedy:
        decision = greedy_chain(drafts.tokens, logits.argmax(-1))
    else:
        decision = chain_rejection_on_device(drafts.tokens, drafts.q, sampler.probs(logits), sampler.generator)
    count, bonus, *tokens = torch.cat([decision, drafts.tokens]).tolist()  # the step's one read back
    drafts_log.note(tokens)
    target.truncate(base + 1 + count)
    return count, tokens[:count] + [bonus], {layer: h[:, : count + 1] for layer, h in captured.items()}


def verify_beam(target: TargetRuntime, layers: tuple[int, ...], beam: Beam, last: int, base: int, sampler: Sampler
                ) -> tuple[list[int], list[int], dict]:
    """verify_round for a Beam: one forward, the accepted path walked on the device and one read back (a target
    with linear-attention layers also reads the tree's shape back once, to run them level by level). Returns
    (accepted nodes, committed tokens: theirs and the next token, features as verify_round's)."""
    device, count = target.device, len(beam.tokens)
    ids = torch.cat([torch.tensor([last], device=device), beam.tokens])
    positions = torch.tensor([base] + [base + 1 + i // beam.width for i in range(count)], device=device)
    mask = torch.cat([torch.ones(count + 1, base + 1, dtype=torch.bool, device=device),
                      torch.cat([torch.zeros(1, count, dtype=torch.bool, device=device), beam.ancestors])], dim=1)
    parents = None  # the slot each token continues: the root the last committed one, a node its parent's
    if target.has_linear_layers:
        parents = torch.cat([torch.tensor([base - 1], device=device),
                             torch.where(beam.parents >= 0, base + 1 + beam.parents, base)])
    h, captured = target.run_layers(0, target.num_layers, target.embed(ids), positions,
                                    slots=base + torch.arange(count + 1, device=device), mask=mask, parents=parents,
                                    capture=layers)
    logits = target.logits(h)  # row 0: after the root; row i + 1: after node i
    if sampler.greedy:
        decision = _greedy_walk(beam, logits.argmax(-1))
    else:
        decision = tree_rejection_on_device(beam.parents, beam.tokens, sampler.probs(logits), beam.levels,
                                            sampler.generator)
    read = torch.cat([decision, beam.tokens, beam.parents]).tolist()  # the round's one read back
    walk, bonus, tokens = read[: beam.levels], read[beam.levels], read[beam.levels + 1: beam.levels + 1 + count]
    drafts_log.note(tokens, read[beam.levels + 1 + count:])
    accepted = [i for i in walk if i >= 0]
    if accepted != list(range(len(accepted))):  # the accepted branch's KV moves into place
        target.cache.move([base + 1 + i for i in accepted], base + 1)
    target.truncate(base + 1 + len(accepted))
    rows = [0] + [i + 1 for i in accepted]
    return accepted, [tokens[i] for i in accepted] + [bonus], {layer: h[:, rows] for layer, h in captured.items()}


def _greedy_walk(beam: Beam, best: torch.Tensor) -> torch.Tensor:
    """verify_tree's greedy walk on the device: at each level the first child of the accepted node that is the
    target's argmax. Returns [levels + 1]: the accepted node per level (-1 once stopped), then the next token."""
    width, device = beam.width, beam.tokens.device
    node, row, path = torch.tensor(-1, device=device), torch.tensor(0, device=device), []
    for level in range(beam.levels):
        own = slice(level * width, (level + 1) * width)
        hit = (beam.parents[own] == node) & (beam.tokens[own] == best[row])
        found = hit.any()
        chosen = level * width + hit.int().argmax()  # the first hit, as verify_tree tries siblings in order
        node = torch.where(found, chosen, -2)  # -2: no node's parent, so the walk stays stopped
        row = torch.where(found, chosen + 1, row)
        path.append(torch.where(found, chosen, -1))
    return torch.cat([torch.stack(path), best[row].view(1)])


def _accept(nodes: list[Node], logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    parents, tokens = [n.parent for n in nodes], [n.token for n in nodes]
    drafts_log.note(tokens, parents)
    if sampler.greedy:
        return verify_tree(parents, tokens, logits.argmax(-1).tolist())
    p, drafts = sampler.probs(logits), torch.tensor(tokens, dtype=torch.long, device=logits.device)
    if nodes and nodes[0].q is not None:  # a sampled chain: the p/q rule, then a bonus token from p
        q = torch.stack([n.q for n in nodes])
        count, token = chain_rejection_on_device(drafts, q, p, sampler.generator).tolist()
        return list(range(count)), token
    depth = max(n.depth for n in nodes) if nodes else 0
    tree = torch.tensor(parents, dtype=torch.long, device=p.device)
    *walk, token = tree_rejection_on_device(tree, drafts, p, depth, sampler.generator).tolist()  # the one read back
    return [node for node in walk if node >= 0], token


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
        drafts_log.note([n.token for n in nodes], [n.parent for n in nodes])
        path, bonus = verify_tree([n.parent for n in nodes], [n.token for n in nodes], argmax)
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
    generation.stats.expected_accepts = float(sum(generation.position_accepts))
    return generation
