"""Pooled metrics follow DESIGN §7: sums over samples, and the pipeline speedup formulas."""

import pytest

from harness.reporting.metrics import OVERALL, summarize


def _row(dataset, new_tokens, steps, schedule="input", decode=1.0, baseline_decode=2.0, qid=0):
    return {
        "config_key": "k", "method": "spd", "params": {"n": 8, "ls": 4}, "model": {"name": "m"}, "temperature": 0.0,
        "dataset": dataset, "question_id": qid, "new_tokens": new_tokens, "steps": steps,
        "timing": {"prefill": 0.1, "decode": decode, "stages": 0.8, "drafter": 0.2, "verify_head": 0.05},
        "lossless": {"checked": True, "identical": True},
        "position_accepts": [1, 2], "baseline": {"new_tokens": new_tokens, "timing": {"decode": baseline_decode}},
        "stats": {"stage_runs": 80, "drafter_calls": 10, "verifications": 5, "fill_drafts": [2, 4],
                  "pipeline": {"num_layers": 30, "n": 8, "largest_stage": 4, "ls": 4, "schedule": schedule}},
    }


def test_pooled_alpha_is_a_ratio_of_sums_not_a_mean_of_ratios():
    rows = [_row("a", 10, 10), _row("a", 30, 10, qid=1)]
    (per_dataset, overall) = summarize(rows)
    assert overall.dataset == OVERALL and per_dataset.dataset == "a"
    # each sample's first token comes from the prefill, not from a step
    assert overall.tokens_per_step == pytest.approx(38 / 20)
    rows = [_row("a", 10, 20), _row("a", 30, 10, qid=1)]
    assert summarize(rows)[-1].tokens_per_step == pytest.approx(38 / 30)  # a mean of ratios would give 1.6


@pytest.mark.parametrize("schedule, cycle_layers", [("input", 4), ("output", 8)])
def test_pipeline_speedup_formulas(schedule, cycle_layers):
    s = summarize([_row("a", 21, 10, schedule=schedule)])[-1]
    alpha = 2.0
    assert s.l_acc == pytest.approx(alpha * 30 / 4)
    assert s.theoretical_speedup == pytest.approx(alpha * 30 / cycle_layers)
    per_layer = 0.8 / (80 * 30 / 8)
    stage, drafter, head = 4 * per_layer, 0.2 / 10, 0.05 / 5
    cycle = (max(stage, drafter) if schedule == "input" else stage + drafter) + head
    assert s.modeled_speedup == pytest.approx(alpha * (30 * per_layer + head) / cycle)
    assert s.wall_clock_speedup == pytest.approx(2.0)  # same tokens in half the decode time
    assert s.position_acceptance == [0.5, 0.5]


def test_eagle3_tau_speedup_and_per_position_acceptance():
    row = _row("a", 41, 10)
    row.update(method="eagle3", position_accepts=[8, 5, 2],
               stats={"draft": {"num_layers": 30, "ls": 1, "m": 3, "width": 1}})
    s = summarize([row])[-1]
    tau = 4.0  # 40 tokens after the prefill one in 10 target forwards
    assert s.tokens_per_step == pytest.approx(tau)
    assert s.theoretical_speedup == pytest.approx(tau * 30 / (1 * 3 + 30))
    assert s.position_acceptance == [0.8, 0.5, 0.2]
    assert s.l_acc is None and s.modeled_speedup is None
