"""The JSONL store survives kills (torn final line) and refuses files it cannot read."""

import json

import pytest

from harness.errors import HarnessError
from harness.results import ResultStore, load_all


def _row(i):
    return {"config_key": "k", "dataset": "d", "question_id": i, "output_ids": [1], "method": "autoregressive"}


def test_append_then_load_round_trips(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    assert store.load() == [] and not store.path.exists()
    store.append(_row(1))
    store.append(_row(2))
    assert [r["question_id"] for r in store.load()] == [1, 2]
    assert store.finished() == {("k", "d", "1"), ("k", "d", "2")}


def test_a_torn_final_line_is_trimmed_on_load(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.append(_row(1))
    with open(store.path, "a") as fh:
        fh.write(json.dumps(_row(2))[:20])  # killed mid-write
    assert [r["question_id"] for r in store.load()] == [1]
    assert store.path.read_text().endswith("\n")


def test_a_corrupt_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row(1)) + "\nnot json\n" + json.dumps(_row(2)) + "\n")
    with pytest.raises(HarnessError, match=r"r.jsonl:2: not a result record"):
        ResultStore(path).load()


def test_load_all_reads_every_file_under_a_folder(tmp_path):
    ResultStore(tmp_path / "a" / "x.jsonl").append(_row(1))
    ResultStore(tmp_path / "b.jsonl").append(_row(2))
    assert sorted(r["question_id"] for r in load_all(tmp_path)) == [1, 2]
    with pytest.raises(HarnessError, match="does not exist"):
        load_all(tmp_path / "missing")
