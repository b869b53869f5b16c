"""Commands write only the regular files they own: never a device node, a FIFO or a symlink itself, never a file
they did not write in this invocation unless told --replace, never a line of a results file that parses. Device
nodes are stood in for by FIFOs, and by a private character device where the tests run as root."""

import json
import os
import stat

import pytest
from click.testing import CliRunner

from harness.cli import main


def _invoke(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output, result.stderr


@pytest.fixture(scope="module")
def records(tiny_dir, eval_dir, tmp_path_factory):
    """One small results file made by a real run on the tiny model."""
    folder = tmp_path_factory.mktemp("records")
    out = folder / "r.jsonl"
    os.environ["SPD_BENCH_CACHE"] = str(folder / "cache")
    try:
        for method in ("autoregressive", "lookup"):  # lookup's rounds give the report its figures
            code, output, _ = _invoke("run", "--model", tiny_dir, "--method", method, "--dataset", "gsm8k",
                                      "--limit", "2", "--max-new-tokens", "4", "--data-dir", eval_dir, "--out", out)
            assert code == 0, output
    finally:
        del os.environ["SPD_BENCH_CACHE"]
    return out


def _one_line_error(code, stderr, message):
    """Exit 2 with the error on one line (notes about the records read, e.g. a modified tree, aside)."""
    lines = [line for line in stderr.strip().splitlines() if not line.startswith("note: ")]
    assert code == 2 and message in stderr and len(lines) == 1, stderr


def test_report_out_never_replaces_a_fifo_a_device_or_a_symlink_nor_a_users_tmp_file(records, tmp_path):
    fifo = tmp_path / "pipe.md"
    os.mkfifo(fifo)
    code, _, stderr = _invoke("report", "--results", records, "--out", fifo)
    _one_line_error(code, stderr, "is a FIFO, not a regular file")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    if os.geteuid() == 0:  # a character device of our own (the numbers of /dev/null), in a private folder
        device = tmp_path / "null"
        os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        code, _, stderr = _invoke("report", "--results", records, "--out", device, "--replace")
        _one_line_error(code, stderr, "is a character device, not a regular file")
        assert stat.S_ISCHR(os.lstat(device).st_mode)

    real, link = tmp_path / "real.md", tmp_path / "link.md"
    real.write_text("old")
    link.symlink_to(real)
    mine = tmp_path / "link.md.tmp"
    mine.write_text("the user's own notes")
    code, output, _ = _invoke("report", "--results", records, "--out", link, "--replace")
    assert code == 0, output
    assert link.is_symlink() and "autoregressive" in real.read_text()
    assert mine.read_text() == "the user's own notes"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no staging left behind


def test_report_out_refuses_an_existing_report_or_figure_without_replace(records, tmp_path):
    out = tmp_path / "x" / "results.md"
    code, output, _ = _invoke("report", "--results", records, "--out", out)
    assert code == 0, output
    made = sorted(p.name for p in (out.parent / "figures").iterdir())
    assert made, "the report writes figures beside it"
    first = out.read_text()
    out.unlink()
    figure = out.parent / "figures" / made[0]
    figure.write_bytes(b"the user's own picture")
    code, _, stderr = _invoke("report", "--results", records, "--out", out)
    _one_line_error(code, stderr, "already exists and this command did not write it; pass --replace")
    assert figure.read_bytes() == b"the user's own picture" and not out.exists()  # all or nothing
    code, output, _ = _invoke("report", "--results", records, "--out", out, "--replace")
    assert code == 0 and out.read_text() == first and figure.read_bytes() != b"the user's own picture"


def test_export_refuses_to_replace_a_same_named_edited_file_without_replace(records, tmp_path):
    out = tmp_path / "export"
    code, output, _ = _invoke("export", "--format", "spec-bench", "--results", records, "--out", out)
    assert code == 0, output
    written = sorted(out.iterdir())[0]
    written.write_text("edited by hand\n")
    code, _, stderr = _invoke("export", "--format", "spec-bench", "--results", records, "--out", out)
    _one_line_error(code, stderr, "already exists")
    assert written.read_text() == "edited by hand\n"
    code, output, _ = _invoke("export", "--format", "spec-bench", "--results", records, "--out", out, "--replace")
    assert code == 0 and json.loads(written.read_text().splitlines()[0])["question_id"] == 0


def test_a_run_with_nothing_to_decode_keeps_a_last_record_without_its_newline(records, tiny_dir, eval_dir, tmp_path,
                                                                             cache):
    out = tmp_path / "r.jsonl"
    first = records.read_text().splitlines()[:2]  # autoregressive's records
    out.write_text("\n".join(first))  # a file copied or edited without its final newline
    before = out.read_bytes()
    code, output, _ = _invoke("run", "--model", tiny_dir, "--dataset", "gsm8k", "--limit", "2",
                              "--max-new-tokens", "4", "--data-dir", eval_dir, "--out", out)
    assert code == 0, output
    assert out.read_bytes() == before
    code, output, _ = _invoke("run", "--model", tiny_dir, "--dataset", "gsm8k", "--limit", "3",
                              "--max-new-tokens", "4", "--data-dir", eval_dir, "--out", out)
    assert code == 0, output
    assert [json.loads(line)["question_id"] for line in out.read_text().splitlines()] == [0, 1, 2]


def test_run_out_a_fifo_is_one_line_and_a_results_folder_skips_one(records, tiny_dir, eval_dir, tmp_path, cache):
    fifo = tmp_path / "r.jsonl"
    os.mkfifo(fifo)
    code, _, stderr = _invoke("run", "--model", tiny_dir, "--dataset", "gsm8k", "--limit", "1",
                              "--max-new-tokens", "4", "--data-dir", eval_dir, "--out", fifo)
    _one_line_error(code, stderr, "is a FIFO, not a regular file")
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "missing.jsonl")
    (tmp_path / "kept.jsonl").write_bytes(records.read_bytes())
    code, output, stderr = _invoke("report", "--results", tmp_path, "--summary")
    assert code == 0 and "autoregressive" in output
    assert "r.jsonl is not a results file (a FIFO, not a regular file): skipped" in stderr
    assert "gone.jsonl is not a results file (a dangling symlink, not a regular file): skipped" in stderr


