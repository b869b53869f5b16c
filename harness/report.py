"""Render pooled metrics as Markdown or CSV: the main table plus per-fill acceptance and lossless details."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

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


def _width(s: Summary) -> int:
    return int(s.params.get("width", 1))


def _config(s: Summary) -> str:
    params = {k: v for k, v in s.params.items() if k != "width"}
    return f"{s.method} {_params(params)}" if params else s.method


def main_tables(summaries: list[Summary]) -> list[str]:
    """One block per (T, width): configurations x datasets, cells 'tokens/step · L'acc · theoretical x'."""
    datasets = sorted({s.dataset for s in summaries if s.dataset != OVERALL}) + [OVERALL]
    lines = []
    for temperature, width in sorted({(s.temperature, _width(s)) for s in summaries}):
        block = [s for s in summaries if (s.temperature, _width(s)) == (temperature, width)]
        by_config: dict[str, dict[str, Summary]] = {}
        for s in block:
            by_config.setdefault(_config(s), {})[s.dataset] = s
        rows = [[config] + [_cell(cells.get(d)) for d in datasets] for config, cells in by_config.items()]
        lines += [f"### T={temperature:g}, width {width}", ""] + _table(["config"] + datasets, rows) + [""]
    return lines


def _cell(s: Summary | None) -> str:
    if s is None:
        return "—"
    return f"{_num(s.tokens_per_step)} · {_num(s.l_acc)} · {_num(s.theoretical_speedup)}x"


def speedup_table(overall: list[Summary]) -> list[str]:
    rows = [[_config(s), str(_width(s)), f"{s.temperature:g}", _num(s.theoretical_speedup), _num(s.modeled_speedup),
             _num(s.wall_clock_speedup), _num(s.tokens_per_second, 1)] for s in overall if s.method != "autoregressive"]
    if not rows:
        return []
    return ["## Theoretical vs modeled multi-device vs measured wall-clock speedup", ""] + _table(
        ["config", "width", "T", "theoretical x", "modeled x", "wall-clock x", "tok/s"], rows) + [""]


def ablation_table(overall: list[Summary]) -> list[str]:
    """Input vs output schedule for pipeline configurations that have both."""
    pairs: dict[tuple, dict[str, Summary]] = {}
    for s in overall:
        if s.pipeline is not None:
            key = (s.method, s.params.get("n"), s.params.get("ls"), _width(s), s.temperature)
            pairs.setdefault(key, {})[s.pipeline["schedule"]] = s
    rows = [[f"{m} n={n} ls={ls}", str(w), f"{t:g}", _num(p["input"].tokens_per_step), _num(p["output"].tokens_per_step),
             _num(p["input"].theoretical_speedup), _num(p["output"].theoretical_speedup)]
            for (m, n, ls, w, t), p in sorted(pairs.items(), key=str) if len(p) == 2]
    if not rows:
        return []
    return ["## Schedule ablation: input vs output state", ""] + _table(
        ["config", "width", "T", "alpha input", "alpha output", "theoretical x input", "theoretical x output"],
        rows) + [""]


def markdown(summaries: list[Summary], figures: dict[str, str] | None = None) -> str:
    overall = [s for s in summaries if s.dataset == OVERALL]
    lines = ["## Results", "", "Cells: tokens/step (alpha or tau) · L'acc · theoretical speedup.", ""]
    lines += main_tables(summaries) + speedup_table(overall) + ablation_table(overall)
    lines += _acceptance_table([s for s in overall if s.pipeline and s.fill_drafts],
                               "## Draft acceptance by pipeline fill level (fill k: drafted with k + 1 tokens in flight)",
                               "fill")
    lines += _acceptance_table([s for s in overall if s.draft and s.fill_drafts],
                               "## Acceptance by draft position (share of rounds that accepted position k)", "pos")
    for title, path in (figures or {}).items():
        lines += [f"![{title}]({path})", ""]
    lines += ["## Losslessness", ""]
    rows = [[s.method, _params(s.params), f"{s.temperature:g}", str(s.checked), str(s.identical),
             ", ".join(f"q{q}@{i}" for q, i in s.divergences) or "—"] for s in overall]
    lines += _table(["method", "params", "T", "checked", "identical", "first divergences"], rows)
    lines += ["", "## All configurations by dataset", ""] + _table(list(COLUMNS), [_cells(s) for s in summaries])
    return "\n".join(lines + ["", NOTES])


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


def render_figures(summaries: list[Summary], rows: list[dict], folder: Path, relative_to: Path) -> dict[str, str]:
    """Write the report's PNG figures; returns {title: path relative to the report}."""
    from harness import figures

    overall = [s for s in summaries if s.dataset == OVERALL]
    made = {
        "Acceptance by fill level / draft position": figures.acceptance(overall, folder / "acceptance.png"),
        "Tokens committed per step (T=0)": figures.accepted_lengths(rows, folder / "accepted_lengths.png"),
        "Speedups per configuration": figures.speedups(overall, folder / "speedups.png"),
    }
    return {title: str(path.relative_to(relative_to)) for title, path in made.items() if path is not None}
