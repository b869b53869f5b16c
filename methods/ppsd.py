"""PPSD: the same pipeline engine, drafting from shallow first-stage features after each step (output schedule)."""

from __future__ import annotations

from dataclasses import dataclass

from methods.base import register
from methods.spd import SPD, PipelineParams


@dataclass(frozen=True)
class PPSDParams(PipelineParams):
    ls: int = 1
    schedule: str = "output"

    def __post_init__(self):
        if self.schedule != "output":
            raise ValueError("PPSD drafts after each pipeline step: use --schedule output")
        super().__post_init__()


@register
class PPSD(SPD):
    name = "ppsd"
    Params = PPSDParams
    policy = "first_stage"
