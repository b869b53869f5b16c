"""Result records and the append-only JSONL store they live in.

A record is one sample of one run configuration. Lines are appended with one write each and flushed to disk, so
a killed run leaves at most one torn final line, which the next load trims; finished samples are skipped on resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.errors import HarnessError


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

    @property
    def sample_key(self) -> tuple[str, str, str]:
        return self.config_key, self.dataset, str(self.question_id)


class ResultStore:
    """Append-only JSONL file of records; created on the first append only."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def load(self) -> list[dict]:
        if not self.path.exists():
            return []
        self._trim_torn_tail()
        rows = []
        try:
            with open(self.path, encoding="utf-8") as fh:
                for number, line in enumerate(fh, 1):
                    if line.strip():
                        rows.append(self._parse(line, number))
        except (OSError, UnicodeDecodeError) as exc:
            raise self._unreadable(exc) from None
        return rows

    def finished(self) -> set[tuple[str, str, str]]:
        return {(r["config_key"], r["dataset"], str(r["question_id"])) for r in self.load()}

    def append(self, record: Record | dict) -> None:
        append_line(self.path, record if isinstance(record, dict) else asdict(record))

    def _unreadable(self, exc: Exception) -> HarnessError:
        return HarnessError(f"cannot read results file {self.path} ({exc}); fix its permissions or pass another --out")

    def _parse(self, line: str, number: int) -> dict:
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "config_key" not in row:
                raise ValueError
            return row
        except ValueError:
            raise HarnessError(
                f"{self.path}:{number}: not a result record; move the file aside or delete that line"
            ) from None

    def _trim_torn_tail(self) -> None:
        """Drop a final line without a newline: the remains of a run killed mid-write."""
        try:
            with open(self.path, "rb+") as fh:
                data = fh.read()
                if data and not data.endswith(b"\n"):
                    fh.truncate(data.rfind(b"\n") + 1)
        except OSError as exc:
            raise self._unreadable(exc) from None


def load_all(results: Path) -> list[dict]:
    """Every record in a results file or in all *.jsonl files under a folder."""
    results = Path(results)
    if not results.exists():
        raise HarnessError(f"results path {results} does not exist; run `spd-bench run` first or pass --results")
    files = [results] if results.is_file() else sorted(results.rglob("*.jsonl"))
    return [row for f in files for row in ResultStore(f).load() if "output_ids" in row]
