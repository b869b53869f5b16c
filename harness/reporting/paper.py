"""The paper: its evaluation grid (`spd-bench sweep --preset paper`), its published reference numbers, which the
report prints beside ours wherever model and configuration match, and its qualitative claims, each checked against
the records: what was measured and whether it agrees.

A claim compares configurations pooled over datasets at width 1, per model, at the paper's sampling (T=1: top-k 50,
top-p 0.95), measured the same way where it can (all executed, else all simulated). Its verdict is "agrees",
"disagrees", "mixed" (some comparisons each way) or "not measured" with the runs that would measure it; the figures
compared are printed beside it either way.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from harness.bench.sweep import GridPoint
from harness.reporting.intervals import MIN_PROMPTS, Interval, paired_interval
from harness.reporting.metrics import OVERALL, Summary, find, params_label
from methods.sampling import NO_TRUNCATION

MEAN = "mean"
FLAGSHIP = "spd"  # the paper's method: what `spd-bench train` trains unless told otherwise
GRID = "EAGLE-3 m 3/7/15, PPSD n 4/8/16, SPD n 4/8/16 x Ls 1-4 (+ output ablation), T 0/1, width 1/4"

# The paper's metrics as the report defines them (the notes under its tables).
DEFINITIONS = """\
tokens/step: tau (draft-then-verify) or alpha (pipeline: tokens per cycle); L'acc = alpha * L / largest stage.
theoretical x: input schedule alpha*L/max(largest stage, Ls), output schedule alpha*L/(largest stage + Ls),
EAGLE-3 tau*L/(Ls*m + L) (tokens/step excludes each sample's prefill token).
modeled x: the same with measured stage / drafter / verification-head times (one device per stage).
wall-clock x: the median over samples of the sample's decode tok/s over AR's on the same prompt, AR timed
beside it in the same run (n: the samples it rests on); a single-process pipeline runs its stages one after
another, so this is below 1 by construction. The paper's reference values compare the pooled ratio, as it reports.
(sim): acceptance replayed on the AR output from one teacher-forced pass (`--simulate`): exact at T=0, expected
acceptance at T>0; no timings and no losslessness check of its own.
lossless %: samples token-identical to greedy AR among those checked (T=0); T>0 is covered by distribution tests.
"""


# --- the paper's tables and figures over its axes ---------------------------------------------------------------------
@dataclass(frozen=True)
class Axes:
    """A scaling table: one method's cells over one of its parameters (rows), or two (rows x columns), the others
    fixed; the report draws one per (T, width) block that has any of its cells."""

    title: str
    method: str
    rows: tuple[str, tuple]  # (parameter, values)
    columns: tuple[str, tuple, str] | None = None  # (parameter, values, its name in the header)
    fixed: dict = field(default_factory=dict, hash=False)


SCALING = (
    Axes("SPD (input schedule) over n and Ls", "spd", ("n", (4, 8, 16)), ("ls", (1, 2, 3, 4), "Ls"),
         {"schedule": "input"}),
    Axes("EAGLE-3 over m", "eagle3", ("m", (3, 7, 15))),
    Axes("PPSD over n", "ppsd", ("n", (4, 8, 16))),
)


@dataclass(frozen=True)
class Ablation:
    """Configurations that differ in one parameter only, side by side (rows named by `label`'s parameters)."""

    title: str
    parameter: str
    values: tuple[str, str]
    label: tuple[str, ...]
    metric: str  # what tokens/step is called for these methods


ABLATION = Ablation("Schedule ablation: input vs output state", "schedule", ("input", "output"), ("n", "ls"), "alpha")


@dataclass(frozen=True)
class Series:
    """A line of theoretical speedup along one parameter of a method, the others fixed."""

    label: str
    method: str
    fixed: dict
    axis: str


@dataclass(frozen=True)
class ScalingFigure:
    title: str
    file: str
    xlabel: str
    lines: list[Series]
    levels: list[Series]  # drawn as flat reference lines, one per value along their axis
    ticks: list[int]


def _values(summaries: list[Summary], methods: tuple[str, ...], parameter: str) -> list:
    return sorted({s.params[parameter] for s in summaries if s.method in methods and parameter in s.params})


def scaling_figures(summaries: list[Summary]) -> list[ScalingFigure]:
    """Theoretical speedup vs pipeline stages n (SPD per Ls and PPSD as lines, EAGLE-3 per m as flat references) and
    SPD (input schedule) vs drafter depth Ls, one line per n."""
    over_n = [Series(f"SPD Ls={ls}", "spd", {"ls": ls, "schedule": "input"}, "n")
              for ls in _values(summaries, ("spd",), "ls")] + [Series("PPSD", "ppsd", {}, "n")]
    over_ls = [Series(f"SPD n={n}", "spd", {"n": n, "schedule": "input"}, "ls")
               for n in _values(summaries, ("spd",), "n")]
    return [ScalingFigure("Theoretical speedup vs n", "speedup_over_n.png", "pipeline stages n", over_n,
                          [Series("EAGLE-3 m", "eagle3", {}, "m")],
                          sorted(set(_values(summaries, ("spd", "ppsd"), "n")) | {4, 8, 16})),
            ScalingFigure("SPD over Ls", "spd_over_ls.png", "drafter layers Ls", over_ls, [], [1, 2, 3, 4])]


def paper_grid() -> list[GridPoint]:
    """EAGLE-3 m in {3, 7, 15}; PPSD n in {4, 8, 16}; SPD n in {4, 8, 16} x Ls in {1..4} (input schedule) plus the
    output-state ablation at n=16, Ls=4; each at T in {0, 1} (T=1 with the reference's top-k and top-p) and draft
    width in {1, 4}."""
    configs = [("eagle3", {"m": m}) for m in (3, 7, 15)]
    configs += [("ppsd", {"n": n, "ls": 1, "schedule": "output"}) for n in (4, 8, 16)]
    configs += [("spd", {"n": n, "ls": ls, "schedule": "input"}) for n in (4, 8, 16) for ls in (1, 2, 3, 4)]
    configs += [("spd", {"n": 16, "ls": 4, "schedule": "output"})]
    return [replace(GridPoint.of(method, t, **params, width=w), **(PAPER_SAMPLING if t > 0 else {}))
            for t in (0, 1) for w in (1, 4) for method, params in configs]


# The reference samples at T=1 from the top 50 tokens within top-p 0.95, on target and drafter alike (the verifiers
# compare the truncated distributions, so decoding stays lossless with respect to the truncated target).
PAPER_SAMPLING = {"top_k": 50, "top_p": 0.95}


def paper_truncation(temperature: float) -> tuple[int, float]:
    """The (top-k, top-p) of the paper's runs at a temperature."""
    return (PAPER_SAMPLING["top_k"], PAPER_SAMPLING["top_p"]) if temperature > 0 else NO_TRUNCATION


@dataclass(frozen=True)
class Reference:
    """A number the paper reports, for a model, configuration, dataset (or the mean over the three) and metric."""

    model: str  # matched against our model's name, ignoring case and punctuation
    method: str
    params: dict = field(hash=False)
    temperature: float
    dataset: str
    metric: str  # a Summary property: l_acc, theoretical_speedup, reference_theoretical, wall_clock_speedup
    value: float
    source: str

    def matches_model(self, name: str) -> bool:
        return _norm(self.model) in _norm(name)


def _norm(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


MAIN = "paper, main table (4B, mean of MT-Bench/GSM8K/HumanEval)"


def _chain(method: str, **params) -> dict:
    defaults = {"ls": 1, "schedule": "output"} if method == "ppsd" else {"schedule": "input"} if method == "spd" else {}
    return {**defaults, **params, "width": 1}


# The reference repository's BENCHMARK_RESULTS (v11, width 1, 80 prompts per dataset, 512 tokens), per model,
# configuration and temperature: (theoretical, wall-clock on n+1 GPUs vs one-GPU AR).
REPO_ROWS = (
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=3), 0, 2.47, 1.88),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=7), 0, 2.72, 1.97),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=15), 0, 2.39, 1.62),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=4), 0, 1.54, 1.28),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=8), 0, 1.68, 1.25),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=16), 0, 1.40, 0.89),
    ("Qwen3.5-4B", "spd", _chain("spd", n=4, ls=4), 0, 2.64, 2.27),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=4), 0, 3.51, 2.41),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=3), 0, 3.39, 2.53),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=2), 0, 3.32, 2.47),
    ("Qwen3.5-4B", "spd", _chain("spd", n=16, ls=2), 0, 3.70, 1.43),
    ("Qwen3.5-4B", "eagle3", _chain("eagle3", m=7), 1, 2.06, 1.46),
    ("Qwen3.5-4B", "ppsd", _chain("ppsd", n=8), 1, 1.44, 0.95),
    ("Qwen3.5-4B", "spd", _chain("spd", n=4, ls=4), 1, 2.48, 1.95),
    ("Qwen3.5-4B", "spd", _chain("spd", n=8, ls=3), 1, 3.05, 2.05),
    ("Qwen3.5-9B", "eagle3", _chain("eagle3", m=7), 0, 3.17, 2.54),
    ("Qwen3.5-9B", "spd", _chain("spd", n=8, ls=3), 0, 3.61, 2.67),
    ("Qwen3.5-9B", "spd", _chain("spd", n=4, ls=4), 0, 2.70, 2.32),
)
REPO = ("paper's reference code v11 (T=0 overall; pipeline theoretical = its n * N / S per-sample mean; wall-clock "
        "on n+1 GPUs vs one-GPU AR)")
