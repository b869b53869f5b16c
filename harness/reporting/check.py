"""Regression check: a configuration's figures and losslessness against a committed baseline, within measured noise.

A baseline is a JSON list with one entry per configuration (overall over its datasets): its label, how to run it again
(`--rerun`: method, parameters, sampling, lengths, dtype, the question ids per dataset and the seeds it was measured
at), each checked figure (tokens/step and the draft acceptance rate) pooled over its seeds with its 95% interval over
the gate's prompts and its value at each seed, and the records it was written from (without their texts).

A rerun decodes the same prompts, so the check compares them prompt by prompt: the relative change of each figure and
its 95% interval from a paired bootstrap over the prompts (both sides redraw the same prompts; at T>0 a prompt's
baseline pools its seeds, so the interval holds the spread that sampling with another seed shows). At T>0 a figure
regressed when its whole interval lies more than the margin below no change: sampling noise passes, a drop the prompts
agree on fails. At T=0 there is no noise to allow for: a rerun of the same code reproduces every prompt (change +0.0%
[+0.0%, +0.0%]), so a drop beyond the margin (which absorbs another machine's rounding) is real, even one that only
some prompts show. The check also fails when a configuration is missing or a checked sample is not
token-identical to greedy AR.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.bench.config import RunConfig, default_out, load_prompts, validate
from harness.bench.runner import Runner
from harness.bench.sweep import missing_drafter
from harness.reporting import intervals
from harness.reporting.metrics import OVERALL, Summary, protocol_label, summarize
from harness.runtime.errors import HarnessError
from harness.runtime.files import Outputs, readable_file
from harness.runtime.models import load_model
from harness.runtime.results import ResultStore

FIGURES = {"tokens_per_step": "tokens/step", "acceptance": "acceptance"}
# What a baseline keeps of each record: enough to pool its figures again (texts, token lists and versions dropped).
RECORD_FIELDS = ("method", "params", "model", "dataset", "question_id", "temperature", "top_k", "top_p",
                 "max_new_tokens", "seed", "dtype", "simulated", "config_key", "new_tokens", "steps",
                 "position_accepts", "lossless", "timing", "stats", "turn", "turns", "drafts")


@dataclass
class Figure:
    """One figure of a baseline configuration: pooled over its seeds, its 95% interval over the gate's prompts (each
    prompt with all its seeds; `prompts`: the fewest of any dataset) and its value at each seed."""

    value: float
    low: float
    high: float
    prompts: int
    seeds: list[float]

    def text(self) -> str:
        spread = f" (seeds: {', '.join(f'{v:.4f}' for v in self.seeds)})" if len(self.seeds) > 1 else ""
        return f"{self.value:.4f} {intervals.Interval(self.low, self.high, self.prompts).text('.4f')}{spread}"


@dataclass
class Expected:
    label: str
    samples: int  # records: prompts x seeds
    run: dict  # how to run it again: see run_spec
    figures: dict[str, Figure]  # by Summary property (FIGURES)
    records: list[dict]  # what the figures pool (RECORD_FIELDS of each record)

    def summary(self) -> Summary:
        return pooled(self.records)


@dataclass
class Change:
    """A figure's relative change from the baseline, prompt by prompt, with its paired 95% interval."""

    figure: str
    baseline: Figure
    current: float | None
    change: float | None
    interval: intervals.Interval | None

    def fell(self, margin: float, sampled: bool) -> bool:
        """Fell by more than the margin: the change itself, or when sampled its whole interval (beyond the noise)."""
        if self.change is None or self.change >= -margin:
            return False
        return not sampled or (self.interval is not None and self.interval.high < -margin)

    def text(self) -> str:
        if self.change is None:
            return "—"
        return f"{self.change:+.1%}" + ("" if self.interval is None else " " + self.interval.text("+.1%"))


@dataclass
class Outcome:
    expected: Expected
    changes: list[Change]
    lossless: str
    verdict: str  # "ok" or why it failed

    @property
    def ok(self) -> bool:
        return self.verdict == "ok"


def _label(s: Summary) -> str:
    params = " ".join(f"{k}={v}" for k, v in sorted(s.params.items()))
    sim = " (sim)" if s.simulated else ""
    return f"{s.model} {s.method} {params} T={s.temperature:g}{sim}{protocol_label(s.turns)}".strip()


