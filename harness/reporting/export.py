"""Our records in other tools' formats, so their scripts read our runs.

- `spec-bench`: Spec-Bench answer files, one JSONL per configuration (`question_id`, `category`, `answer_id`,
  `model_id`, `choices[0]` with `turns`, `decoding_steps`, `new_tokens`, `wall_time`, `accept_lengths`, `tstamp`),
  one line per question with a list entry per turn (a run of every MT-Bench turn: both, in order).
  Its `speed.py` takes a configuration's file and the autoregressive one as `--base-path`; its `equal.py` compares the
  `turns` of two files. The category is the dataset name (its `overall` task reads every line). Simulated records
  have no wall time and are skipped.
- a family's own formats (`Reports.exports`; the pipeline family's `reference`: the reference code's per-sample JSONL,
  methods/pipeline/export.py), one file per configuration. Records of methods without the format are counted as
  skipped.

File names are derived from the configuration (safe characters only, its key last, so they stay unique), and a
folder receives all of an export's files or none.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections import defaultdict
from pathlib import Path

import methods  # noqa: F401  (fills the registry)
from harness.runtime.errors import HarnessError
from harness.runtime.files import Outputs
from harness.runtime.paths import check_out_path
from methods.base import REGISTRY
from methods.capabilities import Reports, offered

SPEC_BENCH = "spec-bench"


def formats() -> dict[str, list[str]]:
    """Every export format and the methods whose records it writes (Spec-Bench's: every method's)."""
    found = {SPEC_BENCH: sorted(REGISTRY)}
    for name, cls in REGISTRY.items():
        for fmt in offered(cls, Reports).exports:
            found.setdefault(fmt, []).append(name)
    return found


def formats_help() -> str:
    """What each format is, for --help."""
    about = {fmt: spec.about for cls in REGISTRY.values() for fmt, spec in offered(cls, Reports).exports.items()}
    return "; ".join(f"{fmt}: {about.get(fmt, 'Spec-Bench answer files')} ({', '.join(names)})"
                     for fmt, names in formats().items())


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


def spec_bench_answer(turns: list[dict]) -> dict:
    """One question's answer line from the records of its turns (in order), its lists one entry per turn."""
    row = turns[0]
    answer = hashlib.sha256(f"{row['config_key']}/{row['dataset']}/{row['question_id']}".encode()).hexdigest()[:22]
    return {
        "question_id": row["question_id"],
        "category": row["dataset"],
        "answer_id": answer,
        "model_id": _name(row),
        "choices": [{"index": 0, "turns": [t["output_text"] for t in turns],
                     "decoding_steps": [t["steps"] for t in turns], "new_tokens": [t["new_tokens"] for t in turns],
                     "wall_time": [_wall(t) for t in turns],
                     "accept_lengths": [a for t in turns for a in t["accepted"]]}],
        "tstamp": max(_stamp(t) for t in turns),
    }


def _answers(group: list[dict]) -> list[dict]:
    """A configuration's answer lines: its records grouped by question, each question's turns in order."""
    questions: dict[tuple, list[dict]] = defaultdict(list)
    for row in group:
        questions[(row["dataset"], str(row["question_id"]))].append(row)
    return [spec_bench_answer(sorted(turns, key=lambda t: t.get("turn", 1))) for turns in questions.values()]


def _questions(rows: list[dict]) -> dict[tuple[str, str, int], str]:
    """The user turn's text per (dataset, question id, turn) from the prompt sets, where they load here (else
    none)."""
    from harness.bench.data import load_samples

    texts = {}
    for dataset in sorted({r["dataset"] for r in rows}):
        try:
            texts.update({(dataset, str(s.question_id), turn): text for s in load_samples(dataset)
                          for turn, text in enumerate(s.turns("all"), 1)})
        except HarnessError:
            continue
    return texts


def export(rows: list[dict], fmt: str, out: Path, outputs: Outputs | None = None) -> tuple[list[Path], int]:
    """Write one file per configuration under `out` (a file already there only with `outputs`' --replace); returns
    the files and how many records had no such format."""
    outputs = outputs or Outputs(replace=False)
    known = formats()
    if fmt not in known:
        raise HarnessError(f"--format must be one of {', '.join(known)}, got {fmt!r}")
    groups: dict[str, list[dict]] = defaultdict(list)
    skipped = simulated = 0
    for row in sorted(rows, key=lambda r: (r["dataset"], str(r["question_id"]), r.get("turn", 1))):
        if fmt == SPEC_BENCH and row.get("simulated"):  # a replay has no wall time to divide by
            simulated += 1
        elif row["method"] in known[fmt]:
            groups[_file_name(row)].append(row)
            continue
        skipped += 1
    if not groups and simulated:
        raise HarnessError(f"no records to export as {fmt}: all {simulated} matching records were simulated "
                           f"(--simulate replays have no wall time); run `spd-bench run` without --simulate")
    if not groups:
        raise HarnessError(f"no records to export as {fmt} ({fmt}: {', '.join(known[fmt])} runs only); run "
                           f"`spd-bench run` first")
    check_out_path(out, folder=True)
    if fmt == SPEC_BENCH:
        files = {f"{name}.jsonl": _answers(group) for name, group in sorted(groups.items())}
        return _write_all(out, files, outputs), skipped
    questions = _questions(rows)
    files = {}
    for name, group in sorted(groups.items()):
        family = offered(REGISTRY[group[0]["method"]], Reports).exports[fmt]
        files[f"{name}{family.suffix}.jsonl"] = [
            family.sample(r, i, questions.get((r["dataset"], str(r["question_id"]), r.get("turn", 1))))
            for i, r in enumerate(group)]
    return _write_all(out, files, outputs), skipped


def _write_all(out: Path, files: dict[str, list[dict]], outputs: Outputs) -> list[Path]:
    """Every file written into a staging folder first, then moved in: all of them appear or none."""
    with outputs.staged(out) as staging:
        for name, lines in files.items():
            (staging / name).write_text("".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines),
                                        encoding="utf-8")
    return [out / name for name in files]
