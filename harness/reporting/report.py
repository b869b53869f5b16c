"""The report: the paper's tables from pooled metrics, as Markdown, LaTeX or CSV (pandas frames; Markdown through
tabulate, LaTeX as booktabs tables).

Tables (in order): the summary; main blocks per (T, width); the paper's scaling tables and its ablation
(reporting/paper.py); theoretical vs modeled vs wall-clock speedup; acceptance per position on each family's axis;
the cycle breakdown and each family's own figures (its Method hooks); simulated vs executed; the paper's claims
checked on the records; the paper's reference values beside ours; losslessness; every configuration by dataset.
Empty cells show "—" and the report ends with the commands that fill the paper grid's missing configurations.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from harness.bench.data import DATASETS
from harness.bench.sweep import GridPoint
from harness.reporting.metrics import (
    OVERALL,
    Block,
    Summary,
    config_label,
    find,
    length_label,
    params_label,
    sampling_label,
)
from harness.reporting.paper import (
    ABLATION,
    DEFINITIONS,
    MEAN,
    REFERENCES,
    SCALING,
    Axes,
    Reference,
    paper_grid,
    paper_truncation,
    scaling_figures,
    verdicts,
)

COLUMNS = ("method", "params", "model", "T", "dataset", "simulated", "samples", "new tokens", "steps", "tokens/step",
           "L'acc", "theoretical x", "modeled x", "wall-clock x", "tok/s", "lossless %")

NOTES = DEFINITIONS


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


# --- cells -------------------------------------------------------------------------------------------------------
_params, _config = params_label, config_label


def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _triple(s: Summary | None) -> str:
    if s is None:
        return "—"
    return f"{_num(s.tokens_per_step)} · {_num(s.l_acc)} · {_num(s.theoretical_speedup)}x"


def _mean_triple(cells: list[Summary]) -> str:
    """Mean over the datasets present of each number in the cell (all three are linear in tokens/step)."""
    def mean(attr):
        values = [getattr(s, attr) for s in cells if getattr(s, attr) is not None]
        return sum(values) / len(values) if values else None
    if not cells:
        return "—"
    return f"{_num(mean('tokens_per_step'))} · {_num(mean('l_acc'))} · {_num(mean('theoretical_speedup'))}x"


def _cell(summaries: list[Summary], block: Block, method: str, **params) -> str:
    found = find(summaries, method, {**params, "width": block.width}, block.temperature, truncation=block.truncation)
    return _triple(found)


def _blocks(summaries: list[Summary]) -> list[Block]:
    return sorted({s.block for s in summaries if s.method != "autoregressive"})


# --- tables ------------------------------------------------------------------------------------------------------
def main_tables(summaries: list[Summary]) -> list[Table]:
    """One block per (T, width): configurations x datasets and their mean."""
    tables = []
    for block in _blocks(summaries):
        by_config: dict[str, dict[str, Summary]] = {}
        for s in summaries:
            if s.block == block and s.method != "autoregressive":
                by_config.setdefault(_config(s), {})[s.dataset] = s
        rows = [[config] + [_triple(cells.get(d)) for d in DATASETS]
                + [_mean_triple([cells[d] for d in DATASETS if d in cells])] for config, cells in by_config.items()]
        tables.append(Table(block.title, ["config", *DATASETS, MEAN], rows,
                            "cells: tokens/step (alpha or tau) · L'acc · theoretical speedup"))
    return tables


def _scaling_rows(summaries: list[Summary], block: Block, axes: Axes) -> tuple[list[str], list[list[str]]]:
    rows_name, row_values = axes.rows
    if axes.columns is None:
        return ["", "all datasets"], [[f"{rows_name}={v}", _cell(summaries, block, axes.method, **axes.fixed,
                                                                  **{rows_name: v})] for v in row_values]
    name, values, title = axes.columns
    return ["", *(f"{title}={c}" for c in values)], [
        [f"{rows_name}={r}"] + [_cell(summaries, block, axes.method, **axes.fixed, **{rows_name: r, name: c})
                                for c in values] for r in row_values]


def scaling_tables(summaries: list[Summary]) -> list[Table]:
    """The paper's scaling tables (reporting/paper.py), per (T, width), on the paper's axes ("—": not run)."""
    tables = []
    for block in _blocks(summaries):
        for axes in SCALING:
            header, rows = _scaling_rows(summaries, block, axes)
            if any(cell != "—" for row in rows for cell in row[1:]):
                tables.append(Table(f"{axes.title}, {block.title}", header, rows,
                                    "cells: tokens/step · L'acc · theoretical speedup, pooled over datasets"))
    return tables


def ablation_table(overall: list[Summary]) -> list[Table]:
    """The paper's ablation: configurations that have both of its parameter's values."""
    spec = ABLATION
    pairs: dict[tuple, dict[str, Summary]] = {}
    for s in overall:
        if spec.parameter in s.params:
            key = (s.method, *(s.params.get(p) for p in spec.label), s.width, s.sampling, s.simulated,
                   s.max_new_tokens)
            pairs.setdefault(key, {})[s.params[spec.parameter]] = s
    first, second = spec.values
    rows = [[f"{m} " + " ".join(f"{p}={v}" for p, v in zip(spec.label, values)) + length_label(tokens)
             + (" (sim)" if sim else ""), str(w), t,
             _num(p[first].tokens_per_step), _num(p[second].tokens_per_step),
             _num(p[first].theoretical_speedup), _num(p[second].theoretical_speedup)]
            for (m, *values, w, t, sim, tokens), p in sorted(pairs.items(), key=str) if len(p) == 2]
    if not rows:
        return []
    return [Table(spec.title, ["config", "width", "T", f"{spec.metric} {first}", f"{spec.metric} {second}",
                               f"theoretical x {first}", f"theoretical x {second}"], rows)]


def speedup_table(overall: list[Summary]) -> list[Table]:
    rows = [[_config(s), str(s.width), s.sampling, _num(s.theoretical_speedup),
             _num(s.reference_theoretical), _num(s.modeled_speedup), _num(s.wall_clock_speedup),
             _num(s.tokens_per_second, 1)]
            for s in overall if s.method != "autoregressive" and not s.simulated]
    if not rows:
        return []
    return [Table("Theoretical vs modeled multi-device vs measured wall-clock speedup",
                  ["config", "width", "T", "theoretical x", "reference def. x", "modeled x", "wall-clock x", "tok/s"],
                  rows, "theoretical: alpha * L / cycle layers (pooled); reference def.: the reference code's n * N / S "
                        "per sample (N counts the prefill token), averaged over samples, as in its published tables")]


def position_axes(overall: list[Summary]) -> dict:
    """Summaries with accepts per position, by their family's axis (PositionAxis), the axes in order of label."""
    found: dict = {}
    for s in overall:
        axis = s.family.positions if s.family else None
        if axis is not None and s.position_drafts:
            found.setdefault(axis, []).append(s)
    return {axis: found[axis] for axis in sorted(found, key=lambda a: a.label)}


