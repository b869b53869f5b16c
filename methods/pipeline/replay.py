"""Acceptance simulation of the pipeline engine: chains (width 1) from batched drafter forwards plus a replay of the
engine's cycle accounting; draft trees (width > 1) by the engine's own cycles on teacher-forced target states.

When the drafter runs for the newest token T, the tokens in flight are T-f .. T (f: the fill level) at depths
q+T-T' (q: query depth, 0 for the input schedule, 1 for output), and everything before T-f is finished. Only
f < n-q states differ from the steady state, so for each position the drafter has at most n-q distinct views.
Finished rows see only finished rows: one causal pass computes them (and their KV) for the whole sequence. Each
(T, f) view is then a group of f+1 in-flight rows that see finished slots below T-f and their own group causally;
groups are batched into chunks with a block mask over one KV cache. A draft off the trajectory is flushed before
anything drafted after it is verified, so only trajectory states matter: the simulation is exact at T=0.

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
from harness.runtime.target import StateCache
from methods.base import Generation
from methods.pipeline.executor import StageExecutor
from methods.pipeline.scheduler import PLACEHOLDER, PipelineEngine
from methods.pipeline.speculator import Speculator
from methods.pipeline.tree import Level, Token
from methods.sampling import Sampler
from methods.teacher import Teacher


def simulate(engine: PipelineEngine, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int,
             sampler: Sampler) -> Generation:
    """The engine's acceptance on `trajectory` (the AR output for this prompt and sampler)."""
    config = engine.config
    if engine.width == 1:
        teacher = Teacher.run(engine.target, prompt_ids, trajectory, engine.capture, sampler)
        teacher.features = engine.prompt_features(teacher.features, len(prompt_ids))
        return replay_cycles(fill_state_accepts(engine.speculator, teacher), teacher, config.n, config.schedule,
                             max_new_tokens, engine.stop_ids, engine.shape())
    capture = tuple(sorted(set(engine.capture) | set(linear_layers(engine.target))))  # + linear layers' inputs
    teacher = Teacher.run(engine.target, prompt_ids, trajectory, capture, sampler, keep_cache=True)
    replay = PipelineEngine(engine.target, engine.speculator, engine.stop_ids, engine.width, engine.drafter_class,
                            executor=TeacherForcedExecutor(engine, teacher), post_norm_prompt=engine.post_norm_prompt)
    generation = replay.generate(prompt_ids, max_new_tokens, sampler)
    generation.stats["expected_accepts"] = float(sum(generation.position_accepts))  # the realised ones, see above
    del generation.stats["stage_runs"]  # cycles before a certain flush draft placeholders
    return generation


@dataclass
class _Slot:
    position: int
    depth: int
    fill: int


def fill_state_accepts(speculator: Speculator, teacher: Teacher, chunk_rows: int = 2048) -> torch.Tensor:
    """[S, F+1] acceptance probability of the draft for position T+1 made from fill state f (NaN: unreachable)."""
    config = speculator.config
    n, query = config.n, config.query_depth
    size, start = teacher.length, teacher.prompt_len
    top = max(0, n - 1 - query)
    accepts = torch.full((size, top + 1), float("nan"))
    cache = StateCache(["full_attention"] * config.ls, size + chunk_rows + n, rewind_window=0)
    projected = torch.cat([speculator.project(d, teacher.features) for d in range(n + 1)])  # [depth, S, D]
    positions = torch.arange(size, device=projected.device)
    finished = speculator.decode(projected[n:], positions, cache.begin(positions), cache)
    queries = list(range(start, size - 1))  # drafts for positions start+1 .. S-1
    if query >= n:  # n = 1, output schedule: the newest token has finished; the drafter sees finished rows only
        _store(accepts, speculator, teacher, queries, [0] * len(queries), finished[:, queries])
        return accepts
    groups = [(t, f) for t in queries for f in range(min(top, t - start) + 1)]
    chunk: list[tuple[int, int]] = []
    rows = 0  # in-flight rows in `chunk`: f + 1 per group
    for group in groups:
        if chunk and rows + group[1] + 1 > chunk_rows:
            _run_chunk(accepts, speculator, teacher, projected, cache, chunk)
            chunk, rows = [], 0
        chunk.append(group)
        rows += group[1] + 1
    if chunk:
        _run_chunk(accepts, speculator, teacher, projected, cache, chunk)
    return accepts


