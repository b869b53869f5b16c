"""Report figures (matplotlib, PNG): acceptance per position on each family's axis, accepted-length histograms of
draft-then-verify rounds, theoretical vs measured speedups and the cycle wall breakdown per executed configuration,
and the paper's scaling figures (reporting/paper.py)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

from harness.reporting.intervals import getter, interval, position  # noqa: E402
from harness.reporting.metrics import Block, Summary, config_label, family, find  # noqa: E402
from harness.reporting.paper import ScalingFigure  # noqa: E402
from methods.capabilities import Reports, offered  # noqa: E402
from methods.rounds import DRAFT_POSITIONS  # noqa: E402


def _label(s: Summary) -> str:
    """The table's name of the configuration, with the width and sampling a figure's rows mix."""
    return f"{config_label(s)} width={s.width} T={s.sampling}"


def _preferred(summaries: list[Summary]) -> list[Summary]:
    """One summary per model and configuration: the executed one where it was also simulated."""
    chosen = (find(summaries, s.method, s.params, s.temperature, s.dataset, s.model, truncation=s.truncation,
                   turns=s.turns) for s in summaries)
    return list({id(s): s for s in chosen}.values())


def acceptance(summaries: list[Summary], path: Path, axes: dict) -> Path | None:
    """Acceptance rate per position, one column of panels per family axis (`axes`: the report's position_axes),
    one row per (T, width), one line per configuration."""
    preferred = {id(s) for s in _preferred(summaries)}
    axes = {axis: [s for s in shown if id(s) in preferred] for axis, shown in axes.items()}
    panels = _panels([s for shown in axes.values() for s in shown])
    if not panels:
        return None
    fig, grid = plt.subplots(len(panels), len(axes), figsize=(6.5 * len(axes), 3.6 * len(panels)), squeeze=False)
    for block, row in zip(panels, grid):
        for ax, (axis, shown) in zip(row, axes.items()):
            for s in shown:
                if s.block == block:
                    rates = [float("nan") if a is None else a for a in s.position_acceptance]
                    line, = ax.plot(range(len(rates)), rates, marker="o", label=config_label(s))
                    below, above = _band(s)
                    ax.fill_between(range(len(rates)), below, above, color=line.get_color(), alpha=0.15)
            ax.set_title(block.title)
            ax.set_xlabel(axis.name)
            ax.set_ylabel("acceptance rate")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def accepted_lengths(rows: list[dict], path: Path) -> Path | None:
    """Histogram of tokens committed per round of the draft-then-verify methods (the families whose positions are a
    round's drafts; a pipeline cycle commits at most one), T=0, from executed records where the configuration was also
    simulated."""
    groups: dict[str, dict[bool, Counter]] = {}
    for row in rows:
        if row["temperature"] == 0 and offered(family(row["method"]), Reports).positions is DRAFT_POSITIONS:
            name = f"{row['method']} " + " ".join(f"{k}={v}" for k, v in sorted(row["params"].items()))
            counts = groups.setdefault(name, {}).setdefault(bool(row.get("simulated")), Counter())
            counts.update(a for a in row["accepted"] if a > 0)
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(groups)
    lengths: set[int] = set()
    for i, (name, kinds) in enumerate(sorted(groups.items())):
        counts = kinds[min(kinds)]  # executed (False) before simulated (True)
        total = sum(counts.values())
        xs = sorted(counts)
        lengths.update(xs)
        ax.bar([x + i * width for x in xs], [counts[x] / total for x in xs], width=width, label=name)
    ax.set_xticks([x + (len(groups) - 1) * width / 2 for x in sorted(lengths)], sorted(lengths))
    ax.set_xlabel("tokens committed per round")
    ax.set_ylabel("share of rounds")
    ax.legend(fontsize=7)
    return _save(fig, path)


SPEEDUPS = (("theoretical", "theoretical_speedup"), ("modeled", "modeled_speedup"),
            ("wall-clock (median paired)", "wall_clock_median"))


def speedup_rows(summaries: list[Summary]) -> list[Summary]:
    """The executed configurations with any speedup figure (prompt lookup, say, has a wall-clock one alone)."""
    return [s for s in summaries if s.method != "autoregressive" and not s.simulated
            and any(getter(attr)(s) is not None for _, attr in SPEEDUPS)]


def speedups(summaries: list[Summary], path: Path) -> Path | None:
    """Theoretical, modeled multi-device and wall-clock speedup per executed configuration (overall rows)."""
    shown = speedup_rows(summaries)
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.4 * len(shown)))
    for k, (name, attr) in enumerate(SPEEDUPS):
        ys = [i + (k - 1) * 0.27 for i in range(len(shown))]
        values, errors = _with_errors(shown, attr)
        ax.barh(ys, [v or 0.0 for v in values], height=0.27, xerr=errors, label=name,
                error_kw={"elinewidth": 0.8, "capsize": 1.5})
        for y, value in zip(ys, values):
            if value is None:  # a missing bar says so where it would be
                ax.annotate("none", (0.01, y), fontsize=5, va="center", color="gray")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(shown)), [_label(s) for s in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup over AR (error bars: 95% bootstrap interval over prompts)")
    ax.legend(fontsize=7)
    fig.text(0.01, 0.0, "none: the family has no such figure (modeled: no timing model of its own) or the run timed "
                        "nothing", fontsize=6, color="gray")
    return _save(fig, path)


def _with_errors(shown: list[Summary], figure) -> tuple[list, list[list[float]]]:
    """Each summary's figure and its interval as matplotlib's [below, above] error lengths (0 where none)."""
    values, below, above = [], [], []
    for s in shown:
        value = getter(figure)(s)
        found = None if value is None else interval(s, figure)
        values.append(value)
        below.append(max(0.0, value - found.low) if found else 0.0)
        above.append(max(0.0, found.high - value) if found else 0.0)
    return values, [below, above]


def cycle_breakdown(summaries: list[Summary], path: Path) -> Path | None:
    """Stacked ms per cycle of each executed configuration whose family times its phases (Reports.cycle_breakdown):
    its serial phases, the ones before "cycle" (which they add up to)."""
    shown = [(s, s.cycle_breakdown) for s in summaries]
    shown = [(s, ms) for s, ms in shown if ms is not None]
    if not shown:
        return None
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.4 * len(shown)))
    left = [0.0] * len(shown)
    names = list(shown[0][1])
    for phase in names[: names.index("cycle")]:
        values = [max(ms[phase], 0.0) for _, ms in shown]
        ax.barh(range(len(shown)), values, left=left, label=phase)
        left = [a + b for a, b in zip(left, values)]
    ax.set_yticks(range(len(shown)), [_label(s) for s, _ in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms per cycle (driver)")
    ax.legend(fontsize=7)
    return _save(fig, path)


def _panels(summaries: list[Summary]) -> list[Block]:
    return sorted({s.block for s in summaries})


def _band(s: Summary) -> tuple[list[float], list[float]]:
    """The 95% interval of the acceptance at each position (nan where there is none)."""
    low, high = [], []
    for k in range(len(s.position_drafts)):
        found = interval(s, position(k))
        low.append(found.low if found else float("nan"))
        high.append(found.high if found else float("nan"))
    return low, high


def _series(summaries: list[Summary], method: str, fixed: dict, axis: str, block: Block
            ) -> tuple[list, list, list[list[float]]]:
    """(x, theoretical speedup, its error lengths) along `axis` for one method at fixed parameters; executed runs
    before simulated."""
    fixed = {**fixed, "width": block.width}
    t, truncation = block.temperature, block.truncation
    values = {s.params[axis] for s in summaries if axis in s.params and s.matches(method, fixed, t, truncation)}
    found = {x: find(summaries, method, {**fixed, axis: x}, t, truncation=truncation) for x in values}
    xs = sorted(x for x, s in found.items() if s.theoretical_speedup is not None)
    ys, errors = _with_errors([found[x] for x in xs], "theoretical_speedup")
    return xs, ys, errors


def _grid_of_panels(panels: list, draw, xlabel: str, path: Path, ticks: list[int]) -> Path | None:
    """One panel per block (T, width), two per row, integer ticks on the x axis."""
    if not panels:
        return None
    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, min(2, len(panels)), figsize=(10 if len(panels) > 1 else 5, 3.8 * rows),
                             squeeze=False)
    drawn = False
    for ax, block in zip(axes.flat, panels):
        drawn |= draw(ax, block)
        ax.set_title(block.title)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("theoretical speedup")
        ax.set_xticks(ticks)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if not drawn:
        plt.close(fig)
        return None
    return _save(fig, path)


def scaling(spec: ScalingFigure, summaries: list[Summary], path: Path) -> Path | None:
    """One of the paper's figures: theoretical speedup along a parameter, a panel per (T, width)."""
    def draw(ax, block) -> bool:
        for series in spec.lines:
            xs, ys, errors = _series(summaries, series.method, series.fixed, series.axis, block)
            if xs:
                ax.errorbar(xs, ys, yerr=errors, marker="o", capsize=2, label=series.label)
        for series in spec.levels:
            xs, ys, _ = _series(summaries, series.method, series.fixed, series.axis, block)
            for x, y in zip(xs, ys):
                ax.axhline(y, linestyle="--", linewidth=1, color="gray")
                ax.annotate(f"{series.label}={x}", (spec.ticks[0], y), fontsize=7, va="bottom")
        return bool(ax.lines)

    return _grid_of_panels(_panels(summaries), draw, spec.xlabel, path, spec.ticks)


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # legends placed beside the axes stay in the picture
    plt.close(fig)
    return path


def _curve_label(row: dict) -> str:
    """The drafter, and the ranks its curve was trained on where that was not one process (in order, e.g. 2 -> 1
    for a data-parallel run resumed on one process)."""
    label = f"{row['method']} {row['config_key'].split('-', 1)[-1]}"
    worlds = [point.get("world_size", 1) for point in row["curve"]]
    changes = [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]]
    return label if changes == [1] else f"{label} ({' then '.join(map(str, changes))} ranks)"


def learning_curves(train_rows: list[dict], path: Path) -> Path | None:
    """Validation against target tokens seen, one line per drafter: top-1 on held-out text (left) and the replayed
    decoding's acceptance on held-out prompts (right)."""
    curves = [(_curve_label(r), r["curve"]) for r in train_rows if r.get("curve")]
    if not curves:
        return None
    fig, (text, decoding) = plt.subplots(1, 2, figsize=(11, 4), squeeze=True)
    for label, curve in curves:
        tokens = [point["tokens"] / 1000 for point in curve]
        text.plot(tokens, [point["top1"] for point in curve], marker="o", label=label)
        if all("decoding" in point for point in curve):
            decoding.plot(tokens, [point["decoding"]["acceptance"] for point in curve], marker="o", label=label)
    for ax, title in ((text, "top-1 on held-out text"), (decoding, "decoding acceptance on held-out prompts")):
        ax.set_xlabel("target tokens seen (thousands)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    text.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
