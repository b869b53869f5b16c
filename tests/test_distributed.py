"""The distributed stage executor on CPU with gloo: one spawned process per stage, the test process as driver.

Token-identical to AR and to the local executor (T=0, hits and misses, prompts of length 1 and longer, linear
attention, trees); T=1 identical to the local executor for the same seed (the sampler lives on the driver); a dead
stage rank ends the run with one line and leaves no process behind.
"""

import multiprocessing
import time

import pytest
import torch

from harness import launch
from harness.errors import HarnessError
from harness.models import load_model
from harness.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig
from methods.spd import SPD
from methods.speculator import Speculator, SpeculatorConfig
from test_spd import _oracle
from tiny_models import tiny_model

GREEDY = SamplingConfig()
PROMPTS = ([7], list(range(10, 19)))


def _saved(tmp_path, arch):
    folder = tmp_path / arch
    tiny_model(arch).save_pretrained(folder)
    return str(folder)


def _spd(folder, n, width, schedule="input"):
    loaded = load_model(folder, "cpu", "float32", tokenizer=False)
    target = TargetRuntime(loaded.model, max_len=256, identity=loaded.identity)
    config = SpeculatorConfig(n=n, ls=1, schedule=schedule, num_layers=target.num_layers)
    torch.manual_seed(1)
    speculator = Speculator(config, target).eval()
    return target, SPD(target, SPD.Params(n=n, ls=1, schedule=schedule, width=width), set(), speculator=speculator)


@pytest.mark.parametrize("arch, n, width, schedule", [("llama", 2, 1, "input"), ("qwen3_5", 3, 1, "output"),
                                                      ("qwen3", 3, 4, "input")])
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
            report = ours.stats["executor"]
            assert report["kind"] == "distributed" and report["world_size"] == n + 1
            assert len(report["stage_forward_s"]) == n and all(s > 0 for s in report["stage_forward_s"])
        executor.close()
    assert not multiprocessing.active_children()


def test_a_dead_stage_rank_ends_the_run_with_one_line_and_no_leftover_process(tmp_path):
    folder = _saved(tmp_path, "llama")
    _, remote = _spd(folder, 2, 1)
    start = time.monotonic()
    with pytest.raises(HarnessError, match="a stage rank stopped answering"):
        with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=30) as group:
            remote.distribute(group, "float32")
            with torch.inference_mode():
                remote.generate([1, 2, 3], 8, Sampler(GREEDY))
                multiprocessing.active_children()[0].kill()
                remote.generate([1, 2, 3], 8, Sampler(GREEDY))
    assert time.monotonic() - start < 60
    assert not multiprocessing.active_children()


def test_a_group_of_the_wrong_size_is_refused(tmp_path):
    folder = _saved(tmp_path, "llama")
    _, remote = _spd(folder, 3, 1)
    with pytest.raises(HarnessError, match="--n 3 needs 4"):
        with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=60) as group:
            remote.distribute(group, "float32")
    assert not multiprocessing.active_children()
