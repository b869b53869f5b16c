"""The files the harness writes: a group of files appears whole or not at all, across filesystems too, and a
replaced file keeps its mode."""

import os
import stat
import tempfile
from pathlib import Path

import pytest

from harness.runtime.errors import HarnessError
from harness.runtime.files import Outputs, replace_whole


def _other_filesystem(tmp_path: Path) -> Path:
    """A folder on another filesystem than tmp_path (a tmpfs), or a skip where the machine has none."""
    for root in ("/dev/shm", "/run/user", "/tmp"):
        if os.path.isdir(root) and os.access(root, os.W_OK) and os.stat(root).st_dev != os.stat(tmp_path).st_dev:
            return Path(tempfile.mkdtemp(dir=root))
    pytest.skip("no writable folder on another filesystem")


def test_staged_files_reach_a_symlinked_folder_on_another_filesystem(tmp_path):
    """Fails on a16459a: `report --out` through such a link with --replace was EXDEV as a traceback, with some
    figures already moved in."""
    elsewhere = _other_filesystem(tmp_path)
    (tmp_path / "reports").symlink_to(elsewhere)
    for name in ("results.md", "figure.png"):
        (elsewhere / name).write_text("old")
    outputs = Outputs(replace=True)
    with outputs.staged(tmp_path) as staging:
        (staging / "reports").mkdir()
        (staging / "reports" / "results.md").write_text("new table")
        (staging / "reports" / "figure.png").write_bytes(b"new figure")
    assert (elsewhere / "results.md").read_text() == "new table"
    assert (elsewhere / "figure.png").read_bytes() == b"new figure"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["figure.png", "results.md"]  # no temporary left


def test_a_group_that_fails_midway_leaves_every_file_as_it_was(tmp_path, monkeypatch):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "a.md").write_text("old a")
    (folder / "b.md").write_text("old b")
    real, calls = os.replace, []

    def failing(source, target):
        calls.append(target)
        if str(target).endswith("b.md") and str(source).endswith(".tmp"):  # its move into place
            raise OSError(5, "Input/output error")
        return real(source, target)

    monkeypatch.setattr(os, "replace", failing)
    with pytest.raises(OSError):
        with Outputs(replace=True).staged(folder) as staging:
            (staging / "a.md").write_text("new a")
            (staging / "b.md").write_text("new b")
    monkeypatch.setattr(os, "replace", real)
    assert (folder / "a.md").read_text() == "old a" and (folder / "b.md").read_text() == "old b"
    assert sorted(p.name for p in folder.iterdir()) == ["a.md", "b.md"]


def test_a_group_that_cannot_be_written_is_one_line_and_writes_nothing(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    locked = folder / "locked"
    locked.mkdir()
    os.chmod(locked, 0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere
        pytest.skip("this user can write a read-only folder")
    try:
        with pytest.raises(HarnessError, match="nothing was written"):
            with Outputs(replace=True).staged(folder) as staging:
                (staging / "a.md").write_text("a")
                (staging / "locked").mkdir()
                (staging / "locked" / "b.md").write_text("b")
        assert not (folder / "a.md").exists()
    finally:
        os.chmod(locked, 0o700)


def test_replacing_a_file_keeps_its_mode(tmp_path):
    """Fails on a16459a: --replace widened a private file to 0644."""
    private = tmp_path / "private.md"
    private.write_text("old")
    os.chmod(private, 0o600)
    Outputs(replace=True).write(private, "new")
    assert private.read_text() == "new" and stat.S_IMODE(os.stat(private).st_mode) == 0o600
    replace_whole(private, "newer")
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    fresh = tmp_path / "fresh.md"
    umask = os.umask(0o027)
    try:
        replace_whole(fresh, "x")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o640  # a new file: what the umask gives