def run_spec(rows: list[dict]) -> dict:
    """The RunConfig fields of one configuration's records, its samples as {dataset: [question ids]}, the seeds its
    records were decoded with and where it ran (local or distributed)."""
    first = rows[0]
    samples: dict[str, list] = {}
    for row in rows:
        if row["question_id"] not in samples.setdefault(row["dataset"], []):
            samples[row["dataset"]].append(row["question_id"])
    return {"method": first["method"], "params": first["params"], "model": first["model"]["name"],
            "temperature": first["temperature"], "top_k": first.get("top_k", 0), "top_p": first.get("top_p", 1.0),
            "max_new_tokens": first["max_new_tokens"], "seeds": sorted({row["seed"] for row in rows}),
            "dtype": first["dtype"], "simulate": bool(first.get("simulated")), "samples": samples,
            "executor": ((first.get("stats") or {}).get("executor") or {}).get("kind", "local"),
            # the turns protocol where it is not the first turn's (baselines written before it stay equal)
            **({"turns": first["turns"]} if first.get("turns", "first") != "first" else {})}


def identity(spec: dict) -> str:
    """What a run must share with a baseline configuration to stand for it: everything in its run_spec but the seeds
    (a reseeded run is the same configuration; the baseline's interval holds its seed spread), the prompt set taken
    as a set."""
    samples = {dataset: sorted(str(q) for q in ids) for dataset, ids in spec["samples"].items()}
    return json.dumps({**{k: v for k, v in spec.items() if k != "seeds"}, "samples": samples}, sort_keys=True)


def pooled(rows: list[dict]) -> Summary:
    """One configuration's records over all their datasets and seeds as one summary."""
    (overall,) = [s for s in summarize([{**row, "config_key": "pooled"} for row in rows], by_engine=False)
                  if s.dataset == OVERALL]
    return overall