def acceptance_tables(overall: list[Summary]) -> list[Table]:
    tables = []
    for axis, shown in position_axes(overall).items():
        size = max(len(s.position_drafts) for s in shown)
        rows = [[_config(s), str(s.width), s.sampling] + [_num(a) for a in s.position_acceptance]
                + ["—"] * (size - len(s.position_drafts)) for s in shown]
        tables.append(Table(axis.title, ["config", "width", "T"] + [f"{axis.label} {k}" for k in range(size)], rows))
    return tables


def _reference_value(summaries: list[Summary], model: str, ref: Reference) -> float | None:
    truncation = paper_truncation(ref.temperature)  # ours compare with the paper's only at its sampling
    if ref.dataset == MEAN:
        cells = [find(summaries, ref.method, ref.params, ref.temperature, d, model, truncation=truncation)
                 for d in DATASETS]
        values = [getattr(c, ref.metric) for c in cells if c is not None]
        return sum(values) / len(values) if len(values) == len(DATASETS) and None not in values else None
    found = find(summaries, ref.method, ref.params, ref.temperature, ref.dataset, model, truncation=truncation)
    return None if found is None else getattr(found, ref.metric)


def reference_table(summaries: list[Summary]) -> list[Table]:
    """The paper's numbers beside ours for every model whose name matches the paper's."""
    rows = []
    models = sorted({s.model for s in summaries})
    for ref in REFERENCES:
        matching = [m for m in models if ref.matches_model(m)]
        ours = [(m, _reference_value(summaries, m, ref)) for m in matching] or [("—", None)]
        for model, value in ours:
            sampling = sampling_label(ref.temperature, paper_truncation(ref.temperature))
            rows.append([ref.model, f"{ref.method} {_params(ref.params)}", sampling, ref.dataset,
                         ref.metric.replace("_", " "), f"{ref.value:.2f}", model, _num(value), ref.source])
    return [Table("The paper's reference values beside ours",
                  ["paper model", "config", "T", "dataset", "metric", "paper", "our model", "ours", "source"], rows,
                  "paper: published numbers (not measured here); ours: this harness on a model whose name matches "
                  "(fill with `spd-bench sweep --preset paper --model <local Qwen3.5-4B folder>` on a GPU)")]


