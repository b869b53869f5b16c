"""The JSONL store: readers never modify a file, only the writer holding it repairs its own torn tail, a second
writer is refused, duplicates count once, and two writers plus a reader under stress lose and duplicate nothing."""

import json
import multiprocessing
import os

import pytest

from harness.runtime.errors import HarnessError
from harness.runtime.results import ResultStore, load_all, sample_key


def _row(i, key="k", payload=0):
    """A sample record with every field the readers need."""
    return {"config_key": key, "dataset": "d", "question_id": i, "output_ids": [1] * payload,
            "method": "autoregressive", "params": {}, "model": {"name": "m"}, "temperature": 0.0,
            "max_new_tokens": payload, "seed": 0, "new_tokens": payload, "steps": payload, "accepted": [],
            "position_accepts": [], "timing": {}, "lossless": {}}


def test_append_then_load_round_trips(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    assert store.load() == [] and not store.path.exists()
    store.append(_row(1))
    store.append(_row(2))
    assert [r["question_id"] for r in store.load()] == [1, 2]
    assert store.finished() == {("k", "d", "1", 1), ("k", "d", "2", 1)}


def test_a_reader_skips_a_torn_final_line_and_leaves_the_file_as_it_is(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.append(_row(1))
    with open(store.path, "a") as fh:
        fh.write(json.dumps(_row(2))[:20])  # killed mid-write, or another process still writing
    before = store.path.read_bytes()
    assert [r["question_id"] for r in store.load()] == [1]
    loaded = load_all(store.path)
    assert [r["question_id"] for r in loaded.rows] == [1] and loaded.duplicates == 0
    assert store.path.read_bytes() == before


def test_a_last_record_without_its_newline_is_read_and_kept(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.path.write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(2)))
    assert [r["question_id"] for r in load_all(store.path).rows] == [1, 2]
    with store.writing():
        store.append(_row(3))
    assert [r["question_id"] for r in store.load()] == [1, 2, 3]


def test_the_writer_repairs_its_own_torn_tail(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.append(_row(1))
    with open(store.path, "a") as fh:
        fh.write(json.dumps(_row(2))[:20])
    with store.writing():
        store.append(_row(2))
    assert [r["question_id"] for r in store.load()] == [1, 2]


def test_a_file_that_is_not_a_results_file_is_never_touched(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nimportant last line")
    before = notes.read_bytes()
    for action in (ResultStore(notes).load, lambda: ResultStore(notes).writing().__enter__(), lambda: load_all(notes)):
        with pytest.raises(HarnessError, match="notes.txt:1: not a result record"):
            action()
    assert notes.read_bytes() == before


def test_a_second_writer_is_refused_and_an_unused_new_file_is_removed(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    with store.writing(), pytest.raises(HarnessError, match="being written by another spd-bench run"):
        with ResultStore(store.path).writing():
            pass
    assert not store.path.exists()  # nothing was appended: no empty file left behind


def test_duplicates_of_a_sample_count_once(tmp_path):
    ResultStore(tmp_path / "a.jsonl").append(_row(1))
    ResultStore(tmp_path / "a.jsonl").append(_row(1))
    ResultStore(tmp_path / "b.jsonl").append(_row(2))
    loaded = load_all(tmp_path)
    assert sorted(r["question_id"] for r in loaded.rows) == [1, 2] and loaded.duplicates == 1


def test_a_sample_timed_again_on_another_engine_is_kept_beside_the_first(tmp_path):
    before, after = _row(1), _row(1)
    before["conditions"] = {"linears": "onednn", "busy": False}
    after["conditions"] = {"linears": "rows", "attention": "rows", "busy": True}
    again = {**after, "conditions": {**after["conditions"], "busy": False}}  # the same engine: a duplicate
    for row in (before, after, again):
        ResultStore(tmp_path / "a.jsonl").append(row)
    loaded = load_all(tmp_path)
    assert [r["conditions"]["linears"] for r in loaded.rows] == ["onednn", "rows"] and loaded.duplicates == 1


def test_a_corrupt_line_in_the_middle_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row(1)) + "\nnot json\n" + json.dumps(_row(2)) + "\n")
    with pytest.raises(HarnessError, match=r"r.jsonl:2: not a result record"):
        ResultStore(path).load()


def test_load_all_reads_every_file_under_a_folder(tmp_path):
    ResultStore(tmp_path / "a" / "x.jsonl").append(_row(1))
    ResultStore(tmp_path / "b.jsonl").append(_row(2))
    assert sorted(r["question_id"] for r in load_all(tmp_path).rows) == [1, 2]
    with pytest.raises(HarnessError, match="does not exist"):
        load_all(tmp_path / "missing")


def _writer(path: str, key: str, count: int, payload: int) -> None:
    """A run's writer: waits for the file, then appends its records (skipping those already there)."""
    store = ResultStore(path)
    while True:
        try:
            with store.writing():
                done = store.finished()
                for i in range(count):
                    if sample_key(key, "d", i) not in done:
                        store.append(_row(i, key, payload))
                return
        except HarnessError:
            continue


def _reader(path: str, rounds: int, out) -> None:
    sizes = []
    for _ in range(rounds):
        sizes.append(len(ResultStore(path).load()))
        os.sched_yield()
    out.put(sizes)


def test_two_writers_and_a_reader_lose_and_duplicate_nothing(tmp_path):
    path = str(tmp_path / "r.jsonl")
    context = multiprocessing.get_context("fork")
    out = context.Queue()
    writers = [context.Process(target=_writer, args=(path, key, 150, 2_000)) for key in ("a", "a", "b")]
    reader = context.Process(target=_reader, args=(path, 100, out))
    for process in (*writers, reader):
        process.start()
    sizes = out.get(timeout=60)
    for process in (*writers, reader):
        process.join(timeout=60)
        assert process.exitcode == 0
    rows = ResultStore(path).load()
    keys = [(r["config_key"], r["question_id"]) for r in rows]
    assert len(keys) == len(set(keys)) == 300  # two runs of "a" (150) and one of "b" (150), each sample once
    assert sizes == sorted(sizes)  # a reader never saw records disappear


def test_a_folder_with_other_tools_files_is_read_with_those_skipped_and_a_broken_results_file_refused(tmp_path):
    ResultStore(tmp_path / "ours.jsonl").append(_row(1))
    (tmp_path / "exports").mkdir()
    (tmp_path / "exports" / "spec-bench.jsonl").write_text(json.dumps({"question_id": 1, "choices": []}) + "\n")
    (tmp_path / "notes.jsonl").write_text("not json at all\n")
    loaded = load_all(tmp_path)
    assert [r["question_id"] for r in loaded.rows] == [1]
    assert sorted(p.name for p in loaded.foreign) == ["notes.jsonl", "spec-bench.jsonl"]
    (tmp_path / "claims.jsonl").write_text(json.dumps(_row(2)) + "\n" + json.dumps({"choices": []}) + "\n")
    with pytest.raises(HarnessError, match="claims.jsonl:2: not a result record"):
        load_all(tmp_path)


def test_a_writer_that_appends_nothing_leaves_a_last_line_without_its_newline_as_it_was(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.path.write_text(json.dumps(_row(1)) + "\n" + json.dumps(_row(2)))
    before = store.path.read_bytes()
    with store.writing():
        pass  # a run with nothing left to decode
    assert store.path.read_bytes() == before


def test_a_last_line_that_parses_but_is_no_record_is_refused_never_cut(tmp_path):
    store = ResultStore(tmp_path / "r.jsonl")
    store.path.write_text(json.dumps(_row(1)) + "\n" + json.dumps({"note": "mine"}))
    before = store.path.read_bytes()
    with pytest.raises(HarnessError, match="r.jsonl:2: not a result record"):
        with store.writing():
            store.append(_row(2))
    assert store.path.read_bytes() == before


def test_a_fifo_or_a_device_is_refused_in_one_line_and_never_read(tmp_path):
    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)  # opening it to read would block forever
    for action in (ResultStore(fifo).load, lambda: ResultStore(fifo).writing().__enter__(), lambda: load_all(fifo)):
        with pytest.raises(HarnessError, match="is a FIFO, not a regular file|is a FIFO; pass"):
            action()
    with pytest.raises(HarnessError, match="is a character device, not a regular file"):
        ResultStore("/dev/zero").load()  # a device that reads forever, as /dev/full does


def test_a_folder_skips_fifos_and_dangling_links_named_jsonl(tmp_path):
    ResultStore(tmp_path / "ours.jsonl").append(_row(1))
    os.mkfifo(tmp_path / "pipe.jsonl")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    loaded = load_all(tmp_path)
    assert [r["question_id"] for r in loaded.rows] == [1]
    assert sorted(p.name for p in loaded.foreign) == ["gone.jsonl", "pipe.jsonl"]


def test_a_symlinked_results_file_is_appended_through_and_stays_a_link(tmp_path):
    real = tmp_path / "real.jsonl"
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    store = ResultStore(link)
    with store.writing():
        store.append(_row(1))
    assert link.is_symlink() and [r["question_id"] for r in ResultStore(real).load()] == [1]


@pytest.mark.parametrize("change, problem", [({"steps": None}, "a NoneType as 'steps'"),
                                             ({"new_tokens": "12"}, "a str as 'new_tokens'"),
                                             ({"lossless": True}, "a bool as 'lossless'"),
                                             ({"model": {}}, "no model name")])
def test_a_sample_record_with_a_mistyped_field_is_one_line_naming_file_and_line(tmp_path, change, problem):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row(1)) + "\n" + json.dumps({**_row(2), **change}) + "\n")
    with pytest.raises(HarnessError, match=f"r.jsonl:2: a sample record with {problem}"):
        load_all(tmp_path)
    missing = _row(3)
    del missing["timing"]
    path.write_text(json.dumps(missing) + "\n")
    with pytest.raises(HarnessError, match="r.jsonl:1: a sample record with no 'timing' field"):
        load_all(path)
