"""The draft-then-verify kit EAGLE-3, SSD and prompt lookup share: a round's drafted nodes and their tree mask, the
target's prefill, ONE verification forward over a round's candidates, and the bookkeeping that commits a round.

A round drafts nodes (a chain or a tree, parents before children) after the newest committed token; the target
verifies all of them in one forward with a tree attention mask, keeps the longest accepted path (its KV compacted
into place) and adds one bonus token. `Rounds` commits what a round accepted and counts it the same way for every
method that runs rounds, executed or replayed on a trajectory (methods/teacher.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Protocol

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods import drafts as drafts_log
from methods.base import Generation, Method, Timer, commit
from methods.capabilities import PositionAxis, Reports, Simulates
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
    """A drafted token on the host (SSD's speculation tree): its parent (index into the round's nodes, -1 for the
    root), depth and branch score."""

    token: int
    parent: int
    depth: int
    score: float = 0.0
    q: torch.Tensor | None = None  # the distribution it was sampled from (sampled chain, T > 0)
    state: torch.Tensor | None = None  # the drafter's output for this node's row [1, 1, D]


@dataclass
class TreeShape:
    """Where a draft tree's nodes hang, on the device: node i's parent (-1: the root; parents before children, and
    siblings tried in index order) and depth (1: a child of the root), and its ancestors (ancestors[i, j]: node j is
    i or above it). `host`: the same parents and depths as lists where the drafter knows them without a read-back."""

    parents: torch.Tensor  # [N]
    depths: torch.Tensor  # [N]
    ancestors: torch.Tensor  # [N, N] bool
    levels: int  # the deepest node's depth
    host: tuple[list[int], list[int]] | None = None

    @classmethod
    def of_parents(cls, parents: list[int], device) -> TreeShape:
        """A shape known on the host (a fixed tree, a chain, SSD's nodes): built once, copied to the device."""
        depths, ancestors = [], torch.zeros(len(parents), len(parents), dtype=torch.bool)
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"node {i}'s parent must come before it, got {parent}")
            depths.append(1 if parent < 0 else depths[parent] + 1)
            if parent >= 0:
                ancestors[i] = ancestors[parent]
            ancestors[i, i] = True
        return cls(torch.tensor(parents, dtype=torch.long, device=device),
                   torch.tensor(depths, dtype=torch.long, device=device), ancestors.to(device),
                   max(depths, default=0), (list(parents), depths))


@dataclass
class DraftTree:
    """A round's drafts on the device: tokens [N] and their shape (None: a chain, each draft the child of the one
    before; a beam or a sparse tree otherwise). `q` [N, V]: the distributions a sampled chain was drawn from (T > 0;
    None: deterministic candidates, which the sibling rule verifies)."""

    tokens: torch.Tensor
    shape: TreeShape | None = None
    q: torch.Tensor | None = None

    @classmethod
    def of_nodes(cls, nodes: list[Node], device) -> DraftTree:
        """Host-side drafts (their tokens and parents copied to the device, nothing read back)."""
        tokens = torch.tensor([n.token for n in nodes], dtype=torch.long, device=device)
        parents = [n.parent for n in nodes]
        chain = parents == list(range(-1, len(nodes) - 1))
        q = torch.stack([n.q for n in nodes]) if nodes and nodes[0].q is not None else None
        return cls(tokens, None if chain else TreeShape.of_parents(parents, device), q)

    @property
    def is_chain(self) -> bool:
        return self.shape is None

    @property
    def levels(self) -> int:
        return len(self.tokens) if self.shape is None else self.shape.levels

    def tree_shape(self) -> TreeShape:
        return self.shape or chain_shape(len(self.tokens), self.tokens.device)


@lru_cache(maxsize=64)
def chain_shape(count: int, device: torch.device) -> TreeShape:
    """A chain of `count` drafts as a tree (its tensors are only read, so rounds share them)."""
    return TreeShape.of_parents(list(range(-1, count - 1)), device)


@dataclass
class Outcome:
    """What a round's verification decided: the accepted nodes (a path from the root), the committed tokens (theirs
    and the next token) and the target's features at the verifier's layers over the root and the accepted rows."""

    accepted: list[int]
    tokens: list[int]
    features: dict[int, torch.Tensor]


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
    prompt_ids: list[int] = field(default_factory=list)
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

    @property
    def position(self) -> int:
        """The newest committed token's position (the root of the next round's drafts)."""
        return len(self.prompt_ids) + self.base

    def commit(self, tokens: list[int], count: int) -> list[int]:
        """Commit a round's tokens, its `count` accepted drafts and the bonus token after them (up to the budget and
        the first stop id); returns the tokens committed."""
        new = commit(self.output, tokens, self.max_new_tokens, self.stop_ids)
        self.accepted.append(len(new))
        for k in range(min(count, len(new))):
            self.position_accepts[k] += 1
        return new

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


