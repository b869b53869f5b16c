"""Our records in other tools' formats, so their scripts read our runs.

- `spec-bench`: Spec-Bench answer files, one JSONL per configuration (`question_id`, `category`, `answer_id`,
  `model_id`, `choices[0]` with `turns`, `decoding_steps`, `new_tokens`, `wall_time`, `accept_lengths`, `tstamp`).
  Its `speed.py` takes a configuration's file and the autoregressive one as `--base-path`; its `equal.py` compares the
  `turns` of two files. The category is the dataset name (its `overall` task reads every line). Simulated records
  have no wall time and are skipped.
- `reference`: the reference code's per-sample JSONL for pipeline runs (`dataset`, `question_id`, `generated`,
  `new_tokens`, `decode_loop_steps`, `acceptance_rate` = N / S, `equivalent_accept_length` = n * N / S, wall times and
  decode tok/s), one file per configuration, so its summaries (per-sample means, pooled rates) apply unchanged. Records
  of other methods have no such file and are counted as skipped.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import defaultdict
from pathlib import Path

from harness.errors import HarnessError

FORMATS = ("spec-bench", "reference")


def _name(row: dict) -> str:
    params = "-".join(f"{k}{v}" for k, v in sorted(row["params"].items()))
    executor = (row.get("stats", {}).get("executor") or {}).get("kind", "local")
    parts = [row["model"]["name"].replace("/", "--"), row["method"], params, f"temperature-{row['temperature']:g}",
             "simulated" if row.get("simulated") else "", "distributed" if executor == "distributed" else "",
             row["config_key"]]
    return "-".join(p for p in parts if p)


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


def reference_sample(row: dict, index: int) -> dict:
    shape = row["stats"]["pipeline"]
    steps, tokens = row["steps"], row["new_tokens"]
    rate = tokens / steps if steps else 0.0
    decode = row["timing"].get("decode", 0.0)
    baseline = row.get("baseline") or {}
    baseline_decode = baseline.get("timing", {}).get("decode", 0.0)
    return {
        "index": index,
        "dataset": row["dataset"],
        "question_id": row["question_id"],
        "generated": row["output_text"],
        "prompt_len": row["prompt_tokens"],
        "new_tokens": tokens,
        "decode_loop_steps": steps,
        "acceptance_rate": rate,
        "equivalent_accept_length": shape["n"] * rate,
        "n_accepted": sum(row["position_accepts"]),
        "n_acceptance_flags": sum(row["stats"].get("fill_drafts", [])),
        "theoretical_pipeline_parallel_factor": shape["num_layers"] / shape["largest_stage"],
        "num_stages": shape["n"],
        "draft_top_k": shape["width"],
        "temperature": row["temperature"],
        "top_k": row["top_k"],
        "top_p": row["top_p"],
        "wall_time_sec": _wall(row),
        "pipeline_prefill_wall_sec": row["timing"].get("prefill", 0.0),
        "pipeline_decode_wall_sec": decode,
        "pipeline_decode_tok_s": tokens / decode if decode else 0.0,
        "baseline_decode_tok_s": baseline.get("new_tokens", 0) / baseline_decode if baseline_decode else None,
        "lossless": row["lossless"],
    }


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
        groups[_name(row)].append(row)
    if not groups:
        raise HarnessError(f"no records to export as {fmt} (reference: pipeline runs only); run `spd-bench run` first")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, group in sorted(groups.items()):
        lines = [spec_bench_answer(r) if fmt == "spec-bench" else reference_sample(r, i) for i, r in enumerate(group)]
        path = out / f"{name}{'__per_sample' if fmt == 'reference' else ''}.jsonl"
        tmp = path.with_suffix(".jsonl.tmp")  # a file appears whole or not at all
        tmp.write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines), encoding="utf-8")
        tmp.replace(path)
        written.append(path)
    return written, skipped