REPO_T1 = "paper's reference code v11 (T=1 with top-k 50, top-p 0.95; otherwise as at T=0)"
REFERENCES = (
    Reference("Qwen3.5-4B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, 1, MEAN, "l_acc", 3.43, MAIN),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 4}, 1, MEAN, "theoretical_speedup", 2.79, MAIN),
    Reference("Qwen3.5-4B", "ppsd", {"n": 8, "ls": 1, "schedule": "output", "width": 4},
              1, MEAN, "theoretical_speedup", 1.67, MAIN),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 4}, 0, MEAN, "theoretical_speedup", 3.61, MAIN),
    Reference("Qwen3.5-4B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4}, 0, MEAN, "l_acc", 2.91, MAIN),
    Reference("Qwen3.5-9B", "spd", {"n": 8, "ls": 4, "schedule": "input", "width": 4},
              1, "humaneval", "l_acc", 5.97, "paper, 9B HumanEval"),
    Reference("Qwen3.5-4B", "eagle3", {"m": 7, "width": 1},
              0, MEAN, "theoretical_speedup", 2.72, "paper, EAGLE-3 over m"),
    Reference("Qwen3.5-4B", "eagle3", {"m": 15, "width": 1},
              0, MEAN, "theoretical_speedup", 2.39, "paper, EAGLE-3 over m"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "output", "width": 4},
              1, MEAN, "l_acc", 4.78, "paper, ablation (raw acceptance)"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "output", "width": 4},
              1, MEAN, "theoretical_speedup", 2.39, "paper, ablation"),
    Reference("Qwen3.5-4B", "spd", {"n": 16, "ls": 4, "schedule": "input", "width": 4},
              1, MEAN, "theoretical_speedup", 3.44, "paper, ablation"),
    *(entry for model, method, params, t, theoretical, wall in REPO_ROWS for entry in (
        Reference(model, method, params, t, "overall",
                  "theoretical_speedup" if method == "eagle3" else "reference_theoretical", theoretical,
                  REPO if t == 0 else REPO_T1),
        Reference(model, method, params, t, "overall", "wall_clock_speedup", wall, REPO if t == 0 else REPO_T1))),
)


