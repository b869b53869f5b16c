"""The distributed stage executor on CPU with gloo: one spawned process per stage, the test process as driver.

Token-identical to AR and to the local executor (T=0, hits and misses, prompts of length 1 and longer, linear
attention, trees); T=1 identical to the local executor for the same seed (the sampler lives on the driver); a dead
stage rank ends the run with one line and leaves no process behind.
"""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from test_spd import _oracle
from tiny_models import tiny_model

from harness.cli import main
from harness.runtime import distributed as launch
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.pipeline.distributed import load_stage
from methods.pipeline.spd import SPD
from methods.pipeline.speculator import Speculator, SpeculatorConfig
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()
PROMPTS = ([7], list(range(10, 19)))


def _saved(tmp_path, arch):
    folder = tmp_path / arch
    tiny_model(arch).save_pretrained(folder)
    return str(folder)


def _spd(folder, n, width, schedule="input", compile="off"):
    loaded = load_model(folder, "cpu", "float32", tokenizer=False)
    target = TargetRuntime(loaded.model, max_len=256, identity=loaded.identity, compile=compile)
    config = SpeculatorConfig(n=n, ls=1, schedule=schedule, num_layers=target.num_layers)
    torch.manual_seed(1)
    speculator = Speculator(config, target).eval()
    return target, SPD(target, SPD.Params(n=n, ls=1, schedule=schedule, width=width), set(), speculator=speculator)


@pytest.mark.parametrize("arch, n, width, schedule", [("llama", 2, 1, "input"), ("qwen3_5", 3, 1, "output"),
                                                      ("qwen3", 3, 4, "input"), ("qwen3_5", 2, 4, "input")])
def test_distributed_pipeline_equals_ar_and_the_local_executor(tmp_path, arch, n, width, schedule):
    folder = _saved(tmp_path, arch)
    target, local = _spd(folder, n, width, schedule)
    _, remote = _spd(folder, n, width, schedule)
    ar = build_method("autoregressive", target, {}, set())
    with launch.stage_group(folder, "cpu", ["cpu"] * n, timeout_s=120) as group:
        executor = remote.distribute(group, "float32")
        with torch.inference_mode():
            for prompt in PROMPTS:
                reference = ar.generate(prompt, 20, Sampler(GREEDY)).output_ids
                by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
                for hit_rate in (0.0, 0.7, 1.0):
                    for method in (local, remote):
                        method.engine.drafter_class = _oracle(by_position, hit_rate, seed=3)
                    ours = remote.generate(prompt, 20, Sampler(GREEDY))
                    theirs = local.generate(prompt, 20, Sampler(GREEDY))
                    assert ours.output_ids == reference
                    assert ours.accepted == theirs.accepted  # same drafts, same verdicts, cycle by cycle
                for method in (local, remote):
                    method.engine.drafter_class = _oracle(by_position, 0.7, seed=3)
                sampled = [m.generate(prompt, 20, Sampler(SamplingConfig(temperature=1.0),
                                                          torch.Generator().manual_seed(5))) for m in (remote, local)]
                assert sampled[0].output_ids == sampled[1].output_ids
            report = ours.stats.executor
            assert report.kind == "distributed" and report.world_size == n + 1
            assert len(report.stage_forward_s) == n and all(s > 0 for s in report.stage_forward_s)
        executor.close()
    assert not multiprocessing.active_children()


def test_stage_ranks_compile_their_layers_as_the_driver_does(tmp_path):
    """`--compile` reaches the ranks through the plan: each stage builds its runtime with the driver's compiled
    step (with `on`, a rank that could not compile would stop the run), and the tokens stay greedy AR's."""
    folder = _saved(tmp_path, "llama")
    target, remote = _spd(folder, 2, 1, compile="on")
    reference = build_method("autoregressive", TargetRuntime(target.model, max_len=256), {}, set())
    with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=120) as group:
        executor = remote.distribute(group, "float32")
        assert executor.plan.compile == "on"
        assert load_stage(executor.plan, 0, "cpu").compiled.mode == "on"
        with torch.inference_mode():
            prompt = PROMPTS[1]
            expected = reference.generate(prompt, 16, Sampler(GREEDY)).output_ids
            remote.engine.drafter_class = _oracle({len(prompt) + i: t for i, t in enumerate(expected)}, 0.7, seed=3)
            assert remote.generate(prompt, 16, Sampler(GREEDY)).output_ids == expected
        executor.close()
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("fault", ["dies", "stops answering"])
def test_a_stage_rank_that_fails_after_joining_ends_the_run_on_the_run_deadline_with_one_line(tmp_path, fault):
    folder = _saved(tmp_path, "llama")
    _, remote = _spd(folder, 2, 1)
    with pytest.raises(HarnessError, match="a stage rank stopped answering") as failure:
        with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=20, join_timeout_s=900) as group:
            remote.distribute(group, "float32")
            with torch.inference_mode():
                remote.generate([1, 2, 3], 8, Sampler(GREEDY))  # every rank has joined and served
                os.kill(group.processes[-1].pid, signal.SIGKILL if fault == "dies" else signal.SIGSTOP)
                start = time.monotonic()
                remote.generate([1, 2, 3], 8, Sampler(GREEDY))
    assert "--timeout 20 s" in str(failure.value)
    if fault == "dies":
        assert "rank 2 (cpu) exited (signal 9)" in str(failure.value)
    assert time.monotonic() - start < 300  # the run deadline ended it, not the 900 s join deadline
    assert not multiprocessing.active_children()