def verify(target: TargetRuntime, layers: tuple[int, ...], tree: DraftTree, last: int, base: int, sampler: Sampler
           ) -> Outcome:
    """ONE target forward over the root (`last`, at `base`) and every draft, the decision on the device and one read
    back of it and the drafts; the accepted branch's KV (and linear states) move into place."""
    device, count = target.device, len(tree.tokens)
    ids = torch.cat([torch.tensor([last], device=device), tree.tokens])
    positions, slots, mask, parents = range(base, base + count + 1), None, None, None
    # A tree's rows see the prefix plus their own branch, node i in slot base + 1 + i. Linear-attention layers take
    # even a chain level by level, so the state after each accepted draft is there whatever is accepted.
    if not tree.is_chain or target.has_linear_layers:
        positions, slots, mask, parents = _tree_rows(tree.tree_shape(), base, target.has_linear_layers, device)
    h, captured = target.run_layers(0, target.num_layers, target.embed(ids), positions, slots=slots, mask=mask,
                                    parents=parents, capture=layers)
    logits = target.logits(h)  # row 0: after the root; row i + 1: after node i
    decision, walked = _decide(tree, logits, sampler)
    shown = [decision, tree.tokens] if tree.is_chain else [decision, tree.tokens, tree.shape.parents]
    read = torch.cat(shown).tolist()  # the round's one read back
    head = tree.levels + 1 if walked else 2
    tokens, tree_parents = read[head: head + count], (read[head + count:] if not tree.is_chain else None)
    drafts_log.note(tokens, tree_parents)
    accepted = [i for i in read[: head - 1] if i >= 0] if walked else list(range(read[0]))
    bonus = read[head - 1]
    if accepted != list(range(len(accepted))):  # the accepted branch's KV (and linear states) move into place
        target.cache.move([base + 1 + i for i in accepted], base + 1)
    target.truncate(base + 1 + len(accepted))  # the rejected drafts' linear states go
    rows = [0] + [i + 1 for i in accepted]
    features = {layer: h[:, rows] for layer, h in captured.items()} if walked else \
        {layer: h[:, : len(rows)] for layer, h in captured.items()}
    return Outcome(accepted, [tokens[i] for i in accepted] + [bonus], features)


def _decide(tree: DraftTree, logits: torch.Tensor, sampler: Sampler) -> tuple[torch.Tensor, bool]:
    """The round's decision on the device, and whether it is a walk ([levels] accepted nodes, then the next token)
    rather than a chain's [accepted count, next token]: the sibling rule walks even a chain."""
    if sampler.greedy:
        if tree.is_chain:
            return greedy_chain(tree.tokens, logits.argmax(-1)), False
        return greedy_walk(tree.shape, tree.tokens, logits.argmax(-1)), True
    if tree.q is not None:
        return chain_rejection_on_device(tree.tokens, tree.q, sampler.probs(logits), sampler.generator), False
    return tree_rejection_on_device(tree.tree_shape().parents, tree.tokens, sampler.probs(logits), tree.levels,
                                    sampler.generator), True


def _tree_rows(shape: TreeShape, base: int, linear: bool, device):
    """A tree call's positions, slots, mask and (through linear-attention layers) parent slots; host lists where the
    shape is known on the host, so the linear layers read nothing back."""
    count = len(shape.parents)
    mask = torch.cat([torch.ones(count + 1, base + 1, dtype=torch.bool, device=device),
                      torch.cat([torch.zeros(1, count, dtype=torch.bool, device=device), shape.ancestors])], dim=1)
    if shape.host is not None and linear:
        parents, depths = shape.host
        return ([base] + [base + d for d in depths], list(range(base, base + count + 1)), mask,
                [base - 1] + [base + 1 + p if p >= 0 else base for p in parents])
    positions = torch.cat([torch.tensor([base], device=device), base + shape.depths])
    parents = None  # the slot each token continues: the root the last committed one, a node its parent's
    if linear:
        parents = torch.cat([torch.tensor([base - 1], device=device),
                             torch.where(shape.parents >= 0, base + 1 + shape.parents, base)])
    return positions, base + torch.arange(count + 1, device=device), mask, parents


