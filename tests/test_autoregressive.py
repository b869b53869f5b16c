"""Autoregressive decoding on the target runtime: greedy equals HF generate; sampling follows the target."""

import pytest
import torch
from tiny_models import tiny_model

from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig


def _ar(model, stop_ids=frozenset()):
    return build_method("autoregressive", TargetRuntime(model, max_len=256), {}, set(stop_ids))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_greedy_matches_hf_generate(arch):
    model = tiny_model(arch)
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 9:].tolist()
    generation = _ar(model).generate(prompt, 24, Sampler(SamplingConfig()))
    assert generation.output_ids == expected
    assert generation.steps == 23 and generation.accepted == [1] * 23
    assert {"prefill", "decode"} <= set(generation.timing)


def test_generation_stops_after_the_first_stop_id_of_any_kind():
    model = tiny_model("llama")
    prompt = [5, 6, 7]
    free = _ar(model).generate(prompt, 20, Sampler(SamplingConfig())).output_ids
    stop = {free[4], 10_000}  # a set of end-of-turn ids, only one of which occurs
    first = next(i for i, t in enumerate(free) if t in stop)
    stopped = _ar(model, stop).generate(prompt, 20, Sampler(SamplingConfig())).output_ids
    assert stopped == free[: first + 1]


def test_sampled_first_token_follows_the_top_k_target_distribution():
    model = tiny_model("llama")
    prompt = [1, 2, 3, 4]
    config = SamplingConfig(temperature=1.0, top_k=4)
    logits = model(torch.tensor([prompt])).logits[0, -1]
    p = Sampler(config).probs(logits)
    method = _ar(model)
    counts = torch.zeros_like(p)
    for seed in range(3000):
        token = method.generate(prompt, 1, Sampler(config, torch.Generator().manual_seed(seed))).output_ids[0]
        counts[token] += 1
    tv = 0.5 * float((counts / counts.sum() - p).abs().sum())
    assert tv < 0.04


def test_sampling_is_reproducible_for_a_seed():
    model = tiny_model("qwen3")
    method = _ar(model)
    config = SamplingConfig(temperature=1.0, top_p=0.9)
    runs = [method.generate([3, 4], 12, Sampler(config, torch.Generator().manual_seed(7))).output_ids for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("method, params", [("autoregressive", {}), ("lookup", {})])
def test_a_prefill_takes_the_head_at_the_last_prompt_position_only(method, params):
    """Fails on a16459a: the prefill built fp32 logits for every prompt position (2k tokens of a 248k vocabulary
    are 2 GB) to read the last one."""
    model = tiny_model("llama")
    target = TargetRuntime(model, max_len=128)
    rows = []
    prompt = list(range(3, 43))
    with target.watching(lambda logits: rows.append(logits.shape[0])):  # every logits block the head computes
        build_method(method, target, params, set()).generate(prompt, 4, Sampler(SamplingConfig()))
    assert rows and rows[0] == 1 and max(rows) < len(prompt)