def test_a_group_of_the_wrong_size_is_refused_before_any_rank_is_waited_for(tmp_path):
    folder = _saved(tmp_path, "llama")
    _, remote = _spd(folder, 3, 1)
    with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=60, join_timeout_s=900) as group:
        with pytest.raises(HarnessError, match="--n 3 needs 4"):
            remote.distribute(group, "float32")
        assert not group.started and not group.store.check(["plan"])  # no plan sent, nothing joined
    assert not multiprocessing.active_children()


def _starting_fails(tmp_path, fault, message: str, model: str | None = None, join_timeout_s: float = 900) -> float:
    """A two-stage group on a tiny Llama whose start fails as `fault(group)` makes it (or as `model`, the folder the
    ranks load, makes it): `message` is the error, no process is left; returns the seconds the start took."""
    folder = _saved(tmp_path, "llama")
    _, remote = _spd(folder, 2, 1)
    with launch.stage_group(model or folder, "cpu", ["cpu"] * 2, timeout_s=20, join_timeout_s=join_timeout_s) as group:
        fault(group)
        start = time.monotonic()
        with pytest.raises(HarnessError, match=message):
            remote.distribute(group, "float32")
    assert not multiprocessing.active_children()
    return time.monotonic() - start


def test_a_rank_that_exits_while_starting_ends_the_wait_at_once_with_its_exit(tmp_path):
    elapsed = _starting_fails(tmp_path, lambda group: os.kill(group.processes[0].pid, signal.SIGKILL),
                              r"rank 1 \(cpu\) exited \(signal 9\) while starting")
    assert elapsed < 300  # far inside the 900 s join deadline


def test_a_rank_that_fails_while_loading_reports_its_own_reason_through_the_driver(tmp_path):
    other = str(tmp_path / "other")
    tiny_model("llama", seed=7).save_pretrained(other)  # same shape, other weights: the ranks refuse to serve them
    _starting_fails(tmp_path, lambda group: None, r"rank \d \(cpu\) failed: model .* has weights .* the driver's are",
                    model=other)


def test_a_rank_that_hangs_while_starting_ends_the_run_on_the_join_deadline_naming_it(tmp_path):
    _starting_fails(tmp_path, lambda group: os.kill(group.processes[1].pid, signal.SIGSTOP),
                    r"rank\(s\) [\d, ]*2 did not finish starting within the join deadline \(--join-timeout 5 s\)",
                    join_timeout_s=5)


class _Runs:
    """An object whose unpickling would call os.system: a plan must never be able to do that."""

    def __reduce__(self):
        return os.system, ("true",)


def test_a_served_rank_builds_only_plans_of_this_harness_from_the_store():
    import io
    import pickle

    from methods.ssd.distributed import DrafterPlan
    from methods.ssd.method import SSDParams
    from methods.ssd.speculate import OracleSpeculation

    rng = torch.Generator().manual_seed(3)
    plan = DrafterPlan("m", "float32", "0" * 64, SSDParams(k=2), None, 64, OracleSpeculation,
                       {"reference": {5: 7}, "rng": rng, "ids": torch.arange(4)}, "off")
    read = launch.PlanUnpickler(io.BytesIO(pickle.dumps(plan))).load()
    assert read.params == plan.params and read.speculation is OracleSpeculation
    assert torch.equal(read.state["ids"], torch.arange(4))
    assert torch.equal(read.state["rng"].get_state(), rng.get_state())
    imported_here = b"charness.runtime.provenance\nsubprocess\n."  # a module our code imports is not our code
    for data in (pickle.dumps(_Runs()), pickle.dumps({"plan": _Runs()}), pickle.dumps(print), imported_here):
        with pytest.raises(pickle.UnpicklingError, match="which a served rank does not build"):
            launch.PlanUnpickler(io.BytesIO(data)).load()


