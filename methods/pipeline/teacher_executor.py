"""The stage executor of a tree replay (`--simulate` at width > 1).

Trees: which children of a trajectory token survive depends on the draft scores of branches off the trajectory, so
those need target states too. The engine runs its own cycles (drafting, pruning, verification rule, counters) with
a `TeacherForcedExecutor` in place of the target: a trajectory token's states come from the teacher pass, and a
token off it gets all its layers in one forward when it is drafted (its ancestors' KV is there by then), in a ring
of slots above the trajectory. Every decision is the engine's own, so T=0 is exact; the cost is one forward of the
off-trajectory drafts per cycle. Once the flush ahead is certain (the trajectory left the tree after single-token
levels), nothing drafted until then can change an outcome (`outcomes_known`): those cycles draft placeholders and
cost nothing, so stage runs are not counted.
Tree drafts are deterministic at any T, and the sibling rule emits a sample of p and accepts iff it is a candidate,
so at T>0 the replay on a sampled AR trajectory is itself a sample of the executed process, and its expected
acceptance is the realised one (p of the candidates would need the sibling sets that skipped cycles prune).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from harness.runtime.errors import HarnessError
from methods.pipeline.executor import StageExecutor
from methods.pipeline.scheduler import PLACEHOLDER, PipelineEngine
from methods.pipeline.tree import Level, Token
from methods.teacher import Teacher


class TeacherForcedExecutor(StageExecutor):
    """The stage executor of a tree replay: trajectory states from the teacher pass, off-trajectory tokens forwarded
    through every layer when they enter, verification by the trajectory's next token."""

    def __init__(self, engine: PipelineEngine, teacher: Teacher):
        super().__init__(engine.target, engine.bounds, engine.capture, engine.width)
        self.teacher = teacher
        self.ring = engine.width * (self.n + 1)  # a drafted token lives at most n cycles, W drafted per cycle
        self.next_slot = 0
        if teacher.length + self.ring > self.target.max_len:
            raise HarnessError(f"the tree replay needs {teacher.length + self.ring} target cache slots but the runtime "
                               f"holds {self.target.max_len}; use a smaller --width or --n")
        self.off_path: weakref.WeakKeyDictionary[Token, _OffPath] = weakref.WeakKeyDictionary()
        self.linear = linear_layers(self.target)
        self.linear_end = 0  # trajectory positions below this have linear-layer states in the target's cache

    def prefill(self, prompt_ids: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The teacher's prompt states, and logits that make the trajectory's first token the pick at any T."""
        start = self.teacher.prompt_len
        return self._certain(self.teacher.token(start)), {layer: self.teacher.features[layer][:, :start]
                                                         for layer in self.capture}

    def enter(self, level: Level) -> None:
        super().enter(level)
        off = [t for t in level if not self._follows_trajectory(t)]
        if off:
            self._forward(off)

    def report(self) -> dict:
        return {"kind": "teacher-forced"}

    def outcomes_known(self, levels: list[Level]) -> bool:
        """The trajectory left the tree at a level after single-token levels only: a single token is the ancestor of
        every later draft, so pruning never removes it; those levels accept and that one rejects, whatever else is
        drafted. (A trajectory token among siblings could still lose all its descendants to their scores.)"""
        for level in levels:
            if not any(self._on_trajectory(t) for t in level):
                return True
            if len(level) > 1:
                return False
        return False

    def advance(self, levels: list[Level]) -> None:
        for level in levels:
            lo, hi = self.bounds[level[0].depth]
            for token in level:
                token.depth += 1
                if token.token == PLACEHOLDER:
                    continue
                record = self.off_path.get(token)
                token.features.update({
                    layer: record.states[layer] if record else self._teacher_state(layer, token.position)
                    for layer in self.capture if lo < layer <= hi})

    def verification_logits(self, finished: Token) -> torch.Tensor:
        """The trajectory's next token decides: it is the argmax at T=0 and the sample the sibling rule draws at T>0
        (certain logits make it so), so a draft is accepted iff it is that token."""
        return self._certain(self.teacher.token(finished.position + 1))

    def truncate(self, position: int) -> None:
        """Trajectory KV stays; off-trajectory slots are reused by the ring."""

    def commit(self, chosen: Token) -> None:
        chosen.slot = chosen.position  # the drafter's cache keeps finished rows at their positions

    def _certain(self, token: int) -> torch.Tensor:
        logits = torch.full((self.target.config.vocab_size,), float("-inf"), device=self.device)
        logits[token] = 0.0
        return logits

    def _on_trajectory(self, token: Token) -> bool:
        """Is the token on the trajectory (with teacher states)?"""
        return token.token != PLACEHOLDER and token not in self.off_path

    def _follows_trajectory(self, token: Token) -> bool:
        """Is the token's branch the trajectory up to and including it (with teacher states there)?"""
        parent_on = token.parent is None or token.parent not in self.off_path
        return parent_on and token.position < self.teacher.length and token.token == self.teacher.token(token.position)

    def _forward(self, tokens: list[Token]) -> None:
        """Every layer of the off-trajectory tokens at once: each sees the trajectory before its branch left it, its
        off-trajectory ancestors and itself."""
        base, kv_end = self.teacher.length, self.teacher.length + self.ring
        mask = torch.zeros(len(tokens), kv_end, dtype=torch.bool)
        for i, token in enumerate(tokens):
            parent = self.off_path.get(token.parent) if token.parent is not None else None
            record = _OffPath(base + self.next_slot, parent.diverged if parent else token.position, parent)
            self.next_slot = (self.next_slot + 1) % self.ring
            self.off_path[token] = record
            mask[i, : record.diverged] = True
            while record is not None:
                mask[i, record.slot] = True
                record = record.parent
        positions = torch.tensor([t.position for t in tokens], device=self.device)
        slots = torch.tensor([self.off_path[t].slot for t in tokens], device=self.device)
        records = [self.off_path[t] for t in tokens]
        parents = [r.parent.slot if r.parent else t.position - 1 for r, t in zip(records, tokens)]
        left_here = [p for p, r in zip(parents, records) if r.parent is None]  # the trajectory token before
        if left_here:
            self._trajectory_linear_states(max(left_here))
        hidden = torch.cat([t.hidden for t in tokens], dim=1)
        _, captured = self.target.run_layers(0, self.target.num_layers, hidden, positions, slots=slots, mask=mask,
                                             parents=torch.tensor(parents, device=self.device), capture=self.capture)
        for b, token in enumerate(tokens):
            self.off_path[token].states = {layer: h[:, b: b + 1] for layer, h in captured.items()}

    def _trajectory_linear_states(self, upto: int) -> None:
        """Linear-attention states of the trajectory through position `upto`, where off-trajectory branches leave
        it: each linear layer runs alone on its teacher input, the prompt at once, then one token per call (a
        branch may leave after any of them; the target keeps the last `rewind_window`)."""
        while self.linear and self.linear_end <= upto:
            end = self.teacher.prompt_len if self.linear_end == 0 else self.linear_end + 1
            for i in self.linear:
                self.target.run_layers(i, i + 1, self.teacher.features[i][:, self.linear_end: end],
                                       range(self.linear_end, end))
            self.linear_end = end

    def _teacher_state(self, layer: int, position: int) -> torch.Tensor:
        return self.teacher.features[layer][:, position: position + 1]


def linear_layers(target) -> list[int]:
    return [i for i, kind in enumerate(target.layer_types) if kind == "linear_attention"]


@dataclass
class _OffPath:
    """Where an off-trajectory token's KV lives in the target cache, where its branch left the trajectory, its
    off-trajectory parent and its hidden states at every captured layer."""

    slot: int
    diverged: int
    parent: _OffPath | None
    states: dict[int, torch.Tensor] | None = None