# --- the paper's claims, checked on the records -----------------------------------------------------------------------
@dataclass(frozen=True)
class Comparison:
    """Two configurations measured the same way (both executed or both simulated) and the direction the claim gives
    a figure from the first to the second."""

    label: str
    first: Summary
    second: Summary
    figure: str  # a Summary property
    rises: bool  # the claim: the second's figure is higher (False: lower)


@dataclass(frozen=True)
class Test:
    """A comparison tested on the prompts both ran: the difference second - first, its paired bootstrap interval."""

    comparison: Comparison
    difference: float
    interval: Interval | None
    prompts: int  # the fewest shared prompts of any dataset

    @property
    def verdict(self) -> str:
        """"agrees" when the interval excludes no difference in the claimed direction, "disagrees" when it excludes
        it the other way, "inconclusive" otherwise (or on too few prompts to trust an interval)."""
        found = self.interval
        if found is None or not found.reliable or not found.excludes(0.0):
            return "inconclusive"
        return "agrees" if (found.low > 0) == self.comparison.rises else "disagrees"

    @property
    def prompts_needed(self) -> int | None:
        """Prompts per dataset that would resolve an inconclusive test at the observed spread: the interval narrows
        as one over the square root of the prompts, until its half-width is the difference."""
        found = self.interval
        if self.verdict != "inconclusive" or found is None or self.difference == 0:
            return None
        half = (found.high - found.low) / 2
        return max(MIN_PROMPTS, math.ceil(self.prompts * (half / abs(self.difference)) ** 2))

    def text(self) -> str:
        c, found = self.comparison, self.interval
        figures = f"{_value(c.first, c.figure)} -> {_value(c.second, c.figure)}"
        spread = "" if found is None else f" [{found.low:+.2f}, {found.high:+.2f}]"
        needed = self.prompts_needed
        return (f"{c.label}: {figures}, difference {self.difference:+.2f}{spread} on {self.prompts} prompts per "
                f"dataset, {self.verdict}" + (f" (about {needed} would resolve it)" if needed else ""))


