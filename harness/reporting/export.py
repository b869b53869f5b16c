"""Our records in other tools' formats, so their scripts read our runs.

- `spec-bench`: Spec-Bench answer files, one JSONL per configuration (`question_id`, `category`, `answer_id`,
  `model_id`, `choices[0]` with `turns`, `decoding_steps`, `new_tokens`, `wall_time`, `accept_lengths`, `tstamp`).
  Its `speed.py` takes a configuration's file and the autoregressive one as `--base-path`; its `equal.py` compares the
  `turns` of two files. The category is the dataset name (its `overall` task reads every line). Simulated records
  have no wall time and are skipped.
- `reference`: the reference code's per-sample JSONL for pipeline runs, every field its eval script writes, by its
  definitions (`reference_sample`), one file per configuration, so its aggregation (pooled N / S, n * sum N / sum S,
  token-weighted mean theoretical gain, pooled flags and tokens per second) applies unchanged. Records of other
  methods have no such file and are counted as skipped.

File names are derived from the configuration (safe characters only, its key last, so they stay unique), and a
folder receives all of an export's files or none.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from harness.runtime.errors import HarnessError
from harness.runtime.paths import check_out_path

FORMATS = ("spec-bench", "reference")


def _name(row: dict) -> str:
    params = "-".join(f"{k}{v}" for k, v in sorted(row["params"].items()))
    executor = (row.get("stats", {}).get("executor") or {}).get("kind", "local")
    parts = [row["model"]["name"].replace("/", "--"), row["method"], params, f"temperature-{row['temperature']:g}",
             "simulated" if row.get("simulated") else "", "distributed" if executor == "distributed" else "",
             row["config_key"]]
    return "-".join(p for p in parts if p)


def _file_name(row: dict) -> str:
    """A safe file name for the row's configuration: parameter values may hold "/" or spaces (SSD's --draft-model
    /path or org/name); the configuration key at the end keeps names unique however they were shortened."""
    readable = re.sub(r"[^A-Za-z0-9._=+-]+", "_", _name(row).removesuffix(row["config_key"])).strip("_-.")
    return f"{readable[:150]}-{row['config_key']}"


def _wall(row: dict) -> float:
    return row["timing"].get("prefill", 0.0) + row["timing"].get("decode", 0.0)


def _stamp(row: dict) -> float:
    finished = row.get("stats", {}).get("finished_at")
    return time.mktime(time.strptime(finished, "%Y-%m-%dT%H:%M:%S")) if finished else 0.0


def spec_bench_answer(row: dict) -> dict:
    answer = hashlib.sha256(f"{row['config_key']}/{row['dataset']}/{row['question_id']}".encode()).hexdigest()[:22]
    return {
        "question_id": row["question_id"],
        "category": row["dataset"],
        "answer_id": answer,
        "model_id": _name(row),
        "choices": [{"index": 0, "turns": [row["output_text"]], "decoding_steps": [row["steps"]],
                     "new_tokens": [row["new_tokens"]], "wall_time": [_wall(row)],
                     "accept_lengths": row["accepted"]}],
        "tstamp": _stamp(row),
    }


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def reference_sample(row: dict, index: int, question: str | None) -> dict:
    """One row of the reference's eval output, every field it writes, by its definitions: N new tokens (the prefill
    token included), S decode-loop steps, `acceptance_rate` N / S, `equivalent_accept_length` n N / S; its toy timing
    model (a standard step 1 s, a pipeline step 1/n s) gives the theoretical times and `theoretical_throughput_gain_pct`
    = (n N / S - 1) * 100; its acceptance flags count the prefill token as one accepted flag. The "ideal" times are
    the decode with the stages' compute run in parallel (one process: the stage seconds shrink to the largest
    stage's share; distributed: they already ran in parallel, nothing is saved)."""
    shape, stats, timing = row["stats"]["pipeline"], row["stats"], row.get("timing") or {}
    n, steps, tokens = shape["n"], row["steps"], row["new_tokens"]
    pipe_time = max(steps, 1) / n
    executor = stats.get("executor") or {}
    distributed = executor.get("kind") == "distributed"
    stage_s = sum(executor.get("stage_forward_s", [])) if distributed else timing.get("stages", 0.0)
    saved = 0.0 if distributed else stage_s * (1 - shape["largest_stage"] / shape["num_layers"])
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
        "n_acceptance_flags": sum(stats.get("fill_drafts", [])) + 1,
        "theoretical_std_time_sec": float(tokens),
        "theoretical_pipe_time_sec": pipe_time if tokens else 0.0,
        "theoretical_std_tok_s": 1.0 if tokens else 0.0,
        "theoretical_pipe_tok_s": tokens / pipe_time if tokens else 0.0,
        "theoretical_throughput_gain_pct": (tokens / pipe_time - 1.0) * 100.0 if tokens else 0.0,
        "wall_time_sec": _wall(row),
        "num_stages": n,
        "use_deepest": True,  # finished tokens draft from their deepest features, as the reference's v11 heads
        "draft_top_k": shape["width"],
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
        "theoretical_pipeline_parallel_factor": shape["num_layers"] / shape["largest_stage"],
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


def _questions(rows: list[dict]) -> dict[tuple[str, str], str]:
    """The prompt text per (dataset, question id) from the prompt sets, where they load here (else none)."""
    from harness.bench.data import load_samples

    texts = {}
    for dataset in sorted({r["dataset"] for r in rows}):
        try:
            texts.update({(dataset, str(s.question_id)): s.prompt for s in load_samples(dataset)})
        except HarnessError:
            continue
    return texts


def export(rows: list[dict], fmt: str, out: Path) -> tuple[list[Path], int]:
    """Write one file per configuration under `out`; returns the files and how many records had no such format."""
    if fmt not in FORMATS:
        raise HarnessError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    groups: dict[str, list[dict]] = defaultdict(list)
    skipped = 0
    for row in sorted(rows, key=lambda r: (r["dataset"], str(r["question_id"]))):
        if (fmt == "reference" and "pipeline" not in row.get("stats", {})) or (
                fmt == "spec-bench" and row.get("simulated")):  # a replay has no wall time to divide by
            skipped += 1
            continue
        groups[_file_name(row)].append(row)
    if not groups:
        raise HarnessError(f"no records to export as {fmt} (reference: pipeline runs only); run `spd-bench run` first")
    check_out_path(out, folder=True)
    questions = _questions(rows) if fmt == "reference" else {}
    files = {}
    for name, group in sorted(groups.items()):
        lines = [spec_bench_answer(r) if fmt == "spec-bench" else
                 reference_sample(r, i, questions.get((r["dataset"], str(r["question_id"]))))
                 for i, r in enumerate(group)]
        files[f"{name}{'__per_sample' if fmt == 'reference' else ''}.jsonl"] = lines
    return _write_all(out, files), skipped


def _write_all(out: Path, files: dict[str, list[dict]]) -> list[Path]:
    """Every file written into a staging folder first, then moved in: all of them appear or none."""
    out.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out, prefix=".export-"))
    try:
        for name, lines in files.items():
            (staging / name).write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                                        encoding="utf-8")
        written = []
        for name in files:
            (staging / name).replace(out / name)
            written.append(out / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