def simulation_table(overall: list[Summary]) -> list[Table]:
    """Configurations run both ways: how close the replay's acceptance is to executed decoding."""
    def key(s):
        return (s.model, s.method, _params(s.params), s.temperature, s.truncation, s.max_new_tokens)
    executed = {key(s): s for s in overall if not s.simulated}
    rows = [[_config(e), str(e.width), e.sampling, f"{e.samples}/{s.samples}", _num(e.tokens_per_step, 3),
             _num(s.tokens_per_step, 3), _num(e.acceptance, 3), _num(s.acceptance, 3), _num(s.expected_acceptance, 3)]
            for s in overall if s.simulated and (e := executed.get(key(s))) is not None]
    if not rows:
        return []
    return [Table("Simulated vs executed", ["config", "width", "T", "samples (exec/sim)", "tokens/step exec",
                                            "tokens/step sim", "acceptance exec", "acceptance sim",
                                            "expected acceptance sim"], rows,
                  "the same configuration decoded and replayed (`--simulate`): equal at T=0 on the same prompts; at "
                  "T>0 a chain replay accepts each draft with the verifier's probability sum_x min(p, q) along a "
                  "sampled AR trajectory and the expected acceptance is the mean of those probabilities, while a tree "
                  "replay (width > 1) is itself a sample of the executed process (expected = realised)")]


def summary_table(overall: list[Summary]) -> Table:
    """One line per configuration, pooled over datasets: what `make bench` ends with."""
    rows = [[_config(s), str(s.width), s.sampling, str(s.samples), _num(s.acceptance),
             _num(s.tokens_per_step), _num(s.l_acc), _num(s.theoretical_speedup), _num(s.wall_clock_speedup),
             "—" if s.lossless_pct is None else f"{s.identical}/{s.checked}"] for s in overall]
    return Table("Measured acceptance and speedups (pooled over datasets)",
                 ["config", "width", "T", "samples", "acceptance", "tokens/step", "L'acc", "theoretical x",
                  "wall-clock x", "lossless"], rows)


def claims_table(summaries: list[Summary]) -> list[Table]:
    rows = [[v.claim, v.model, v.verdict, v.measured] for v in verdicts(summaries)]
    return [Table("The paper's claims, as measured here", ["claim", "model", "verdict", "measured"], rows,
                  "each claim checked on the records above (width 1, pooled over datasets; both sides executed, "
                  "else both simulated); drafters trained on a small budget make these statements about them, not "
                  "about the paper's drafters")]


