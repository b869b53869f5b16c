"""Speculative Pipeline Decoding: the pipeline engine with multi-depth features (input or output schedule)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import Generation, Method, param, register
from methods.pipeline.export import REFERENCE
from methods.pipeline.replay import simulate
from methods.pipeline.scheduler import PipelineEngine
from methods.pipeline.speculator import SCHEDULES, Speculator, SpeculatorConfig, drafter_tag
from methods.sampling import Sampler

PREFILL_FEATURES = ("pre-norm", "reference")


@dataclass(frozen=True)
class PipelineParams:
    n: int = param(8, "Pipeline stages: the target's layers in n near-even stages, n tokens in flight.")
    ls: int = param(4, "Drafter decoder layers.")
    schedule: str = param("input", "The drafter reads the features before each step (input) or after it (output).")
    width: int = param(1, "Draft width: candidates per drafted position (1: a chain).")
    # "reference": as the reference code's single-process prefill reads HF's hidden_states[L] (its decoding and
    # training use pre-norm)
    prefill_features: str = param("pre-norm", "pre-norm, or reference: the prompt's features at a bound equal to the "
                                              "layer count taken after the final norm.", recorded_when_set=True)

    def __post_init__(self):
        if self.width < 1 or self.n < 1:
            raise ValueError(f"draft width and n must be >= 1, got width={self.width}, n={self.n}")
        if self.prefill_features not in PREFILL_FEATURES:
            raise ValueError(f"prefill_features must be one of {', '.join(PREFILL_FEATURES)}, got "
                             f"{self.prefill_features!r}")
        SpeculatorConfig(n=self.n, ls=self.ls, schedule=self.schedule)  # validates schedule and ls

    @property
    def tag(self) -> str:
        return drafter_tag(self.n, self.ls, self.schedule)


def pipeline_drafter(method: str, params: PipelineParams) -> tuple[str, str]:
    """Checkpoint tag and train command of a pipeline drafter."""
    return params.tag, f"spd-bench train --method {method} --n {params.n} --ls {params.ls} --schedule {params.schedule}"


def load_speculator(target, method: str, policy: str, params: PipelineParams, checkpoint: str | None) -> Speculator:
    """The trained drafter for (target, method, n, Ls, schedule): from --checkpoint or the cache."""
    folder, saved = checkpoints.locate(target.identity, method, *pipeline_drafter(method, params), checkpoint)
    config = checkpoints.config_section(folder, saved, "speculator", SpeculatorConfig, "an spd/ppsd one")
    if (config.n, config.ls, config.schedule, config.policy) != (params.n, params.ls, params.schedule, policy):
        raise HarnessError(f"checkpoint {folder} is for {config.to_dict()}, not {params.tag} ({policy})")
    weights = checkpoints.load_weights(folder)
    speculator = Speculator(config, target, draft_ids=weights.get("draft_ids"))
    checkpoints.load_into(speculator, weights, folder)
    return speculator.eval()


@register
class SPD(Method):
    name = "spd"
    Params = PipelineParams
    policy = "multi_depth"
    trainable = True
    exports = {"reference": REFERENCE}

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """n x Ls x schedule (defaults: the family's parameter defaults), each with the aggregation bounds given
        (shared projections, e.g. to fit a drafter under the size shipped in the repository)."""
        from methods.pipeline.objective import PipelineSpec

        default = cls.Params()
        schedules = cls.train_schedules(values.get("schedule") or [default.schedule])
        bounds = tuple(values.get("aggr_bounds") or ())
        return [PipelineSpec(cls.name, n, ls, schedule, cls.policy, bounds) for n in values.get("n") or [default.n]
                for ls in values.get("ls") or [default.ls] for schedule in schedules]

    @classmethod
    def train_schedules(cls, schedules: list[str]) -> list[str]:
        if not schedules or any(s not in SCHEDULES for s in schedules):
            raise ValueError(f"--schedule must list input and/or output, got {','.join(schedules)!r}")
        return schedules

    @classmethod
    def drafter(cls, params: PipelineParams) -> tuple[str, str]:
        return pipeline_drafter(cls.name, params)

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        """alpha * L / cycle: the input schedule drafts during the step (cycle max(largest stage, Ls) layers), the
        output schedule and PPSD after it (largest stage + Ls)."""
        shape = summary.pipeline
        if shape is None or summary.tokens_per_step is None:
            return None
        largest, ls = shape["largest_stage"], shape["ls"]
        cycle = max(largest, ls) if shape["schedule"] == "input" else largest + ls
        return summary.tokens_per_step * shape["num_layers"] / cycle

    @classmethod
    def modeled_speedup(cls, summary) -> float | None:
        """The same with measured times: one device per stage plus one for the drafter and verification head."""
        counts, shape = summary.counts, summary.pipeline
        if (shape is None or not counts["stage_runs"] or not counts["drafter_calls"] or not counts["verifications"]
                or not summary.stage_seconds):  # simulated runs have no timings
            return None
        per_layer = summary.stage_seconds / (counts["stage_runs"] * shape["num_layers"] / shape["n"])
        drafter = summary.timing["drafter"] / counts["drafter_calls"]
        head = summary.timing["verify_head"] / counts["verifications"]
        stage = shape["largest_stage"] * per_layer
        cycle = (max(stage, drafter) if shape["schedule"] == "input" else stage + drafter) + head
        return summary.tokens_per_step * (shape["num_layers"] * per_layer + head) / cycle

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params: PipelineParams) -> tuple[Path, dict] | None:
        """A reference speculation head (a v11 `.pt` file, methods/pipeline/interop.py): SPD's input schedule with
        multi-depth features, so PPSD reads none."""
        if cls.policy != "multi_depth" or not path.is_file():
            return None
        from methods.pipeline.interop import import_spd

        target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
        return import_spd(path, target, expect=(params.n, params.ls)), {}

    @classmethod
    def check_model(cls, params: PipelineParams, num_layers: int) -> None:
        if params.n > num_layers:
            raise ValueError(f"--n {params.n} is outside 1..{num_layers}: the target has {num_layers} layers")

    def __init__(self, target, params: PipelineParams, stop_ids, checkpoint=None, speculator: Speculator | None = None):
        super().__init__(target, params, stop_ids, checkpoint)
        self.speculator = speculator or load_speculator(target, self.name, self.policy, params, checkpoint)
        self.engine = PipelineEngine(target, self.speculator, stop_ids, width=params.width,
                                     post_norm_prompt=params.prefill_features == "reference")

    @classmethod
    def served(cls, params: PipelineParams) -> tuple[int, str]:
        return params.n, f"--n {params.n} needs one per stage"

    def distribute(self, group, dtype: str):
        """Run the target's stages on the ranks of `group` (methods/pipeline/distributed.py) from now on."""
        from methods.pipeline.distributed import DistributedExecutor

        self.engine.executor = DistributedExecutor(group, self.target, self.engine.bounds, self.engine.capture,
                                                   self.params.width, dtype)
        return self.engine.executor

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        return self.engine.generate(prompt_ids, max_new_tokens, sampler)

    @torch.inference_mode()
    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        return simulate(self.engine, prompt_ids, trajectory, max_new_tokens, sampler)
