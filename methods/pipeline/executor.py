"""Who runs the target's layers for the pipeline scheduler: the seam between decisions and compute.

The scheduler (methods/pipeline/scheduler.py) decides what is drafted, pruned, verified, flushed and refilled; it hands
tokens to a `StageExecutor` for the few operations that touch the target: the prompt's prefill, a fresh level's
embedding, one stage step for a level of in-flight tokens, the verification logits of a token that finished the
last stage, truncation after a rejection and moving an accepted sibling's KV to its position. `LocalExecutor`
runs them on one in-process target runtime; the teacher-forced executor of the replay
(methods/pipeline/replay.py) reads them from a teacher pass instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from harness.runtime.target import Positions, TargetRuntime
from methods.pipeline.tree import Level, Token, is_chain, tree_mask
from methods.stats import Executor


@dataclass
class StageCall:
    """One level's stage step: the layer range, inputs, KV placement and which captured layers come back."""

    lo: int
    hi: int
    wanted: tuple[int, ...]
    hidden: torch.Tensor  # [1, B, D]
    # The tree's shape is the host's (lists): the runtime groups a tree's levels without reading anything back.
    positions: Positions | list[int]  # a chain's one position as a range; a tree level's [B] (siblings share it)
    slots: list[int] | None  # trees: sibling KV slots [B]
    mask: torch.Tensor | None  # trees: [B, kv_end]
    parents: list[int] | None  # trees: the slot each token continues [B] (linear-attention layers)


class StageExecutor(ABC):
    """The target-side operations of one generation; `start` begins it, the rest follow the scheduler's cycles."""

    def __init__(self, target: TargetRuntime, bounds: list[tuple[int, int]], capture: tuple[int, ...], width: int):
        self.target, self.bounds, self.capture, self.width = target, bounds, capture, width
        self.n = len(bounds)

    @property
    def device(self) -> torch.device:
        return self.target.device

    def start(self) -> None:
        """Before a generation (the local executor empties the target's caches)."""

    @abstractmethod
    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The prompt's last logits [V] and its hidden states {layer: [1, P, D]} at the captured layers."""

    def enter(self, level: Level) -> None:
        """A fresh level at depth 0: its tokens' input states (and their embedding as feature 0)."""
        h = self.target.embed(torch.tensor([t.token for t in level], device=self.device))
        for b, token in enumerate(level):
            token.hidden = h[:, b: b + 1]
            token.features[0] = token.hidden

    @abstractmethod
    def advance(self, levels: list[Level]) -> None:
        """Every level runs the stage at its depth (then each token is one stage deeper, with its new features)."""

    @abstractmethod
    def verification_logits(self, finished: Token) -> torch.Tensor:
        """The target's next-token logits [V] after a token that finished the last stage."""

    @abstractmethod
    def truncate(self, position: int) -> None:
        """A rejection at `position`: forget every in-flight state from there."""

    @abstractmethod
    def commit(self, chosen: Token) -> None:
        """An accepted token: its KV moves to its position if it lived in a sibling slot."""

    def stage_call(self, level: Level, chain: bool, base: int, kv_end: int) -> StageCall:
        """The step of `level` through the stage at its depth (trees: sibling slots and a tree mask)."""
        lo, hi = self.bounds[level[0].depth]
        positions, slots, mask, parents = range(level[0].position, level[0].position + 1), None, None, None
        if not chain:
            positions = [level[0].position] * len(level)
            slots = [t.slot for t in level]
            mask = tree_mask(level, base, kv_end)
            parents = [t.position - 1 if t.parent is None else t.parent.slot for t in level]
        return StageCall(lo, hi, tuple(layer for layer in self.capture if lo < layer <= hi),
                         torch.cat([t.hidden for t in level], dim=1), positions, slots, mask, parents)

    @staticmethod
    def absorb(level: Level, out: torch.Tensor, captured: dict[int, torch.Tensor]) -> None:
        """A level's stage output: each token one stage deeper, with its new hidden state and features."""
        for b, token in enumerate(level):
            token.hidden = out[:, b: b + 1]
            token.features.update({layer: h[:, b: b + 1] for layer, h in captured.items()})
            token.depth += 1

    def report(self) -> Executor:
        """What the record says about the executor (the distributed one adds its ranks and their stage times)."""
        return Executor()

    def close(self) -> None:
        """After the last generation (the distributed executor stops its ranks)."""

    def outcomes_known(self, levels: list[Level]) -> bool:
        """Whether every verification until the next flush is already decided whatever is drafted now (a replay
        knows the trajectory; an executor running the target never does)."""
        return False


class LocalExecutor(StageExecutor):
    """Every stage on the in-process target runtime, one after another."""

    def __init__(self, target: TargetRuntime, bounds: list[tuple[int, int]], capture: tuple[int, ...], width: int):
        super().__init__(target, bounds, capture, width)
        if target.rewind_window < self.n:
            raise ValueError(f"target rewind window {target.rewind_window} < n = {self.n}")

    def start(self) -> None:
        self.target.reset()

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        logits, captured = self.target.forward(torch.tensor(prompt_ids, device=self.device), start=0,
                                               capture=self.capture, last=True)
        return logits[-1], captured

    def advance(self, levels: list[Level]) -> None:
        """One call per level (stages own disjoint layers, so their order is free); trees with a tree mask."""
        chain, base = is_chain(levels), levels[0][0].position
        kv_end = base + self.n * self.width  # above every sibling slot in flight
        for level in levels:
            call = self.stage_call(level, chain, base, kv_end)
            self.absorb(level, *self.target.run_layers(call.lo, call.hi, call.hidden, call.positions, slots=call.slots,
                                                       mask=call.mask, parents=call.parents, capture=call.wanted))

    def verification_logits(self, finished: Token) -> torch.Tensor:
        return self.target.logits(finished.hidden)[0]

    def truncate(self, position: int) -> None:
        self.target.truncate(position)  # KV from `position` on, and linear-attention updates since

    def commit(self, chosen: Token) -> None:
        if chosen.slot != chosen.position:
            self.target.cache.move([chosen.slot], chosen.position)
            chosen.slot = chosen.position
