"""SPD on tiny models: token-identical to greedy AR at T=0 (any drafter quality), target distribution at T=1."""

import pytest
import torch

from harness.target import TargetRuntime
from methods.base import build_method
from methods.pipeline import Drafter
from methods.sampling import Sampler, SamplingConfig
from methods.ppsd import PPSD
from methods.spd import SPD
from methods.speculator import Speculator, SpeculatorConfig, stage_bounds
from tiny_models import tiny_model

GREEDY = SamplingConfig()


def _spd(model, n, schedule="input", ls=2, max_len=256, method=SPD):
    target = TargetRuntime(model, max_len=max_len)
    config = SpeculatorConfig(n=n, ls=ls, schedule=schedule, policy=method.policy,
                              num_layers=model.config.num_hidden_layers)
    speculator = Speculator(config, target).eval()
    params = method.Params(n=n, ls=ls, schedule=schedule)
    return target, method(target, params, set(), speculator=speculator)


def _oracle(reference: dict[int, int], hit_rate: float, seed: int = 0, record: list | None = None):
    """A drafter that proposes the greedy reference token with probability `hit_rate`, so accepts and rejects mix.

    It still runs the real drafter (its cache bookkeeping stays exercised); `record` collects what it computed.
    """
    rng = torch.Generator().manual_seed(seed)

    class Oracle(Drafter):
        def logits(self, rows):
            real = super().logits(rows)
            if record is not None:
                record.append(([(r.position, r.token, r.depth) for r in rows], real.clone()))
            position = rows[-1].position + 1
            if position in reference and float(torch.rand((), generator=rng)) < hit_rate:
                logits = torch.full_like(real, -10.0)
                logits[reference[position]] = 10.0
                return logits
            return real

    return Oracle


def test_stage_bounds_split_near_evenly_with_larger_stages_first():
    assert stage_bounds(30, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 27), (27, 30)]
    assert stage_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError):
        stage_bounds(4, 5)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("n, schedule, method", [(3, "input", SPD), (4, "output", SPD), (6, "input", SPD),
                                                 (1, "input", SPD), (2, "output", SPD), (4, "output", PPSD)])
@pytest.mark.parametrize("hit_rate", [0.0, 0.8, 1.0])
def test_greedy_output_is_token_identical_to_ar(arch, n, schedule, method, hit_rate):
    model = tiny_model(arch)
    target, method = _spd(model, n, schedule, method=method)
    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], [3, 4], list(range(10, 19))):  # includes prompts shorter than n
        reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
        by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
        method.engine.drafter_class = _oracle(by_position, hit_rate)
        generation = method.generate(prompt, 24, Sampler(GREEDY))
        assert generation.output_ids == reference
        assert generation.steps == len(generation.accepted)
        assert sum(generation.accepted) == len(reference) - 1  # every token after the prefill one is committed by a cycle
        if hit_rate == 1.0:  # a perfect drafter fills the pipeline once: n cycles, then one token per cycle
            assert generation.steps == len(reference) - 1 + (n - 1)


def test_greedy_stops_at_a_stop_id_like_ar():
    model = tiny_model("llama")
    target, method = _spd(model, 3)
    ar = build_method("autoregressive", target, {}, set())
    free = ar.generate([5, 6], 20, Sampler(GREEDY)).output_ids
    stop = {free[6]}
    expected = free[: free.index(free[6]) + 1]
    method.engine.stop_ids = stop
    method.engine.drafter_class = _oracle({2 + i: t for i, t in enumerate(free)}, 0.9)
    assert method.generate([5, 6], 20, Sampler(GREEDY)).output_ids == expected


def _exact_joint_of_tokens_1_and_2(model, prompt, vocab):
    """P(x1, x2) under the target at T=1, marginalising the prefill token x0, by enumerating all continuations."""
    seqs = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    probs = torch.softmax(model(seqs).logits.float(), dim=-1)  # [V*V, len, V]
    p0 = probs[0, len(prompt) - 1]
    joint = torch.zeros(vocab, vocab)
    for a in range(vocab):
        p1 = probs[a * vocab, len(prompt)]
        for b in range(vocab):
            joint[b] += p0[a] * p1[b] * probs[a * vocab + b, len(prompt) + 1]
    return joint.flatten()


@pytest.mark.parametrize("schedule, method", [("input", SPD), ("output", SPD), ("output", PPSD)])
def test_sampled_tokens_follow_the_target_distribution(schedule, method):
    """T=1: the joint of the 2nd and 3rd generated tokens (both verified drafts) matches the exact target joint."""
    vocab = 4
    model = tiny_model("llama", vocab_size=vocab)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.25)  # flatter target, so every outcome is likely
    _, method = _spd(model, 2, schedule, method=method)
    with torch.no_grad():  # a drafter far from the target, so a wrong residual would show
        method.speculator.head.weight.copy_(torch.randn(vocab, 64, generator=torch.Generator().manual_seed(0)))
    prompt = [1, 2, 3]
    expected = _exact_joint_of_tokens_1_and_2(model, prompt, vocab)
    counts = torch.zeros(vocab * vocab)
    runs = 1500
    for seed in range(runs):
        out = method.generate(prompt, 3, Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(seed)))
        counts[out.output_ids[1] * vocab + out.output_ids[2]] += 1
    tv = 0.5 * float((counts / runs - expected).abs().sum())
    assert tv < 0.07


@pytest.mark.parametrize("arch, n, schedule", [("llama", 3, "input"), ("llama", 4, "output"), ("qwen3_5", 4, "input"), ("qwen3", 2, "output")])
def test_unrolled_training_forward_equals_the_logits_the_pipeline_drafts_with(arch, n, schedule):
    """Same tokens and depths: the training layout reproduces every draft the engine computed (fp32)."""
    from methods.speculator import unrolled_logits

    model = tiny_model(arch)
    target, method = _spd(model, n, schedule)
    ar = build_method("autoregressive", target, {}, set())
    prompt = [4, 9, 2, 7, 1]
    reference = ar.generate(prompt, 20, Sampler(GREEDY)).output_ids
    by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
    seen = []
    method.engine.drafter_class = _oracle(by_position, 0.7, seed=3, record=seen)
    method.generate(prompt, 20, Sampler(GREEDY))
    sequence = prompt + reference
    target.reset()
    _, features = target.forward(torch.tensor(sequence), start=0, capture=method.speculator.config.all_feature_layers())
    compared = 0
    for rows, real in seen:
        if any(p >= len(sequence) or sequence[p] != t for p, t, _ in rows):
            continue  # the pipeline held a draft that was later rejected: no training row describes it
        start = min((p for p, _, depth in rows if depth < n), default=rows[-1][0] + 1)  # oldest in-flight token
        positions = torch.arange(len(sequence))
        starts = torch.where(positions >= start, start, 0)[None]
        logits = method.speculator.full_vocab(unrolled_logits(method.speculator, features, starts))[0]
        assert (logits[rows[-1][0]] - real).abs().max() < 1e-4
        compared += 1
    assert compared >= 8