@pytest.mark.parametrize("args, message", [
    (["check", "--baseline", "{tmp}", "--results", "{records}", "--write"], "is a folder; pass a file path"),
    (["check", "--baseline", "{records}/b.json", "--results", "{records}", "--write"], "lies under the file"),
    (["check", "--baseline", "{tmp}/b.json", "--rerun", "--results", "{records}"], "does not exist"),
    (["export", "--format", "spec-bench", "--results", "{records}", "--out", "{records}/x"], "lies under the file"),
])
def test_paths_that_cannot_be_written_or_read_are_one_line(args, message, records, tmp_path):
    code, _, stderr = _invoke(*[a.format(tmp=tmp_path, records=records) for a in args])
    _one_line_error(code, stderr, message)


def test_run_out_under_a_file_is_one_line(records, tiny_dir, eval_dir, cache):
    code, _, stderr = _invoke("run", "--model", tiny_dir, "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "4",
                              "--data-dir", eval_dir, "--out", records / "r.jsonl")
    _one_line_error(code, stderr, "lies under the file")


def _hash_at_once(folder, cache, start):
    os.environ["SPD_BENCH_CACHE"] = str(cache)
    from harness.runtime.models import weights_sha256

    start.wait()
    return weights_sha256(folder)


def test_processes_filling_the_weight_hash_cache_at_once_each_leave_a_whole_file(tmp_path):
    """Ranks of one group hash their model at the same moment into one shared cache: no process may find its
    temporary file taken by another's rename (a fixed temporary name failed a distributed start this way)."""
    import multiprocessing

    from safetensors.torch import save_file
    import torch

    folders = []
    for i in range(6):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        save_file({"w": torch.full((4,), float(i))}, folder / "model.safetensors")
        folders.append(folder)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        start = manager.Barrier(len(folders))
        with context.Pool(len(folders)) as pool:
            digests = pool.starmap(_hash_at_once, [(f, tmp_path / "cache", start) for f in folders])
    assert len(set(digests)) == len(folders)
    json.loads((tmp_path / "cache" / "weight-hashes.json").read_text())
    assert not list((tmp_path / "cache").glob("*.tmp"))
