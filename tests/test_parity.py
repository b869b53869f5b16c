"""Train/decode parity: the states the decoding engine builds for the drafter are the states training builds, on
every (position, fill level) decoding visits with trajectory tokens in flight, for both schedules, PPSD's policy,
Ls 1-2 and a linear-attention target; a drafter fed one stage too shallow in decoding is caught."""

import pytest
from test_simulate import NEW, PROMPTS, _pipeline

from methods.autoregressive import Autoregressive
from methods.pipeline.drafter import Drafter
from methods.pipeline.parity import compare
from methods.pipeline.ppsd import PPSD
from methods.pipeline.spd import SPD
from methods.sampling import Sampler, SamplingConfig


def _parity(method):
    """Parity pooled over the fitted drafter's prompts (its accepts put every fill level on the trajectory)."""
    total = None
    for prompt in PROMPTS:
        trajectory = Autoregressive(method.target, None, set()).generate(prompt, NEW, Sampler(SamplingConfig()))
        found = compare(method.engine, prompt, trajectory.output_ids, NEW)
        if total is None:
            total = found
        else:
            total.add(found)
    return total


@pytest.mark.parametrize("arch, method, n, schedule, ls", [
    ("llama", SPD, 1, "input", 2), ("llama", SPD, 2, "input", 2), ("llama", SPD, 4, "input", 1),
    ("llama", SPD, 3, "output", 2), ("llama", PPSD, 3, "output", 1), ("qwen3_5", SPD, 3, "input", 2),
])
def test_engine_drafts_from_the_training_layouts_states(arch, method, n, schedule, ls):
    parity = _parity(_pipeline(arch, method, n, schedule, ls))
    assert parity.lossless
    assert parity.disagree == 0, parity.mismatches
    visited = [f.states > 0 for f in parity.fills]
    assert all(visited[:2]), "accepted drafts must put the engine past fill 0 on the trajectory"
    for f in parity.fills:
        assert f.decode_hits == f.train_hits
        assert f.all_states >= f.states


def test_parity_catches_rows_one_stage_too_shallow_in_decoding(monkeypatch):
    original = Drafter.logits

    def shallow(self, finished, levels):
        in_flight = [t for level in levels for t in level if t.depth > 0]
        for t in in_flight:
            t.depth -= 1
        try:
            return original(self, finished, levels)
        finally:
            for t in in_flight:
                t.depth += 1

    method = _pipeline("llama", SPD, 4, "input", 1)
    monkeypatch.setattr(Drafter, "logits", shallow)
    parity = _parity(method)
    assert parity.disagree > 0
    assert {m["fill"] for m in parity.mismatches} - {0}  # fill 0 has no in-flight row below the newest
