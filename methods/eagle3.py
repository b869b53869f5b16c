"""EAGLE-3: a trained one-layer head drafts m tokens (a chain, or a beam tree of width W) from fused target
features and its own states; the target verifies every candidate in ONE forward with a tree attention mask, keeps
the longest accepted path (its KV compacted into place) and adds one bonus token per round.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness import checkpoints
from harness.errors import HarnessError
from harness.target import StateCache, TargetRuntime
from methods.base import RECORDED_WHEN_SET, Generation, Method, Timer, commit, register
from methods.eagle_head import LAYOUTS, EagleConfig, EagleHead
from methods.eagle_replay import chain_accepts, replay_rounds, rounds_on_trajectory
from methods.sampling import Sampler
from methods.teacher import Teacher
from methods.verify import chain_rejection, verify_tree


@dataclass(frozen=True)
class EagleParams:
    m: int = 7  # draft depth per round
    width: int = 1  # 1: a chain; W: the W best branches per depth by cumulative draft log-probability
    ttt: int = 7  # which trained head: the training-time-test depth it was trained with
    # which kind of head: the harness's own or the EAGLE-3 authors' layer (eagle_head.py)
    layout: str = field(default="harness", metadata=RECORDED_WHEN_SET)

    def __post_init__(self):
        if min(self.m, self.width, self.ttt) < 1:
            raise ValueError(f"m, width and ttt must be >= 1, got m={self.m}, width={self.width}, ttt={self.ttt}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def tag(self) -> str:
        return f"ttt{self.ttt}" + ("" if self.layout == "harness" else f"-{self.layout}")


def load_head(target: TargetRuntime, params: EagleParams, checkpoint: str | None) -> EagleHead:
    folder, saved = checkpoints.locate(target.identity, "eagle3", *EAGLE3.drafter(params), checkpoint)
    config = checkpoints.config_section(folder, saved, "eagle", EagleConfig, "an EAGLE-3 head")
    if config.layout != params.layout:
        raise HarnessError(f"{folder} holds a {config.layout}-layout EAGLE-3 head; pass --param layout={config.layout}")
    weights = checkpoints.load_weights(folder)
    head = EagleHead(config, target, draft_ids=weights.get("draft_ids"))
    checkpoints.load_into(head, weights, folder)
    return head.eval()


@dataclass(eq=False)
class Node:
    """A drafted token: its parent (index into the round's nodes, -1 for the root), depth and branch score."""

    token: int
    parent: int
    depth: int
    score: float = 0.0
    q: torch.Tensor | None = None  # the distribution it was sampled from (sampled chain, T > 0)
    state: torch.Tensor | None = None  # the head's output for this node's row [1, 1, D]


class _Head:
    """The head's side of one generation. Its KV cache holds the row of the token at position q in slot q - 1, so
    the target-feature rows fill slots 0 .. base - 1 and a round's draft rows follow from slot base."""

    def __init__(self, head: EagleHead, max_len: int):
        self.head = head
        self.device = head.head.weight.device
        self.cache = StateCache(["full_attention"], max_len, rewind_window=0)
        self.root: torch.Tensor | None = None  # output state of the newest target-feature row

    @classmethod
    def started(cls, head: EagleHead, max_len: int, prompt_ids: list[int], first: int, captured: dict) -> _Head:
        """The head after the prefill: rows for the prompt's tokens after the first and the first sampled token."""
        started = cls(head, max_len)
        started.append(prompt_ids[1:] + [first], captured, start=1)
        return started

    def append(self, tokens: list[int], features: dict[int, torch.Tensor], start: int) -> None:
        """Rows for `tokens` at positions start.. with the target features of the positions before them; the
        newest row's output becomes the root the next draft starts from."""
        head = self.head
        positions = torch.arange(start, start + len(tokens), device=self.device)
        mask = self.cache.begin(positions - 1)
        out = head.rows(head.embed(positions.new_tensor(tokens)[None]), head.fused(features), positions, mask, self.cache)
        self.root = out[:, -1:]

    def draft_rows(self, nodes: list[Node], level: list[int], base: int) -> torch.Tensor:
        """Rows for the nodes of one level, reading their parents' states; node i sits in slot base + i."""
        head = self.head
        tokens = torch.tensor([nodes[i].token for i in level], device=self.device)
        feature = torch.cat([nodes[nodes[i].parent].state if nodes[i].parent >= 0 else self.root for i in level], 1)
        positions = torch.tensor([base + nodes[i].depth for i in level], device=self.device)
        slots = torch.tensor([base + i for i in level], device=self.device)
        layout = tree_mask(nodes, level, base, base, base + len(nodes))
        mask = self.cache.begin(positions, slots, layout.to(self.device))
        return head.rows(head.embed(tokens[None]), feature, positions, mask, self.cache)


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


@register
class EAGLE3(Method):
    name = "eagle3"
    Params = EagleParams
    trainable = True

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """One head per training-time-test depth and layout."""
        from methods.objectives import EagleSpec

        default = cls.Params()
        layouts = values.get("layout") or [default.layout]
        if any(layout not in LAYOUTS for layout in layouts):
            raise ValueError(f"the EAGLE-3 layout must be one of {', '.join(LAYOUTS)}, got {layouts}")
        return [EagleSpec(ttt, layout) for ttt in values.get("ttt") or [default.ttt] for layout in layouts]

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        """tau * L / (Ls * m + L): a round drafts m tokens through the head's Ls layers, then one target forward."""
        shape = summary.draft
        if shape is None or summary.tokens_per_step is None:
            return None
        return summary.tokens_per_step * shape["num_layers"] / (shape["ls"] * shape["m"] + shape["num_layers"])

    @classmethod
    def drafter(cls, params: EagleParams) -> tuple[str, str]:
        layout = "" if params.layout == "harness" else f" --eagle-layout {params.layout}"
        return params.tag, f"spd-bench train --method eagle3 --ttt {params.ttt}{layout}"

    def __init__(self, target, params: EagleParams, stop_ids, checkpoint=None, head: EagleHead | None = None):
        super().__init__(target, params, stop_ids, checkpoint)
        self.head = head or load_head(target, params, checkpoint)
        self.layers = self.head.config.all_feature_layers()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        timer = Timer(self.target.device)
        first, captured = self.prefill(prompt_ids, sampler, timer)
        return self._rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer, self._verify)

    def prefill(self, prompt_ids: list[int], sampler: Sampler, timer: Timer) -> tuple[int, dict]:
        """The prompt's target forward: the first token and the head's feature layers over the prompt."""
        return target_prefill(self.target, self.layers, prompt_ids, sampler, timer)

    @torch.inference_mode()
    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        """Chains: every round's acceptance from one batched training-time-test forward (methods/eagle_replay.py).
        Trees: the real drafting rounds, verified against the trajectory instead of a target forward. Tree drafts
        are deterministic and the sibling rule emits a sample of p, accepting iff it is a candidate, so at T>0 the
        replay is a sample of the executed process (its expected acceptance is the realised one: the target's
        distributions off the trajectory are not known)."""
        if self.params.width == 1:
            teacher = Teacher.run(self.target, prompt_ids, trajectory, self.layers, sampler)
            accepts = chain_accepts(self.head, teacher, self.params.m)
            return replay_rounds(accepts, teacher, self.params.m, max_new_tokens, self.stop_ids, self._shape())
        return rounds_on_trajectory(
            lambda first, prefix, timer, verify: self._rounds(prompt_ids, first, prefix, max_new_tokens, sampler, timer,
                                                              verify),
            self.target, prompt_ids, trajectory, self.layers, sampler)

    def _rounds(self, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int, sampler: Sampler,
                timer: Timer, verify) -> Generation:
        """Draft, verify (`verify(nodes, last, base, sampler)` -> path, bonus, features), commit, until done."""
        m = self.params.m
        with timer("prefill"):
            head = _Head.started(self.head, self.target.max_len, prompt_ids, first, captured)
        output = [first]
        accepted, position_accepts, candidates = [], [0] * m, 0
        with timer("decode"):
            while len(output) < max_new_tokens and output[-1] not in self.stop_ids:
                base = len(prompt_ids) + len(output) - 1  # position of the newest committed token
                with timer("drafter"):
                    nodes = self._draft(head, base, sampler)
                with timer("verify"):
                    path, bonus, features = verify(nodes, output[-1], base, sampler)
                new = commit(output, [nodes[i].token for i in path] + [bonus], max_new_tokens, self.stop_ids)
                accepted.append(len(new))
                candidates += len(nodes)
                for k in range(min(len(path), len(new))):
                    position_accepts[k] += 1
                with timer("drafter"):
                    features = {layer: h[:, : len(new)] for layer, h in features.items()}
                    head.append(new, features, start=base + 1)
        return Generation(
            output_ids=output,
            steps=len(accepted),
            accepted=accepted,
            position_accepts=position_accepts,
            timing=timer.totals,
            stats={"candidates": candidates, "draft": self._shape()},
        )

    def _shape(self) -> dict:
        return {"num_layers": self.target.num_layers, "ls": 1, "m": self.params.m, "width": self.params.width}

    # --- drafting -------------------------------------------------------------------------------------------------
    def _draft(self, head: _Head, base: int, sampler: Sampler) -> list[Node]:
        """m levels of candidates after the root, parents before children (at most W per level)."""
        width = self.params.width
        nodes: list[Node] = []
        frontier, states = [-1], head.root
        for depth in range(1, self.params.m + 1):
            logits = self.head.full_vocab(self.head.head_logits(states))[0]  # [len(frontier), V]
            level = self._children(nodes, frontier, logits, depth, width, sampler)
            if depth == self.params.m:
                break
            states = head.draft_rows(nodes, level, base)
            for i, index in enumerate(level):
                nodes[index].state = states[:, i : i + 1]
            frontier = level
        return nodes

    def _children(self, nodes: list[Node], frontier: list[int], logits: torch.Tensor, depth: int, width: int,
                  sampler: Sampler) -> list[int]:
        """Add the next level: a sampled token (chain, T > 0) or the `width` best children by cumulative score."""
        start = len(nodes)
        if width == 1 and not sampler.greedy:
            q = sampler.probs(logits[0])
            nodes.append(Node(sampler.draw(q), frontier[0], depth, q=q))
            return [start]
        scores = [nodes[i].score if i >= 0 else 0.0 for i in frontier]
        for row, token, score in sampler.best_children(logits, scores, width):
            nodes.append(Node(token, frontier[row], depth, score))
        return list(range(start, len(nodes)))

    # --- verification ---------------------------------------------------------------------------------------------
    def _verify(self, nodes: list[Node], last: int, base: int, sampler: Sampler):
        return verify_round(self.target, self.layers, nodes, last, base, sampler)


