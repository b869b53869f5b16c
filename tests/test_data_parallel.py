"""Data-parallel training under torchrun on gloo (2 ranks of 1 thread, tiny model): the ranks train what one process
trains on the same global batch, a killed or stopped rank ends the run in one line, and bad input stops every rank
before anything is written."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from harness.cli import main
from harness.runtime.errors import HarnessError
from harness.training.ranks import Ranks
from harness.training.train import TrainConfig, for_ranks

ROOT = Path(__file__).parents[1]
KINDS = ("spd-n2-ls1-input", "eagle3-ttt3", "ppsd-n2-ls1-output")
TRAIN = ["train", "--method", "spd,eagle3,ppsd", "--n", "2", "--ls", "1", "--ttt", "3", "--seq-len", "32",
         "--draft-vocab", "512", "--val-prompts", "0", "--warmup", "0.3", "--lr", "1e-3"]


def _env(cache: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "SPD_BENCH_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def _torchrun(args: list[str], cache: Path, cwd: Path, **popen) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "harness.cli", "--", *args]
    return subprocess.Popen(command, cwd=cwd, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **popen)


def _weights(cache: Path, kind: str) -> dict[str, torch.Tensor]:
    (path,) = cache.glob(f"drafters/*/{kind}/model.safetensors")
    return load_file(path)


def _errors(output: str) -> list[str]:
    return [line[line.index("error: "):] for line in output.splitlines() if "error: " in line]


@pytest.mark.parametrize("autocast", [False, True])
def test_two_ranks_train_what_one_process_trains_on_the_same_global_batch(tiny_dir, tmp_path, monkeypatch, autocast):
    """2 ranks x batch 1 against 1 process x batch 2, k=3 steps, SPD, EAGLE-3 and PPSD drafters together: equal to
    fp32 rounding without autocast, to bf16 rounding under it. The chunks carry different counts of assistant
    tokens, so a loss averaged per rank (DDP's mean of per-rank means) trains another objective and fails this."""
    args = [*TRAIN, "--model", str(tiny_dir), "--tokens", "192", "--no-feature-cache",
            "--autocast" if autocast else "--no-autocast"]
    ranks = _torchrun([*args, "--batch-size", "1"], tmp_path / "two", tmp_path)
    output = ranks.communicate(timeout=600)[0]
    assert ranks.returncode == 0, output[-3000:]
    assert output.count("checkpoint: ") == 3  # rank 0 alone reports (and writes)
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "one"))
    monkeypatch.chdir(tmp_path)
    alone = CliRunner().invoke(main, [*args, "--batch-size", "2"])
    assert alone.exit_code == 0, alone.output
    # Relative to each tensor's norm (zero-initialised branches hold only their three updates): fp32 rounding, or
    # bf16's, where a near-zero gradient's sign may flip and move one element by a whole Adam step.
    tolerance = 3e-2 if autocast else 1e-5
    for kind in KINDS:
        two, one = _weights(tmp_path / "two", kind), _weights(tmp_path / "one", kind)
        assert torch.equal(two["draft_ids"], one["draft_ids"])  # the vocabulary's counts summed over the ranks
        for name, value in one.items():
            gap = (two[name].float() - value.float()).norm() / value.float().norm().clamp(min=1e-12)
            assert gap < tolerance, (kind, name, gap)
    rows = [json.loads(line) for line in (tmp_path / "results" / tiny_dir.name / "train.jsonl").read_text().splitlines()]
    assert {(r["world_size"], r["global_batch"], r["steps"], r["tokens"]) for r in rows} == {(1, 2, 3, 192), (2, 2, 3, 192)}


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int:
    for child in Path("/proc").iterdir():
        try:
            environ = (child / "environ").read_bytes().split(b"\0")
            status = (child / "status").read_text()
        except (OSError, ValueError):
            continue
        parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if parent == launcher.pid and f"RANK={rank}".encode() in environ:
            return int(child.name)
    raise AssertionError(f"no rank {rank} under torchrun {launcher.pid}")


