"""The grid across machines: a sweep's plan, its shards, per-item records that merge, and what is still missing."""

import errno
import fcntl
import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.bench.config import RunConfig
from harness.bench.plan import parse_shard, plan, shard
from harness.bench.sweep import grid
from harness.cli import main
from harness.reporting.paper import paper_grid
from harness.runtime.errors import HarnessError
from harness.runtime.results import ResultStore

ROOT = Path(__file__).resolve().parents[1]
BASE = RunConfig(limit=2, max_new_tokens=16)


def test_the_plan_orders_items_by_cost_and_not_by_the_command_line():
    one = plan(grid(["spd", "eagle3"], {"n": [4, 8], "m": [3, 7], "ls": [4]}, [0.0, 1.0], [1, 4]), BASE)
    other = plan(grid(["eagle3", "spd"], {"m": [7, 3], "ls": [4], "n": [8, 4]}, [1.0, 0.0], [4, 1]), BASE)
    assert [i.name for i in one] == [i.name for i in other] and len(one) == 16
    assert [i.cost for i in one] == sorted((i.cost for i in one), reverse=True)
    assert one[0].point.method == "spd" and one[0].point.param_dict == {"n": 8, "ls": 4, "width": 4}
    simulated = plan(grid(["spd"], {"n": [8], "ls": [4]}, [0.0], [1]), replace(BASE, simulate=True))
    assert simulated[0].cost < next(i for i in one if i.name == simulated[0].name).cost  # a replay costs less
    per_dataset = plan(grid(["eagle3"], {"m": [3]}, [0.0], [1]), BASE, per_dataset=True)
    assert [i.dataset for i in per_dataset] == ["gsm8k", "humaneval", "mt_bench"]
    assert len({i.out(BASE, Path("r")) for i in one + per_dataset}) == len(one) + len(per_dataset)


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8])
def test_shards_cover_the_grid_exactly_once_and_about_evenly(count):
    items = plan(paper_grid(), BASE)
    shards = [shard(items, i, count) for i in range(1, count + 1)]
    assert sorted(i.name + i.point.method for s in shards for i in s) == sorted(i.name + i.point.method for i in items)
    loads = [sum(i.cost for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(i.cost for i in items)


@pytest.mark.parametrize("text", ["0/2", "3/2", "2", "a/b", "1/0"])
def test_a_bad_shard_is_a_one_line_error(text):
    with pytest.raises(HarnessError, match="I/N"):
        parse_shard(text)
    result = CliRunner().invoke(main, ["sweep", "--method", "lookup", "--shard", text, "--plan"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output


def test_plan_prints_each_items_exact_run_command(tmp_path, eval_dir):
    args = ["sweep", "--method", "lookup", "--k", "2,4", "--dataset", "gsm8k,mt_bench", "--limit", "1",
            "--max-new-tokens", "8", "--data-dir", str(eval_dir), "--results", str(tmp_path), "--plan"]
    lines = CliRunner().invoke(main, args).output.splitlines()
    assert len(lines) == 2 and all(line.startswith("spd-bench run --method lookup --k ") for line in lines)
    assert f"--out {tmp_path}/smollm2-135m/lookup/k2-T0.jsonl" in "\n".join(lines)
    entries = json.loads(CliRunner().invoke(main, [*args, "--json", "--shard", "2/2"]).output)
    assert [e["shard"] for e in entries] == [2] and entries[0]["command"] in lines


def _sweep(tiny, eval_dir, results, *extra):
    return ["sweep", "--method", "lookup", "--k", "1,2,3,4", "--model", str(tiny), "--dataset", "gsm8k,mt_bench",
            "--limit", "2", "--max-new-tokens", "8", "--data-dir", str(eval_dir), "--results", str(results),
            "--simulate", *extra]


def _report(*folders):
    result = CliRunner().invoke(main, ["report", *(w for f in folders for w in ("--results", str(f)))])
    assert result.exit_code == 0, result.output
    return re.sub(r"note: .*\n", "", result.output)


def test_two_shards_at_once_into_one_folder_merge_into_the_one_process_report(tiny_dir, eval_dir, tmp_path):  # noqa: F811
    """Two shard processes started together write into one results folder without refusing each other; the merged
    report equals the one-process sweep's; `--plan --missing` lists what is left; a rerun resumes, runs nothing."""
    single, shared = tmp_path / "single", tmp_path / "shared"
    assert CliRunner().invoke(main, _sweep(tiny_dir, eval_dir, single)).exit_code == 0
    missing = CliRunner().invoke(main, _sweep(tiny_dir, eval_dir, shared, "--plan", "--missing"))
    assert len(missing.output.splitlines()) == 4
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    jobs = [subprocess.Popen([sys.executable, "-m", "harness.cli", *_sweep(tiny_dir, eval_dir, shared, "--shard",
                                                                           f"{i}/2")],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in (1, 2)]
    outputs = [job.communicate()[0] for job in jobs]  # no deadline: a slow start on a busy machine is not a failure
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert all("2 of 4 work items" in out for out in outputs)
    assert len(list(shared.rglob("*.jsonl"))) == 4  # one file per work item
    assert _report(shared) == _report(single)
    assert CliRunner().invoke(main, _sweep(tiny_dir, eval_dir, shared, "--plan", "--missing")).output == ""
    again = CliRunner().invoke(main, _sweep(tiny_dir, eval_dir, shared, "--shard", "1/2"))
    assert "(0 ran now)" in again.output and sum(1 for f in shared.rglob("*.jsonl") for _ in f.open()) == 16


def test_a_configuration_split_by_dataset_across_folders_merges_into_one_row(tiny_dir, eval_dir, tmp_path):  # noqa: F811
    """Per-dataset work items in two folders (one per shard): `report --results A --results B` pools them into the
    configuration's one row, says what it read from each, and `--missing` sees a half-done second wave."""
    single, a, b = tmp_path / "single", tmp_path / "a", tmp_path / "b"
    sweep = [*_sweep(tiny_dir, eval_dir, single)]
    sweep[sweep.index("1,2,3,4")] = "2"
    assert CliRunner().invoke(main, sweep).exit_code == 0
    for folder, index in ((a, 1), (b, 2)):
        part = [*sweep, "--per-dataset", "--shard", f"{index}/2"]
        part[part.index(str(single))] = str(folder)
        assert CliRunner().invoke(main, part).exit_code == 0
    assert {f.parent.parent.parent.name for f in (*a.rglob("*.jsonl"), *b.rglob("*.jsonl"))} == {"a", "b"}
    result = CliRunner().invoke(main, ["report", "--results", str(a), "--results", str(b)])
    assert f"read 2 records from 1 results files under {a}" in result.output
    assert _report(a, b) == _report(single)
    folders = CliRunner().invoke(main, ["report", "--results", str(tmp_path)]).output  # a folder of shards' folders
    assert f"read 2 records from 1 results files under {b}" in folders and f"4 records from 1 results files under " \
        f"{single}" in folders
    left = [*sweep, "--per-dataset", "--plan", "--missing"]
    left[left.index(str(single))] = str(a)
    assert len(CliRunner().invoke(main, left).output.splitlines()) == 1  # a holds one of the two datasets


def test_a_filesystem_without_locks_writes_with_a_warning(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    store = ResultStore(tmp_path / "r.jsonl")
    with pytest.warns(UserWarning, match="does not lock files"), store.writing():
        store.append({"config_key": "k", "dataset": "d", "question_id": 1})
    assert store.finished() == {("k", "d", "1", 1)}