def breakdown_table(overall: list[Summary]) -> list[Table]:
    """Executed runs of families that time their steps' phases (Method.cycle_breakdown), beside the speedups."""
    found = [(s, s.cycle_breakdown) for s in overall]
    found = [(s, ms) for s, ms in found if ms is not None]
    if not found:
        return []
    phases = list(found[0][1])
    rows = [[_config(s), s.sampling, str(s.width), str(s.steps)] + [_num(ms.get(p), 1) for p in phases]
            + [f"{_num(v)}x" for v in (s.theoretical_speedup, s.modeled_speedup, s.wall_clock_speedup)]
            for s, ms in found]
    return [Table("Cycle wall breakdown", ["config", "T", "width", "cycles", *(f"{p} ms" for p in phases),
                                           "theoretical", "modeled", "wall-clock"], rows,
                  found[0][0].family.breakdown_note)]


def family_tables(overall: list[Summary]) -> list[Table]:
    """A table per method family with figures of its own (Method.figures), one row per configuration."""
    found: dict[str, list[tuple[Summary, dict]]] = {}
    for s in overall:
        figures = s.family.figures(s) if s.family else {}
        if figures:
            found.setdefault(s.method, []).append((s, figures))
    tables = []
    for method, entries in found.items():
        names = list(entries[0][1])
        rows = [[_config(s), s.sampling, str(s.samples)] + [_num(figures.get(n)) for n in names]
                for s, figures in entries]
        tables.append(Table(f"{method} figures", ["config", "T", "samples", *names], rows,
                            entries[0][0].family.figures_note))
    return tables


def lossless_table(overall: list[Summary]) -> list[Table]:
    rows = [[_config(s), str(s.width), s.sampling, str(s.checked), str(s.identical),
             ", ".join(f"q{q}@{i}" for q, i in s.divergences) or "—"] for s in overall if not s.simulated]
    return [Table("Losslessness", ["config", "width", "T", "checked", "identical", "first divergences"], rows)]


def detail_table(summaries: list[Summary]) -> Table:
    return Table("All configurations by dataset", list(COLUMNS), [_cells(s) for s in summaries])


def _cells(s: Summary) -> list[str]:
    lossless = "—" if s.lossless_pct is None else f"{s.lossless_pct:.0f} ({s.identical}/{s.checked})"
    return [s.method, _params(s.params), s.model, s.sampling, s.dataset, "yes" if s.simulated else "no",
            str(s.samples), str(s.new_tokens), str(s.steps), _num(s.tokens_per_step), _num(s.l_acc),
            _num(s.theoretical_speedup), _num(s.modeled_speedup), _num(s.wall_clock_speedup),
            _num(s.tokens_per_second, 1), lossless]


def missing_points(summaries: list[Summary]) -> list[GridPoint]:
    """Points of the paper grid with no record for any model in these results."""
    return [p for p in paper_grid()
            if find(summaries, p.method, p.param_dict, p.temperature, truncation=p.truncation) is None]


def tables(summaries: list[Summary]) -> list[Table]:
    overall = [s for s in summaries if s.dataset == OVERALL]
    return ([summary_table(overall)] + main_tables(summaries) + scaling_tables(summaries) + ablation_table(overall)
            + speedup_table(overall)
            + acceptance_tables(overall) + breakdown_table(overall) + family_tables(overall) + simulation_table(overall)
            + claims_table(summaries)
            + reference_table(summaries)
            + lossless_table(overall)
            + [detail_table(summaries)])