def _wait_for_checkpoint(cache: Path, launcher: subprocess.Popen, limit_s: float = 300) -> Path:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = list(cache.glob("drafters/*/spd-n2-ls1-input/config.json"))
        if found:
            return found[0].parent
        assert launcher.poll() is None, launcher.communicate()[0][-3000:]
        time.sleep(0.2)
    raise AssertionError("no checkpoint within the time limit")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


SLOW = ["--method", "spd", "--n", "2", "--ls", "1", "--seq-len", "32", "--draft-vocab", "512", "--val-prompts", "0",
        "--batch-size", "1", "--save-every", "10"]


def test_a_killed_rank_ends_the_run_in_one_line_and_one_process_resumes_it(tiny_dir, tmp_path, monkeypatch):
    """kill -9 of rank 1 mid-run: rank 0 names it, no rank outlives the run, the last checkpoint loads, and one process
    resumes it to the same schedule (global batch 2) without repeating a step. The corpus is the target's own replies,
    regenerated half by each rank and merged by rank 0: the resumed run regenerates nothing."""
    cache = tmp_path / "cache"
    args = ["train", *SLOW, "--model", str(tiny_dir), "--tokens", "19200", "--timeout", "60", "--corpus", "self"]
    launcher = _torchrun(args, cache, tmp_path)
    checkpoint = _wait_for_checkpoint(cache, launcher)
    rank0, rank1 = _rank_pid(launcher, 0), _rank_pid(launcher, 1)
    os.kill(rank1, signal.SIGKILL)
    output = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0
    (line,) = _errors(output)
    assert f"rank 1 (pid {rank1}) is gone" in line and "--resume" in line, line
    assert not _alive(rank0) and not _alive(rank1)
    saved = json.loads((checkpoint / "config.json").read_text())["train"]
    assert saved["step"] % 10 == 0 and saved["config"]["global_batch"] == 2
    (replies,) = cache.glob("corpus/*/greedy-*.jsonl")
    indices = [json.loads(line)["conversation"] for line in replies.read_text().splitlines()]
    assert len(indices) == len(set(indices)) and {i % 2 for i in indices} == {0, 1}  # both ranks' halves, each once

    monkeypatch.setenv("SPD_BENCH_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    resumed = CliRunner().invoke(main, [*args, "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert replies.read_text().count("\n") == len(indices)
    train = json.loads((checkpoint / "config.json").read_text())["train"]
    steps = [point["step"] for point in train["curve"]]
    assert steps == sorted(set(steps)) and steps[-1] == 300 and train["config"]["batch_size"] == 2
    assert train["tokens"] == 300 * 2 * 32


def test_a_stopped_rank_ends_every_rank_within_the_deadline(tiny_dir, tmp_path):
    """SIGSTOP of rank 1: rank 0 waits out --timeout, names the stopped rank, ends it and leaves; nothing is left."""
    cache = tmp_path / "cache"
    launcher = _torchrun(["train", *SLOW, "--model", str(tiny_dir), "--tokens", "64000", "--timeout", "8"], cache,
                         tmp_path)
    checkpoint = _wait_for_checkpoint(cache, launcher)
    rank0, rank1 = _rank_pid(launcher, 0), _rank_pid(launcher, 1)
    stopped = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    output = launcher.communicate(timeout=120)[0]
    assert time.monotonic() - stopped < 8 + 20  # the deadline, then no launcher's grace period
    assert launcher.returncode != 0
    (line,) = _errors(output)
    assert f"rank 1 (pid {rank1}) is stopped" in line and "--timeout 8 s" in line, line
    assert not _alive(rank0) and not _alive(rank1)
    assert json.loads((checkpoint / "config.json").read_text())["train"]["step"] % 10 == 0


def test_ranks_on_other_options_or_model_files_stop_before_anything_is_written(tiny_dir, tmp_path):
    """Rank 1 on another learning rate and on another copy of the model whose weights differ: one line on rank 0
    naming both, exit 2 on every rank, no checkpoint, feature cache or record."""
    import shutil

    other = tmp_path / "other-model"
    shutil.copytree(tiny_dir, other)
    weights = load_file(other / "model.safetensors")
    name = next(iter(weights))
    weights[name] = weights[name] + 1
    from safetensors.torch import save_file

    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    script = ('import os, sys; from harness.cli import main; rank = os.environ["RANK"]; '
              f'sys.argv = ["spd-bench", *{["train", *SLOW, "--tokens", "640"]!r}, "--model", '
              f'{str(tiny_dir)!r} if rank == "0" else {str(other)!r}, "--lr", "1e-4" if rank == "0" else "2e-4"]; '
              'main()')
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
               sys.executable, "-c", script]
    result = subprocess.run(command, cwd=tmp_path, env=_env(tmp_path / "cache"), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode != 0
    (line,) = _errors(result.stdout + result.stderr)
    assert "the training ranks disagree" in line and "lr: 0.0002 on rank 1, 0.0001 on rank 0" in line, line
    assert "weights sha256" in line or "model" in line
    assert "exitcode  : 2" in result.stdout + result.stderr
    assert not (tmp_path / "cache" / "drafters").exists() and not (tmp_path / "results").exists()
    assert not list((tmp_path / "cache").glob("features/*/*/*"))


def test_a_global_batch_must_divide_over_the_ranks():
    config = TrainConfig(drafters=[], batch_size=2, global_batch=6)
    with pytest.raises(HarnessError, match=r"--global-batch 6 does not divide over 4 ranks; use 4 or 8"):
        for_ranks(config, Ranks(world=4), None)
    assert for_ranks(config, Ranks(world=3), None).batch_size == 2
    assert for_ranks(TrainConfig(drafters=[], batch_size=2), Ranks(world=4), None).global_size == 8
    resumed = for_ranks(TrainConfig(drafters=[], batch_size=3), Ranks(world=2), 4)  # the saved schedule wins
    assert (resumed.global_size, resumed.batch_size) == (4, 2)
    with pytest.raises(HarnessError, match="resume on a world size that divides it"):
        for_ranks(TrainConfig(drafters=[]), Ranks(world=3), 4)
    with pytest.raises(HarnessError, match="differs from the resumed run's 4"):
        for_ranks(TrainConfig(drafters=[], global_batch=8), Ranks(world=2), 4)


def test_bench_train_reports_each_rank_and_the_scaling_over_one_process(tiny_dir, tmp_path, monkeypatch):
    """1 process x batch 2 then 2 ranks x batch 1 into one records file: the second reports both ranks, the global
    batch's total and its ratio to the first."""
    out = tmp_path / "train.jsonl"
    args = ["bench", "train", "--model", str(tiny_dir), "--method", "spd", "--n", "2", "--ls", "1", "--seq-len", "32",
            "--steps", "2", "--out", str(out)]
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    alone = CliRunner().invoke(main, [*args, "--batch-size", "2"])
    assert alone.exit_code == 0, alone.output
    ranks = _torchrun([*args, "--batch-size", "1"], tmp_path / "cache", tmp_path)
    output = ranks.communicate(timeout=600)[0]
    assert ranks.returncode == 0, output[-3000:]
    one, two = [json.loads(line) for line in out.read_text().splitlines()]
    assert (one["world_size"], two["world_size"], one["global_batch"], two["global_batch"]) == (1, 2, 2, 2)
    assert two["threads"] == 1 and len(two["rank_tokens_s"]) == 2 and all(x > 0 for x in two["rank_tokens_s"])
    assert two["total_tokens_s"] <= 2 * max(two["rank_tokens_s"])
    row = next(line for line in output.splitlines() if line.startswith("spd-n2-ls1-input"))
    assert row.split()[1:4] == ["2", "x", "1"]
    assert row.split()[-1] == f"{two['total_tokens_s'] / one['total_tokens_s']:.2f}x"


def test_an_offline_teacher_trains_on_prepared_features_alone(tiny_dir, tmp_path, monkeypatch):
    """`--prepare-features` in one process, then 2 ranks train with `--teacher offline` (rank 1 holding only the
    target's embedding, norm, head and first layer): the weights one process trains online on the same cached
    features. The cache costs what the layers read say per token; an offline run with no features stops in one
    line, writing nothing."""
    from harness.training.features import bytes_per_token

    args = ["train", "--method", "spd,eagle3", "--n", "2", "--ls", "1", "--ttt", "3", "--seq-len", "32",
            "--draft-vocab", "512", "--val-prompts", "0", "--warmup", "0.3", "--lr", "1e-3", "--no-autocast",
            "--model", str(tiny_dir), "--tokens", "192", "--batch-size", "1"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "empty"))
    refused = CliRunner().invoke(main, [*args, "--teacher", "offline"])
    assert refused.exit_code == 2 and "6 of the run's 6 chunks are not in the feature cache" in refused.output
    assert "--prepare-features" in refused.output and not (tmp_path / "empty" / "drafters").exists()

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "offline"))
    prepared = CliRunner().invoke(main, [*args, "--prepare-features"])
    assert prepared.exit_code == 0, prepared.output
    assert "features: 6 chunks (6 computed now)" in prepared.output
    files = list((tmp_path / "offline").glob("features/*/*/chunk-*.safetensors"))
    # spd n=2 (layers 0-4) and EAGLE-3 (1, 2) on the 4-layer target read 5 layers of 64 in bf16, plus the final
    # state, its log-normaliser and the ids; each file adds its header
    expected = bytes_per_token(64, 5) * 32 * len(files)
    assert len(files) == 6 and expected <= sum(f.stat().st_size for f in files) <= expected + 2048 * len(files)
    ranks = _torchrun([*args, "--teacher", "offline"], tmp_path / "offline", tmp_path)
    output = ranks.communicate(timeout=600)[0]
    assert ranks.returncode == 0, output[-3000:]

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "online"))
    online = CliRunner().invoke(main, [*args[:-1], "2"])
    assert online.exit_code == 0, online.output
    for kind in ("spd-n2-ls1-input", "eagle3-ttt3"):
        offline, alone = _weights(tmp_path / "offline", kind), _weights(tmp_path / "online", kind)
        for name, value in alone.items():
            gap = (offline[name].float() - value.float()).norm() / value.float().norm().clamp(min=1e-12)
            assert gap < 1e-5, (kind, name, gap)


