"""Bootstrap intervals over prompts: their coverage on a known distribution, their replicates, seeds and reliability."""

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd

from harness.reporting import intervals
from harness.reporting.metrics import OVERALL, summarize
from harness.reporting.render import csv_text

ROOT = Path(__file__).resolve().parents[1]


def _rows(tokens: list[int], steps: list[int], dataset: str = "gsm8k", key: str = "k") -> list[dict]:
    """Prompt lookup records (a method with no stats of its own): `tokens[i]` after the prefill one in `steps[i]`."""
    return [{"config_key": key, "method": "lookup", "params": {"k": 10}, "model": {"name": "m"}, "simulated": False,
             "temperature": 0.0, "top_k": 0, "top_p": 1.0, "dataset": dataset, "question_id": i,
             "new_tokens": n + 1, "steps": s, "accepted": [], "position_accepts": [],
             "timing": {"decode": s * 0.01}, "lossless": {"checked": True, "identical": True},
             "baseline": {"new_tokens": n + 1, "timing": {"decode": n * 0.01}}, "stats": {}}
            for i, (n, s) in enumerate(zip(tokens, steps))]


def _overall(rows: list[dict]):
    (found,) = [s for s in summarize(rows) if s.dataset == OVERALL]
    return found


def test_the_interval_covers_the_true_figure_at_about_its_stated_rate():
    """Tokens per step of 30 prompts, each Poisson(12) tokens in 10 steps: the true figure is 1.2; over 200 runs the
    95% interval should hold it about 95% of the time (the percentile bootstrap runs a little short at n = 30)."""
    rng = np.random.default_rng(7)
    covered = 0
    for run in range(200):
        tokens = rng.poisson(12, 30).tolist()
        found = intervals.interval(_overall(_rows(tokens, [10] * 30, key=f"run{run}")), "tokens_per_step")
        covered += found.low <= 1.2 <= found.high
    assert 0.88 <= covered / 200 <= 0.99, covered


def test_the_interval_is_reproducible_and_the_pooled_figure_sits_inside_it():
    tokens = [8, 14, 11, 13, 9, 12, 15, 10]
    first = intervals.interval(_overall(_rows(tokens, [10] * 8)), "tokens_per_step")
    intervals._CACHE.clear()
    again = intervals.interval(_overall(_rows(tokens, [10] * 8)), "tokens_per_step")
    assert first == again and first.low <= sum(tokens) / 80 <= first.high and first.reliable


def test_resampling_stays_within_each_dataset_so_the_pooled_weighting_holds():
    """Two datasets of very different tokens per step: every replicate pools 5 prompts of each, never 10 of one."""
    rows = _rows([30] * 5, [10] * 5, "gsm8k") + _rows([10] * 5, [10] * 5, "humaneval")
    for replica in intervals.replicates(_overall(rows)):
        assert replica.tokens_per_step == 2.0 and replica.samples == 10


def test_few_prompts_are_flagged_unreliable_and_csv_carries_low_and_high():
    few = _rows([8, 14, 11], [10] * 3)
    found = intervals.interval(_overall(few), "tokens_per_step")
    assert found.prompts == 3 and not found.reliable
    frame = pd.read_csv(io.StringIO(csv_text(summarize(_rows([8, 14, 11, 13, 9, 12], [10] * 6)))))
    overall = frame[frame["dataset"] == OVERALL].iloc[0]
    assert overall["tokens/step low"] <= overall["tokens/step"] <= overall["tokens/step high"]
    assert overall["prompts"] == 6 and overall["wall-clock samples"] == 6


def test_a_replicate_that_draws_every_prompt_once_is_the_summary_itself():
    """On committed records of every family: the vectorised replicate pools exactly as the summary does."""
    rows = []
    for path in sorted((ROOT / "results" / "smollm2-135m").glob("*.jsonl")):
        found = [json.loads(line) for line in path.read_text().splitlines()]
        rows += [r for r in found if "kind" not in r][:40]
    figures = ("tokens_per_step", "acceptance", "l_acc", "theoretical_speedup", "modeled_speedup",
               "reference_theoretical", "wall_clock_median", "expected_acceptance")
    for summary in summarize(rows):
        groups = [g for found in summary.prompts().values() for g in found]
        replica = intervals._Pool(summary, groups).replicate(np.ones(len(groups)))
        for figure in figures:
            ours, theirs = getattr(summary, figure), getattr(replica, figure)
            assert (ours is None) == (theirs is None) and (ours is None or abs(ours - theirs) < 1e-9), figure
        own = summary.reports.figures(summary)
        for name, ours in own.items():
            theirs = summary.reports.figures(replica)[name]
            assert (ours is None) == (theirs is None) and (ours is None or abs(ours - theirs) < 1e-9), name


def test_a_time_ratio_interval_redraws_prompts_within_each_dataset():
    slower = [2.0, 2.2, 1.8, 2.1, 1.9, 4.0, 4.4, 3.6, 4.2, 3.8]
    faster = [1.0] * 5 + [2.0] * 5
    value, interval = intervals.time_ratio_interval(slower, faster, ["a"] * 5 + ["b"] * 5, "key")
    assert value == sum(slower) / sum(faster)
    assert interval.reliable and 1.8 < interval.low <= value <= interval.high < 2.2
    assert intervals.time_ratio_interval(slower, faster, ["a"] * 5 + ["b"] * 5, "key")[1] == interval  # reproducible
    assert not intervals.time_ratio_interval([2.0, 3.0], [1.0, 1.0], ["a", "a"], "key")[1].reliable
