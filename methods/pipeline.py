"""The speculative pipeline engine: n target stages with one in-flight token per stage, drafted by a Speculator.

One cycle: (input schedule) draft from the pre-step features, advance every in-flight token by one stage,
(output schedule) draft from the post-step features, then, if the oldest token finished the last stage, its
target distribution verifies the token in flight right behind it. Accept: the draft enters stage 0. Reject: KV is
truncated (linear-attention state rewound), the pipeline is flushed and the correction enters alone.
SPD, its output-state ablation and PPSD are configurations (feature policy x schedule) of this one engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.target import StateCache, TargetRuntime
from methods.base import Generation, Timer
from methods.sampling import Sampler
from methods.speculator import Speculator
from methods.verify import accept_or_resample


@dataclass
class Token:
    """A token in the pipeline: its position, id, current hidden state and the features captured so far."""

    position: int
    token: int
    depth: int
    hidden: torch.Tensor | None  # [1, 1, D] while in flight; None for prompt rows
    features: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, 1, D]
    draft_probs: torch.Tensor | None = None  # q used to draft it (T > 0); None for verified tokens
    fill: int = 0  # in-flight tokens older than it when it was drafted (pipeline fill level)


@dataclass
class _Run:
    """Mutable state of one generation: committed output, pipeline contents and counters."""

    output: list[int]
    in_flight: list[Token]
    pending: list[Token]  # finished tokens whose drafter rows are not final yet
    n: int
    accepted: list[int] = field(default_factory=list)  # tokens committed per cycle (0 while filling)
    stage_runs: int = 0
    drafter_calls: int = 0
    fill_drafts: list[int] = field(default_factory=list)
    fill_accepts: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.fill_drafts = [0] * self.n
        self.fill_accepts = [0] * self.n


class Drafter:
    """The speculator's inference side: its own KV cache holds finished rows; in-flight rows are recomputed."""

    def __init__(self, speculator: Speculator, max_len: int):
        self.speculator = speculator
        self.cache = StateCache(["full_attention"] * speculator.config.ls, max_len, rewind_window=0)
        self.final = 0  # rows below this position are final (depth n) in the cache

    def logits(self, rows: list[Token]) -> torch.Tensor:
        """Draft logits (full vocabulary) for the position after the last row; rows start at `self.final`."""
        spec = self.speculator
        if rows[0].position != self.final:
            raise ValueError(f"drafter rows start at {rows[0].position}, but rows below {self.final} are final")
        x = torch.cat([spec.project(r.depth, r.features) for r in rows], dim=1)
        positions = torch.tensor([r.position for r in rows], device=x.device)
        mask = self.cache.begin(positions)
        out = spec.rows_forward(x, positions, mask, self.cache)
        finished = [r.position for r in rows if r.depth == spec.config.n]
        if finished:
            self.final = finished[-1] + 1
        return spec.full_vocab(spec.head_logits(out[:, -1:]))[0, 0]


