"""EAGLE-3: a trained one-layer head drafts m tokens (a chain, or a beam tree of width W) from fused target
features and its own states; the target verifies every candidate in ONE forward with a tree attention mask, keeps
the longest accepted path (its KV compacted into place) and adds one bonus token per round.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime.target import TargetRuntime
from methods.base import Generation, Method, Timer, param, register
from methods.capabilities import HeadExport, ImportFormat, Imports, SelfChecks, Trains
from methods.eagle3.head import LAYOUTS, EagleConfig, EagleHead, HeadSession, head_tag, load_head, train_command
from methods.eagle3.interop import check_export_target, export_head, import_eagle3, import_folder, is_eagle3_folder
from methods.eagle3.replay import chain_accepts, replay_rounds
from methods.rounds import DraftShape, DraftTree, Outcome, RoundMethod, Rounds, TreeShape, feed
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
class EAGLE3(RoundMethod, Trains, Imports, SelfChecks):
    name = "eagle3"
    Params = EagleParams
    Stats = EagleStats
    training_params = ("ttt", "layout")
    imports = {"eagle3": ImportFormat("An EAGLE-3 head folder (config.json + model.safetensors or pytorch_model.bin).",
                                      import_folder, ("ttt",))}
    head_export = HeadExport("An EAGLE-3 head trained with --eagle-layout eagle3, in the EAGLE-3 folder format "
                             "(SGLang, the EAGLE code).", check_export_target, export_head, ("ttt",))

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
        self._depths = None  # a beam's node depths, made once

    @property
    def depth(self) -> int:
        return self.params.m

    def session(self, rounds: Rounds, captured: dict, sampler: Sampler, timer: Timer) -> EagleSession:
        head = HeadSession.started(self.head, self.target.max_len, rounds.prompt_ids, rounds.output[0], captured)
        return EagleSession(self, head)

    @torch.inference_mode()
    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        """Chains: every round's acceptance from one batched training-time-test forward (methods/eagle3/replay.py).
        Trees: the round kit's replay of the real drafting rounds."""
        if self.params.width > 1:
            return super().simulate(prompt_ids, trajectory, max_new_tokens, sampler)
        teacher = Teacher.run(self.target, prompt_ids, trajectory, self.layers, sampler)
        accepts = chain_accepts(self.head, teacher, self.params.m)
        generation = replay_rounds(accepts, teacher, self.params.m, max_new_tokens, self.stop_ids)
        generation.stats = EagleStats(generation.stats.expected_accepts, draft=self.shape(),
                                      candidates=self.params.m * generation.steps)
        return generation

    def draft_chain(self, head: HeadSession, base: int, sampler: Sampler) -> DraftTree:
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
        return DraftTree(torch.cat(tokens), q=torch.stack(qs) if qs else None)

    def draft_beam(self, head: HeadSession, base: int, sampler: Sampler) -> DraftTree:
        """A beam: each level keeps the `width` best children by cumulative log-probability under the sampling
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
        return DraftTree(torch.cat(tokens), TreeShape(torch.cat(parents), self._beam_depths(), ancestors, m))

    def _beam_depths(self) -> torch.Tensor:
        """Node i of a beam lies at depth i // width + 1 (the same every round)."""
        if self._depths is None:
            count = self.params.m * self.params.width
            self._depths = torch.arange(count, device=self.target.device) // self.params.width + 1
        return self._depths

    def _draft_logits(self, states: torch.Tensor, base: int, depth: int) -> torch.Tensor:
        """Draft logits [rows, V] (full vocabulary) for position base + depth from the rows' states [1, rows, D]."""
        return self.head.full_vocab(self.head.head_logits(states))[0]

    def shape(self) -> DraftShape:
        return DraftShape(self.target.num_layers, 1, self.params.m, self.params.width)


@dataclass
class EagleSession:
    """One generation's head (the round kit's RoundSession): it drafts a chain or a beam from its states and takes
    the target's features of every committed token."""

    method: EAGLE3
    head: HeadSession
    candidates: int = 0

    def draft(self, rounds: Rounds, sampler: Sampler, timer: Timer) -> DraftTree:
        with timer("drafter"):
            method, base = self.method, rounds.position
            tree = method.draft_chain(self.head, base, sampler) if method.params.width == 1 else \
                method.draft_beam(self.head, base, sampler)
        self.candidates += len(tree.tokens)
        return tree

    def learn(self, rounds: Rounds, outcome: Outcome, new: list[int], timer: Timer) -> None:
        with timer("drafter"):
            feed(self.head, rounds, outcome, new)

    def finish(self, rounds: Rounds, timer: Timer) -> tuple[Stats, dict]:
        return EagleStats(candidates=self.candidates, draft=self.method.shape()), {}
