"""Render pooled metrics as Markdown or CSV tables."""

from __future__ import annotations

import csv
import io
import json

from harness.metrics import Summary

COLUMNS = ("method", "params", "model", "T", "dataset", "samples", "new tokens", "tok/s", "steps", "tokens/step", "lossless %")


def _params(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(params.items())) or "—"


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cells(s: Summary) -> list[str]:
    lossless = "—" if s.lossless_pct is None else f"{s.lossless_pct:.0f} ({s.identical}/{s.checked})"
    return [
        s.method,
        _params(s.params),
        s.model,
        f"{s.temperature:g}",
        s.dataset,
        str(s.samples),
        str(s.new_tokens),
        _num(s.tokens_per_second, 1),
        str(s.steps),
        _num(s.tokens_per_step),
        lossless,
    ]


def markdown(summaries: list[Summary]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(_cells(s)) + " |" for s in summaries]
    notes = [
        "",
        "tok/s: decode throughput (tokens after the prefill token / decode seconds), pooled as sums. "
        "lossless %: samples token-identical to greedy AR among those checked (T=0 runs; T>0 is covered by "
        "distribution tests).",
    ]
    return "\n".join(lines + notes) + "\n"


def csv_text(summaries: list[Summary]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for s in summaries:
        row = _cells(s)
        row[1] = json.dumps(s.params, sort_keys=True)
        writer.writerow(row)
    return buffer.getvalue()


RENDERERS = {"markdown": markdown, "csv": csv_text}
