"""The rendered report: per-(T, width) blocks, the schedule ablation, speedups side by side, and figures."""

from harness.metrics import summarize
from harness.report import markdown, render_figures


def _row(method, params, dataset, schedule=None, draft=None, temperature=0.0):
    stats = {"fill_drafts": [4, 4]} if schedule else {}
    if schedule:
        stats["pipeline"] = {"num_layers": 30, "n": params["n"], "largest_stage": 4, "ls": 4, "schedule": schedule}
    if draft:
        stats["draft"] = draft
    return {
        "config_key": f"{method}{sorted(params.items())}{temperature}", "method": method, "params": params,
        "model": {"name": "m"}, "temperature": temperature, "dataset": dataset, "question_id": 0, "new_tokens": 11,
        "steps": 8, "accepted": [0, 1, 2, 1, 0, 3, 2, 1], "position_accepts": [2, 1],
        "timing": {"decode": 1.0, "stages": 0.5, "drafter": 0.2, "verify_head": 0.1},
        "lossless": {"checked": True, "identical": True}, "baseline": {"new_tokens": 11, "timing": {"decode": 2.0}},
        "stats": stats,
    }


def test_report_blocks_ablation_speedups_and_figures(tmp_path):
    rows = []
    for dataset in ("gsm8k", "mt_bench"):
        for schedule in ("input", "output"):
            rows.append(_row("spd", {"n": 8, "ls": 4, "schedule": schedule, "width": 1}, dataset, schedule))
        rows.append(_row("eagle3", {"m": 3, "width": 4, "ttt": 7}, dataset,
                         draft={"num_layers": 30, "ls": 1, "m": 3, "width": 4}))
    summaries = summarize(rows)
    figures = render_figures(summaries, rows, tmp_path / "figures", relative_to=tmp_path)
    assert set(figures.values()) == {"figures/acceptance.png", "figures/accepted_lengths.png", "figures/speedups.png"}
    assert all((tmp_path / p).stat().st_size > 1000 for p in figures.values())
    text = markdown(summaries, figures)
    assert "### T=0, width 1" in text and "### T=0, width 4" in text
    # alpha = 10 tokens after the prefill one / 8 cycles; theoretical x input 1.25 * 30 / 4, output 1.25 * 30 / 8
    assert "| spd ls=4 n=8 schedule=input | 1.25 · 9.38 · 9.38x | 1.25 · 9.38 · 9.38x | 1.25 · 9.38 · 9.38x |" in text
    assert "| spd n=8 ls=4 | 1 | 0 | 1.25 | 1.25 | 9.38 | 4.69 |" in text  # the ablation row
    assert "![Speedups per configuration](figures/speedups.png)" in text
