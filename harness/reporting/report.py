"""The report's tables: the paper's tables and ours from pooled metrics, each a `Table` of formatted cells with its
interval (render.py writes them as Markdown, LaTeX or CSV).

Tables (in order): the summary; main blocks per (T, width); the paper's scaling tables and its ablation
(reporting/paper.py); theoretical vs modeled vs wall-clock speedup; acceptance per position on each family's axis;
the cycle breakdown and each family's own figures (its Method hooks); simulated vs executed; the paper's claims
checked on the records; the paper's reference values beside ours; losslessness; every configuration by dataset.
Empty cells show "—".
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from harness.bench.data import DATASETS, MULTI_TURN
from harness.bench.sweep import GridPoint
from harness.reporting.intervals import (
    MIN_PROMPTS,
    RESAMPLES,
    Figure,
    Interval,
    getter,
    interval,
    paired_interval,
    percentile_interval,
    position,
    replicates,
)
from harness.reporting.metrics import (
    OVERALL,
    Block,
    Summary,
    config_label,
    find,
    length_label,
    params_label,
    protocol_label,
    sampling_label,
    turn_label,
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
    verdicts,
)

COLUMNS = ("method", "params", "model", "T", "dataset", "simulated", "samples", "new tokens", "steps", "tokens/step",
           "L'acc", "theoretical x", "modeled x", "wall-clock x", "tok/s", "lossless %", "engine")

NOTES = DEFINITIONS + f"""\
[low, high]: the 95% interval of the figure by bootstrap over prompts ({RESAMPLES} resamples drawing each dataset's
prompts again with replacement, so the pooled figure keeps its weighting; seeds fixed, so the report re-renders
identically). Below {MIN_PROMPTS} prompts in a dataset a figure says "too few" instead of an interval.
MT-Bench: each question's first user turn (the paper's protocol), except in configurations labelled [all turns],
which decode every turn as one conversation (Spec-Bench's and EAGLE's; "MT-Bench by turn" shows each turn).
"""


@dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]
    note: str = ""


# --- cells -------------------------------------------------------------------------------------------------------
_params, _config = params_label, config_label


def _bracket(found: Interval | None, digits: int) -> str:
    """The interval after a figure (see Interval.text)."""
    return "" if found is None else " " + found.text(f".{digits}f")


def _ci(s: Summary | None, figure: str | Figure, digits: int = 2, unit: str = "") -> str:
    """A pooled figure with its 95% bootstrap interval over prompts: "1.20 [1.14, 1.27]" (intervals.py)."""
    value = None if s is None else getter(figure)(s)
    if value is None:
        return "—"
    return f"{value:.{digits}f}{unit}" + _bracket(interval(s, figure), digits)


def _mean_ci(cells: list[Summary], figure: str | Figure, unit: str = "") -> str:
    """The mean over datasets of a figure, its interval from the datasets' replicates averaged draw by draw."""
    get = getter(figure)
    present = [s for s in cells if get(s) is not None]
    if not present:
        return "—"
    draws = zip(*(replicates(s) for s in present))
    means = [None if None in (values := [get(r) for r in draw]) else sum(values) / len(values) for draw in draws]
    found = percentile_interval(means, min(s.fewest_prompts for s in present))
    return f"{sum(get(s) for s in present) / len(present):.2f}{unit}" + _bracket(found, 2)


def _wall(s: Summary | None) -> str:
    """The median per-sample paired wall-clock ratio, its interval and how many samples it rests on."""
    if s is None or s.wall_clock_median is None:
        return "—"
    count = len(s.wall_clock_ratios)
    busy = f", {s.busy} busy" if s.busy else ""
    return _ci(s, "wall_clock_median") + (f" (n={count}{busy})" if count else f" ({s.busy} busy)" if busy else "")


def _triple(s: Summary | None) -> str:
    if s is None:
        return "—"
    return f"{_ci(s, 'tokens_per_step')} · {_ci(s, 'l_acc')} · {_ci(s, 'theoretical_speedup', unit='x')}"


