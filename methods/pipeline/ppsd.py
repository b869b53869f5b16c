"""PPSD: the same pipeline engine, drafting from shallow first-stage features after each step (output schedule)."""

from __future__ import annotations

from dataclasses import dataclass

from methods.base import param, register
from methods.pipeline.spd import SPD, PipelineParams


@dataclass(frozen=True)
class PPSDParams(PipelineParams):
    ls: int = param(1, "Drafter decoder layers.")
    schedule: str = param("output", "PPSD drafts after each step (output).", choices=("output",))

    def __post_init__(self):
        if self.schedule != "output":
            raise ValueError("PPSD drafts after each pipeline step: use --schedule output")
        super().__post_init__()


@register
class PPSD(SPD):
    name = "ppsd"
    Params = PPSDParams
    policy = "first_stage"
    imports = {}  # the reference's heads draft from multi-depth features (SPD's)

    @classmethod
    def selfcheck_distributed(cls, target, scratch):
        return None  # the stage ranks serve SPD's engine alike: its check covers them

    @classmethod
    def train_schedules(cls, schedules: list[str]) -> list[str]:
        """PPSD drafts from output states only: a list with SPD's schedules (one train command for both) trains it
        once, with the output schedule."""
        if "output" not in schedules:
            raise ValueError(f"--schedule for ppsd must include output, got {','.join(schedules)!r}")
        return ["output"]