def greedy_walk(shape: TreeShape, tokens: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
    """verify_tree's greedy walk on the device: at each level the first child (in index order) of the accepted node
    whose token is the target's argmax. Returns [levels + 1]: the accepted node per level (-1 once stopped), then
    the next token."""
    device = tokens.device
    node, row, path = torch.tensor(-1, device=device), torch.tensor(0, device=device), []
    for level in range(1, shape.levels + 1):
        hit = (shape.depths == level) & (shape.parents == node) & (tokens == best[row])
        found = hit.any()
        chosen = hit.int().argmax()
        node = torch.where(found, chosen, -2)  # -2: no node's parent, so the walk stays stopped
        row = torch.where(found, chosen + 1, row)
        path.append(torch.where(found, chosen, -1))
    return torch.cat([torch.stack(path), best[row].view(1)]) if path else best[:1]


def trajectory_verifier(teacher: Teacher):
    """Verification that reads the trajectory instead of running the target: the accepted path is the branch that
    follows it and the next token its next one (T=0: the argmax; T>0: the sampled token, see RoundMethod.simulate)."""

    def replayed(tree: DraftTree, last: int, base: int, sampler) -> Outcome:
        shape = tree.tree_shape()
        tokens, parents, depths = torch.stack([tree.tokens, shape.parents, shape.depths]).tolist()
        on_path = []  # is node i's branch the trajectory up to and including it?
        argmax = [teacher.token(base + 1)]
        for token, parent, depth in zip(tokens, parents, depths):
            position = base + depth
            on_path.append((parent < 0 or on_path[parent]) and position < teacher.length
                           and token == teacher.token(position))
            argmax.append(teacher.token(position + 1) if on_path[-1] and position + 1 < teacher.length else -1)
        drafts_log.note(tokens, None if tree.is_chain else parents)
        path, bonus = verify_tree(parents, tokens, argmax)
        features = {layer: h[:, base: base + len(path) + 1] for layer, h in teacher.features.items()}
        return Outcome(path, [tokens[i] for i in path] + [bonus], features)

    return replayed


def feed(head, rounds: Rounds, outcome: Outcome, new: list[int]) -> None:
    """A drafter that reads target features (`head.append`) takes those of the tokens the round committed."""
    features = {layer: h[:, : len(new)] for layer, h in outcome.features.items()}
    head.append(new, features, start=rounds.position - len(new) + 1)


class RoundSession(Protocol):
    """One generation's drafter, as a round method starts it (`RoundMethod.session`): it drafts each round into a
    DraftTree and learns from what the round committed; `finish` gives the generation's Stats and any timings of
    its own."""

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree: ...

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None: ...

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict[str, float]]: ...


class RoundMethod(Method, Reports, Simulates):
    """A draft-then-verify method. The kit owns the loop: prefill, rounds (draft, ONE verify, commit, learn), stopping,
    counting and timing, executed on the target or replayed on a trajectory (`--simulate`), so a replay runs the
    family's very drafting. A family sets `layers` (the target layers its drafter reads), `depth` (the most drafts a
    round can accept) and `session`; every round method reports its draft positions and replays."""

    positions = DRAFT_POSITIONS
    layers: tuple[int, ...] = ()

    @property
    def depth(self) -> int:
        raise NotImplementedError

    def session(self, rounds: Rounds, captured: dict, sampler: Sampler, timer: Timer) -> RoundSession:
        """The generation's drafter, started on the prompt's features at `layers` (`rounds` holds the first token)."""
        raise NotImplementedError

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        timer = Timer(self.target.device)
        first, captured = target_prefill(self.target, self.layers, prompt_ids, sampler, timer)
        return self.run_rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer,
                               partial(verify, self.target, self.layers))

    @torch.inference_mode()
    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        """The real rounds with the trajectory in place of the target's verification forward: exact at T=0. Drafts
        that are deterministic candidates keep the sibling rule's outcome a sample of the executed process at T>0
        (it emits a sample of p and accepts iff it is a candidate); the realised acceptance is the expected one."""
        try:
            self.check_simulation(self.params, 0.0 if sampler.greedy else sampler.config.temperature)
        except ValueError as exc:
            raise HarnessError(str(exc)) from None
        teacher = Teacher.run(self.target, prompt_ids, trajectory, self.layers, sampler)
        return replay_on(teacher, self.session, self.depth, max_new_tokens, self.stop_ids)

    def run_rounds(self, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int, sampler: Sampler,
                   timer: Timer, verifier, start=None) -> Generation:
        """`decode_rounds` with this method's session (`start`: another, of `session`'s signature)."""
        return decode_rounds(start or self.session, self.depth, prompt_ids, first, captured, max_new_tokens,
                             self.stop_ids, sampler, timer, verifier)


def decode_rounds(start, depth: int, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int,
                  stop_ids: set[int], sampler: Sampler, timer: Timer, verifier) -> Generation:
    """Rounds from the first token until the budget or a stop id: `start(rounds, captured, sampler, timer)` gives the
    RoundSession, `verifier(tree, last, base, sampler)` -> Outcome decides each round."""
    rounds = Rounds([first], depth, max_new_tokens, stop_ids, prompt_ids)
    with timer("prefill"):
        session = start(rounds, captured, sampler, timer)
    with timer("decode"):
        while not rounds.done:
            tree = session.draft(rounds, sampler, timer)
            with timer("verify"):
                outcome = verifier(tree, rounds.output[-1], rounds.position, sampler)
            new = rounds.commit(outcome.tokens, len(outcome.accepted))
            session.learn(rounds, outcome, new, timer)
    stats, timing = session.finish(rounds, timer)
    return rounds.generation({**timer.totals, **timing}, stats)


def replay_on(teacher: Teacher, start, depth: int, max_new_tokens: int, stop_ids: set[int]) -> Generation:
    """`decode_rounds` on a trajectory the teacher holds (its features in place of the target's)."""
    prompt_len = teacher.prompt_len
    prefix = {layer: h[:, :prompt_len] for layer, h in teacher.features.items()}
    generation = decode_rounds(start, depth, teacher.ids[:prompt_len].tolist(), teacher.token(prompt_len), prefix,
                               max_new_tokens, stop_ids, teacher.sampler, Timer(teacher.ids.device),
                               trajectory_verifier(teacher))
    generation.stats.expected_accepts = float(sum(generation.position_accepts))
    return generation