def _mean_triple(cells: list[Summary]) -> str:
    """Mean over the datasets present of each number in the cell (all three are linear in tokens/step)."""
    if not cells:
        return "—"
    return (f"{_mean_ci(cells, 'tokens_per_step')} · {_mean_ci(cells, 'l_acc')} · "
            f"{_mean_ci(cells, 'theoretical_speedup', unit='x')}")


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
                cells = by_config.setdefault(_config(s), {})
                if s.dataset not in cells or cells[s.dataset].finished < s.finished:  # re-measured: the latest
                    cells[s.dataset] = s
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
                   s.max_new_tokens, s.turns)
            pairs.setdefault(key, {})[s.params[spec.parameter]] = s
    first, second = spec.values
    rows = [[f"{m} " + " ".join(f"{p}={v}" for p, v in zip(spec.label, values)) + length_label(tokens)
             + (" (sim)" if sim else "") + protocol_label(turns), str(w), t,
             _ci(p[first], "tokens_per_step"), _ci(p[second], "tokens_per_step"),
             _ci(p[first], "theoretical_speedup"), _ci(p[second], "theoretical_speedup")]
            for (m, *values, w, t, sim, tokens, turns), p in sorted(pairs.items(), key=str) if len(p) == 2]
    if not rows:
        return []
    return [Table(spec.title, ["config", "width", "T", f"{spec.metric} {first}", f"{spec.metric} {second}",
                               f"theoretical x {first}", f"theoretical x {second}"], rows)]


def speedup_table(overall: list[Summary]) -> list[Table]:
    rows = [[_config(s), str(s.width), s.sampling, _ci(s, "theoretical_speedup"),
             _ci(s, "reference_theoretical"), _ci(s, "modeled_speedup"), _wall(s), _ci(s, "tokens_per_second", 1),
             s.engine] for s in overall if s.method != "autoregressive" and not s.simulated]
    if not rows:
        return []
    return [Table("Theoretical vs modeled multi-device vs measured wall-clock speedup",
                  ["config", "width", "T", "theoretical x", "reference def. x", "modeled x", "wall-clock x", "tok/s",
                   "engine"],
                  rows, "theoretical: alpha * L / cycle layers (pooled); reference def.: the reference code's n * N / S "
                        "per sample (N counts the prefill token), averaged over samples, as in its published tables; "
                        "engine: the dtype and kernels the timed samples ran with (AR beside them ran the same)")]


def turns_table(summaries: list[Summary]) -> list[Table]:
    """Runs of every turn of a multi-turn set: each turn's figures beside the turns pooled, and how far acceptance
    moved from the first turn (paired over the questions that have both)."""
    by_label = {(s.config_key, s.engine, s.dataset): s for s in summaries}
    rows = []
    for pooled in (s for s in summaries if s.turns != "first" and s.dataset in MULTI_TURN):
        turns = list(itertools.takewhile(bool, (by_label.get((pooled.config_key, pooled.engine,
                                                             turn_label(pooled.dataset, n)))
                                                for n in itertools.count(1))))
        for label, s in [*((f"turn {n}", t) for n, t in enumerate(turns, 1)), ("both", pooled)]:
            rows.append([_config(pooled), pooled.sampling, label, str(s.samples), f"{_mean_prompt(s):.0f}",
                         _ci(s, "tokens_per_step"), _ci(s, "acceptance", 3),
                         _moved(s, turns[0]) if s is not pooled else "—", _ci(s, "theoretical_speedup"), _wall(s)])
    if not rows:
        return []
    return [Table("MT-Bench by turn (runs of every turn)",
                  ["config", "T", "turn", "samples", "prompt tokens", "tokens/step", "acceptance", "vs turn 1",
                   "theoretical x", "wall-clock x"], rows,
                  "a later turn's prompt is the conversation so far (the method's own earlier answers, so at T>0 "
                  "each method samples its own first answer, as Spec-Bench does), rendered through the chat "
                  "template and prefilled anew each turn (its KV is not carried over; the timing counts that "
                  "prefill); prompt tokens: the mean, history included; vs turn 1: acceptance minus turn 1's, its "
                  "interval over the questions that have both, redrawn together")]


def _mean_prompt(s: Summary) -> float:
    return sum(row.get("prompt_tokens", 0) for row, _ in s.units) / max(1, len(s.units))


def _moved(s: Summary, first: Summary) -> str:
    """s's acceptance minus `first`'s, with its paired interval ("—" for the first turn itself)."""
    if s is first or s.acceptance is None or first.acceptance is None:
        return "—"
    found, _ = paired_interval(s, first, "acceptance", lambda a, b: a - b)
    return f"{s.acceptance - first.acceptance:+.3f}" + ("" if found is None else " " + found.text("+.3f"))


def position_axes(overall: list[Summary]) -> dict:
    """Summaries with accepts per position, by their family's axis (PositionAxis), the axes in order of label."""
    found: dict = {}
    for s in overall:
        axis = s.reports.positions
        if axis is not None and s.position_drafts:
            found.setdefault(axis, []).append(s)
    return {axis: found[axis] for axis in sorted(found, key=lambda a: a.label)}


