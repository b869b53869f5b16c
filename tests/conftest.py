import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# `make test` runs one pytest-xdist worker per core: each worker (and any process it starts) keeps to its share of
# the cores, as two workers at two threads each would fight over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(_threads)
    torch.set_num_threads(_threads)

from harness.bench.data import SHIPPED
from harness.runtime.kernels import rows_kernel_problem

rows_kernel_problem()  # built or loaded before any test runs, so no test's captured output holds the build's line


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


@pytest.fixture(scope="session")
def eval_dir() -> Path:
    """The paper's prompt sets as shipped in the repository."""
    return SHIPPED


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 model converted to a cached HF folder (its tokenizer also serves tiny models)."""
    from harness.runtime.models import EMBEDDED, embedded_folder

    return embedded_folder(EMBEDDED["smollm2-135m"])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template, saved as an HF folder."""
    from tiny_models import tiny_model
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_model("llama", num_layers=4, vocab_size=49152)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(folder)
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private harness cache per test."""
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
