"""Export to Spec-Bench answer files and the reference's per-sample JSONL: their scripts' formulas, applied to the
exported files, give back what our records say."""

import json

import pytest

from harness.errors import HarnessError
from harness.export import export
from harness.metrics import summarize


def _record(method, question_id, text, steps, tokens, decode_s, simulated=False):
    pipeline = {"num_layers": 30, "n": 8, "largest_stage": 4, "ls": 1, "schedule": "input", "width": 1}
    params = {"n": 8, "ls": 1, "schedule": "input", "width": 1} if method == "spd" else {}
    return {
        "method": method, "params": params, "model": {"name": "org/tiny"}, "dataset": "gsm8k",
        "question_id": question_id, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "prompt_tokens": 12,
        "output_ids": list(range(tokens)), "output_text": text, "new_tokens": tokens, "steps": steps,
        "accepted": [1] * (tokens - 1) + [0] * (steps - tokens + 1), "position_accepts": [tokens - 1],
        "timing": {} if simulated else {"prefill": 0.5, "decode": decode_s}, "simulated": simulated,
        "lossless": {"checked": True, "identical": True}, "config_key": f"{method}{simulated}",
        "stats": {"pipeline": pipeline, "fill_drafts": [steps]} if method == "spd" else {},
        "baseline": {"new_tokens": tokens, "timing": {"decode": 2.0}} if method == "spd" else None,
    }


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_spec_bench_files_give_speed_py_its_tokens_per_second_and_equal_py_its_turns(tmp_path):
    rows = [_record("autoregressive", q, f"answer {q}", 10, 10, 2.0) for q in (1, 2)]
    rows += [_record("spd", q, f"answer {q}", 30, 10, 1.0) for q in (1, 2)]
    rows.append(_record("spd", 1, "answer 1", 30, 10, 0.0, simulated=True))
    files, skipped = export(rows, "spec-bench", tmp_path)
    assert skipped == 1 and len(files) == 2  # the replay has no wall time
    ar, spd = (_lines(f) for f in sorted(files))  # "...-autoregressive-..." sorts first
    # speed.py: per answer sum(new_tokens) / sum(wall_time), then the mean
    speeds = [sum(a["choices"][0]["new_tokens"]) / sum(a["choices"][0]["wall_time"]) for a in spd]
    assert speeds == [10 / 1.5, 10 / 1.5]
    assert [a["choices"][0]["turns"] for a in spd] == [a["choices"][0]["turns"] for a in ar]  # equal.py
    assert {a["category"] for a in spd} == {"gsm8k"} and len({a["answer_id"] for a in spd + ar}) == 4
    assert sum(spd[0]["choices"][0]["accept_lengths"]) == 9  # tokens committed by cycles


def test_reference_files_reproduce_its_theoretical_speedup_and_skip_other_methods(tmp_path):
    rows = [_record("spd", 1, "a", 30, 10, 1.0), _record("spd", 2, "b", 20, 12, 1.0),
            _record("autoregressive", 1, "a", 10, 10, 2.0)]
    files, skipped = export(rows, "reference", tmp_path)
    assert skipped == 1
    (samples,) = (_lines(f) for f in files)
    assert [s["decode_loop_steps"] for s in samples] == [30, 20] and samples[0]["index"] == 0
    per_sample_mean = sum(s["equivalent_accept_length"] for s in samples) / len(samples)
    (ours,) = [s for s in summarize(rows[:2]) if s.dataset == "overall"]
    assert per_sample_mean == pytest.approx(ours.reference_theoretical) == pytest.approx((8 * 10 / 30 + 8 * 12 / 20) / 2)
    assert samples[0]["baseline_decode_tok_s"] == 5.0 and samples[0]["pipeline_decode_tok_s"] == 10.0


def test_nothing_to_export_is_one_clear_error(tmp_path):
    with pytest.raises(HarnessError, match="no records to export as reference"):
        export([_record("autoregressive", 1, "a", 10, 10, 2.0)], "reference", tmp_path / "out")
    assert not (tmp_path / "out").exists()
