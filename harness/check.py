"""Regression check: pooled acceptance and losslessness of recorded results against a committed baseline.

A baseline is a JSON list with one entry per configuration (overall over its datasets): its config key, a label,
tokens/step and the sample count. The check fails when a configuration is missing, any checked sample is not
token-identical to greedy AR, or tokens/step fell by more than the relative tolerance.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.metrics import OVERALL, Summary


@dataclass
class Expected:
    config_key: str
    label: str
    tokens_per_step: float
    samples: int


@dataclass
class Outcome:
    expected: Expected
    current: float | None
    lossless: str
    verdict: str  # "ok" or why it failed

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


def _label(s: Summary) -> str:
    params = " ".join(f"{k}={v}" for k, v in sorted(s.params.items()))
    return f"{s.model} {s.method} {params} T={s.temperature:g}".strip()


def baseline_from(summaries: list[Summary]) -> list[Expected]:
    return [Expected(s.config_key, _label(s), round(s.tokens_per_step, 4), s.samples)
            for s in summaries if s.dataset == OVERALL and s.tokens_per_step is not None]


def write_baseline(path: Path, summaries: list[Summary]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(e) for e in baseline_from(summaries)], indent=1) + "\n")


def read_baseline(path: Path) -> list[Expected]:
    try:
        return [Expected(**entry) for entry in json.loads(Path(path).read_text())]
    except (OSError, ValueError, TypeError) as exc:
        raise HarnessError(f"cannot read baseline {path} ({exc}); write one with spd-bench check --write") from None


def compare(baseline: list[Expected], summaries: list[Summary], tolerance: float) -> list[Outcome]:
    current = {s.config_key: s for s in summaries if s.dataset == OVERALL}
    outcomes = []
    for expected in baseline:
        s = current.get(expected.config_key)
        if s is None:
            outcomes.append(Outcome(expected, None, "—", "missing"))
            continue
        lossless = f"{s.identical}/{s.checked}"
        if s.identical < s.checked:
            verdict = "lost losslessness"
        elif s.tokens_per_step < expected.tokens_per_step * (1 - tolerance):
            verdict = f"tokens/step fell more than {tolerance:.0%}"
        else:
            verdict = "ok"
        outcomes.append(Outcome(expected, s.tokens_per_step, lossless, verdict))
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    lines = ["| config | baseline tokens/step | current | change | lossless | verdict |", "|---|---|---|---|---|---|"]
    for o in outcomes:
        current = "—" if o.current is None else f"{o.current:.4f}"
        change = "—" if o.current is None else f"{o.current / o.expected.tokens_per_step - 1:+.1%}"
        lines.append(f"| {o.expected.label} | {o.expected.tokens_per_step:.4f} | {current} | {change} | {o.lossless} "
                     f"| {o.verdict} |")
    return "\n".join(lines) + "\n"