def acceptance_tables(overall: list[Summary]) -> list[Table]:
    tables = []
    for axis, shown in position_axes(overall).items():
        size = max(len(s.position_drafts) for s in shown)
        rows = [[_config(s), str(s.width), s.sampling] + [_ci(s, position(k)) for k in range(len(s.position_drafts))]
                + ["—"] * (size - len(s.position_drafts)) for s in shown]
        tables.append(Table(axis.title, ["config", "width", "T"] + [f"{axis.label} {k}" for k in range(size)], rows))
    return tables


def _reference_value(summaries: list[Summary], model: str, ref: Reference) -> str:
    """Ours for a paper reference, with its interval ("—": not measured at the paper's configuration)."""
    truncation = paper_truncation(ref.temperature)  # ours compare with the paper's only at its sampling
    if ref.dataset == MEAN:
        cells = [find(summaries, ref.method, ref.params, ref.temperature, d, model, truncation=truncation)
                 for d in DATASETS]
        if None in cells or any(getattr(c, ref.metric) is None for c in cells):
            return "—"
        return _mean_ci(cells, ref.metric)
    return _ci(find(summaries, ref.method, ref.params, ref.temperature, ref.dataset, model, truncation=truncation),
               ref.metric)


def reference_table(summaries: list[Summary]) -> list[Table]:
    """The paper's numbers beside ours for every model whose name matches the paper's."""
    rows = []
    models = sorted({s.model for s in summaries})
    for ref in REFERENCES:
        matching = [m for m in models if ref.matches_model(m)]
        ours = [(m, _reference_value(summaries, m, ref)) for m in matching] or [("—", "—")]
        for model, value in ours:
            sampling = sampling_label(ref.temperature, paper_truncation(ref.temperature))
            rows.append([ref.model, f"{ref.method} {_params(ref.params)}", sampling, ref.dataset,
                         ref.metric.replace("_", " "), f"{ref.value:.2f}", model, value, ref.source])
    return [Table("The paper's reference values beside ours",
                  ["paper model", "config", "T", "dataset", "metric", "paper", "our model", "ours", "source"], rows,
                  "paper: published numbers (not measured here); ours: this harness on a model whose name matches "
                  "(fill with `spd-bench sweep --preset paper --model <local Qwen3.5-4B folder>` on a GPU)")]


