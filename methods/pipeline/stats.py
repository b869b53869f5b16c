"""What a pipeline generation records: its shape (the speedup formulas' inputs) and its counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from methods.capabilities import PositionAxis
from methods.stats import Record, Stats, same

FILL_LEVELS = PositionAxis("fill", "Draft acceptance by pipeline fill level (fill k: k + 1 tokens in flight)",
                           "fill level")


@dataclass
class PipelineShape(Record):
    """Layer count, stages, the largest stage's layers, drafter depth, schedule and width."""

    num_layers: int
    n: int
    largest_stage: int
    ls: int
    schedule: str
    width: int = 1


@dataclass
class PipelineStats(Stats):
    fill_drafts: list[int] = field(default_factory=list)  # drafts verified at each fill level
    stage_runs: int | None = None  # stage calls summed over token slots (tree replays skip them)
    drafter_calls: int | None = None
    verifications: int | None = None
    pipeline: PipelineShape | None = same()

    def drafts(self, steps: int, positions: int) -> list[int]:
        return self.fill_drafts or super().drafts(steps, positions)


def stage_seconds(stats: PipelineStats, timing: dict[str, float]) -> float:
    """Seconds of stage compute: distributed runs time it on the ranks, where the driver's "stages" is its wait,
    transfers included."""
    executor = stats.executor
    if executor is not None and executor.kind == "distributed":
        return sum(executor.stage_forward_s or [])
    return timing.get("stages", 0.0)
