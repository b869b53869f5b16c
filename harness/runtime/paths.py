"""Where generated artefacts (converted models, reference outputs, checkpoints) live: outside the repository."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$SPD_BENCH_CACHE`, else `$XDG_CACHE_HOME/spd-bench`, else `~/.cache/spd-bench`."""
    if root := os.environ.get("SPD_BENCH_CACHE"):
        path = Path(root)
    else:
        path = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spd-bench"
    path.mkdir(parents=True, exist_ok=True)
    return path


def kernel_cache_dir() -> Path:
    """Where the native kernels build: `$SPD_BENCH_KERNEL_CACHE`, else `spd-bench/kernels` in the user's cache
    (`$XDG_CACHE_HOME` or ~/.cache). Not under `$SPD_BENCH_CACHE`: a build is named by everything that decides it,
    so every checkout, venv and private test cache can share it, and a fresh `$SPD_BENCH_CACHE` does not rebuild."""
    if root := os.environ.get("SPD_BENCH_KERNEL_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "spd-bench" / "kernels"


def check_out_path(out: Path, folder: bool) -> None:
    """`--out` can be written as a folder (`folder`) or as a file: it is not the other kind, and the nearest part of
    it that exists is a folder (not a file it would have to lie under). One line naming the fix otherwise."""
    from harness.runtime.errors import HarnessError

    if folder and out.exists() and not out.is_dir():
        raise HarnessError(f"--out {out} is a file; pass a folder path")
    if not folder and out.is_dir():
        raise HarnessError(f"--out {out} is a folder; pass a file path such as {out / 'results.md'}")
    existing = out
    while not existing.exists():
        existing = existing.parent
    if existing != out and not existing.is_dir():
        raise HarnessError(f"--out {out} lies under the file {existing}; pass a path in a folder")