def simulation_table(overall: list[Summary]) -> list[Table]:
    """Configurations run both ways: how close the replay's acceptance is to executed decoding."""
    def key(s):
        return (s.model, s.method, _params(s.params), s.temperature, s.truncation, s.max_new_tokens, s.turns)
    executed = {key(s): s for s in overall if not s.simulated}
    rows = [[_config(e), str(e.width), e.sampling, f"{e.samples}/{s.samples}", _ci(e, "tokens_per_step", 3),
             _ci(s, "tokens_per_step", 3), _ci(e, "acceptance", 3), _ci(s, "acceptance", 3),
             _ci(s, "expected_acceptance", 3)]
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
    rows = [[_config(s), str(s.width), s.sampling, str(s.samples), _ci(s, "acceptance"),
             _ci(s, "tokens_per_step"), _ci(s, "l_acc"), _ci(s, "theoretical_speedup"), _wall(s),
             "—" if s.lossless_pct is None else f"{s.identical}/{s.checked}"] for s in overall]
    return Table("Measured acceptance and speedups (pooled over datasets)",
                 ["config", "width", "T", "samples", "acceptance", "tokens/step", "L'acc", "theoretical x",
                  "wall-clock x", "lossless"], rows)


def claims_table(summaries: list[Summary]) -> list[Table]:
    rows = [[v.claim, v.model, v.verdict, v.measured] for v in verdicts(summaries)]
    return [Table("The paper's claims, as measured here", ["claim", "model", "verdict", "measured"], rows,
                  "each claim tested on the records above (width 1, pooled over datasets; both sides executed, or "
                  "both simulated, never one of each): per comparison the difference second - first on the prompts "
                  "both ran, with its 95% paired bootstrap interval; agrees / disagrees when the interval excludes "
                  "no difference in / against the claimed direction, inconclusive otherwise (with the prompts per "
                  "dataset that would resolve it at the observed spread); drafters trained on a small budget make "
                  "these statements about them, not about the paper's drafters")]


def _phase(name: str) -> Figure:
    return lambda s: (s.cycle_breakdown or {}).get(name)


def breakdown_table(overall: list[Summary]) -> list[Table]:
    """Executed runs of families that time their steps' phases (Reports.cycle_breakdown), beside the speedups."""
    found = [(s, s.cycle_breakdown) for s in overall]
    found = [(s, ms) for s, ms in found if ms is not None]
    if not found:
        return []
    phases = list(found[0][1])
    rows = [[_config(s), s.sampling, str(s.width), str(s.steps)] + [_ci(s, _phase(p), 1) for p in phases]
            + [_ci(s, "theoretical_speedup", unit="x"), _ci(s, "modeled_speedup", unit="x"), _wall(s)]
            for s, _ in found]
    return [Table("Cycle wall breakdown", ["config", "T", "width", "cycles", *(f"{p} ms" for p in phases),
                                           "theoretical", "modeled", "wall-clock"], rows,
                  found[0][0].reports.breakdown_note)]


def _own(name: str) -> Figure:
    return lambda s: s.reports.figures(s).get(name)


def family_tables(overall: list[Summary]) -> list[Table]:
    """A table per method family with figures of its own (Reports.figures), one row per configuration."""
    found: dict[str, list[tuple[Summary, dict]]] = {}
    for s in overall:
        figures = s.reports.figures(s)
        if figures:
            found.setdefault(s.method, []).append((s, figures))
    tables = []
    for method, entries in found.items():
        names = list(entries[0][1])
        rows = [[_config(s), s.sampling, str(s.samples)] + [_ci(s, _own(n)) for n in names] + [s.engine or "—"]
                for s, _ in entries]
        tables.append(Table(f"{method} figures", ["config", "T", "samples", *names, "engine"], rows,
                            "; ".join(filter(None, [entries[0][0].reports.figures_note,
                                                    "engine: the dtype and kernels that timed it"]))))
    return tables


def lossless_table(overall: list[Summary]) -> list[Table]:
    rows = [[_config(s), str(s.width), s.sampling, str(s.checked), str(s.identical), str(s.flips), str(s.logic),
             ", ".join(f"q{q}@{i}{'~' if verdict == 'flip' else ''}" for q, i, verdict in s.divergences) or "—",
             s.engine or "—"]
            for s in overall if not s.simulated]
    return [Table("Losslessness", ["config", "width", "T", "checked", "identical", "numerics flips",
                                   "logic divergences", "first divergences", "engine"], rows,
                  "numerics flip (~): at the first divergence the method took its own target logits' argmax, a "
                  "near-tie within the difference between its verify forward's logits and AR's one-token step's, "
                  "of the size they differ by on the sample's earlier positions (harness/runtime/verdict.py); "
                  "any other divergence is a logic divergence")]


def detail_table(summaries: list[Summary]) -> Table:
    return Table("All configurations by dataset", list(COLUMNS), [_cells(s) for s in summaries])


def dataset_cell(s: Summary) -> str:
    """The dataset cell, with the turns protocol where it is not the first turn's."""
    return s.dataset + protocol_label(s.turns)


def _cells(s: Summary) -> list[str]:
    lossless = "—" if s.lossless_pct is None else f"{s.lossless_pct:.0f} ({s.identical}/{s.checked})"
    return [s.method, _params(s.params), s.model, s.sampling, dataset_cell(s), "yes" if s.simulated else "no",
            str(s.samples), str(s.new_tokens), str(s.steps), _ci(s, "tokens_per_step"), _ci(s, "l_acc"),
            _ci(s, "theoretical_speedup"), _ci(s, "modeled_speedup"), _wall(s),
            _ci(s, "tokens_per_second", 1), lossless, s.engine or "—"]


def missing_points(summaries: list[Summary]) -> list[GridPoint]:
    """Points of the paper grid with no record for any model in these results."""
    return [p for p in paper_grid()
            if find(summaries, p.method, p.param_dict, p.temperature, truncation=p.truncation) is None]


def tables(summaries: list[Summary]) -> list[Table]:
    overall = [s for s in summaries if s.dataset == OVERALL]
    return ([summary_table(overall)] + main_tables(summaries) + turns_table(summaries) + scaling_tables(summaries)
            + ablation_table(overall)
            + speedup_table(overall)
            + acceptance_tables(overall) + breakdown_table(overall) + family_tables(overall) + simulation_table(overall)
            + claims_table(summaries)
            + reference_table(summaries)
            + lossless_table(overall)
            + [detail_table(summaries)])
