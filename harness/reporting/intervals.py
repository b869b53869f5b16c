"""95% intervals by bootstrap over prompts, for every pooled figure and for the difference between two configurations.

A configuration's figure pools its samples (metrics.py). Its interval comes from RESAMPLES replicates that draw the
prompts again with replacement within each dataset (as many as that dataset has, so the pooled figure keeps its
weighting by dataset), pool each replicate the same way and take the 2.5th and 97.5th percentiles of the figure.
A paired comparison draws the same prompts for both configurations (the ones both ran), so the prompt-to-prompt
spread they share cancels in the difference. Seeds are fixed by configuration, so a report re-renders identically.
With fewer than MIN_PROMPTS prompts in a dataset an interval is marked unreliable: resampling three prompts says
little about the next thirty.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from harness.reporting.metrics import Summary

RESAMPLES = 400
MIN_PROMPTS = 5
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    low: float
    high: float
    prompts: int  # the fewest prompts of any dataset the figure pools

    @property
    def reliable(self) -> bool:
        return self.prompts >= MIN_PROMPTS

    def excludes(self, value: float) -> bool:
        return not self.low <= value <= self.high

    def text(self, form: str = ".2f") -> str:
        """"[low, high]"; an interval of too few prompts says so instead of printing a tight-looking one."""
        if not self.reliable:
            return f"[{self.prompts} prompt{'' if self.prompts == 1 else 's'}: too few]"
        return f"[{self.low:{form}}, {self.high:{form}}]"


def percentile_interval(values: list[float], prompts: int) -> Interval | None:
    """The central LEVEL share of replicate values; None when most replicates have no value."""
    values = [v for v in values if v is not None]
    if len(values) < RESAMPLES // 2:
        return None
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(values, [tail, 100 - tail])
    return Interval(float(low), float(high), prompts)


def _seed(*parts) -> int:
    """A seed from the configurations' identities (stable across processes, unlike hash())."""
    return zlib.crc32("|".join(map(str, parts)).encode())


def _redraws(sizes: dict[str, int], rng: np.random.Generator) -> list[np.ndarray]:
    """RESAMPLES times, how often each prompt is drawn when each dataset's prompts (`sizes`, in order, prompts
    numbered dataset by dataset) are drawn again with replacement, as many as it has."""
    offsets = np.cumsum([0, *sizes.values()])
    made = []
    for _ in range(RESAMPLES):
        counts = np.zeros(offsets[-1])
        for offset, size in zip(offsets, sizes.values()):
            np.add.at(counts, rng.integers(0, size, size) + offset, 1)
        made.append(counts)
    return made


SCALARS = ("samples", "new_tokens", "steps", "checked", "identical", "flips", "baseline_tokens", "baseline_decode_s")


def _leaves(s: Summary) -> dict[tuple, float]:
    """Everything a summary adds up over its samples, by path (a replicate's figures are functions of these)."""
    out = {("", name): getattr(s, name) for name in SCALARS}
    out |= {("timing", key): value for key, value in s.timing.items()}
    out |= {("drafts", i): value for i, value in enumerate(s.position_drafts)}
    out |= {("accepts", i): value for i, value in enumerate(s.position_accepts)}
    if s.stats is not None:
        out |= {("stats", *path): value for path, value in s.stats.leaves().items()}
    return out


class _Pool:
    """A summary's prompts as rows of numbers (each the sum over the samples that decoded it), so that a replicate's
    sums are one weighted sum of rows."""

    def __init__(self, summary: Summary, groups: list[list]):
        self.template, self.groups = summary, groups
        leaves = []
        for group in groups:
            one = summary.empty()
            for unit in group:
                one.add_unit(unit)
            leaves.append(_leaves(one))
        self.keys = sorted({key for found in leaves for key in found}, key=str)
        self.matrix = np.array([[found.get(key, 0.0) for key in self.keys] for found in leaves], dtype=float)

    def replicate(self, counts: np.ndarray) -> Summary:
        """The summary of the prompts taken `counts[i]` times each."""
        values = dict(zip(self.keys, counts @ self.matrix))
        replica = self.template.empty()
        for name in SCALARS:
            setattr(replica, name, values.get(("", name), 0.0))
        replica.timing.update({key[1]: v for key, v in values.items() if key[0] == "timing"})
        replica.position_drafts = [values[("drafts", i)] for i in range(len(self.template.position_drafts))]
        replica.position_accepts = [values[("accepts", i)] for i in range(len(self.template.position_accepts))]
        if self.template.stats is not None:
            replica.stats = self.template.stats.with_leaves({key[1:]: v for key, v in values.items()
                                                             if key[0] == "stats"})
        replica.units = [unit for group, count in zip(self.groups, counts) for _ in range(int(count))
                         for unit in group]
        replica.lengths = [(row["new_tokens"], row["steps"]) for row, _ in replica.units]
        return replica


