"""Render pooled metrics as Markdown or CSV: the main table plus per-fill acceptance and lossless details."""

from __future__ import annotations

import csv
import io
import json

from harness.metrics import OVERALL, Summary

COLUMNS = ("method", "params", "model", "T", "dataset", "samples", "new tokens", "steps", "tokens/step",
           "L'acc", "theoretical x", "modeled x", "wall-clock x", "tok/s", "lossless %")

NOTES = """\
tokens/step: tau (draft-then-verify) or alpha (pipeline: tokens per cycle); L'acc = alpha * L / largest stage.
theoretical x: input schedule alpha*L/max(largest stage, Ls), output schedule alpha*L/(largest stage + Ls),
EAGLE-3 tau*L/(Ls*m + L) (tokens/step excludes each sample's prefill token).
modeled x: the same with measured stage / drafter / verification-head times (one device per stage).
wall-clock x: decode tok/s over AR's, AR timed beside the method on the same prompts in the same run; a
single-process pipeline runs its stages one after another, so this is below 1 by construction.
lossless %: samples token-identical to greedy AR among those checked (T=0); T>0 is covered by distribution tests.
"""


def _params(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(params.items())) or "—"


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cells(s: Summary) -> list[str]:
    lossless = "—" if s.lossless_pct is None else f"{s.lossless_pct:.0f} ({s.identical}/{s.checked})"
    return [s.method, _params(s.params), s.model, f"{s.temperature:g}", s.dataset, str(s.samples), str(s.new_tokens),
            str(s.steps), _num(s.tokens_per_step), _num(s.l_acc), _num(s.theoretical_speedup), _num(s.modeled_speedup),
            _num(s.wall_clock_speedup), _num(s.tokens_per_second, 1), lossless]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + [
        "| " + " | ".join(r) + " |" for r in rows]


def _acceptance_table(summaries: list[Summary], title: str, label: str) -> list[str]:
    if not summaries:
        return []
    width = max(len(s.fill_drafts) for s in summaries)
    header = ["method", "params", "T"] + [f"{label} {k}" for k in range(width)]
    rows = [[s.method, _params(s.params), f"{s.temperature:g}"]
            + [_num(a) for a in s.fill_acceptance] + ["—"] * (width - len(s.fill_drafts)) for s in summaries]
    return [title, ""] + _table(header, rows) + [""]


def markdown(summaries: list[Summary]) -> str:
    lines = ["## Results", ""] + _table(list(COLUMNS), [_cells(s) for s in summaries]) + ["", NOTES]
    overall = [s for s in summaries if s.dataset == OVERALL]
    lines += _acceptance_table([s for s in overall if s.pipeline and s.fill_drafts],
                               "## Draft acceptance by pipeline fill level (fill k: drafted with k + 1 tokens in flight)",
                               "fill")
    lines += _acceptance_table([s for s in overall if s.draft and s.fill_drafts],
                               "## Acceptance by draft position (share of rounds that accepted position k)", "pos")
    lines += ["## Losslessness", ""]
    rows = [[s.method, _params(s.params), f"{s.temperature:g}", str(s.checked), str(s.identical),
             ", ".join(f"q{q}@{i}" for q, i in s.divergences) or "—"] for s in overall]
    lines += _table(["method", "params", "T", "checked", "identical", "first divergences"], rows)
    return "\n".join(lines) + "\n"


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
