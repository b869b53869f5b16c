"""Acceptance simulation of the pipeline engine: chains (width 1) from batched drafter forwards plus a replay of the
engine's cycle accounting; draft trees (width > 1) by the engine's own cycles on teacher-forced target states.

When the drafter runs for the newest token T, the tokens in flight are T-f .. T (f: the fill level) at depths
q+T-T' (q: query depth, 0 for the input schedule, 1 for output), and everything before T-f is finished. Only
f < n-q states differ from the steady state, so for each position the drafter has at most n-q distinct views.
Finished rows see only finished rows: one causal pass computes them (and their KV) for the whole sequence. Each
(T, f) view is then a group of f+1 in-flight rows that see finished slots below T-f and their own group causally;
groups are batched into chunks with a block mask over one KV cache. A draft off the trajectory is flushed before
anything drafted after it is verified, so only trajectory states matter: the simulation is exact at T=0.

Trees run the engine's own cycles on teacher-forced target states (methods/pipeline/teacher_executor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.state_cache import StateCache
from methods.base import Generation
from methods.pipeline.scheduler import PipelineEngine
from methods.pipeline.speculator import Speculator
from methods.pipeline.stats import PipelineShape, PipelineStats
from methods.pipeline.teacher_executor import TeacherForcedExecutor, linear_layers
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
    generation.stats.expected_accepts = float(sum(generation.position_accepts))  # the realised ones, see above
    generation.stats.stage_runs = None  # cycles before a certain flush draft placeholders
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
    projected = torch.cat([speculator.project(d, teacher.features) for d in range(n + 1)])  # [depth, S, D]
    cache = StateCache(["full_attention"] * config.ls, size + chunk_rows + n, rewind_window=0, device=projected.device)
    positions = torch.arange(size, device=projected.device)
    finished = speculator.decode(projected[n:], positions, cache.begin(range(size)), cache)
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
                  stop_ids: set[int], shape: PipelineShape | None) -> Generation:
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
        stats=PipelineStats(expected, fill_drafts=fill_drafts, stage_runs=stage_runs, drafter_calls=len(accepted),
                            verifications=sum(fill_drafts), pipeline=shape),
    )
