"""Speculative Pipeline Decoding: the pipeline engine with multi-depth features (input or output schedule)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import Generation, Method, offers, param, register
from methods.capabilities import (ChecksParity, ImportFormat, Imports, Reports, SelfChecks, Serves, Simulates,
                                  Trains)
from methods.pipeline.drafter import oracle_drafter
from methods.pipeline.export import REFERENCE
from methods.pipeline.replay import simulate
from methods.pipeline.scheduler import PipelineEngine
from methods.pipeline.speculator import SCHEDULES, Speculator, SpeculatorConfig, drafter_tag
from methods.pipeline.stats import FILL_LEVELS, PipelineStats, stage_seconds
from methods.sampling import Sampler

PREFILL_FEATURES = ("pre-norm", "reference")


@dataclass(frozen=True)
class PipelineParams:
    n: int = param(8, "Pipeline stages: the target's layers in n near-even stages, n tokens in flight.")
    ls: int = param(4, "Drafter decoder layers.")
    schedule: str = param("input", "The drafter reads the features before each step (input) or after it (output).",
                          choices=SCHEDULES)
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


def _import_v11(path: Path, target: TargetRuntime, params: PipelineParams, force: bool) -> Path:
    from methods.pipeline.interop import import_spd

    return import_spd(path, target, force=force)


@register
class SPD(Method, Reports, Trains, Imports, Serves, Simulates, SelfChecks, ChecksParity):
    name = "spd"
    Params = PipelineParams
    Stats = PipelineStats
    positions = FILL_LEVELS
    policy = "multi_depth"
    training_params = ("n", "ls", "schedule")
    training_options = {"aggr_bounds": (int, "Hidden-state indices 0 < b1 < ... whose cumulative "
                                              "features the projections read, shared between depths as in the "
                                              "reference (default: one projection per depth)."),
                        "init": (str, "The drafter's layers start as copies of the target's last layers (target, the "
                                      "default) or as identity (residual branches zero).")}
    exports = {"reference": REFERENCE}
    imports = {"spd": ImportFormat("A reference speculation head (v11 .pt, e.g. Qwen3.5-4B_s8_l4.pt).", _import_v11)}
    serves = "one rank per pipeline stage"

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """n x Ls x schedule (defaults: the family's parameter defaults), each with the aggregation bounds given
        (shared projections, e.g. to fit a drafter under the size shipped in the repository)."""
        from methods.pipeline.objective import PipelineSpec

        default = cls.Params()
        schedules = cls.train_schedules(values.get("schedule") or [default.schedule])
        bounds = tuple(values.get("aggr_bounds") or ())
        inits = values.get("init") or ["target"]
        if len(inits) > 1:
            raise ValueError(f"--init takes one value, got {','.join(inits)}")
        return [PipelineSpec(cls.name, n, ls, schedule, cls.policy, bounds, inits[0])
                for n in values.get("n") or [default.n] for ls in values.get("ls") or [default.ls]
                for schedule in schedules]

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
        shape = summary.stats.pipeline
        if shape is None or summary.tokens_per_step is None:
            return None
        cycle = max(shape.largest_stage, shape.ls) if shape.schedule == "input" else shape.largest_stage + shape.ls
        return summary.tokens_per_step * shape.num_layers / cycle

    @classmethod
    def modeled_speedup(cls, summary) -> float | None:
        """The same with measured times: one device per stage plus one for the drafter and verification head."""
        stats, shape = summary.stats, summary.stats.pipeline
        stage_s = stage_seconds(stats, summary.timing)
        if (shape is None or not stats.stage_runs or not stats.drafter_calls or not stats.verifications
                or not stage_s):  # simulated runs have no timings
            return None
        per_layer = stage_s / (stats.stage_runs * shape.num_layers / shape.n)
        drafter = summary.timing["drafter"] / stats.drafter_calls
        head = summary.timing["verify_head"] / stats.verifications
        stage = shape.largest_stage * per_layer
        cycle = (max(stage, drafter) if shape.schedule == "input" else stage + drafter) + head
        return summary.tokens_per_step * (shape.num_layers * per_layer + head) / cycle

    @classmethod
    def l_acc(cls, summary) -> float | None:
        """alpha * L / largest stage: accepted layers per cycle over the slowest stage's."""
        shape = summary.stats.pipeline
        if shape is None or summary.tokens_per_step is None:
            return None
        return summary.tokens_per_step * shape.num_layers / shape.largest_stage

    @classmethod
    def reference_speedup(cls, summary) -> float | None:
        """The reference code's theoretical speedup: n * N / S per sample (N counts the prefill token, S the decode
        cycles), averaged over samples, so a row compares with its published tables directly."""
        shape = summary.stats.pipeline
        if shape is None or not summary.samples:
            return None
        return sum(shape.n * tokens / steps for tokens, steps in summary.lengths if steps) / summary.samples

    breakdown_note = ("ms per pipeline cycle on the driver: draft, stages (local: every stage in turn; distributed: "
                      "control, transfers and the wait for the slowest rank), verification head, the rest (sampling, "
                      "bookkeeping); slowest stage: the busiest rank's forward time per cycle (distributed only)")

    @classmethod
    def cycle_breakdown(cls, summary) -> dict[str, float | None] | None:
        """Executed runs: the driver's serial phases in ms per cycle (they add up to the cycle's wall time) and,
        distributed, the slowest stage rank's forward time per cycle."""
        decode = summary.timing.get("decode")
        if summary.stats.pipeline is None or summary.simulated or not summary.steps or not decode:
            return None
        ms = {phase: 1000 * summary.timing.get(key, 0.0) / summary.steps
              for phase, key in (("draft", "drafter"), ("stages", "stages"), ("verify", "verify_head"))}
        ms["other"] = 1000 * decode / summary.steps - sum(ms.values())
        ms["cycle"] = 1000 * decode / summary.steps
        forward = (summary.stats.executor.stage_forward_s if summary.stats.executor else None) or []
        ms["slowest stage"] = 1000 * max(forward) / summary.steps if forward else None
        return ms

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params: PipelineParams) -> tuple[Path, dict] | None:
        """A reference speculation head (a v11 `.pt` file, methods/pipeline/interop.py): SPD's input schedule with
        multi-depth features, so PPSD reads none."""
        if cls.policy != "multi_depth" or not path.is_file():
            return None
        from methods.pipeline.interop import import_spd

        target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
        return import_spd(path, target, expect=(params.n, params.ls)), {}

    def parity(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int):
        """The drafter's top-1 per (position, fill level) through the training layout, the engine and the replay
        (methods/pipeline/parity.py)."""
        from methods.pipeline.parity import compare

        return compare(self.engine, prompt_ids, trajectory, max_new_tokens)

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

    @classmethod
    def relative_cost(cls, params: PipelineParams, simulate: bool) -> float:
        """Trees verify `width` candidates per position: a width-4 sample took about 3x a chain's here."""
        return super().relative_cost(params, simulate) * (1 if params.width == 1 or simulate else 3)

    @classmethod
    def selfcheck_cases(cls, target) -> list[tuple[str, Method]]:
        """n=4, Ls=1 with random drafters, every schedule the method has, chains and width-4 trees."""
        found = []
        for schedule in (s for s in SCHEDULES if offers(cls, {"schedule": s})):
            for width in (1, 4):
                config = SpeculatorConfig(n=4, ls=1, schedule=schedule, policy=cls.policy, num_layers=target.num_layers)
                params = cls.Params(n=4, ls=1, schedule=schedule, width=width)
                method = cls(target, params, set(), speculator=Speculator(config, target).eval())
                found.append((f"{cls.name} n=4 ls=1 {schedule} w={width}", method))
        return found

    @classmethod
    def selfcheck_distributed(cls, target, scratch: Path) -> tuple[str, Method, int] | None:
        speculator = Speculator(SpeculatorConfig(n=2, ls=1, policy=cls.policy, num_layers=target.num_layers),
                                target).eval()
        return f"{cls.name} n=2", cls(target, cls.Params(n=2, ls=1), set(), speculator=speculator), 2

    def with_oracle(self, reference: dict[int, int], hit_rate: float) -> SPD:
        self.engine.drafter_class = oracle_drafter(reference, hit_rate)
        return self

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
