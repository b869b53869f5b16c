"""Regression check: pooled acceptance and losslessness of recorded results against a committed baseline.

A baseline is a JSON list with one entry per configuration (overall over its datasets): its config key, a label,
tokens/step, the draft acceptance rate and the sample count. The check fails when a configuration is missing, any
checked sample is not token-identical to greedy AR, or tokens/step or the acceptance rate fell by more than the
relative tolerance (the acceptance rate only where the baseline accepted at least MIN_ACCEPTS drafts: fewer are
noise).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.errors import HarnessError
from harness.metrics import OVERALL, Summary


MIN_ACCEPTS = 20


@dataclass
class Expected:
    config_key: str
    label: str
    tokens_per_step: float
    samples: int
    acceptance: float | None = None  # share of verified drafts accepted (absent in older baselines)
    accepts: int = 0  # drafts accepted in the baseline run


@dataclass
class Outcome:
    expected: Expected
    current: float | None
    acceptance: float | None
    lossless: str
    verdict: str  # "ok" or why it failed

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


def _label(s: Summary) -> str:
    params = " ".join(f"{k}={v}" for k, v in sorted(s.params.items()))
    return f"{s.model} {s.method} {params} T={s.temperature:g}{' (sim)' if s.simulated else ''}".strip()


def baseline_from(summaries: list[Summary]) -> list[Expected]:
    return [Expected(s.config_key, _label(s), round(s.tokens_per_step, 4), s.samples,
                     None if s.acceptance is None else round(s.acceptance, 4), sum(s.fill_accepts))
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
    overall = [s for s in summaries if s.dataset == OVERALL]
    by_key = {s.config_key: s for s in overall}
    labels = Counter(_label(s) for s in overall)
    # A retrained drafter changes the config key (it includes the weights' hash), so a unique label also matches.
    by_label = {_label(s): s for s in overall if labels[_label(s)] == 1}
    outcomes = []
    for expected in baseline:
        s = by_key.get(expected.config_key) or by_label.get(expected.label)
        if s is None:
            outcomes.append(Outcome(expected, None, None, "—", "missing"))
            continue
        lossless = f"{s.identical}/{s.checked}"
        if s.identical < s.checked:
            verdict = "lost losslessness"
        elif s.tokens_per_step < expected.tokens_per_step * (1 - tolerance):
            verdict = f"tokens/step fell more than {tolerance:.0%}"
        elif (expected.acceptance is not None and expected.accepts >= MIN_ACCEPTS
              and (s.acceptance or 0.0) < expected.acceptance * (1 - tolerance)):
            verdict = f"acceptance fell more than {tolerance:.0%}"
        else:
            verdict = "ok"
        outcomes.append(Outcome(expected, s.tokens_per_step, s.acceptance, lossless, verdict))
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    lines = ["| config | baseline tokens/step | current | change | baseline acceptance | current | change | lossless "
             "| verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for o in outcomes:
        e = o.expected
        lines.append(f"| {e.label} | {_pair(e.tokens_per_step, o.current)} | {_pair(e.acceptance, o.acceptance)} "
                     f"| {o.lossless} | {o.verdict} |")
    return "\n".join(lines) + "\n"


def _pair(expected: float | None, current: float | None) -> str:
    """'baseline | current | relative change' cells."""
    def fmt(value):
        return "—" if value is None else f"{value:.4f}"
    change = "—" if expected in (None, 0) or current is None else f"{current / expected - 1:+.1%}"
    return f"{fmt(expected)} | {fmt(current)} | {change}"