def test_an_offline_rank_other_than_0_loads_only_what_drafters_read(tiny_dir):
    from harness.training.train import _loaded

    config = TrainConfig(drafters=[], model=str(tiny_dir), teacher="offline")
    partial = _loaded(config, Ranks(rank=1, world=2)).model
    assert [type(layer).__name__ for layer in partial.model.layers][1:] == ["Identity"] * 3
    assert partial.lm_head.weight.device.type == "cpu" and partial.model.embed_tokens is not None
    whole = _loaded(config, Ranks(rank=0, world=2)).model  # rank 0 validates: the whole target
    assert not any(isinstance(layer, torch.nn.Identity) for layer in whole.model.layers)


def test_more_ranks_than_the_corpus_has_chunks_for_is_one_line(tiny_dir):
    from harness.runtime.models import load_model
    from harness.training.corpus import conversations
    from harness.training.train import training_chunks

    loaded = load_model(str(tiny_dir))
    config = for_ranks(TrainConfig(drafters=[], seq_len=32, batch_size=1, tokens=32), Ranks(world=64), None)
    few = [(0, messages) for messages in list(conversations())[:3]]
    with pytest.raises(HarnessError, match=r"fewer than the 64 that --tokens 32 needs \(a global batch of 64 chunks "
                                           r"over 64 ranks\); lower --tokens or the ranks"):
        training_chunks(config, loaded, few, Ranks(world=64))