def paired_test(comparison: Comparison) -> Test:
    first, second = comparison.first, comparison.second
    found, prompts = paired_interval(first, second, comparison.figure, lambda a, b: b - a)
    return Test(comparison, getattr(second, comparison.figure) - getattr(first, comparison.figure), found, prompts)


@dataclass(frozen=True)
class Claim:
    text: str
    compare: Callable[[list[Summary], str], list[Comparison]]  # (summaries, model) -> comparisons found
    measure: str  # the runs that measure it


@dataclass
class Verdict:
    claim: str
    model: str
    measured: str
    verdict: str


def _value(s: Summary, metric: str) -> str:
    return f"{getattr(s, metric):.2f}" + (" (sim)" if s.simulated else "")


def _spd(n: int, ls: int, schedule: str) -> dict:
    return {"n": n, "ls": ls, "schedule": schedule, "width": 1}


def _pair(summaries: list[Summary], model: str, method: str, params: tuple[dict, dict], temperature: float
          ) -> tuple[Summary | None, Summary | None]:
    """Two configurations measured the same way: both executed, else both simulated; never one of each."""
    truncation = paper_truncation(temperature)
    for simulated in (False, True):
        first, second = (find(summaries, method, p, temperature, model=model, simulated=simulated,
                              truncation=truncation) for p in params)
        if first and second:
            return first, second
    return None, None


