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