def target_prefill(target: TargetRuntime, layers: tuple[int, ...], prompt_ids: list[int], sampler: Sampler,
                   timer: Timer) -> tuple[int, dict]:
    """The prompt's target forward: the first token and the hidden states at `layers` over the prompt."""
    target.reset()
    with timer("prefill"):
        logits, captured = target.forward(torch.tensor(prompt_ids, device=target.device), 0, layers)
        return sampler.pick(logits[-1]), captured


def verify_round(target: TargetRuntime, layers: tuple[int, ...], nodes: list[Node], last: int, base: int,
                 sampler: Sampler):
    """One target forward over the root and every candidate; returns (accepted node path, next token, target
    features at `layers` of the root and the path rows)."""
    device = target.device
    ids = torch.tensor([last] + [n.token for n in nodes], device=device)
    positions = torch.tensor([base] + [base + n.depth for n in nodes], device=device)
    chain = all(n.parent == i - 1 for i, n in enumerate(nodes))
    slots = mask = parents = None
    # Rows see the prefix plus their own branch; slots base + 1 + i hold the candidates. Linear-attention layers
    # take even a chain level by level, so the state after each accepted candidate is there whatever is accepted.
    if not chain or target.has_linear_layers:
        slots = base + torch.arange(len(ids), device=device)
        mask = tree_mask(nodes, [-1] + list(range(len(nodes))), base + 1, base + 1, base + len(ids))
        parents = torch.tensor([base - 1] + [base + 1 + n.parent if n.parent >= 0 else base for n in nodes],
                               device=device)
    h, captured = target.run_layers(0, target.num_layers, target.embed(ids), positions, slots=slots, mask=mask,
                                    parents=parents, capture=layers)
    logits = target.logits(h)
    path, bonus = _accept(nodes, logits, sampler)
    if path and path != list(range(len(path))):  # the accepted branch's KV (and linear states) move
        target.cache.move(torch.tensor([base + 1 + i for i in path], device=device), base + 1)
    target.truncate(base + 1 + len(path))  # the rejected candidates' linear states go
    rows = [0] + [i + 1 for i in path]
    return path, bonus, {layer: h[:, rows] for layer, h in captured.items()}


def _accept(nodes: list[Node], logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    parents, tokens = [n.parent for n in nodes], [n.token for n in nodes]
    if sampler.greedy:
        return verify_tree(parents, tokens, None, logits.argmax(-1).tolist())
    p = sampler.probs(logits)
    if nodes and nodes[0].q is not None:  # a sampled chain: the p/q rule, then a bonus token from p
        count, token = chain_rejection(tokens, torch.stack([n.q for n in nodes]), p, sampler.generator)
        return list(range(count)), token
    return verify_tree(parents, tokens, p, None, sampler.generator)