# --- renderers ---------------------------------------------------------------------------------------------------
def _frame(header: list[str], rows: list[list[str]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=header, dtype=str)


def _markdown_table(table: Table) -> list[str]:
    lines = [f"## {table.title}", ""]
    if table.note:
        lines += [table.note, ""]
    # Cells are already formatted strings: numbers must not be re-parsed (that would drop "x" and trailing zeros).
    return lines + [_frame(table.header, table.rows).to_markdown(index=False, disable_numparse=True,
                                                                  colalign=_alignment(table)), ""]


def _alignment(table: Table) -> tuple[str, ...]:
    """Numbers (and their "—" placeholders) right-aligned, words left-aligned."""
    def numeric(column: int) -> bool:
        return bool(table.rows) and all(re.match(r"^([—+\-]|\d)", row[column]) for row in table.rows)
    return tuple("right" if numeric(c) else "left" for c in range(len(table.header)))


def _fill_commands(summaries: list[Summary]) -> list[str]:
    missing = missing_points(summaries)
    if not missing:
        return []
    return (["## Filling the empty cells", "",
             f"{len(missing)} configurations of the paper's grid have no record yet. All of them, resumably "
             "(missing drafters are listed with their train commands; add `--simulate` for acceptance only):", "",
             "    spd-bench sweep --preset paper", "", "or one at a time:", ""]
            + [f"    {p.run_command()}" for p in missing] + [""])


def markdown(summaries: list[Summary], figures: dict[str, str] | None = None) -> str:
    lines = ["# Results", ""]
    for table in tables(summaries):
        lines += _markdown_table(table)
    for title, path in (figures or {}).items():
        lines += [f"![{title}]({path})", ""]
    return "\n".join(lines + _fill_commands(summaries) + [NOTES])


def markdown_summary(summaries: list[Summary]) -> str:
    """The summary table alone, with the notes that define its columns."""
    table = summary_table([s for s in summaries if s.dataset == OVERALL])
    return "\n".join(_markdown_table(table) + [NOTES])


def _latex_escape(text: str) -> str:
    for raw, escaped in (("\\", r"\textbackslash{}"), ("&", r"\&"), ("%", r"\%"), ("_", r"\_"), ("#", r"\#"),
                         ("·", r"$\cdot$"), ("—", "--"), ("'", "'")):
        text = text.replace(raw, escaped)
    return text


def latex(summaries: list[Summary], figures: dict[str, str] | None = None) -> str:
    """Every table as a booktabs tabular in a table float, ready to \\input into a paper."""
    out = ["% generated by spd-bench report --format latex; needs \\usepackage{booktabs}"]
    for table in tables(summaries):
        frame = _frame([_latex_escape(h) for h in table.header],
                       [[_latex_escape(cell) for cell in row] for row in table.rows])
        caption = _latex_escape(table.title) + (f". {_latex_escape(table.note)}" if table.note else "")
        tex = frame.to_latex(index=False, caption=caption, position="t",
                             column_format="l" + "r" * (len(table.header) - 1))
        out.append(tex.replace("\\begin{table}[t]\n", "\\begin{table}[t]\n\\centering\n\\small\n", 1))
    return "\n".join(out)


def csv_text(summaries: list[Summary], figures: dict[str, str] | None = None) -> str:
    rows = []
    for s in summaries:
        row = _cells(s)
        row[1] = json.dumps(s.params, sort_keys=True)
        rows.append(row)
    return _frame(list(COLUMNS), rows).to_csv(index=False)


RENDERERS = {"markdown": markdown, "latex": latex, "csv": csv_text}


def render_figures(summaries: list[Summary], rows: list[dict], folder: Path, relative_to: Path,
                   train_rows: list[dict] = ()) -> dict[str, str]:
    """Write the report's PNG figures; returns {title: path relative to the report}."""
    from harness.reporting import figures

    overall = [s for s in summaries if s.dataset == OVERALL]
    axes = position_axes(overall)
    made = {spec.title: figures.scaling(spec, overall, folder / spec.file) for spec in scaling_figures(overall)}
    made |= {
        f"Acceptance by {' / '.join(axis.name for axis in axes)}":
            figures.acceptance(overall, folder / "acceptance.png", axes),
        "Tokens committed per round (draft-then-verify, T=0)": figures.accepted_lengths(rows, folder / "accepted_lengths.png"),
        "Speedups per executed configuration": figures.speedups(overall, folder / "speedups.png"),
        "Cycle wall breakdown": figures.cycle_breakdown(overall, folder / "cycle_breakdown.png"),
        "Drafter learning curves": figures.learning_curves(list(train_rows), folder / "learning_curves.png"),
    }
    return {title: str(path.relative_to(relative_to)) for title, path in made.items() if path is not None}
