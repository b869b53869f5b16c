"""SPD on tiny models: token-identical to greedy AR at T=0 (any drafter quality), target distribution at T=1."""

import pytest
import torch
from tiny_models import flat_target, sampled_joint_tv, tiny_model

from harness.runtime.target import TargetRuntime, stage_bounds
from methods.base import build_method, recorded_params
from methods.pipeline.drafter import Drafter
from methods.pipeline.ppsd import PPSD
from methods.pipeline.spd import SPD
from methods.pipeline.speculator import Speculator, SpeculatorConfig
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()


def _spd(model, n, schedule="input", ls=2, max_len=256, method=SPD, width=1):
    target = TargetRuntime(model, max_len=max_len)
    config = SpeculatorConfig(n=n, ls=ls, schedule=schedule, policy=method.policy,
                              num_layers=model.config.num_hidden_layers)
    speculator = Speculator(config, target).eval()
    params = method.Params(n=n, ls=ls, schedule=schedule, width=width)
    return target, method(target, params, set(), speculator=speculator)


def _branch(leaf, n):
    """The in-flight tokens on the path to `leaf`, oldest first (empty when the leaf already finished)."""
    path = []
    while leaf is not None and leaf.depth < n:
        path.append(leaf)
        leaf = leaf.parent
    return path[::-1]


def _oracle(reference: dict[int, int], hit_rate: float, seed: int = 0, record: list | None = None):
    """A drafter that proposes the greedy reference token with probability `hit_rate` (per leaf), so accepts and
    rejects mix. It still runs the real drafter (its cache bookkeeping stays exercised); `record` collects what it
    computed for the newest leaf.
    """
    rng = torch.Generator().manual_seed(seed)

    class Oracle(Drafter):
        def logits(self, finished, levels):
            real = super().logits(finished, levels)
            out = real.clone()
            leaves = levels[-1] if levels else finished[-1:]
            for i, leaf in enumerate(leaves):
                if record is not None:
                    branch = finished + _branch(leaf, self.speculator.config.n)
                    record.append(([(r.position, r.token, r.depth) for r in branch], real[i].clone(), len(leaves)))
                position = leaf.position + 1
                if position in reference and float(torch.rand((), generator=rng)) < hit_rate:
                    out[i] = -10.0
                    out[i, reference[position]] = 10.0
            return out

    return Oracle


def test_stage_bounds_split_near_evenly_with_larger_stages_first():
    assert stage_bounds(30, 8) == [(0, 4), (4, 8), (8, 12), (12, 16), (16, 20), (20, 24), (24, 27), (27, 30)]
    assert stage_bounds(6, 3) == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError):
        stage_bounds(4, 5)


CONFIGS = [(3, "input", SPD), (4, "output", SPD), (6, "input", SPD), (1, "input", SPD), (2, "output", SPD),
           (4, "output", PPSD)]


@pytest.mark.parametrize("arch, width", [("llama", 1), ("qwen3", 1), ("qwen3_5", 1), ("llama", 4), ("qwen3", 4),
                                         ("qwen3_5", 2), ("qwen3_5", 4)])
@pytest.mark.parametrize("n, schedule, method", CONFIGS)
@pytest.mark.parametrize("hit_rate", [0.0, 0.8, 1.0])
def test_greedy_output_is_token_identical_to_ar(arch, width, n, schedule, method, hit_rate):
    model = tiny_model(arch)
    target, method = _spd(model, n, schedule, method=method, width=width)
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


@pytest.mark.parametrize("schedule", ["input", "output"])
def test_tree_branches_rescue_a_wrong_first_choice(schedule):
    """Width 4 keeps the runner-up draft in flight: when it is the target's token, no flush happens (width 1 flushes)."""
    model = tiny_model("llama")
    n, prompt = 3, [3, 4, 5]
    steps = {}
    for width in (1, 4):
        target, method = _spd(model, n, schedule, width=width)
        reference = build_method("autoregressive", target, {}, set()).generate(prompt, 16, Sampler(GREEDY)).output_ids
        by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
        tricky = {len(prompt) + 4, len(prompt) + 9}  # the target's token is only the drafter's second choice here

        class SecondBest(Drafter):
            def logits(self, finished, levels):
                out = torch.zeros_like(super().logits(finished, levels))
                for i, leaf in enumerate(levels[-1] if levels else finished[-1:]):
                    position = leaf.position + 1
                    right = by_position.get(position, 0)
                    out[i, right] = 10.0
                    if position in tricky:
                        out[i, (right + 1) % out.shape[-1]] = 11.0
                return out

        method.engine.drafter_class = SecondBest
        generation = method.generate(prompt, 16, Sampler(GREEDY))
        assert generation.output_ids == reference
        steps[width] = generation.steps
    assert steps[4] == len(reference) - 1 + (n - 1)  # never flushed
    assert steps[1] == steps[4] + 2 * (n - 1)  # one refill per tricky position


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


@pytest.mark.parametrize("arch, schedule, method, width", [
    ("llama", "input", SPD, 1), ("llama", "output", SPD, 1), ("llama", "output", PPSD, 1), ("llama", "input", SPD, 2),
    ("llama", "output", SPD, 4), ("qwen3_5", "input", SPD, 2), ("qwen3_5", "output", SPD, 4)])
def test_sampled_tokens_follow_the_target_distribution(arch, schedule, method, width):
    """T=1: the joint of the 2nd and 3rd generated tokens (both verified drafts) matches the exact target joint
    (on Qwen3.5, sibling branches through its linear-attention layers)."""
    vocab = 4
    model = flat_target(vocab, arch)
    _, method = _spd(model, 2, schedule, method=method, width=width)
    with torch.no_grad():  # a drafter far from the target, so a wrong residual would show
        method.speculator.head.weight.copy_(torch.randn(vocab, 64, generator=torch.Generator().manual_seed(0)))
    tv = sampled_joint_tv(method, model, vocab)
    assert tv < 0.07


