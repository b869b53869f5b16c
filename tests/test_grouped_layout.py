"""The grouped training layout reproduces the dense depth-unrolled one (same rows, same visibility, same logits) for
both schedules, n = 1 (no in-flight rows for the output schedule) to n = L, full and flushed pipelines, and every
architecture; and its gradients match too, so a training step is the same step, although the grouped layout leaves
out the rows no logit depends on (dead slots, and every row but the queries after the last layer's keys)."""

import random

import pytest
import torch
from tiny_models import tiny_model
from unrolled_reference import unrolled_logits

from harness.runtime.target import TargetRuntime
from methods.pipeline import grouped_layout
from methods.pipeline.grouped_layout import grouped_logits
from methods.pipeline.objective import segment_starts
from methods.pipeline.speculator import Speculator, SpeculatorConfig


@pytest.fixture(autouse=True, params=[grouped_layout.POSITION_BLOCK, 7], ids=["one-block", "blocks-of-7"])
def _position_block(request, monkeypatch):
    """Every comparison runs with the training block size (one block at these lengths) and with uneven blocks of 7
    positions, the first of which sees no finished row at n >= 7."""
    monkeypatch.setattr(grouped_layout, "POSITION_BLOCK", request.param)


def _speculator(arch: str, n: int, ls: int, schedule: str, aggr_bounds=()) -> tuple[Speculator, dict, torch.Tensor]:
    model = tiny_model(arch)
    target = TargetRuntime(model, max_len=64)
    torch.manual_seed(n)
    speculator = Speculator(SpeculatorConfig(n=n, ls=ls, schedule=schedule, num_layers=6, aggr_bounds=aggr_bounds),
                            target)
    with torch.no_grad():
        for projection in speculator.projections:
            projection.weight.normal_(0, 0.05)
    size = 40
    features = {layer: torch.randn(2, size, 64) for layer in speculator.config.all_feature_layers()}
    rng = random.Random(n)
    starts = torch.stack([segment_starts(size, n, flush, rng) for flush in (False, True)])
    return speculator, features, starts


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("n, ls, schedule", [(1, 1, "input"), (1, 2, "output"), (2, 2, "input"), (3, 2, "output"),
                                             (4, 1, "input"), (6, 2, "input")])
def test_grouped_logits_equal_the_unrolled_layouts(arch, n, ls, schedule):
    speculator, features, starts = _speculator(arch, n, ls, schedule)
    assert torch.allclose(grouped_logits(speculator, features, starts), unrolled_logits(speculator, features, starts),
                          atol=1e-4)


@pytest.mark.parametrize("schedule", ["input", "output"])
def test_shared_projections_give_the_unrolled_logits(schedule):
    """Depths that share a projection (aggregation bounds) share one projection call in the grouped layout."""
    speculator, features, starts = _speculator("llama", 6, 2, schedule, aggr_bounds=(0, 2, 5))
    assert torch.allclose(grouped_logits(speculator, features, starts), unrolled_logits(speculator, features, starts),
                          atol=1e-4)


@torch.inference_mode(False)
@torch.enable_grad()
@pytest.mark.parametrize("arch, n, ls, schedule", [("llama", 4, 2, "input"), ("qwen3", 3, 1, "output"),
                                                   ("qwen3_5", 6, 2, "input")])
def test_grouped_gradients_equal_the_unrolled_layouts(arch, n, ls, schedule):
    speculator, features, starts = _speculator(arch, n, ls, schedule)
    grads = []
    for forward in (grouped_logits, unrolled_logits):
        speculator.zero_grad()
        forward(speculator, features, starts).logsumexp(-1).sum().backward()
        # a parameter one layout never reads (the output schedule's depth-0 projection) has no gradient: zero
        grads.append(torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                                for p in speculator.parameters() if p.requires_grad]))
    assert torch.allclose(grads[0], grads[1], atol=1e-4)
