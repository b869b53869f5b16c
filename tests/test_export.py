"""Export to Spec-Bench answer files and the reference's per-sample JSONL: their scripts' formulas, applied to the
exported files, give back what our records say."""

import json

import pytest

from harness.reporting.export import export
from harness.reporting.metrics import summarize
from harness.runtime.errors import HarnessError


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


def _reference_aggregate(rows: list[dict]) -> dict:
    """The reference eval script's aggregation over its per-sample rows, as it computes it."""
    tokens, steps = sum(r["new_tokens"] for r in rows), sum(r["decode_loop_steps"] for r in rows)
    pipe_decode = sum(r["pipeline_decode_wall_sec"] for r in rows)
    base_tokens, base_decode = sum(r["baseline_new_tokens"] for r in rows), sum(r["baseline_decode_wall_sec"] for r in rows)
    return {"acceptance_rate": tokens / steps, "equivalent_accept_length": rows[0]["num_stages"] * tokens / steps,
            "gain_pct": sum(r["theoretical_throughput_gain_pct"] * r["new_tokens"] for r in rows) / tokens,
            "accepted": sum(r["n_accepted"] for r in rows), "flags": sum(r["n_acceptance_flags"] for r in rows),
            "speedup": (tokens / pipe_decode) / (base_tokens / base_decode)}


def test_the_reference_aggregation_of_an_export_gives_the_figures_of_our_records(tmp_path):
    rows = [_record("spd", 1, "a", 30, 10, 1.0), _record("spd", 2, "b", 20, 12, 1.5)]
    rows[1]["position_accepts"], rows[1]["stats"]["fill_drafts"] = [4, 3], [9, 8]
    (path,), _ = export(rows, "reference", tmp_path)
    samples = _lines(path)
    theirs = _reference_aggregate(samples)
    tokens, steps = 22, 50
    assert theirs["acceptance_rate"] == pytest.approx(tokens / steps)
    assert theirs["equivalent_accept_length"] == pytest.approx(8 * tokens / steps)
    gains = [(8 * r["new_tokens"] / r["steps"] - 1) * 100 for r in rows]
    assert theirs["gain_pct"] == pytest.approx((gains[0] * 10 + gains[1] * 12) / 22) and theirs["gain_pct"] > 0
    # the prefill token is one accepted flag per sample there: ours are 9 of 30 and 7 of 17
    assert (theirs["accepted"], theirs["flags"]) == (9 + 1 + 7 + 1, 30 + 1 + 17 + 1)
    assert theirs["speedup"] == pytest.approx((22 / 2.5) / (22 / 4.0))
    fields = {"index", "dataset", "question_id", "question", "generated", "new_tokens", "decode_loop_steps",
              "acceptance_rate", "equivalent_accept_length", "n_accepted", "n_acceptance_flags",
              "theoretical_std_time_sec", "theoretical_pipe_time_sec", "theoretical_std_tok_s",
              "theoretical_pipe_tok_s", "theoretical_throughput_gain_pct", "wall_time_sec", "num_stages", "use_deepest",
              "draft_top_k", "pipeline_prefill_wall_sec", "pipeline_decode_wall_sec", "pipeline_decode_tok_s",
              "pipeline_stage_stream_gpu_sec", "pipeline_ideal_parallel_saved_sec", "ideal_decode_wall_sec",
              "pipeline_ideal_decode_tok_s", "baseline_prefill_wall_sec", "baseline_decode_wall_sec",
              "baseline_new_tokens", "baseline_decode_tok_s", "speedup_vs_baseline", "ideal_speedup_vs_baseline"}
    assert fields <= set(samples[0])
    from harness.bench.data import load_samples

    prompts = {str(s.question_id): s.prompt for s in load_samples("gsm8k")}
    assert [s["question"] for s in samples] == [prompts["1"], prompts["2"]]  # the prompt text, from the shipped set


def test_a_record_without_top_k_exports_and_names_with_slashes_make_safe_unique_files(tmp_path):
    row = _record("spd", 1, "a", 30, 10, 1.0)
    del row["top_k"]
    (path,), _ = export([row], "reference", tmp_path / "ref")
    assert _lines(path)[0]["top_k"] == 0
    ssd = [_record("autoregressive", 1, "a", 10, 10, 2.0) for _ in range(2)]
    for record, model in zip(ssd, ("/models/draft", "org/draft")):
        record.update(method="ssd", params={"draft_model": model, "k": 3}, config_key=model[-12:].replace("/", "x"))
    files, _ = export(ssd, "spec-bench", tmp_path / "sb")
    assert len(files) == 2 and all(f.parent == tmp_path / "sb" and "/" not in f.name for f in files)
    assert sorted(p.name for p in (tmp_path / "sb").iterdir()) == sorted(f.name for f in files)  # nothing else


def test_export_into_a_file_is_one_line_and_writes_nothing(tmp_path):
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "sub"):
        with pytest.raises(HarnessError, match="is a file|lies under the file"):
            export([_record("spd", 1, "a", 30, 10, 1.0)], "reference", out)
    assert (tmp_path / "file").read_text() == "x"


def test_an_export_of_simulated_records_alone_says_they_were_simulated(tmp_path):
    from harness.runtime.errors import HarnessError

    rows = [_record("spd", q, f"answer {q}", 30, 10, 0.0, simulated=True) for q in (1, 2)]
    with pytest.raises(HarnessError, match="all 2 matching records were simulated"):
        export(rows, "spec-bench", tmp_path / "out")
    assert not (tmp_path / "out").exists()
