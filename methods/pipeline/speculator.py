"""The pipeline drafter: a small decoder fed multi-depth target features of in-flight tokens.

A token that has finished k of the n pipeline stages ("depth k") contributes one row whose input is a per-depth
linear projection of the target hidden states it has: h[0] (embedding) and a few layers up to the deepest it reached.
Rows attend causally at their true positions; the newest row's logits draft the next token. Both the pipeline
(inference, one row per token at its current depth) and training (methods/pipeline/grouped_layout.py: every query with the
rows the pipeline would hold) go through the same `decode`, so they cannot drift apart.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from harness.runtime.target import TargetRuntime, stage_bounds
from methods.draft_module import DraftModule
from methods.pipeline.grouped_layout import GROUPED

SCHEDULES = ("input", "output")
POLICIES = ("multi_depth", "first_stage")
LAYER_KINDS = ("target", "qwen3")


def drafter_tag(n: int, ls: int, schedule: str) -> str:
    """The checkpoint tag of a pipeline drafter: its stage count, layers and schedule."""
    return f"n{n}-ls{ls}-{schedule}"


def feature_layers(policy: str, bounds: list[tuple[int, int]], depth: int) -> tuple[int, ...]:
    """Target layers whose outputs feed a row at `depth` (h[0] = embedding, h[k] = output of layer k)."""
    if depth == 0:
        return (0,)
    deepest = bounds[depth - 1][1]
    if policy == "first_stage":  # PPSD: shallow first-stage output only
        return (bounds[0][1],)
    return tuple(sorted({0, round(deepest / 3), round(2 * deepest / 3), deepest}))


@dataclass
class SpeculatorConfig:
    n: int
    ls: int
    schedule: str = "input"
    policy: str = "multi_depth"
    num_layers: int = 0
    target: dict = field(default_factory=dict)  # name + weights_sha256 of the target it was trained for
    draft_vocab_size: int | None = None
    # The reference's aggregation (its "aggr_feature_bound"): hidden-state indices b_0 = 0 < b_1 < ...; projection i
    # reads cat(h[b_0], ..., h[b_i]) and a token at depth d uses the deepest i with b_i at or below the layer it
    # reached, so depths share projections. Empty: one projection per depth over feature_layers (this harness's own).
    aggr_bounds: tuple[int, ...] = ()
    layer_kind: str = "target"  # decoder layers of the target's class, or "qwen3" (the reference's for Llama targets)

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"feature policy must be one of {POLICIES}, got {self.policy!r}")
        if self.ls < 1:
            raise ValueError(f"ls must be >= 1, got {self.ls}")
        if self.layer_kind not in LAYER_KINDS:
            raise ValueError(f"layer kind must be one of {LAYER_KINDS}, got {self.layer_kind!r}")
        self.aggr_bounds = tuple(self.aggr_bounds)
        bounds = self.aggr_bounds
        if bounds and (bounds[0] != 0 or any(b >= c for b, c in itertools.pairwise(bounds))
                       or (self.num_layers and bounds[-1] > self.num_layers)):
            most = f" to at most {self.num_layers}" if self.num_layers else ""
            raise ValueError(f"aggregation bounds must start at 0 and rise strictly{most}, got {list(bounds)}")

    @property
    def query_depth(self) -> int:
        """Depth of the newest token when the drafter runs: before (input) or after (output) the stage step."""
        return 0 if self.schedule == "input" else 1

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return stage_bounds(self.num_layers, self.n)

    def projection_of(self, depth: int) -> int:
        """Which projection a row at `depth` goes through (bounds: shared between depths)."""
        if not self.aggr_bounds:
            return depth
        reached = self.bounds[depth - 1][1] if depth else 0
        return max(i for i, b in enumerate(self.aggr_bounds) if b <= reached)

    @property
    def projection_inputs(self) -> list[int]:
        """Features read by each projection, in order."""
        if self.aggr_bounds:
            return [i + 1 for i in range(len(self.aggr_bounds))]
        return [len(self.layers_for(d)) for d in range(self.n + 1)]

    def layers_for(self, depth: int) -> tuple[int, ...]:
        if self.aggr_bounds:
            return self.aggr_bounds[: self.projection_of(depth) + 1]
        return feature_layers(self.policy, self.bounds, depth)

    def all_feature_layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for d in range(self.n + 1) for layer in self.layers_for(d)}))

    def to_dict(self) -> dict:
        return asdict(self)


class Speculator(DraftModule):
    """Per-depth projections -> Ls decoder layers of the target's shape -> target's final norm -> trainable head."""

    def __init__(self, config: SpeculatorConfig, target: TargetRuntime, draft_ids: torch.Tensor | None = None):
        super().__init__(target, config.ls, draft_ids, attention=GROUPED,  # trains in the grouped layout
                         layer_kind=config.layer_kind)
        self.config = config
        hidden = target.config.hidden_size
        self.projections = nn.ModuleList(
            nn.Linear(count * hidden, hidden, bias=False) for count in config.projection_inputs
        )
        with torch.no_grad():
            for count, projection in zip(config.projection_inputs, self.projections):
                # Start as "the deepest feature passes through": a sensible init that training refines.
                projection.weight.zero_()
                projection.weight[:, (count - 1) * hidden:].copy_(torch.eye(hidden))
        self.to(device=target.device, dtype=target.dtype)

    # --- features ---------------------------------------------------------------------------------------------
    def project(self, depth: int, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """Row input for a token at `depth` from its hidden states {layer: [..., D]}."""
        parts = [features[layer] for layer in self.config.layers_for(depth)]
        return self.projections[self.config.projection_of(depth)](torch.cat(parts, dim=-1))
