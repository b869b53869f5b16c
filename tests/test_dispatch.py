"""The engine's host budget, counted exactly (aten ops and host syncs from dispatch modes): plain decoding reads back
one token per token and runs no more ops than HF `generate`; a draft-then-verify round reads back what it committed
and little else. Counts do not depend on the machine's speed, so tests can hold them."""

import pytest
import torch
from tiny_models import tiny_model

from harness.bench.dispatch import count_generation, counting, parse_configuration
from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig

GREEDY = Sampler(SamplingConfig())
PROMPTS = [list(range(10, 30)), [3, 4, 5, 6] * 5]


def _counts(method, prompts=PROMPTS, tokens=24):
    def generate(ids):
        made = method.generate(ids, tokens, GREEDY)
        return made.output_ids, made.steps

    return count_generation(generate, prompts)


def test_the_counter_sees_every_kind_of_read_back():
    t = torch.tensor([3, 4, 5])
    with counting() as counts:
        int(t[0]), t.tolist(), t.nonzero(), bool((t > 4).any()), torch.equal(t, t), t[t > 3]
    assert counts.syncs == 6, dict(counts.kinds)
    assert set(counts.kinds) == {"int", "tolist", "nonzero", "bool", "equal", "boolean mask"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_autoregressive_reads_back_one_token_per_token_and_runs_no_more_ops_than_hf_generate(arch):
    model = tiny_model(arch)
    ours = build_method("autoregressive", TargetRuntime(model, max_len=128), {}, set())
    counts, tokens, steps = _counts(ours)
    assert counts.syncs <= tokens, dict(counts.sites)

    def hf(ids):
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                             pad_token_id=0)
        return range(out.shape[1] - len(ids)), out.shape[1] - len(ids) - 1

    with torch.inference_mode():
        reference, hf_tokens, _ = count_generation(hf, PROMPTS)
    assert hf_tokens == tokens
    assert counts.ops / tokens <= reference.ops / hf_tokens, (counts.ops / tokens, reference.ops / hf_tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_prompt_lookup_round_reads_back_at_most_twice(arch):
    method = build_method("lookup", TargetRuntime(tiny_model(arch), max_len=128), {"k": 4}, set())
    counts, _, steps = _counts(method)
    assert counts.syncs <= 2 * steps, dict(counts.sites)


def test_a_configuration_names_its_method_and_parameters():
    assert parse_configuration("eagle3:m=3,width=4") == ("eagle3", {"m": 3, "width": 4})
    assert parse_configuration("spd") == ("spd", {})
    with pytest.raises(HarnessError, match="must look like name:key=value"):
        parse_configuration("spd:n")


def _sampled_counts(method, temperature: float):
    """Counts over PROMPTS with a seeded sampler at `temperature`: (counts, tokens, steps)."""
    sampler = Sampler(SamplingConfig(temperature), torch.Generator().manual_seed(0))

    def generate(ids):
        made = method.generate(ids, 24, sampler)
        return made.output_ids, made.steps

    return count_generation(generate, PROMPTS)


def _eagle3(arch: str, width: int):
    from methods.eagle3.head import EagleConfig, EagleHead
    from methods.eagle3.method import EAGLE3, EagleParams

    target = TargetRuntime(tiny_model(arch), max_len=128)
    head = EagleHead(EagleConfig(ttt=3, num_layers=target.num_layers), target).eval()
    return EAGLE3(target, EagleParams(m=3, width=width, ttt=3), set(), head=head)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_eagle3_tree_on_linear_attention_reads_its_shape_and_its_outcome(temperature):
    """Qwen3.5's linear layers take a tree level by level: the tree's shape is read back once per round, beside
    its outcome."""
    counts, _, steps = _sampled_counts(_eagle3("qwen3_5", 4), temperature)
    assert counts.syncs <= 2 * steps + len(PROMPTS), dict(counts.sites)  # + the prefill's token per prompt


@pytest.mark.parametrize("width, temperature", [(1, 0.0), (1, 1.0), (4, 0.0), (4, 1.0)])
def test_an_eagle3_round_reads_back_once(width, temperature):
    counts, _, steps = _sampled_counts(_eagle3("llama", width), temperature)
    assert counts.syncs <= steps + 2 * len(PROMPTS), dict(counts.sites)  # + the prefill's token per prompt


@pytest.mark.parametrize("arch, width, temperature", [("llama", 1, 0.0), ("llama", 4, 0.0), ("llama", 1, 1.0),
                                                      ("llama", 4, 1.0), ("qwen3_5", 4, 0.0), ("qwen3_5", 4, 1.0)])
def test_an_spd_cycle_reads_back_at_most_twice(arch, width, temperature):
    """Also a tree through linear-attention layers (Qwen3.5): the stage calls take the tree's shape from the host."""
    from methods.pipeline.spd import SPD
    from methods.pipeline.speculator import Speculator, SpeculatorConfig

    target = TargetRuntime(tiny_model(arch, num_layers=8), max_len=256)
    speculator = Speculator(SpeculatorConfig(n=4, ls=1, num_layers=8), target).eval()
    method = SPD(target, SPD.Params(n=4, ls=1, width=width), set(), speculator=speculator)
    counts, _, steps = _sampled_counts(method, temperature)
    assert counts.syncs <= 2 * steps, dict(counts.sites)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_ssd_round_reads_back_its_speculation_and_its_verdict(temperature, monkeypatch):
    """Per round: the speculation cache's tokens at once (with the fallback's drafts on a miss) and the verification's
    decision (the synchronous rerun is left out of the count)."""
    from methods.eagle3.head import EagleConfig, EagleHead
    from methods.ssd.method import SSD, SSDParams

    target = TargetRuntime(tiny_model("llama"), max_len=256)
    head = EagleHead(EagleConfig(ttt=3, num_layers=6), target).eval()
    method = SSD(target, SSDParams(ttt=3), set(), head=head)
    monkeypatch.setattr(SSD, "_time_synchronous", lambda *args: None)
    sampler = Sampler(SamplingConfig(temperature), torch.Generator().manual_seed(0))
    misses = []

    def generate(ids):
        made = method.generate(ids, 24, sampler)
        misses.append(made.stats.fallback_drafts)
        return made.output_ids, made.steps

    counts, _, steps = count_generation(generate, PROMPTS)
    assert sum(misses) > len(PROMPTS), misses  # rounds after the first missed the cache too
    assert counts.syncs <= 2 * steps + len(PROMPTS), dict(counts.sites)  # + the prefill's token


def test_the_distributed_pipeline_driver_reads_back_at_most_twice_a_cycle(tmp_path):
    from harness.runtime import distributed as launch
    from methods.pipeline.spd import SPD
    from methods.pipeline.speculator import Speculator, SpeculatorConfig

    tiny_model("llama").save_pretrained(tmp_path / "llama")
    folder = str(tmp_path / "llama")
    target = TargetRuntime(tiny_model("llama"), max_len=256)
    speculator = Speculator(SpeculatorConfig(n=2, ls=1, num_layers=6), target).eval()
    method = SPD(target, SPD.Params(n=2, ls=1), set(), speculator=speculator)
    with launch.stage_group(folder, "cpu", ["cpu"] * 2, timeout_s=120, join_timeout_s=900) as group:
        executor = method.distribute(group, "float32")
        counts, _, steps = _counts(method)
        executor.close()
    assert counts.syncs <= 2 * steps, dict(counts.sites)


class _Clock:
    """Stands in for CUDA's events and synchronize on a CPU: an event records a fake device time when recorded."""

    def __init__(self):
        self.now, self.syncs = 0.0, 0

    def event(self, enable_timing=False):
        clock = self

        class Event:
            def record(self, stream=None):
                self.at = clock.now

            def elapsed_time(self, other):
                return (other.at - self.at) * 1000  # milliseconds, as CUDA's

        return Event()

    def synchronize(self, *args):
        self.syncs += 1


def test_cuda_timing_synchronises_once_when_read_not_around_every_component(monkeypatch):
    from methods.base import Timer

    clock = _Clock()
    monkeypatch.setattr(torch.cuda, "Event", clock.event)
    monkeypatch.setattr(torch.cuda, "synchronize", clock.synchronize)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    timer = Timer(torch.device("cuda"))
    with timer("decode"):
        for _ in range(3):
            with timer("drafter"):
                clock.now += 0.25
            with timer("verify"):
                clock.now += 1.0
    assert clock.syncs == 0
    assert timer.totals == {"drafter": 0.75, "verify": 3.0, "decode": 3.75}
    assert clock.syncs == 1
    with timer("verify"):
        clock.now += 0.5
    assert timer.totals["verify"] == 3.5 and clock.syncs == 2
    assert timer.totals["verify"] == 3.5 and clock.syncs == 2  # nothing new recorded: nothing to wait for
