"""What code and packages a record was made with, so a reader can tell fresh figures from old ones."""

from __future__ import annotations

import functools
import importlib.metadata
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


OUTPUTS = ("results", "reports")  # what runs write: a run appending to a committed results file changes no code


@functools.cache
def code_identity() -> dict:
    """This checkout's `tree_identity`."""
    return tree_identity(ROOT)


def tree_identity(root: Path) -> dict:
    """The checkout's commit and whether tracked files other than the outputs differ from it (uncommitted code
    changes); both None outside a git checkout (an installed wheel)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": None, "modified": None}
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){out}" for out in OUTPUTS))
    return {"commit": commit.strip(), "modified": None if status is None else bool(status.strip())}


def versions() -> dict:
    """Package versions and the code's identity (code_identity)."""
    found = {}
    for name in ("spd-bench", "torch", "transformers"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return {**found, **code_identity()}