def _lacc_rises_with_n(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for ls in (1, 2, 3, 4):
        four, eight = _pair(summaries, model, "spd", (_spd(4, ls, "input"), _spd(8, ls, "input")), 0.0)
        if four and eight and four.l_acc is not None and eight.l_acc is not None:
            out.append(Comparison(f"Ls={ls}: L'acc n=4 -> n=8", four, eight, "l_acc", rises=True))
    return out


def _output_schedule_tradeoff(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for n in (4, 8, 16):
        for ls in (1, 2, 3, 4):
            inp, outp = _pair(summaries, model, "spd", (_spd(n, ls, "input"), _spd(n, ls, "output")), 0.0)
            if inp and outp and None not in (inp.tokens_per_step, outp.tokens_per_step):
                out += [Comparison(f"n={n} Ls={ls}: alpha input -> output", inp, outp, "tokens_per_step", rises=True),
                        Comparison(f"n={n} Ls={ls}: theoretical x input -> output", inp, outp,
                                   "theoretical_speedup", rises=False)]
    return out


def _best(summaries: list[Summary], model: str, method: str, temperature: float, simulated: bool
          ) -> Summary | None:
    found = [s for s in summaries if s.model == model and s.dataset == OVERALL and s.method == method
             and s.temperature == temperature and s.truncation == paper_truncation(temperature) and s.width == 1
             and s.simulated == simulated and s.theoretical_speedup is not None]
    return max(found, key=lambda s: s.theoretical_speedup, default=None)


def _name(s: Summary) -> str:
    return f"{s.method} {params_label(s.params)}"


def _order_at_t1(summaries: list[Summary], model: str) -> list[Comparison]:
    for simulated in (False, True):  # all three executed, else all three simulated
        best = [_best(summaries, model, m, 1.0, simulated) for m in ("spd", "eagle3", "ppsd")]
        if all(s is not None for s in best):
            break
    else:
        return []
    return [Comparison(f"best of each, theoretical x {_name(low)} -> {_name(high)}", low, high,
                       "theoretical_speedup", rises=True) for high, low in zip(best, best[1:])]


def _eagle_m7_over_m15(summaries: list[Summary], model: str) -> list[Comparison]:
    out = []
    for temperature in (0.0, 1.0):
        seven, fifteen = _pair(summaries, model, "eagle3", ({"m": 7, "width": 1}, {"m": 15, "width": 1}), temperature)
        if seven and fifteen:
            out.append(Comparison(f"T={temperature:g}: theoretical x m=15 -> m=7", fifteen, seven,
                                  "theoretical_speedup", rises=True))
    return out


CLAIMS = (
    Claim("L'acc rises from n=4 to n=8 (SPD, input schedule, T=0)", _lacc_rises_with_n,
          "spd-bench sweep --method spd --n 4,8 --ls 1,2,3,4 --temperature 0"),
    Claim("The output schedule has higher alpha but lower theoretical speedup than the input schedule (SPD, T=0)",
          _output_schedule_tradeoff, "spd-bench sweep --method spd --n 8 --ls 4 --schedule input,output"),
    Claim("At T=1: SPD > EAGLE-3 > PPSD (theoretical speedup, best configuration of each)", _order_at_t1,
          "spd-bench sweep --method spd,eagle3,ppsd --temperature 1 --top-k 50 --top-p 0.95"),
    Claim("EAGLE-3 m=7 beats m=15 (theoretical speedup)", _eagle_m7_over_m15,
          "spd-bench sweep --method eagle3 --m 7,15"),
)


def combined(tests: list[Test]) -> str:
    """A claim's verdict from its tests: all agree, all disagree, some each way (mixed), else inconclusive."""
    verdicts = {t.verdict for t in tests}
    if verdicts == {"agrees"} or verdicts == {"disagrees"}:
        return verdicts.pop()
    return "mixed" if {"agrees", "disagrees"} <= verdicts else "inconclusive"


def verdicts(summaries: list[Summary]) -> list[Verdict]:
    """Every claim on every model with records (a claim with no records on any model is listed once)."""
    models = sorted({s.model for s in summaries}) or ["—"]
    out = []
    for claim in CLAIMS:
        for model in models:
            comparisons = claim.compare(summaries, model)
            if not comparisons:
                out.append(Verdict(claim.text, model, f"not measured: `{claim.measure}`", "not measured"))
                continue
            tests = [paired_test(c) for c in comparisons]
            out.append(Verdict(claim.text, model, "; ".join(t.text() for t in tests), combined(tests)))
    return out