@pytest.mark.parametrize("arch, n, schedule, width", [("llama", 3, "input", 1), ("llama", 4, "output", 1),
                                                      ("qwen3_5", 4, "input", 1), ("qwen3", 2, "output", 1),
                                                      ("llama", 3, "input", 4), ("qwen3", 4, "output", 4)])
def test_training_forward_equals_the_logits_the_pipeline_drafts_with(arch, n, schedule, width):
    """Same tokens and depths: the training layout reproduces every draft the engine computed (fp32), for every
    branch of a draft tree too (each branch sees only its own ancestors)."""
    from methods.pipeline.grouped_layout import grouped_logits

    model = tiny_model(arch)
    target, method = _spd(model, n, schedule, width=width)
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
    compared, tree_rows = 0, 0
    for rows, real, leaves in seen:
        if any(p >= len(sequence) or sequence[p] != t for p, t, _ in rows):
            continue  # the pipeline held a draft that was later rejected: no training row describes it
        start = min((p for p, _, depth in rows if depth < n), default=rows[-1][0] + 1)  # oldest in-flight token
        positions = torch.arange(len(sequence))
        starts = torch.where(positions >= start, start, 0)[None]
        logits = method.speculator.full_vocab(grouped_logits(method.speculator, features, starts))[0]
        assert (logits[rows[-1][0]] - real).abs().max() < 1e-4
        compared += 1
        tree_rows += leaves > 1
    assert compared >= 8
    assert (tree_rows > 0) == (width > 1)


@pytest.mark.parametrize("width", [1, 3])
def test_the_scheduler_reaches_the_target_only_through_its_stage_executor(width):
    """An executor that logs every call around the local one: the engine's output stays AR's, and the calls are the
    seam's (one prefill, one stage step per cycle, a verification per finished token, a truncation per rejection,
    a commit per acceptance)."""
    from methods.pipeline.executor import LocalExecutor

    model, n, prompt = tiny_model("qwen3_5" if width == 1 else "llama"), 3, [5, 6, 7]
    target, method = _spd(model, n, width=width)
    reference = build_method("autoregressive", target, {}, set()).generate(prompt, 20, Sampler(GREEDY)).output_ids
    calls = []

    class Logging(LocalExecutor):
        def __getattribute__(self, name):
            attribute = super().__getattribute__(name)
            if name in ("start", "prefill", "enter", "advance", "verification_logits", "truncate", "commit"):
                calls.append(name)
            return attribute

    engine = method.engine
    engine.executor = Logging(target, engine.bounds, engine.capture, width)
    engine.drafter_class = _oracle({len(prompt) + i: t for i, t in enumerate(reference)}, 0.6, seed=1)
    generation = method.generate(prompt, 20, Sampler(GREEDY))
    assert generation.output_ids == reference
    assert calls[:2] == ["start", "prefill"] and calls.count("prefill") == 1
    assert calls.count("advance") == generation.steps
    verified = sum(generation.stats.fill_drafts)
    accepted = sum(generation.position_accepts)
    assert calls.count("verification_logits") == verified
    assert calls.count("commit") == accepted and calls.count("truncate") == verified - accepted > 0


def test_the_reference_prefill_reads_the_last_layer_after_the_final_norm_and_both_settings_stay_lossless():
    """A bound equal to L (the reference's default bounds for n <= 6): its single-process prefill reads HF's
    hidden_states[L], after the final norm; `prefill_features=reference` reproduces that for the prompt's rows only."""
    model = tiny_model("qwen3", num_layers=8)
    target = TargetRuntime(model, max_len=128)
    speculator = Speculator(SpeculatorConfig(n=4, ls=1, num_layers=8, aggr_bounds=(0, 2, 6, 7, 8)), target).eval()
    methods = {mode: SPD(target, SPD.Params(n=4, ls=1, prefill_features=mode), set(), speculator=speculator)
               for mode in ("pre-norm", "reference")}
    prompt = list(range(10, 21))
    with torch.inference_mode():
        _, captured = target.forward(torch.tensor(prompt), start=0, capture=(7, 8))
        rows = {}
        for mode, method in methods.items():
            method.engine.executor.start()
            rows[mode] = method.engine._prefill(prompt, Sampler(GREEDY))[1]
        for p, (plain, theirs) in enumerate(zip(rows["pre-norm"], rows["reference"])):
            assert torch.allclose(plain.features[8], captured[8][:, p: p + 1])
            assert torch.allclose(theirs.features[8], target.final_norm(captured[8])[:, p: p + 1])
            assert torch.equal(plain.features[7], theirs.features[7])  # only the last layer's rows change
        assert not torch.allclose(rows["pre-norm"][0].features[8], rows["reference"][0].features[8])
        reference = build_method("autoregressive", target, {}, set()).generate(prompt, 16, Sampler(GREEDY)).output_ids
        for method in methods.values():
            executed = method.generate(prompt, 16, Sampler(GREEDY))
            assert executed.output_ids == reference
            assert method.simulate(prompt, reference, 16, Sampler(GREEDY)).accepted == executed.accepted
    assert recorded_params(SPD.Params()) == recorded_params(SPD.Params(prefill_features="pre-norm"))  # keys unchanged
    assert recorded_params(SPD.Params(prefill_features="reference"))["prefill_features"] == "reference"
    with pytest.raises(ValueError, match="prefill_features must be one of pre-norm, reference"):
        SPD.Params(prefill_features="post")
