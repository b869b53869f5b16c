"""Acceptance simulation (--simulate) equals executed decoding at T=0: same committed tokens, steps, accepted
counts per step and per draft position, for SPD (both schedules), PPSD and EAGLE-3, chains and trees. Drafters are
briefly fitted to the tiny target's own continuations, so accepts and rejects mix; at T=1 the replayed acceptance
tracks executed runs."""

import random

import pytest
import torch
from tiny_models import tiny_model

from harness.runtime.target import TargetRuntime
from methods.autoregressive import Autoregressive
from methods.drafts import drafted
from methods.eagle3.head import EagleConfig, EagleHead, ttt_logits
from methods.eagle3.method import EAGLE3, EagleParams
from methods.pipeline.grouped_layout import grouped_logits
from methods.pipeline.objective import segment_starts
from methods.pipeline.ppsd import PPSD
from methods.pipeline.spd import SPD
from methods.pipeline.speculator import Speculator, SpeculatorConfig
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()
PROMPTS = [torch.randint(0, 256, (4,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
NEW = 40


def _sequences(target: TargetRuntime) -> tuple[torch.Tensor, dict]:
    """Greedy continuations of PROMPTS and their teacher-forced features (every layer)."""
    ar = Autoregressive(target, None, set())
    ids = torch.tensor([p + ar.generate(p, NEW, Sampler(GREEDY)).output_ids for p in PROMPTS])
    features = {}
    with torch.no_grad():  # teacher states: constants for the drafter's loss
        for row in ids:
            target.reset()
            _, captured = target.forward(row, 0, tuple(range(target.num_layers + 1)))
            for layer, h in captured.items():
                features.setdefault(layer, []).append(h)
    return ids, {layer: torch.cat(h) for layer, h in features.items()}


def _fit(module, loss_fn, steps: int = 10) -> None:
    """A few Adam steps: enough for a mix of accepts and rejects on the fitted continuations."""
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    module.train()
    for step in range(steps):
        loss = loss_fn(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    module.eval()


@torch.inference_mode(False)
@torch.enable_grad()
def _pipeline(arch: str, method, n: int, schedule: str, ls: int, width: int = 1):
    model = tiny_model(arch)
    target = TargetRuntime(model, max_len=256)
    config = SpeculatorConfig(n=n, ls=ls, schedule=schedule, policy=method.policy,
                              num_layers=model.config.num_hidden_layers)
    speculator = Speculator(config, target)
    ids, features = _sequences(target)
    rng = random.Random(0)

    def loss(step):
        starts = torch.stack([segment_starts(ids.shape[1], n, step % 2 == 1, rng) for _ in ids])
        logits = grouped_logits(speculator, features, starts)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    _fit(speculator, loss)
    return method(target, method.Params(n=n, ls=ls, schedule=schedule, width=width), set(), speculator=speculator)


@torch.inference_mode(False)
@torch.enable_grad()
def _eagle(arch: str, m: int, width: int):
    model = tiny_model(arch)
    target = TargetRuntime(model, max_len=256)
    head = EagleHead(EagleConfig(ttt=m, num_layers=model.config.num_hidden_layers), target)
    ids, features = _sequences(target)

    def loss(step):
        total = 0.0
        for k, logits in enumerate(ttt_logits(head, features, ids, m), start=1):
            total = total + torch.nn.functional.cross_entropy(logits[:, : -k - 1].flatten(0, 1), ids[:, k + 1:].flatten())
        return total

    _fit(head, loss)
    return EAGLE3(target, EagleParams(m=m, width=width, ttt=m), set(), head=head)


def _assert_same(method, sampling: SamplingConfig = GREEDY, seed: int = 0) -> None:
    """Executed and simulated runs agree on every count, and accepts and rejects mix (so the test can't be vacuous)."""
    accepted = rejected = 0
    for prompt in PROMPTS:
        with drafted() as executed_drafts:
            executed = method.generate(prompt, NEW, Sampler(sampling, torch.Generator().manual_seed(seed)))
        with drafted() as simulated_drafts:
            simulated = method.simulate(prompt, executed.output_ids, NEW,
                                        Sampler(sampling, torch.Generator().manual_seed(seed)))
        assert simulated.output_ids == executed.output_ids
        if sampling.greedy:  # every executed round's proposals are logged (what the regression gate compares) ...
            assert executed_drafts.rounds > 0
        if sampling.greedy and isinstance(method, EAGLE3) and method.params.width > 1:  # ... and a tree replay's
            assert simulated_drafts.record() == executed_drafts.record()  # round for round as executed
        assert simulated.steps == executed.steps
        assert simulated.accepted == executed.accepted
        assert simulated.position_accepts == executed.position_accepts
        if sampling.greedy or method.params.width > 1:  # certain outcomes, or trees' realised acceptance
            assert simulated.stats.expected_accepts == pytest.approx(sum(executed.position_accepts))
        for key in ("fill_drafts", "stage_runs", "drafter_calls", "verifications", "candidates"):
            # tree replays leave out what they skip: stage runs, candidates
            if getattr(simulated.stats, key, None) is not None:
                assert getattr(simulated.stats, key) == getattr(executed.stats, key), key
        accepted += sum(executed.position_accepts)
        if getattr(executed.stats, "fill_drafts", None):  # pipeline: verified drafts that were rejected
            rejected += sum(executed.stats.fill_drafts) - sum(executed.position_accepts)
        else:  # draft-then-verify: rounds that stopped before the last draft
            rejected += sum(1 for count in executed.accepted if count <= method.params.m)
    assert accepted > 0 and rejected > 0, "the fitted drafter must mix accepts and rejects"


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
@pytest.mark.parametrize("method, n, schedule, ls", [
    (SPD, 1, "input", 2), (SPD, 1, "output", 1), (SPD, 2, "input", 2), (SPD, 4, "input", 1),
    (SPD, 3, "output", 2), (PPSD, 2, "output", 1), (PPSD, 4, "output", 1),
])
def test_pipeline_simulation_equals_execution(arch, method, n, schedule, ls):
    _assert_same(_pipeline(arch, method, n, schedule, ls))


@pytest.mark.parametrize("arch, width", [("llama", 1), ("qwen3_5", 1), ("llama", 4), ("qwen3", 4), ("qwen3_5", 4)])
@pytest.mark.parametrize("m", [1, 4])
def test_eagle_simulation_equals_execution(arch, m, width):
    _assert_same(_eagle(arch, m, width))


TREE_CONFIGS = [(SPD, 2, "input", 2), (SPD, 4, "input", 1), (SPD, 3, "output", 2), (PPSD, 4, "output", 1)]


# On tiny Qwen3.5 wider trees (and Ls=2 drafters at width 2) catch every draft, and the test needs misses too.
@pytest.mark.parametrize("arch, width, method, n, schedule, ls", [
    *[(arch, 4, *config) for arch in ("llama", "qwen3") for config in TREE_CONFIGS],
    ("qwen3_5", 2, SPD, 4, "input", 1), ("qwen3_5", 2, PPSD, 4, "output", 1),
])
def test_pipeline_tree_simulation_equals_execution(arch, width, method, n, schedule, ls):
    _assert_same(_pipeline(arch, method, n, schedule, ls, width=width))


@pytest.mark.parametrize("build", [lambda: _pipeline("llama", SPD, 3, "input", 2, width=4),
                                   lambda: _pipeline("qwen3", PPSD, 2, "output", 1, width=4),
                                   lambda: _pipeline("qwen3_5", SPD, 2, "output", 1, width=2),
                                   lambda: _eagle("llama", 3, 4)], ids=["spd", "ppsd", "spd-qwen3_5", "eagle3"])
def test_sampled_tree_simulation_replays_the_executed_run(build):
    """Tree drafts are deterministic and the sibling rule accepts iff the token it emits is a candidate, so replayed
    on the executed run's own sampled output a tree run is reproduced exactly at T>0 too."""
    method = build()
    for seed in range(3):
        _assert_same(method, SamplingConfig(0.5), seed)


def _acceptance(generation) -> tuple[int, int]:
    drafts = sum(generation.stats.fill_drafts) if getattr(generation.stats, "fill_drafts", None) else len(generation.accepted)
    return sum(generation.position_accepts), drafts


@pytest.mark.parametrize("build", [lambda: _pipeline("llama", SPD, 2, "input", 2),
                                   lambda: _pipeline("llama", PPSD, 2, "output", 1),
                                   lambda: _eagle("llama", 3, 1)], ids=["spd", "ppsd", "eagle3"])
def test_sampled_simulation_tracks_executed_acceptance(build):
    """At T=1 the replay's acceptance (expected min(p, q) per draft along a sampled trajectory) matches executed
    runs on average: both are pooled over the same prompts and seeds."""
    method = build()
    executed, simulated, expected = [0, 0], [0, 0], 0.0
    for seed in range(12):
        for prompt in PROMPTS:
            run = method.generate(prompt, NEW, Sampler(SamplingConfig(1.0), torch.Generator().manual_seed(seed)))
            replay = method.simulate(prompt, run.output_ids, NEW,
                                     Sampler(SamplingConfig(1.0), torch.Generator().manual_seed(seed)))
            executed = [a + b for a, b in zip(executed, _acceptance(run))]
            simulated = [a + b for a, b in zip(simulated, _acceptance(replay))]
            expected += replay.stats.expected_accepts
    rate_executed, rate_simulated = executed[0] / executed[1], simulated[0] / simulated[1]
    assert rate_executed > 0.05
    assert abs(rate_executed - rate_simulated) < 0.1
    assert abs(rate_executed - expected / simulated[1]) < 0.1