class PipelineEngine:
    """Runs one generation; all state lives here, the target runtime and drafter are reset per prompt."""

    def __init__(self, target: TargetRuntime, speculator: Speculator, stop_ids: set[int], drafter_class=Drafter):
        self.target = target
        self.drafter_class = drafter_class
        self.speculator = speculator
        self.config = speculator.config
        self.stop_ids = stop_ids
        self.bounds = self.config.bounds
        self.capture = self.config.all_feature_layers()
        if target.rewind_window < self.config.n:
            raise ValueError(f"target rewind window {target.rewind_window} < n = {self.config.n}")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        self.target.reset()
        drafter = self.drafter_class(self.speculator, self.target.max_len)
        timer = Timer(self.target.device)
        with timer("prefill"):
            first, finished_rows = self._prefill(prompt_ids, sampler)
        run = _Run(output=[first.token], in_flight=[first], pending=finished_rows, n=self.config.n)
        with timer("decode"):
            while len(run.output) < max_new_tokens and run.output[-1] not in self.stop_ids:
                self._cycle(run, drafter, sampler, timer)
        return Generation(
            output_ids=run.output,
            steps=len(run.accepted),
            accepted=run.accepted,
            position_accepts=run.fill_accepts,
            timing=timer.totals,
            stats={
                "fill_drafts": run.fill_drafts,
                "stage_runs": run.stage_runs,
                "drafter_calls": run.drafter_calls,
                "verifications": sum(run.fill_drafts),
                "pipeline": self.shape(),
            },
        )

    def _cycle(self, run: _Run, drafter: Drafter, sampler: Sampler, timer: Timer) -> None:
        """Draft (before or after the step, by schedule), advance every stage, verify if a token finished."""
        if self.config.schedule == "input":
            draft = self._timed_draft(run, drafter, sampler, timer)
        with timer("stages"):
            run.stage_runs += self._advance(run.in_flight)
        finished = run.in_flight.pop(0) if run.in_flight[0].depth == self.config.n else None
        if finished is not None:
            run.pending.append(finished)
        if self.config.schedule == "output":
            draft = self._timed_draft(run, drafter, sampler, timer)
        if finished is None:  # the pipeline is still filling
            run.in_flight.append(draft)
            run.accepted.append(0)
            return
        with timer("verify_head"):
            candidate = run.in_flight[0] if run.in_flight else draft  # n == 1: this cycle's draft is next
            ok, token = self._verify(finished, candidate, sampler)
        run.fill_drafts[candidate.fill] += 1
        run.accepted.append(1)
        if ok:
            run.fill_accepts[candidate.fill] += 1
            run.output.append(candidate.token)
            run.in_flight.append(draft)
            return
        run.output.append(token)
        position = finished.position + 1
        self.target.truncate(position)
        run.in_flight = [self._new_token(position, token, fill=0)]

    def _timed_draft(self, run: _Run, drafter: Drafter, sampler: Sampler, timer: Timer) -> Token:
        with timer("drafter"):
            draft = self._draft(drafter, run.pending, run.in_flight, sampler)
        run.drafter_calls += 1
        return draft

    # --- steps ----------------------------------------------------------------------------------------------------
    def _prefill(self, prompt_ids: list[int], sampler: Sampler) -> tuple[Token, list[Token]]:
        """Full forward over the prompt; its tokens are finished rows for the drafter, the sampled token enters."""
        target = self.target
        ids = torch.tensor(prompt_ids, device=target.device)
        logits, captured = target.forward(ids, start=0, capture=self.capture)
        n = self.config.n
        prompt_rows = [
            Token(p, t, n, None, {layer: captured[layer][:, p : p + 1] for layer in self.capture})
            for p, t in enumerate(prompt_ids)
        ]
        first = self._new_token(len(prompt_ids), sampler.pick(logits[-1]), fill=0)
        return first, prompt_rows

    def _new_token(self, position: int, token: int, fill: int, q: torch.Tensor | None = None) -> Token:
        h = self.target.embed(torch.tensor([token], device=self.target.device))
        return Token(position, token, 0, h, {0: h}, q, fill)

    def _draft(self, drafter: Drafter, pending: list[Token], in_flight: list[Token], sampler: Sampler) -> Token:
        """Draft the token after the newest in-flight one; finished tokens become final rows on the way."""
        rows = pending + in_flight
        logits = drafter.logits(rows)
        pending.clear()
        position, fill = rows[-1].position + 1, max(0, len(in_flight) - 1)
        if sampler.greedy:
            return self._new_token(position, int(torch.argmax(logits)), fill)
        q = sampler.probs(logits)
        return self._new_token(position, sampler.draw(q), fill, q)

    def shape(self) -> dict:
        """What the speedup formulas need: layer count, stage sizes, drafter depth and schedule."""
        sizes = [hi - lo for lo, hi in self.bounds]
        return {"num_layers": self.target.num_layers, "n": self.config.n, "largest_stage": max(sizes),
                "ls": self.config.ls, "schedule": self.config.schedule}

    def _advance(self, in_flight: list[Token]) -> int:
        """Every in-flight token runs the stage at its depth (stages own disjoint layers, so order is free)."""
        for tok in in_flight:
            lo, hi = self.bounds[tok.depth]
            wanted = tuple(layer for layer in self.capture if lo < layer <= hi)
            positions = torch.tensor([tok.position], device=self.target.device)
            tok.hidden, captured = self.target.run_layers(lo, hi, tok.hidden, positions, capture=wanted)
            tok.features.update(captured)
            tok.depth += 1
        return len(in_flight)

    def _verify(self, finished: Token, candidate: Token, sampler: Sampler) -> tuple[bool, int]:
        logits = self.target.logits(finished.hidden)[0]
        if sampler.greedy:
            best = int(torch.argmax(logits))
            return candidate.token == best, best
        p = sampler.probs(logits)
        return accept_or_resample(candidate.token, candidate.draft_probs, p, sampler.generator)
