"""Result records and the append-only JSONL store they live in.

A record is one sample of one run configuration. Lines are appended with one write each and flushed to disk, so a
killed run leaves at most one torn final line. Readers never modify a file: they skip an unterminated final line.
Only a writer repairs it, under an exclusive lock held for its whole run and after every complete line parsed as a
record (so a file that is not a results file is never touched); a second writer on the same file is refused.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.runtime.errors import HarnessError
from harness.runtime.files import kind_of, make_folder, regular_target


def config_key(spec: dict) -> str:
    """Stable short hash of everything that defines a run (method, params, model, sampling, length, seed, dtype, device)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def append_line(path: Path, row: dict) -> None:
    """Append one JSON line with a single write, flushed to disk: a kill leaves at most a torn last line."""
    line = (json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Record:
    method: str
    params: dict
    model: dict
    dataset: str
    question_id: int | str
    temperature: float
    top_k: int
    top_p: float
    max_new_tokens: int
    seed: int
    dtype: str
    device: str
    prompt_tokens: int
    output_ids: list[int]
    output_text: str
    new_tokens: int
    steps: int
    accepted: list[int]
    position_accepts: list[int]
    timing: dict
    lossless: dict
    config_key: str
    versions: dict
    simulated: bool = False  # acceptance replayed on the AR output (no timing, no losslessness check)
    stats: dict = field(default_factory=dict)
    baseline: dict | None = None  # AR on the same prompt and seed, timed beside the method
    prompt_source: dict = field(default_factory=dict)  # the prompt set's origin (file, package + version) and sha256
    conditions: dict = field(default_factory=dict)  # load, cores, threads, processor, Linear kernels
    turn: int = 1  # which user turn of the question this decoded (1: the first)
    turns: str = "first"  # the protocol: the first user turn only, or every turn as a conversation ("all")
    drafts: dict = field(default_factory=dict)  # digest of every round's proposed drafts, and the rounds counted


SampleKey = tuple[str, str, str, int]


def sample_key(config_key: str, dataset: str, question_id, turn: int = 1) -> SampleKey:
    """What one record is the only record of: a configuration's turn of one question."""
    return config_key, dataset, str(question_id), turn


def row_key(row: dict) -> SampleKey:
    """A record's sample_key (records older than the turn field decoded the first turn)."""
    return sample_key(row["config_key"], row.get("dataset"), row.get("question_id"), row.get("turn", 1))


def timed_on(row: dict) -> tuple:
    """The engine a record was timed on: its Linears', attention's and compiled step's kernels (all None for
    records that did not say). One sample timed on two engines is two measurements, not a duplicate."""
    conditions = row.get("conditions") or {}
    compiled = conditions.get("compile") or {}
    return conditions.get("linears"), conditions.get("attention"), compiled.get("engine"), compiled.get("cuda_graphs")


class ResultStore:
    """Append-only JSONL file of records; created on the first append only."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._unrepaired: int | None = None  # the held file's descriptor until its tail is repaired

    def load(self) -> list[dict]:
        """Every complete record; an unterminated final line (a write still in progress, or killed) is skipped."""
        kind = kind_of(self.path)
        if kind is not None:
            raise HarnessError(f"results file {self.path} is {kind}, not a regular file; pass a file path as --out")
        if not self.path.exists():
            return []
        try:
            data = self.path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise self._unreadable(exc) from None
        *lines, tail = data.split("\n")
        rows = [self._parse(line, number) for number, line in enumerate(lines, 1) if line.strip()]
        if _parses(tail):  # a whole last line without its newline (a file edited or copied)
            rows.append(self._parse(tail, len(lines) + 1))
        return rows  # else the remains of a write in progress or cut short

    @contextmanager
    def writing(self) -> Iterator[ResultStore]:
        """Hold the file for one run: refuse a concurrent writer and a file that is not a results file, repair a torn
        tail before the first record is appended (a run that appends nothing leaves the file as it was), and remove
        the file again if the run appended nothing to a file it created."""
        self.path = regular_target(self.path, "results file")  # a symlink is written through, never replaced
        created = not self.path.exists()
        make_folder(self.path.parent, "results")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise self._unreadable(exc) from None
        try:
            self._lock(fd)
            self.load()  # every complete line is a record: this is a results file, ours to repair
            self._unrepaired = fd
            yield self
        finally:
            self._unrepaired = None
            if created and os.fstat(fd).st_size == 0:
                self.path.unlink(missing_ok=True)
            os.close(fd)

    def _repair_tail(self, fd: int) -> None:
        """End the file on a line break: a whole record that only lacks its newline gets one; the remains of a write
        that was cut short (never a line that parses) are cut off."""
        size = os.fstat(fd).st_size
        data = os.pread(fd, size, 0)
        if data and not data.endswith(b"\n"):
            cut = data.rfind(b"\n") + 1
            if _parses(data[cut:].decode("utf-8", "replace")):
                os.pwrite(fd, b"\n", size)
            else:
                os.ftruncate(fd, cut)

    def _lock(self, fd: int) -> None:
        """Hold the file alone; a filesystem without locks (some network and FUSE mounts) cannot refuse a second
        writer, so the run goes on with a warning: sweep shards and plan items never share a file."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise HarnessError(f"results file {self.path} is being written by another spd-bench run; wait for it "
                               f"to finish or pass another --out") from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            warnings.warn(f"{self.path}: its filesystem does not lock files ({os.strerror(exc.errno)}), so a second "
                          f"run on this file would not be refused; give each job its own file (sweep --shard, "
                          f"sweep --plan) or --out", stacklevel=2)

    def finished(self) -> set[SampleKey]:
        return {row_key(r) for r in self.load()}

    def append(self, record: Record | dict) -> None:
        if self._unrepaired is not None:
            self._repair_tail(self._unrepaired)
            self._unrepaired = None
        append_line(self.path, record if isinstance(record, dict) else asdict(record))

    def _unreadable(self, exc: Exception) -> HarnessError:
        return HarnessError(f"cannot read results file {self.path} ({exc}); fix its permissions or pass another --out")

    def _parse(self, line: str, number: int) -> dict:
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "config_key" not in row:
                raise ValueError
        except ValueError:
            raise HarnessError(
                f"{self.path}:{number}: not a result record; move the file aside or delete that line"
            ) from None
        if "output_ids" in row and (problem := sample_problem(row)):
            raise HarnessError(f"{self.path}:{number}: a sample record with {problem}; rerun that sample or delete "
                               f"that line")
        return row