def configurations(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The records by configuration (label and identity): the runs of one configuration at several seeds together."""
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["config_key"], []).append(row)
    found: dict[tuple[str, str], list[dict]] = {}
    for s in summarize(rows, by_engine=False):
        if s.dataset == OVERALL:
            found.setdefault((_label(s), identity(run_spec(by_key[s.config_key]))), []).extend(by_key[s.config_key])
    return found


def figures(rows: list[dict]) -> dict[str, Figure]:
    """The checked figures of one configuration's records: pooled over its seeds with their interval (one bootstrap
    for all), and at each seed."""
    summary = pooled(rows)
    by_seed: dict[int, list[dict]] = {}
    for row in rows:
        by_seed.setdefault(row["seed"], []).append(row)
    per_seed = [pooled(found) for _, found in sorted(by_seed.items())]
    found = {}
    for name in FIGURES:
        value, interval = getattr(summary, name), intervals.interval(summary, name)
        if value is not None and interval is not None:
            found[name] = Figure(round(value, 4), round(interval.low, 4), round(interval.high, 4), interval.prompts,
                                 [round(getattr(s, name), 4) for s in per_seed])
    return found


def baseline_from(rows: list[dict]) -> list[Expected]:
    expected = []
    for (name, _), found in configurations(rows).items():
        if measured := figures(found):
            expected.append(Expected(name, len(found), run_spec(found), measured,
                                     [{k: row[k] for k in RECORD_FIELDS if k in row} for row in found]))
    return expected


def write_baseline(path: Path, rows: list[dict], outputs: Outputs) -> list[str]:
    """Write the baseline of `rows`; returns what a reader should be warned of (see seed_warnings)."""
    expected = baseline_from(rows)
    outputs.write(path, json.dumps([asdict(e) for e in expected], indent=1) + "\n")
    return seed_warnings(expected)


def seed_warnings(baseline: list[Expected]) -> list[str]:
    """Sampled configurations measured at one seed: their interval holds the prompts' spread but not the seeds'."""
    return [f"{e.label} was measured at one seed (T>0): a rerun at another seed may fail on sampling noise alone; "
            f"write the baseline from runs at 3 or more seeds" for e in baseline
            if e.run["temperature"] > 0 and len(e.run["seeds"]) < 2]


def read_baseline(path: Path) -> list[Expected]:
    """The baseline's entries; an empty, truncated, mistyped or older-format baseline is an error, never a gate that
    passes."""
    try:
        entries = json.loads(readable_file(path, "--baseline").read_text())
        if not isinstance(entries, list) or not entries:
            raise ValueError("it holds no configurations")
        expected = []
        for entry in entries:
            entry = dict(entry)
            entry["figures"] = {name: Figure(**f) for name, f in entry["figures"].items()}
            e = Expected(**entry)
            if not (isinstance(e.label, str) and isinstance(e.samples, int) and isinstance(e.run, dict)
                    and e.records and set(e.figures) <= set(FIGURES)):
                raise ValueError(f"entry {e.label!r} has a field of the wrong type")
            if not e.figures:
                raise ValueError(f"entry {e.label!r} checks no figure")
            if not all(_finite(f.value, f.low, f.high, *f.seeds) for f in e.figures.values()):
                raise ValueError(f"entry {e.label!r} has a figure that is not a finite number")
            _agrees_with_its_records(e)
            expected.append(e)
        return expected
    except (OSError, ValueError, TypeError, KeyError, AttributeError, HarnessError) as exc:
        raise HarnessError(f"cannot read baseline {path} ({exc}); write one with spd-bench check --write") from None


def _agrees_with_its_records(e: Expected) -> None:
    """A baseline's stored figures are its records pooled: an entry cut or edited by hand, whose figures say other
    than its records do, would judge a rerun against numbers nothing measured."""
    if e.samples != len(e.records):
        raise ValueError(f"entry {e.label!r} says {e.samples} samples but holds {len(e.records)} records")
    pooled_now = figures(e.records)
    for name, stored in e.figures.items():
        found = pooled_now.get(name)
        if found is None or found.value != stored.value or found.seeds != stored.seeds:
            raise ValueError(f"entry {e.label!r}: its {FIGURES[name]} {stored.value} is not what its records pool "
                             f"to ({None if found is None else found.value}); it was cut or edited")


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def of_turns(baseline: list[Expected], turns: str | None, path: Path) -> list[Expected]:
    """The entries decoded under the `turns` protocol (None: all of them); none is bad input."""
    if turns is None:
        return baseline
    kept = [e for e in baseline if e.run.get("turns", "first") == turns]
    if not kept:
        raise HarnessError(f"{path} holds no configuration of --turns {turns}; drop --turns or pass another baseline")
    return kept


def rerun(baseline: list[Expected], results: Path, model: str | None, device: str, data_dir: str | None,
          seed: int | None = None, compile: str = "off") -> list[str]:
    """Run every baseline configuration again into `results` (a fresh folder): same prompts, sampling,
    lengths and dtype, at `seed` (default: the baseline's first), the drafter from the cache, the target's layer
    step compiled as `compile` says. Returns why configurations could not run (they then count as missing)."""
    loaded_models, problems = {}, []
    for expected in baseline:
        config, wanted = _config(expected.run, model, device, data_dir, seed, compile)
        validate(config)
        samples = [s for s in load_prompts(config) if str(s.question_id) in wanted[s.dataset]]
        if len(samples) < sum(len(ids) for ids in wanted.values()):
            raise HarnessError(f"{expected.label}: some of its prompts are not in the datasets found; pass the "
                               f"--data-dir the baseline was written with")
        if config.model not in loaded_models:
            loaded_models[config.model] = load_model(config.model, config.device, config.dtype)
        loaded = loaded_models[config.model]
        command = missing_drafter(config, loaded.identity)
        if command is not None:
            problems.append(f"{expected.label}: no drafter; train it with: {command}")
            continue
        store = ResultStore(default_out(config, loaded.identity.name, results))
        store.load()
        try:
            Runner(config, loaded).run(samples, store)
        except HarnessError as exc:  # this model or mode cannot run it (e.g. trees on linear attention)
            problems.append(f"{expected.label}: {exc}")
    return problems


def _config(spec: dict, model: str | None, device: str, data_dir: str | None, seed: int | None, compile: str
            ) -> tuple[RunConfig, dict[str, set]]:
    wanted = {dataset: {str(q) for q in ids} for dataset, ids in spec["samples"].items()}
    # No AR timed beside each sample: the gate checks figures, not speed (at T=0 AR still decodes each prompt once,
    # the losslessness reference).
    config = RunConfig(method=spec["method"], params=dict(spec["params"]), model=model or spec["model"],
                       datasets=tuple(wanted), temperature=spec["temperature"], top_k=spec["top_k"],
                       top_p=spec["top_p"], max_new_tokens=spec["max_new_tokens"],
                       seed=spec["seeds"][0] if seed is None else seed, device=device, dtype=spec["dtype"],
                       data_dir=data_dir, simulate=spec["simulate"], baseline=False, compile=compile,
                       turns=spec.get("turns", "first"))
    return config, wanted


def compare(baseline: list[Expected], rows: list[dict], margin: float, flip_rate: float = 0.0) -> list[Outcome]:
    """Each baseline configuration against the records of the same label and identity (lengths, prompt set,
    sampling, dtype, executor; any seeds); a run that differs in any of them is not that configuration, so it counts
    as missing. The config key is not required to match: a retrained drafter changes it (it includes the weights'
    hash). Losslessness fails on any logic divergence and on numerics flips in more than `flip_rate` of the checked
    samples."""
    found = configurations(rows)
    outcomes = []
    for expected in baseline:
        current = found.get((expected.label, identity(expected.run)))
        if current is None:
            outcomes.append(Outcome(expected, [], "—", "missing"))
            continue
        before, now = expected.summary(), pooled(current)
        changes = [_change(name, f, before, now) for name, f in expected.figures.items()]
        sampled = expected.run["temperature"] > 0
        fell = [c for c in changes if c.fell(margin, sampled)]
        drafter = drafter_change(expected.records, current, sampled)
        if now.logic:
            verdict = f"lost losslessness ({now.logic} logic divergences)"
        elif now.flips > flip_rate * now.checked:
            verdict = f"{now.flips} numerics flips, beyond the {flip_rate:.0%} flip rate"
        elif fell:
            beyond = "its noise and " if sampled else ""
            verdict = "; ".join(f"{FIGURES[c.figure]} fell beyond {beyond}the {margin:.0%} margin" for c in fell)
        else:
            verdict = "ok"
        if drafter:
            verdict = drafter if verdict == "ok" else f"{verdict}; {drafter}"
        outcomes.append(Outcome(expected, changes, _lossless(now), verdict))
    return outcomes


def _lossless(now: Summary) -> str:
    """identical/checked, with the flips beside it where there are any."""
    if not now.checked:
        return "—"
    return f"{now.identical}/{now.checked}" + (f" (+{now.flips} flips)" if now.flips else "")


def drafter_change(before: list[dict], now: list[dict], sampled: bool) -> str | None:
    """What changed in the drafter, said apart from the figures: its weights (the records' fingerprints) and, at T=0,
    where every proposal is deterministic, what it proposed (each prompt's digest of every round's drafts, accepted
    or not). None when neither changed or the baseline does not hold them (records from before they were kept)."""
    said = []
    weights = lambda rows: {(r.get("stats") or {}).get("drafter") for r in rows} - {None}  # noqa: E731
    old, new = weights(before), weights(now)
    if old and new and old != new:
        said.append(f"drafter weights changed ({', '.join(sorted(w[:8] for w in old))} -> "
                    f"{', '.join(sorted(w[:8] for w in new))})")
    if not sampled:
        digests = {_prompt(r): (r.get("drafts") or {}).get("digest") for r in before}
        compared = [(digests[_prompt(r)], (r.get("drafts") or {}).get("digest")) for r in now if _prompt(r) in digests]
        compared = [(a, b) for a, b in compared if a and b]
        moved = sum(a != b for a, b in compared)
        if moved:
            said.append(f"proposed drafts changed on {moved} of {len(compared)} prompts"
                        + ("" if said else " with the weights unchanged (the drafting code changed)"))
    return "; ".join(said) or None


def _prompt(row: dict) -> tuple:
    return row["dataset"], str(row["question_id"]), row.get("turn", 1)


def _change(name: str, baseline: Figure, before: Summary, now: Summary) -> Change:
    """The figure's relative change now/before - 1 and its interval over the prompts both decoded, redrawn together."""
    current = getattr(now, name)
    if current is None or not baseline.value:
        return Change(name, baseline, current, None, None)
    found, _ = intervals.paired_interval(before, now, name, lambda b, a: a / b - 1)
    return Change(name, baseline, current, current / getattr(before, name) - 1, found)


def table(outcomes: list[Outcome]) -> str:
    from tabulate import tabulate

    rows = []
    for o in outcomes:
        run = o.expected.run
        size = f"{sum(len(ids) for ids in run['samples'].values())} x {len(run['seeds'])}"
        for c in o.changes or [None]:
            rows.append((o.expected.label, size, FIGURES[c.figure] if c else "—", c.baseline.text() if c else "—",
                         "—" if c is None or c.current is None else f"{c.current:.4f}", c.text() if c else "—",
                         o.lossless, o.verdict))
    return tabulate(rows, headers=["config", "prompts x seeds", "figure", "baseline [95% interval over prompts]",
                                   "current", "change [paired 95% interval]", "lossless", "verdict"],
                    tablefmt="pipe", disable_numparse=True) + "\n"
