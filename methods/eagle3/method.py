"""EAGLE-3: a trained one-layer head drafts m tokens (a chain, or a beam tree of width W) from fused target
features and its own states; the target verifies every candidate in ONE forward with a tree attention mask, keeps
the longest accepted path (its KV compacted into place) and adds one bonus token per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime.target import TargetRuntime
from methods.base import Generation, HeadExport, ImportFormat, Method, Timer, param, register
from methods.eagle3.head import LAYOUTS, EagleConfig, EagleHead, HeadSession, head_tag, load_head, train_command
from methods.eagle3.interop import check_export_target, export_head, import_eagle3, import_folder, is_eagle3_folder
from methods.eagle3.replay import chain_accepts, replay_rounds
from methods.rounds import (
    DRAFT_POSITIONS,
    Beam,
    Chain,
    DraftShape,
    Node,
    Rounds,
    rounds_on_trajectory,
    target_prefill,
    verify_beam,
    verify_chain,
)
from methods.sampling import Sampler, draw
from methods.stats import Stats, same
from methods.teacher import Teacher


@dataclass(frozen=True)
class EagleParams:
    m: int = param(7, "Draft depth per round.")
    width: int = param(1, "1: a chain; W: the W best branches per depth by cumulative draft log-probability.")
    ttt: int = param(7, "Which trained head: the training-time-test depth it was trained with.")
    layout: str = param("harness", "Which kind of head: the harness's own layer or the EAGLE-3 authors' (eagle3, "
                                   "exportable with export-head).", recorded_when_set=True, flags=("--eagle-layout",))

    def __post_init__(self):
        if min(self.m, self.width, self.ttt) < 1:
            raise ValueError(f"m, width and ttt must be >= 1, got m={self.m}, width={self.width}, ttt={self.ttt}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    @property
    def tag(self) -> str:
        return head_tag(self.ttt, self.layout)


@dataclass
class EagleStats(Stats):
    candidates: int | None = None  # draft tokens offered to the verifier
    draft: DraftShape | None = same()


@register
class EAGLE3(Method):
    name = "eagle3"
    Params = EagleParams
    Stats = EagleStats
    positions = DRAFT_POSITIONS
    training_params = ("ttt", "layout")
    imports = {"eagle3": ImportFormat("An EAGLE-3 head folder (config.json + model.safetensors or pytorch_model.bin).",
                                      import_folder, ("ttt",))}
    head_export = HeadExport("An EAGLE-3 head trained with --eagle-layout eagle3, in the EAGLE-3 folder format "
                             "(SGLang, the EAGLE code).", check_export_target, export_head, ("ttt",))
    trainable = True

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """One head per training-time-test depth and layout."""
        from methods.eagle3.objective import EagleSpec

        default = cls.Params()
        layouts = values.get("layout") or [default.layout]
        if any(layout not in LAYOUTS for layout in layouts):
            raise ValueError(f"the EAGLE-3 layout must be one of {', '.join(LAYOUTS)}, got {layouts}")
        return [EagleSpec(ttt, layout) for ttt in values.get("ttt") or [default.ttt] for layout in layouts]

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        """tau * L / (Ls * m + L): a round drafts m tokens through the head's Ls layers, then one target forward."""
        shape = summary.stats.draft
        if shape is None or summary.tokens_per_step is None:
            return None
        return summary.tokens_per_step * shape.num_layers / (shape.ls * shape.m + shape.num_layers)

    @classmethod
    def selfcheck_cases(cls, target) -> list[tuple[str, Method]]:
        found = []
        for width in (1, 4):
            head = EagleHead(EagleConfig(ttt=3, num_layers=target.num_layers), target).eval()
            found.append((f"eagle3 m=3 w={width}", cls(target, EagleParams(m=3, width=width, ttt=3), set(), head=head)))
        return found

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params: EagleParams) -> tuple[Path, dict] | None:
        """A head folder in the EAGLE-3 authors' format (methods/eagle3/interop.py), filed under `ttt`."""
        if not is_eagle3_folder(path):
            return None
        target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
        return import_eagle3(path, target, ttt=params.ttt), {"layout": "eagle3"}

    @classmethod
    def drafter(cls, params: EagleParams) -> tuple[str, str]:
        return params.tag, train_command(params.ttt, params.layout)

    def __init__(self, target, params: EagleParams, stop_ids, checkpoint=None, head: EagleHead | None = None):
        super().__init__(target, params, stop_ids, checkpoint)
        self.head = head or load_head(target, params.ttt, params.layout, checkpoint)
        self.layers = self.head.config.all_feature_layers()

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        timer = Timer(self.target.device)
        first, captured = self.prefill(prompt_ids, sampler, timer)
        if self.params.width == 1:
            return self._device_rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer, self._chain_round)
        return self._device_rounds(prompt_ids, first, captured, max_new_tokens, sampler, timer, self._beam_round)

    def prefill(self, prompt_ids: list[int], sampler: Sampler, timer: Timer) -> tuple[int, dict]:
        """The prompt's target forward: the first token and the head's feature layers over the prompt."""
        return target_prefill(self.target, self.layers, prompt_ids, sampler, timer)

    @torch.inference_mode()
    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        """Chains: every round's acceptance from one batched training-time-test forward (methods/eagle3/replay.py).
        Trees: the real drafting rounds, verified against the trajectory instead of a target forward. Tree drafts
        are deterministic and the sibling rule emits a sample of p, accepting iff it is a candidate, so at T>0 the
        replay is a sample of the executed process (its expected acceptance is the realised one: the target's
        distributions off the trajectory are not known)."""
        if self.params.width == 1:
            teacher = Teacher.run(self.target, prompt_ids, trajectory, self.layers, sampler)
            accepts = chain_accepts(self.head, teacher, self.params.m)
            generation = replay_rounds(accepts, teacher, self.params.m, max_new_tokens, self.stop_ids)
            generation.stats = EagleStats(generation.stats.expected_accepts, draft=self._shape(),
                                          candidates=self.params.m * generation.steps)
            return generation
        return rounds_on_trajectory(
            lambda first, prefix, timer, verify: self._rounds(prompt_ids, first, prefix, max_new_tokens, sampler, timer,
                                                              verify),
            self.target, prompt_ids, trajectory, self.layers, sampler)

    def _rounds(self, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int, sampler: Sampler,
                timer: Timer, verify) -> Generation:
        """Draft, verify (`verify(nodes, last, base, sampler)` -> path, bonus, features), commit, until done."""
        with timer("prefill"):
            head = HeadSession.started(self.head, self.target.max_len, prompt_ids, first, captured)
        rounds = Rounds([first], self.params.m, max_new_tokens, self.stop_ids)
        candidates = 0
        with timer("decode"):
            while not rounds.done:
                base = len(prompt_ids) + rounds.base  # position of the newest committed token
                with timer("drafter"):
                    nodes = self._draft(head, base, sampler)
                with timer("verify"):
                    path, bonus, features = verify(nodes, rounds.output[-1], base, sampler)
                new = rounds.commit_path(nodes, path, bonus)
                candidates += len(nodes)
                with timer("drafter"):
                    features = {layer: h[:, : len(new)] for layer, h in features.items()}
                    head.append(new, features, start=base + 1)
        return rounds.generation(timer.totals, EagleStats(candidates=candidates, draft=self._shape()))

    def _device_rounds(self, prompt_ids: list[int], first: int, captured: dict, max_new_tokens: int,
                       sampler: Sampler, timer: Timer, one_round) -> Generation:
        """Rounds drafted, verified and decided on the device, each reading back once: `one_round(head, base, last,
        sampler, timer)` -> (accepted drafts, committed tokens, features)."""
        with timer("prefill"):
            head = HeadSession.started(self.head, self.target.max_len, prompt_ids, first, captured)
        rounds = Rounds([first], self.params.m, max_new_tokens, self.stop_ids)
        with timer("decode"):
            while not rounds.done:
                base = len(prompt_ids) + rounds.base
                count, tokens, features = one_round(head, base, rounds.output[-1], sampler, timer)
                new = rounds.commit(tokens, count)
                with timer("drafter"):
                    head.append(new, {layer: h[:, : len(new)] for layer, h in features.items()}, start=base + 1)
        candidates = self.params.m * self.params.width * len(rounds.accepted)
        return rounds.generation(timer.totals, EagleStats(candidates=candidates, draft=self._shape()))

    def _chain_round(self, head: HeadSession, base: int, last: int, sampler: Sampler, timer: Timer):
        with timer("drafter"):
            drafts = self._draft_chain(head, base, sampler)
        with timer("verify"):
            return verify_chain(self.target, self.layers, drafts, last, base, sampler)

    def _beam_round(self, head: HeadSession, base: int, last: int, sampler: Sampler, timer: Timer):
        with timer("drafter"):
            beam = self._draft_beam(head, base, sampler)
        with timer("verify"):
            accepted, tokens, features = verify_beam(self.target, self.layers, beam, last, base, sampler)
        return len(accepted), tokens, features

    def _draft_chain(self, head: HeadSession, base: int, sampler: Sampler) -> Chain:
        """m drafts after the root, each the argmax (T=0) or a draw from q (T>0), fed back as tensors."""
        tokens, qs, state = [], [], head.root
        for depth in range(1, self.params.m + 1):
            logits = self._draft_logits(state, base, depth)[0]
            if sampler.greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                qs.append(sampler.probs(logits))
                token = draw(qs[-1], sampler.generator)[None]
            tokens.append(token)
            if depth < self.params.m:
                state = head.chain_row(token, state, base, depth)
        return Chain(torch.cat(tokens), torch.stack(qs) if qs else None)

    def _draft_beam(self, head: HeadSession, base: int, sampler: Sampler) -> Beam:
        """Trees: each level keeps the `width` best children by cumulative log-probability under the sampling
        settings (best_children's rule) with every choice, parent and ancestor mask on the device."""
        width, m, device = self.params.width, self.params.m, self.target.device
        ancestors = torch.zeros(m * width, m * width, dtype=torch.bool, device=device)
        tokens, parents, scores, states = [], [], torch.zeros(1, device=device), head.root
        for depth in range(1, m + 1):
            top = torch.topk(sampler.log_probs(self._draft_logits(states, base, depth)), width, dim=-1)
            best = torch.topk((top.values + scores[:, None]).flatten(), width)
            rows, scores = best.indices // width, best.values
            own = torch.arange((depth - 1) * width, depth * width, device=device)
            parent = (depth - 2) * width + rows if depth > 1 else torch.full((width,), -1, device=device)
            if depth > 1:
                ancestors[own] = ancestors[parent]
            ancestors[own, own] = True
            tokens.append(top.indices.flatten()[best.indices])
            parents.append(parent)
            if depth < m:
                states = head.beam_rows(tokens[-1], states[:, rows], base, depth, own, ancestors)
        return Beam(torch.cat(tokens), torch.cat(parents), ancestors, width)

    def _draft_logits(self, states: torch.Tensor, base: int, depth: int) -> torch.Tensor:
        """Draft logits [rows, V] (full vocabulary) for position base + depth from the rows' states [1, rows, D]."""
        return self.head.full_vocab(self.head.head_logits(states))[0]

    def _shape(self) -> DraftShape:
        return DraftShape(self.target.num_layers, 1, self.params.m, self.params.width)

    # --- drafting -------------------------------------------------------------------------------------------------
    def _draft(self, head: HeadSession, base: int, sampler: Sampler) -> list[Node]:
        """m levels of candidates after the root, parents before children (at most W per level)."""
        width = self.params.width
        nodes: list[Node] = []
        frontier, states = [-1], head.root
        for depth in range(1, self.params.m + 1):
            level = self._children(nodes, frontier, self._draft_logits(states, base, depth), depth, width, sampler)
            if depth == self.params.m:
                break
            states = head.draft_rows(nodes, level, base)
            for i, index in enumerate(level):
                nodes[index].state = states[:, i : i + 1]
            frontier = level
        return nodes

    def _children(self, nodes: list[Node], frontier: list[int], logits: torch.Tensor, depth: int, width: int,
                  sampler: Sampler) -> list[int]:
        """Add the next level: the `width` best children by cumulative score."""
        start = len(nodes)
        scores = [nodes[i].score if i >= 0 else 0.0 for i in frontier]
        for row, token, score in sampler.best_children(logits, scores, width):
            nodes.append(Node(token, frontier[row], depth, score))
        return list(range(start, len(nodes)))

