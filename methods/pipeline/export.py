"""The pipeline family's records in the reference code's eval format (`spd-bench export --format reference`): one
JSONL row per sample with every field its eval script writes, by its definitions, so its aggregation (pooled N / S,
n * sum N / sum S, token-weighted mean theoretical gain, pooled flags and tokens per second) applies unchanged."""

from __future__ import annotations

from methods.capabilities import ExportFormat
from methods.pipeline.stats import PipelineStats, stage_seconds


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _wall(row: dict) -> float:
    return row["timing"].get("prefill", 0.0) + row["timing"].get("decode", 0.0)


def reference_sample(row: dict, index: int, question: str | None) -> dict:
    """One row of the reference's eval output, every field it writes, by its definitions: N new tokens (the prefill
    token included), S decode-loop steps, `acceptance_rate` N / S, `equivalent_accept_length` n N / S; its toy timing
    model (a standard step 1 s, a pipeline step 1/n s) gives the theoretical times and `theoretical_throughput_gain_pct`
    = (n N / S - 1) * 100; its acceptance flags count the prefill token as one accepted flag. The "ideal" times are
    the decode with the stages' compute run in parallel (one process: the stage seconds shrink to the largest
    stage's share; distributed: they already ran in parallel, nothing is saved)."""
    stats, timing = PipelineStats.read(row["stats"]), row.get("timing") or {}
    shape, steps, tokens = stats.pipeline, row["steps"], row["new_tokens"]
    n = shape.n
    pipe_time = max(steps, 1) / n
    distributed = stats.executor_kind == "distributed"
    stage_s = stage_seconds(stats, timing)
    saved = 0.0 if distributed else stage_s * (1 - shape.largest_stage / shape.num_layers)
    decode = timing.get("decode", 0.0)
    ideal = decode - saved
    baseline = row.get("baseline") or {}
    base_decode = (baseline.get("timing") or {}).get("decode", 0.0)
    base_tok_s = _ratio(baseline.get("new_tokens", 0), base_decode) if baseline else None
    out = {
        "index": index,
        "dataset": row["dataset"],
        "question_id": row["question_id"],
        "question": question,
        "generated": row["output_text"],
        "new_tokens": tokens,
        "decode_loop_steps": steps,
        "acceptance_rate": _ratio(tokens, steps),
        "equivalent_accept_length": n * _ratio(tokens, steps),
        "n_accepted": sum(row["position_accepts"]) + 1,  # the prefill token is an accepted flag there
        "n_acceptance_flags": sum(stats.fill_drafts) + 1,
        "theoretical_std_time_sec": float(tokens),
        "theoretical_pipe_time_sec": pipe_time if tokens else 0.0,
        "theoretical_std_tok_s": 1.0 if tokens else 0.0,
        "theoretical_pipe_tok_s": tokens / pipe_time if tokens else 0.0,
        "theoretical_throughput_gain_pct": (tokens / pipe_time - 1.0) * 100.0 if tokens else 0.0,
        "wall_time_sec": _wall(row),
        "num_stages": n,
        "use_deepest": True,  # finished tokens draft from their deepest features, as the reference's v11 heads
        "draft_top_k": shape.width,
        "pipeline_prefill_wall_sec": timing.get("prefill", 0.0),
        "pipeline_decode_wall_sec": decode,
        "pipeline_decode_tok_s": _ratio(tokens, decode),
        "pipeline_stage_stream_gpu_sec": stage_s,
        "pipeline_ideal_parallel_saved_sec": saved,
        "ideal_decode_wall_sec": ideal,
        "pipeline_ideal_decode_tok_s": _ratio(tokens, ideal),
        # beyond the reference's fields: the sampling, the stage split and our losslessness verdict
        "temperature": row["temperature"],
        "top_k": row.get("top_k", 0),
        "top_p": row.get("top_p", 1.0),
        "theoretical_pipeline_parallel_factor": shape.num_layers / shape.largest_stage,
        "prompt_len": row.get("prompt_tokens"),
        "lossless": row["lossless"],
    }
    if baseline:
        out.update({
            "baseline_prefill_wall_sec": (baseline.get("timing") or {}).get("prefill", 0.0),
            "baseline_decode_wall_sec": base_decode,
            "baseline_new_tokens": baseline.get("new_tokens", 0),
            "baseline_decode_tok_s": base_tok_s,
            "speedup_vs_baseline": _ratio(out["pipeline_decode_tok_s"], base_tok_s or 0.0) or None,
            "ideal_speedup_vs_baseline": _ratio(out["pipeline_ideal_decode_tok_s"], base_tok_s or 0.0) or None,
        })
    return out


REFERENCE = ExportFormat(reference_sample, "__per_sample", "the reference code's per-sample JSONL")