def _run_chunk(accepts, speculator, teacher, projected, cache, groups) -> None:
    """In-flight rows of `groups` in one call: row (T', depth) of group (T, f) for T' in T-f .. T."""
    query, size = speculator.config.query_depth, teacher.length
    rows = [(t - back, query + back, g, t - f) for g, (t, f) in enumerate(groups) for back in range(f, -1, -1)]
    row_pos = torch.tensor([r[0] for r in rows])
    group = torch.tensor([r[2] for r in rows])
    segment = torch.tensor([r[3] for r in rows])
    mask = torch.cat([
        torch.arange(size)[None, :] < segment[:, None],  # finished slots before the group's segment
        (group[None, :] == group[:, None]) & (row_pos[None, :] <= row_pos[:, None]),  # own group, causal
    ], dim=1)
    device = projected.device
    depth = torch.tensor([r[1] for r in rows], device=device)
    x = projected[depth, row_pos.to(device)][None]  # [1, rows, D]
    slots = size + torch.arange(len(rows), device=device)
    attend = cache.begin(row_pos.to(device), slots, mask.to(device))
    out = speculator.decode(x, row_pos.to(device), attend, cache)
    last = [i for i, r in enumerate(rows) if r[0] == groups[r[2]][0]]  # the newest row of each group
    _store(accepts, speculator, teacher, [t for t, _ in groups], [f for _, f in groups], out[:, last])


def _store(accepts, speculator, teacher, queries: list[int], fills: list[int], states: torch.Tensor) -> None:
    logits = speculator.full_vocab(speculator.head_logits(states))[0]
    probs = teacher.accept_probs(torch.tensor(queries) + 1, logits)
    accepts[torch.tensor(queries), torch.tensor(fills)] = probs.cpu()


def replay_cycles(accepts: torch.Tensor, teacher: Teacher, n: int, schedule: str, max_new_tokens: int,
                  stop_ids: set[int], shape: dict) -> Generation:
    """The engine's cycles (see methods/pipeline/scheduler.py) on the trajectory: fill, verify, accept or flush."""
    start = teacher.prompt_len
    output = [teacher.token(start)]
    in_flight = [_Slot(start, 0, 0)]
    accepted, fill_drafts, fill_accepts = [], [0] * n, [0] * n
    stage_runs, expected = 0, 0.0

    def draft(newest: int) -> _Slot:
        return _Slot(newest + 1, 0, max(0, len(in_flight) - 1))

    while len(output) < max_new_tokens and output[-1] not in stop_ids:
        if schedule == "input":
            drafted = draft(in_flight[-1].position)
        stage_runs += len(in_flight)
        for slot in in_flight:
            slot.depth += 1
        finished = in_flight.pop(0) if in_flight[0].depth == n else None
        if schedule == "output":
            drafted = draft(in_flight[-1].position if in_flight else finished.position)
        if finished is None:
            in_flight.append(drafted)
            accepted.append(0)
            continue
        candidate = (in_flight + [drafted])[0]
        fill_drafts[candidate.fill] += 1
        accepted.append(1)
        output.append(teacher.token(candidate.position))
        probability = float(accepts[candidate.position - 1, candidate.fill])
        expected += probability
        if teacher.accepts(probability):
            fill_accepts[candidate.fill] += 1
            in_flight.append(drafted)
        else:
            in_flight = [_Slot(candidate.position, 0, 0)]
    return Generation(
        output_ids=output,
        steps=len(accepted),
        accepted=accepted,
        position_accepts=fill_accepts,
        stats={"fill_drafts": fill_drafts, "stage_runs": stage_runs, "drafter_calls": len(accepted),
               "verifications": sum(fill_drafts), "expected_accepts": expected, "pipeline": shape},
    )


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
            positions = torch.arange(self.linear_end, end, device=self.device)
            for i in self.linear:
                self.target.run_layers(i, i + 1, self.teacher.features[i][:, self.linear_end: end], positions)
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