# The fields every reader of a sample record relies on, and their JSON types.
SAMPLE_FIELDS = {"method": str, "params": dict, "model": dict, "dataset": str, "question_id": (int, str),
                 "temperature": (int, float), "max_new_tokens": int, "seed": int, "output_ids": list,
                 "new_tokens": int, "steps": int, "accepted": list, "position_accepts": list, "timing": dict,
                 "lossless": dict, "config_key": str}


def sample_problem(row: dict) -> str | None:
    """What makes a sample record unreadable (a missing or mistyped field), or None."""
    for name, kind in SAMPLE_FIELDS.items():
        if name not in row:
            return f"no {name!r} field"
        if not isinstance(row[name], kind) or isinstance(row[name], bool):
            return f"a {type(row[name]).__name__} as {name!r}"
    if not isinstance(row["model"].get("name"), str):
        return "no model name"
    return None


def load_training(results: Path | list[Path] | tuple[Path, ...]) -> list[dict]:
    """The drafter training records (`spd-bench train`) in results files or folders, the latest per drafter and
    file (a file of its own keeps a study's runs, such as a data-parallel one, beside the shipped drafters')."""
    paths = [Path(p) for p in results] if isinstance(results, (list, tuple)) else [Path(results)]
    files = [f for path in paths for f in ([path] if path.is_file() else sorted(path.rglob("train.jsonl")))]
    latest = {}
    for f in files:
        for row in ResultStore(f).load():
            if row.get("kind") == "train":
                latest[(row["model"]["name"], row["config_key"], f)] = row
    return list(latest.values())


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


def claims_to_be_results(path: Path) -> bool:
    """A file whose first line is a record of ours (a Spec-Bench or reference export, say, is not): only such a file
    is refused when a later line is not a record."""
    try:
        with open(path, encoding="utf-8") as fh:
            first = fh.readline()
        row = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(row, dict) and "config_key" in row


