import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The paper's prompt sets live beside the checkout (../shared/data/eval); $SPD_BENCH_EVAL overrides the location.
SHARED_EVAL = Path(os.environ.get("SPD_BENCH_EVAL", Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """The paper's prompt sets, read in place from ../shared (never copied into the repo)."""
    if not (SHARED_EVAL / "mt_bench.jsonl").exists():
        pytest.skip(f"benchmark prompt files not found at {SHARED_EVAL}")
    return SHARED_EVAL


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 model converted to a cached HF folder (its tokenizer also serves tiny models)."""
    from harness.models import EMBEDDED, embedded_folder

    return embedded_folder(EMBEDDED["smollm2-135m"])