_CACHE: dict[tuple, tuple[object, object]] = {}  # ids -> (the objects, kept alive so ids stay theirs; what was made)


def _replicates(summary: Summary) -> tuple[list[Summary], int]:
    """RESAMPLES summaries of the configuration over prompts redrawn within each dataset, and its fewest prompts of
    any dataset."""
    key = (id(summary),)
    if key not in _CACHE:
        rng = np.random.default_rng(_seed(summary.config_key, summary.model, summary.dataset, summary.simulated))
        by_dataset = summary.prompts()
        pool = _Pool(summary, [group for found in by_dataset.values() for group in found])
        sizes = {dataset: len(found) for dataset, found in by_dataset.items()}
        made = [pool.replicate(counts) for counts in _redraws(sizes, rng)]
        _CACHE[key] = (summary, (made, min(sizes.values(), default=0)))
    return _CACHE[key][1]


def replicates(summary: Summary) -> list[Summary]:
    """RESAMPLES summaries of the configuration over prompts redrawn within each dataset."""
    return _replicates(summary)[0]


Figure = Callable[[Summary], "float | None"]


def getter(figure: str | Figure) -> Figure:
    """A figure of a summary: a property name, or a function of the summary."""
    return figure if callable(figure) else (lambda s: getattr(s, figure))


def position(k: int) -> Figure:
    """The acceptance at draft position (or fill level) k."""
    return lambda s: s.position_acceptance[k] if k < len(s.position_drafts) else None


def interval(summary: Summary, figure: str | Figure) -> Interval | None:
    """The 95% interval of one of the summary's figures (see `getter`)."""
    if summary.samples == 0:
        return None
    get = getter(figure)
    made, prompts = _replicates(summary)
    return percentile_interval([get(r) for r in made], prompts)


def paired(a: Summary, b: Summary) -> tuple[list[Summary], list[Summary], int]:
    """Replicates of two configurations over the same redrawn prompts (those both ran), and the fewest prompts of any
    dataset they share."""
    key = (id(a), id(b))
    if key not in _CACHE:
        units_a, units_b = a.units_by_prompt(), b.units_by_prompt()
        common: dict[str, list] = {}
        for prompt in sorted(set(units_a) & set(units_b)):
            common.setdefault(prompt[0], []).append(prompt)
        prompts = [p for found in common.values() for p in found]
        pools = _Pool(a, [units_a[p] for p in prompts]), _Pool(b, [units_b[p] for p in prompts])
        rng = np.random.default_rng(_seed(a.config_key, b.config_key, a.model, a.dataset, a.simulated, b.simulated))
        draws = _redraws({d: len(p) for d, p in common.items()}, rng) if prompts else []
        made = ([pools[0].replicate(c) for c in draws], [pools[1].replicate(c) for c in draws])
        _CACHE[key] = ((a, b), (made, min((len(p) for p in common.values()), default=0)))
    (made_a, made_b), prompts = _CACHE[key][1]
    return made_a, made_b, prompts


def paired_interval(a: Summary, b: Summary, figure: str, change: Callable[[float, float], float]
                    ) -> tuple[Interval | None, int]:
    """The 95% interval of `change(a's figure, b's figure)` over the prompts both ran, redrawn together (replicates
    where either figure is missing, or the change is undefined, have no value), and the fewest shared prompts of any
    dataset."""
    replicas_a, replicas_b, prompts = paired(a, b)
    values = []
    for ra, rb in zip(replicas_a, replicas_b):
        first, second = getattr(ra, figure), getattr(rb, figure)
        try:
            values.append(None if first is None or second is None else change(first, second))
        except ZeroDivisionError:
            values.append(None)
    return (percentile_interval(values, prompts) if replicas_a else None), prompts


def time_ratio_interval(slower: list[float], faster: list[float], datasets: list[str], key: str
                        ) -> tuple[float, Interval]:
    """sum(slower) / sum(faster) over paired per-prompt seconds (> 1: `faster` is faster) and its 95% interval,
    each dataset's prompts (`datasets[i]` names prompt i's) redrawn within it."""
    sizes = dict(Counter(datasets))
    order = sorted(range(len(datasets)), key=lambda i: list(sizes).index(datasets[i]))  # dataset by dataset
    a, b = np.array(slower)[order], np.array(faster)[order]
    draws = _redraws(sizes, np.random.default_rng(_seed("time-ratio", key)))
    values = [float(c @ a / (c @ b)) for c in draws]
    return float(a.sum() / b.sum()), percentile_interval(values, min(sizes.values()))
