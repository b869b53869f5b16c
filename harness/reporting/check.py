"""Regression check: pooled acceptance and losslessness of recorded results against a committed baseline.

A baseline is a JSON list with one entry per configuration (overall over its datasets): its config key, a label,
tokens/step, the draft acceptance rate, the sample count and how to run it again (`--rerun`: method, parameters,
sampling, lengths, seed, dtype and the question ids per dataset). The check fails when a configuration is missing, any
checked sample is not token-identical to greedy AR, or tokens/step or the acceptance rate fell by more than the
relative tolerance (the acceptance rate only where the baseline accepted at least MIN_ACCEPTS drafts: fewer are
noise).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.bench.config import RunConfig, default_out, load_prompts, validate
from harness.bench.runner import Runner
from harness.bench.sweep import missing_drafter
from harness.reporting.metrics import OVERALL, Summary
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model
from harness.runtime.results import ResultStore

MIN_ACCEPTS = 20


@dataclass
class Expected:
    config_key: str
    label: str
    tokens_per_step: float
    samples: int
    acceptance: float | None = None  # share of verified drafts accepted (absent in older baselines)
    accepts: int = 0  # drafts accepted in the baseline run
    run: dict | None = None  # how to run it again (absent in older baselines): see run_spec


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


def run_spec(rows: list[dict]) -> dict:
    """The RunConfig fields of one configuration's records, its samples as {dataset: [question ids]} and where it ran
    (local or distributed)."""
    first = rows[0]
    samples: dict[str, list] = {}
    for row in rows:
        samples.setdefault(row["dataset"], []).append(row["question_id"])
    return {"method": first["method"], "params": first["params"], "model": first["model"]["name"],
            "temperature": first["temperature"], "top_k": first.get("top_k", 0), "top_p": first.get("top_p", 1.0),
            "max_new_tokens": first["max_new_tokens"], "seed": first["seed"], "dtype": first["dtype"],
            "simulate": bool(first.get("simulated")), "samples": samples,
            "executor": ((first.get("stats") or {}).get("executor") or {}).get("kind", "local")}


def identity(spec: dict) -> str:
    """What a run must share with a baseline configuration to stand for it: everything in its run_spec, the prompt
    set taken as a set and the executor (local in baselines older than the field)."""
    samples = {dataset: sorted(str(q) for q in ids) for dataset, ids in spec["samples"].items()}
    return json.dumps({**spec, "samples": samples, "executor": spec.get("executor", "local")}, sort_keys=True)


def baseline_from(summaries: list[Summary], rows: list[dict]) -> list[Expected]:
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["config_key"], []).append(row)
    return [Expected(s.config_key, _label(s), round(s.tokens_per_step, 4), s.samples,
                     None if s.acceptance is None else round(s.acceptance, 4), sum(s.position_accepts),
                     run_spec(by_key[s.config_key]))
            for s in summaries if s.dataset == OVERALL and s.tokens_per_step is not None]


def write_baseline(path: Path, summaries: list[Summary], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(e) for e in baseline_from(summaries, rows)], indent=1) + "\n")


def read_baseline(path: Path) -> list[Expected]:
    """The baseline's entries; an empty, truncated or mistyped baseline is an error, never a gate that passes."""
    try:
        entries = json.loads(Path(path).read_text())
        if not isinstance(entries, list) or not entries:
            raise ValueError("it holds no configurations")
        expected = [Expected(**entry) for entry in entries]
        for e in expected:
            if not (isinstance(e.config_key, str) and isinstance(e.label, str) and isinstance(e.samples, int)
                    and isinstance(e.tokens_per_step, (int, float)) and isinstance(e.run, (dict, type(None)))):
                raise ValueError(f"entry {e.label!r} has a field of the wrong type")
        return expected
    except (OSError, ValueError, TypeError) as exc:
        raise HarnessError(f"cannot read baseline {path} ({exc}); write one with spd-bench check --write") from None


def rerun(baseline: list[Expected], results: Path, model: str | None, device: str, data_dir: str | None
          ) -> list[str]:
    """Run every baseline configuration again into `results` (resuming what is there): same prompts, sampling,
    lengths, seed and dtype, the drafter from the cache. Returns why configurations could not run (they then count
    as missing)."""
    loaded_models, problems = {}, []
    for expected in baseline:
        if expected.run is None:
            problems.append(f"{expected.label}: the baseline has no run configuration; rewrite it with --write")
            continue
        config, wanted = _config(expected.run, model, device, data_dir)
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


def _config(spec: dict, model: str | None, device: str, data_dir: str | None) -> tuple[RunConfig, dict[str, set]]:
    wanted = {dataset: {str(q) for q in ids} for dataset, ids in spec["samples"].items()}
    config = RunConfig(method=spec["method"], params=dict(spec["params"]), model=model or spec["model"],
                       datasets=tuple(wanted), temperature=spec["temperature"], top_k=spec["top_k"],
                       top_p=spec["top_p"], max_new_tokens=spec["max_new_tokens"], seed=spec["seed"], device=device,
                       dtype=spec["dtype"], data_dir=data_dir, simulate=spec["simulate"])
    return config, wanted


def compare(baseline: list[Expected], summaries: list[Summary], rows: list[dict], tolerance: float) -> list[Outcome]:
    """Each baseline configuration against the run of the same label and identity (lengths, prompt set, sampling,
    seed, dtype, executor); a run that differs in any of them is not that configuration, so it counts as missing. The
    config key is not required to match: a retrained drafter changes it (it includes the weights' hash)."""
    by_key: dict[str, list[dict]] = {}
    for row in rows:
        by_key.setdefault(row["config_key"], []).append(row)
    found = {(_label(s), identity(run_spec(by_key[s.config_key]))): s
             for s in summaries if s.dataset == OVERALL and s.config_key in by_key}
    outcomes = []
    for expected in baseline:
        s = found.get((expected.label, identity(expected.run))) if expected.run else None
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
    from tabulate import tabulate

    rows = [(o.expected.label, *_pair(o.expected.tokens_per_step, o.current), *_pair(o.expected.acceptance, o.acceptance),
             o.lossless, o.verdict) for o in outcomes]
    return tabulate(rows, headers=["config", "baseline tokens/step", "current", "change", "baseline acceptance",
                                   "current", "change", "lossless", "verdict"],
                    tablefmt="pipe", disable_numparse=True) + "\n"


def _pair(expected: float | None, current: float | None) -> tuple[str, str, str]:
    """Baseline, current and relative change cells."""
    def fmt(value):
        return "—" if value is None else f"{value:.4f}"
    change = "—" if expected in (None, 0) or current is None else f"{current / expected - 1:+.1%}"
    return fmt(expected), fmt(current), change
