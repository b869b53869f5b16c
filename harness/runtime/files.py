"""Files the harness writes and reads, and the rules that keep it to its own: only regular files are read or written
(a device node, FIFO or socket is refused in one line, never read forever or replaced); a symlink is followed to its
target, never replaced; an existing file is overwritten only with the user's `--replace`; every write goes through a
uniquely named temporary file in the target's folder and one rename, so a reader never sees half a file."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.runtime.errors import HarnessError

_KINDS = ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder"))


def kind_of(path: Path) -> str | None:
    """What a path that is not a regular file is ("a FIFO", "a dangling symlink", ...); None for a regular file or
    a path that does not exist."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return "a dangling symlink" if os.path.islink(path) else None
    except OSError as exc:
        return f"unreadable ({exc.strerror})"
    return next((name for test, name in _KINDS if test(mode)), None)


def regular_target(path: Path, what: str) -> Path:
    """The file a path names, symlinks followed: a regular file or nothing yet, under a folder (not under a file)."""
    path = Path(path)
    kind = kind_of(path)
    if kind == "a folder":
        raise HarnessError(f"{what} {path} is a folder; pass a file path such as {path / 'results.md'}")
    if kind is not None and kind != "a dangling symlink":
        raise HarnessError(f"{what} {path} is {kind}, not a regular file; pass a file path")
    target = Path(os.path.realpath(path))
    existing = target.parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise HarnessError(f"{what} {path} lies under the file {existing}; pass a path in a folder")
    return target


def readable_file(path: Path, what: str) -> Path:
    """A path to read that exists and is a regular file (symlinks followed), or a one-line error."""
    kind = kind_of(path)
    if kind is not None:
        raise HarnessError(f"{what} {path} is {kind}, not a regular file; pass a file path")
    if not Path(path).exists():
        raise HarnessError(f"{what} {path} does not exist; pass an existing file")
    return Path(path)


def make_folder(folder: Path, what: str) -> Path:
    """Create a folder to write into, or a one-line error naming why not."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HarnessError(f"cannot create {what} folder {folder} ({exc.strerror}); pass another path") from None
    return Path(folder)


def replace_whole(target: Path, data: str | bytes) -> None:
    """Write `target` through a temporary file named for this process alone and one rename: processes writing the
    same file at once (ranks filling one cache) each leave a whole file, the last one's."""
    tmp = _beside(target, data)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _beside(target: Path, data: str | bytes) -> Path:
    """`data` in a temporary file in `target`'s folder (so the rename into place never crosses a filesystem), with
    the mode `target` has (a private file stays private) or, for a new file, the one the umask gives."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, _mode_for(target))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _move_all(pairs: list[tuple[Path, Path]], what: str) -> None:
    """Each source's bytes to its target, all or none: first every file is written beside its target (a failure
    there removes them and changes nothing), then each is renamed into place within its own folder, the file it
    replaces kept aside until all are in (a failure there puts every one back)."""
    staged: list[tuple[Path, Path]] = []
    try:
        for source, target in pairs:
            make_folder(target.parent, what)
            staged.append((_beside(target, source.read_bytes()), target))
    except OSError as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise HarnessError(f"cannot write {what} {pairs[len(staged)][1]} ({exc.strerror}); nothing was written; "
                           f"pass another path") from None
    done: list[tuple[Path, Path | None]] = []
    try:
        for tmp, target in staged:
            aside = target.with_name(f".{target.name}.{os.getpid()}.old") if target.exists() else None
            if aside is not None:
                os.replace(target, aside)
            done.append((target, aside))
            os.replace(tmp, target)
    except BaseException:
        for target, aside in reversed(done):
            if aside is not None:
                os.replace(aside, target)
            elif target.exists():
                target.unlink()
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        raise
    for _, aside in done:
        if aside is not None:
            aside.unlink(missing_ok=True)


class Outputs:
    """The files one command writes: each checked before anything is written, written whole or not at all."""

    def __init__(self, replace: bool, what: str = "--out"):
        self.replace = replace
        self.what = what
        self.written: set[Path] = set()

    def claim(self, path: Path) -> Path:
        """The target of `path`, refused when it is not a regular file or exists (and neither --replace nor this
        invocation wrote it)."""
        target = regular_target(path, self.what)
        if target.exists() and not self.replace and target not in self.written:
            raise HarnessError(f"{path} already exists and this command did not write it; pass --replace to "
                               f"overwrite it or choose another path")
        return target

    def write(self, path: Path, data: str | bytes) -> Path:
        target = self.claim(path)
        make_folder(target.parent, self.what)
        replace_whole(target, data)
        self.written.add(target)
        return target

    @contextmanager
    def staged(self, folder: Path) -> Iterator[Path]:
        """A private staging folder: what the block writes there is moved into `folder` when it ends, every file
        checked first and each written beside its final target (a symlinked target on another filesystem too), so
        all of them appear or none."""
        make_folder(folder, self.what)
        staging = Path(tempfile.mkdtemp(dir=folder, prefix=".staging-"))
        try:
            yield staging
            files = sorted(p for p in staging.rglob("*") if p.is_file())
            targets = [self.claim(folder / p.relative_to(staging)) for p in files]
            _move_all(list(zip(files, targets)), self.what)
            self.written.update(targets)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
