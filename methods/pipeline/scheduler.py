"""The speculative pipeline engine: n target stages with the in-flight tokens of up to W draft branches.

One cycle: (input schedule) draft from the pre-step features, advance every in-flight token by one stage,
(output schedule) draft from the post-step features, then, if the oldest token finished the last stage, its
target distribution verifies the tokens in flight right behind it. Accept: the accepted token's subtree stays and
the drafts enter stage 0. Reject: KV is truncated (linear-attention state rewound), the pipeline is flushed and the
correction enters alone. SPD, its output-state ablation and PPSD are configurations (feature policy x schedule).

The engine is the scheduler: it owns drafting, pruning, the verification rules, flush and refill, and works on
tokens (methods/pipeline/tree.py: levels of up to W branches; every kept node leads to a newest-level leaf, so
after any acceptance stage 0 still has work). A `StageExecutor` (methods/pipeline/executor.py) runs the target's
side: in this process (`LocalExecutor`, the default) or read from a teacher pass (the replay).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from harness.runtime.target import TargetRuntime
from methods import drafts as drafts_log
from methods.base import Generation, Timer
from methods.pipeline.drafter import Drafter
from methods.pipeline.executor import LocalExecutor, StageExecutor
from methods.pipeline.speculator import Speculator
from methods.pipeline.stats import PipelineShape, PipelineStats
from methods.pipeline.tree import Level, Token, fill_level, keep_subtree, prune_dead_branches
from methods.sampling import Sampler
from methods.verify import chain_rejection_on_device, siblings_on_device

PLACEHOLDER = -1  # token id drafted where no draft can change an outcome (see StageExecutor.outcomes_known)


@dataclass
class _Run:
    """Mutable state of one generation: committed output, pipeline contents and counters."""

    output: list[int]
    in_flight: list[Level]
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


class PipelineEngine:
    """Runs one generation; all scheduling state lives here, the executor's and drafter's caches are reset per
    prompt."""

    def __init__(self, target: TargetRuntime, speculator: Speculator, stop_ids: set[int], width: int = 1,
                 drafter_class=Drafter, executor: StageExecutor | None = None, post_norm_prompt: bool = False):
        self.target = target
        self.post_norm_prompt = post_norm_prompt  # the reference's prefill features (PipelineParams.prefill_features)
        self.drafter_class = drafter_class
        self.speculator = speculator
        self.config = speculator.config
        self.stop_ids = stop_ids
        self.width = width
        self.bounds = self.config.bounds
        self.capture = self.config.all_feature_layers()
        self.executor = executor or LocalExecutor(target, self.bounds, self.capture, width)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        self.executor.start()
        drafter = self.drafter_class(self.speculator, self.target.max_len)
        timer = Timer(self.target.device)
        with timer("prefill"):
            first, finished_rows = self._prefill(prompt_ids, sampler)
        run = _Run(output=[first.token], in_flight=[[first]], pending=finished_rows, n=self.config.n)
        with timer("decode"):
            while len(run.output) < max_new_tokens and run.output[-1] not in self.stop_ids:
                self._cycle(run, drafter, sampler, timer)
        return Generation(
            output_ids=run.output,
            steps=len(run.accepted),
            accepted=run.accepted,
            position_accepts=run.fill_accepts,
            timing=timer.totals,
            stats=PipelineStats(fill_drafts=run.fill_drafts, stage_runs=run.stage_runs, drafter_calls=run.drafter_calls,
                                verifications=sum(run.fill_drafts), pipeline=self.shape(),
                                executor=self.executor.report()),
        )

    def _cycle(self, run: _Run, drafter: Drafter, sampler: Sampler, timer: Timer) -> None:
        """Draft (before or after the step, by schedule), advance every stage, verify if a token finished."""
        if self.config.schedule == "input":
            draft = self._timed_draft(run, drafter, sampler, timer)
        with timer("stages"):
            self.executor.advance(run.in_flight)
        run.stage_runs += sum(len(level) for level in run.in_flight)
        finished = None
        if run.in_flight[0][0].depth == self.config.n:
            (finished,) = run.in_flight.pop(0)
            finished.parent = None  # the verified prefix needs no tree links (and old tokens can be freed)
            run.pending.append(finished)
        if self.config.schedule == "output":
            draft = self._timed_draft(run, drafter, sampler, timer)
        if finished is None:  # the pipeline is still filling
            run.in_flight.append(draft)
            run.accepted.append(0)
            return
        levels = run.in_flight + [draft]
        with timer("verify_head"):
            candidates = levels[0]  # n == 1: this cycle's drafts are next
            chosen, token = self._verify(finished, candidates, sampler)
        fill = candidates[0].fill
        run.fill_drafts[fill] += 1
        run.accepted.append(1)
        if chosen is not None:
            run.fill_accepts[fill] += 1
            run.output.append(chosen.token)
            keep_subtree(chosen, levels)
            self.executor.commit(chosen)
            run.in_flight.append(draft)
            return
        run.output.append(token)
        position = finished.position + 1
        self.executor.truncate(position)
        run.in_flight = [self._new_tokens(position, [token], [None], [0.0], fill=0)]

    def _timed_draft(self, run: _Run, drafter: Drafter, sampler: Sampler, timer: Timer) -> Level:
        with timer("drafter"):
            draft = self._draft(drafter, run, sampler)
        run.drafter_calls += 1
        prune_dead_branches(run.in_flight + [draft])
        return draft

    # --- steps ----------------------------------------------------------------------------------------------------
    def _prefill(self, prompt_ids: list[int], sampler: Sampler) -> tuple[Token, list[Token]]:
        """The prompt's forward; its tokens are finished rows for the drafter, the sampled token enters."""
        logits, captured = self.executor.prefill(prompt_ids)
        captured = self.prompt_features(captured, len(prompt_ids))
        n = self.config.n
        prompt_rows = [
            Token(p, t, n, None, {layer: captured[layer][:, p : p + 1] for layer in self.capture})
            for p, t in enumerate(prompt_ids)
        ]
        (first,) = self._new_tokens(len(prompt_ids), [sampler.pick(logits)], [None], [0.0], fill=0)
        return first, prompt_rows

    def prompt_features(self, captured: dict[int, torch.Tensor], length: int) -> dict[int, torch.Tensor]:
        """The first `length` (prompt) rows of the captured layers as the drafter reads them: pre-norm, or with
        post_norm_prompt the last layer's after the final norm."""
        last = self.target.num_layers
        if not self.post_norm_prompt or last not in captured:
            return captured
        h = captured[last]
        return {**captured, last: torch.cat([self.target.final_norm(h[:, :length]), h[:, length:]], dim=1)}

    def _new_tokens(self, position: int, tokens: list[int], parents: list, scores: list[float], fill: int,
                    q: torch.Tensor | None = None) -> Level:
        """A level of fresh tokens at depth 0; the b-th sibling gets slot position + b * n."""
        level = [Token(position, token, 0, None, {}, q, fill, slot=position + b * self.config.n, parent=parent,
                       score=score)
                 for b, (token, parent, score) in enumerate(zip(tokens, parents, scores))]
        self.executor.enter(level)
        return level

    def _draft(self, drafter: Drafter, run: _Run, sampler: Sampler) -> Level:
        """Draft the level after the newest one: a sampled token (width 1, T > 0) or the W best children by score."""
        levels = run.in_flight
        leaves = levels[-1] if levels else [run.pending[-1]]
        position, fill = leaves[0].position + 1, fill_level(levels)
        if self.executor.outcomes_known(levels):  # nothing drafted before the next flush can change an outcome
            return [Token(position, PLACEHOLDER, 0, None, fill=fill, parent=leaf) for leaf in leaves]
        logits = drafter.logits(run.pending, levels)
        run.pending.clear()
        parents = [leaf if leaf.depth < self.config.n else None for leaf in leaves]
        if self.width == 1 and not sampler.greedy:  # one sampled draft, verified with the p/q rule
            q = sampler.probs(logits[0])
            return self._new_tokens(position, [sampler.draw(q)], parents, [0.0], fill, q)
        children = sampler.best_children(logits, [leaf.score for leaf in leaves], self.width)
        return self._new_tokens(position, [token for _, token, _ in children],
                                [parents[row] for row, _, _ in children], [score for _, _, score in children], fill)

    def shape(self) -> PipelineShape:
        """What the speedup formulas need: layer count, stage sizes, drafter depth, schedule and width."""
        sizes = [hi - lo for lo, hi in self.bounds]
        return PipelineShape(self.target.num_layers, self.config.n, max(sizes), self.config.ls, self.config.schedule,
                             self.width)

    def _verify(self, finished: Token, candidates: Level, sampler: Sampler) -> tuple[Token | None, int]:
        """The finished token's target distribution tests the drafts after it: (accepted draft or None, token)."""
        drafts_log.note([t.token for t in candidates], [-1] * len(candidates))  # siblings after the finished one
        logits = self.executor.verification_logits(finished)
        if sampler.greedy:
            best = int(torch.argmax(logits))
            return next((t for t in candidates if t.token == best), None), best
        p, drafts = sampler.probs(logits), torch.tensor([t.token for t in candidates], device=logits.device)
        if candidates[0].draft_probs is not None:  # a sampled chain draft: the p/q rule (p's second row, the bonus
            # after an accepted draft, goes unused: the draft itself is the token)
            count, token = chain_rejection_on_device(drafts, candidates[0].draft_probs[None], torch.stack([p, p]),
                                                     sampler.generator).tolist()
            return (candidates[0] if count else None), token
        slot, emitted = siblings_on_device(torch.arange(len(candidates), device=p.device)[None], drafts, p[None],
                                           sampler.generator)
        index, token = torch.cat([slot, emitted]).tolist()  # the decision's one read back
        return (None, token) if index < 0 else (candidates[index], candidates[index].token)