@dataclass
class Loaded:
    """The sample records under one or more results paths, one per (config key, dataset, question id), and what was
    left out."""

    rows: list[dict]
    duplicates: int  # records of a sample already found (two runs on one file, say): counted once
    foreign: list[Path]  # JSONL files that are not results files (exports, other tools' output): skipped
    # each path (a folder whose records lie in several subfolders, shards' say: each of those): files and records
    sources: list[tuple[Path, int, int]] = field(default_factory=list)


def load_all(results: Path | list[Path] | tuple[Path, ...]) -> Loaded:
    """Every sample record in each results file, or in all *.jsonl files under each folder (shards' folders, say),
    the first found of a sample on each engine that timed it (`timed_on`)."""
    paths = [Path(p) for p in results] if isinstance(results, (list, tuple)) else [Path(results)]
    found, foreign, sources = [], [], []
    for path in paths:
        files, skipped = _results_files(path)
        foreign += skipped
        parts = _by_part(path, files)
        held = {part: rows for part, (_, rows) in parts.items() if rows}
        if len(held) > 1:  # a folder of shards' (or models') folders: say what each held
            sources += [(part, parts[part][0], len(rows)) for part, rows in held.items()]
        else:
            sources.append((path, len(files), sum(len(rows) for rows in held.values())))
        found += [row for rows in held.values() for row in rows]
    unique = {}
    for row in found:
        unique.setdefault((row_key(row), timed_on(row)), row)
    return Loaded(list(unique.values()), len(found) - len(unique), foreign, sources)


def _results_files(path: Path) -> tuple[list[Path], list[Path]]:
    """The results files at `path` (a file, or every *.jsonl under a folder) and the JSONL files there that are not
    results files."""
    kind = kind_of(path)
    if kind not in (None, "a folder"):
        raise HarnessError(f"results path {path} is {kind}; pass a results file or folder")
    if not path.exists():
        raise HarnessError(f"results path {path} does not exist; run `spd-bench run` first or pass --results")
    if path.is_file():
        return [path], []
    candidates = sorted(path.rglob("*.jsonl"))
    # only regular files are read: a FIFO would block, a device read forever, a dangling link has nothing to read
    foreign = [f for f in candidates if kind_of(f) is not None or (f.stat().st_size and not claims_to_be_results(f))]
    return [f for f in candidates if f not in foreign], foreign


def _by_part(path: Path, files: list[Path]) -> dict[Path, tuple[int, list[dict]]]:
    """The sample records of `files` by the entry of `path` they lie under (the file itself for a file): how many
    files and which records."""
    parts: dict[Path, tuple[int, list[dict]]] = {}
    for f in files:
        part = path if f == path else path / f.relative_to(path).parts[0]
        count, rows = parts.setdefault(part, (0, []))
        rows.extend(row for row in ResultStore(f).load() if "output_ids" in row)
        parts[part] = (count + 1, rows)
    return parts


def code_notes(rows: list[dict], current: dict) -> list[str]:
    """What a reader should know about the code the records come from: several commits, commits other than this
    checkout's (`current`: code_identity()), modified trees, or records older than the commit field."""
    commits: dict[str, int] = {}
    modified = unknown = 0
    for row in rows:
        version = row.get("versions") or {}
        if not version.get("commit"):
            unknown += 1
            continue
        commits[version["commit"]] = commits.get(version["commit"], 0) + 1
        modified += bool(version.get("modified"))
    notes = []
    if len(commits) > 1:
        listed = ", ".join(f"{c[:10]} ({k})" for c, k in sorted(commits.items(), key=lambda item: -item[1]))
        notes.append(f"the records come from {len(commits)} commits: {listed}")
    other = sum(k for c, k in commits.items() if c != current.get("commit"))
    if other and current.get("commit"):
        notes.append(f"{other} of {len(rows)} records were made at another commit than this checkout's "
                     f"({current['commit'][:10]}): rerun them to measure this code")
    if modified:
        notes.append(f"{modified} records were made from a modified tree (uncommitted changes)")
    if unknown:
        notes.append(f"{unknown} records carry no commit (made before records named their code)")
    return notes