def test_rank_and_world_size_alone_are_not_torchrun(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert not launch.under_torchrun()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert launch.under_torchrun()


def test_a_torchrun_rank_whose_driver_never_comes_ends_with_one_line(tiny_dir, tmp_path):  # noqa: F811
    port = launch_free_port()
    env = {**os.environ, "RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "PYTHONPATH": str(Path(__file__).parents[1]), "HF_HUB_OFFLINE": "1"}
    served = subprocess.run([sys.executable, "-m", "harness.cli", "run", "--method", "spd", "--n", "2", "--ls", "1",
                             "--model", str(tiny_dir), "--executor", "distributed", "--join-timeout", "3"],
                            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert served.returncode == 2
    errors = [line for line in served.stderr.splitlines() if line.strip()]
    assert errors == [f"error: rank 1: torchrun rank 1 could not reach the group's store at 127.0.0.1:{port} within "
                      f"the join deadline (--join-timeout 3 s): {errors[0].rsplit(': ', 1)[-1]}"]


def launch_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the train record goes to ./results


def test_run_command_starts_its_ranks_and_torchrun_starts_the_same_run(tiny_dir, eval_dir, tmp_path, cache):  # noqa: F811
    train = CliRunner().invoke(main, ["train", "--model", str(tiny_dir), "--n", "2", "--ls", "1", "--seq-len", "32",
                                      "--batch-size", "2", "--draft-vocab", "512", "--tokens", "64", "--val-prompts", "1"])
    assert train.exit_code == 0, train.output
    run = ["run", "--method", "spd", "--n", "2", "--ls", "1", "--model", str(tiny_dir), "--dataset", "gsm8k",
           "--limit", "2", "--max-new-tokens", "10", "--data-dir", str(eval_dir), "--executor", "distributed",
           "--timeout", "120"]
    spawned = CliRunner().invoke(main, run + ["--out", str(tmp_path / "spawned.jsonl")])
    assert spawned.exit_code == 0, spawned.output
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
               "-m", "harness.cli", "--", *run, "--out", str(tmp_path / "torchrun.jsonl")]
    torchrun = subprocess.run(command, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    records = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
               for name in ("spawned", "torchrun")}
    for rows in records.values():
        assert len(rows) == 2 and all(r["lossless"]["identical"] for r in rows)
        assert all(r["stats"]["executor"]["world_size"] == 3 and r["stats"]["executor"]["backend"] == "gloo"
                   for r in rows)
    assert [r["output_ids"] for r in records["spawned"]] == [r["output_ids"] for r in records["torchrun"]]
    assert records["spawned"][0]["config_key"] == records["torchrun"][0]["config_key"]


def test_an_nccl_group_waits_on_the_host_within_the_run_deadline(monkeypatch):
    """Fails on a16459a: NCCL's send/recv/wait returned at once, so a dead rank hung the run until the watchdog."""
    import os

    from harness.runtime import distributed

    joined = {}
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.setattr(distributed.dist, "init_process_group",
                        lambda backend, **kwargs: joined.update(backend=backend, **kwargs))
    distributed.join_group("gloo", None, 0, 2, 30.0)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ
    distributed.join_group("nccl", None, 0, 2, 30.0)
    assert os.environ["TORCH_NCCL_BLOCKING_WAIT"] == "1" and joined["timeout"].total_seconds() == 30.0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_stage_rank_keeps_keys_values_and_states_for_its_own_layers_only(tmp_path, arch):
    """Fails on a16459a: every stage rank allocated keys and values for every attention layer of the model."""
    from methods.pipeline.distributed import StagePlan

    folder = _saved(tmp_path, arch)
    target, _ = _spd(folder, 3, 1)
    bounds = [(0, 2), (2, 4), (4, 6)]
    plan = StagePlan(model=folder, dtype="float32", bounds=bounds, capture=(), max_len=64, rewind_window=8,
                     compile="off", weights_sha256=target.identity.weights_sha256)
    stage = load_stage(plan, 1, "cpu")
    with torch.inference_mode():
        h = target.embed(torch.arange(3, 9))
        stage.run_layers(2, 4, h, range(0, 6))
    held = {i for i, kind in enumerate(target.layer_types) if kind == "full_attention" and 2 <= i < 4}
    assert set(stage.cache.pair) == held and len(stage.cache.kv or ()) == 2 * len(held)
    assert set(stage.cache.linear) == {i for i in range(2, 4) if target.layer_types[i] == "linear_attention"}
