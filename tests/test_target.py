"""The staged target runtime reproduces HF's own forward, and rewinds exactly."""

import pytest
import torch

from harness.target import TargetRuntime
from tiny_models import tiny_model

ARCHS = ["llama", "qwen3", "qwen3_5"]
SPLITS = [(6,), (1, 5), (2, 2, 2), (1, 1, 1, 1, 1, 1), (4, 2)]
TOL = 1e-4


def _stages(sizes):
    bounds, lo = [], 0
    for size in sizes:
        bounds.append((lo, lo + size))
        lo += size
    return bounds


@pytest.fixture(scope="module", params=ARCHS)
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("sizes", SPLITS)
def test_stage_by_stage_prefill_matches_hf_full_forward_logits_and_hidden_states(model, sizes):
    ids = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(1))
    reference = model(ids[None], output_hidden_states=True)
    runtime = TargetRuntime(model)
    h, positions, captured = runtime.embed(ids), torch.arange(17), {}
    for lo, hi in _stages(sizes):
        h, got = runtime.run_layers(lo, hi, h, positions, capture=tuple(range(7)))
        captured.update(got)
    assert (runtime.logits(h) - reference.logits[0]).abs().max() < TOL
    for k in range(6):  # HF's last entry is post-norm; ours are all pre-norm
        assert (captured[k][0] - reference.hidden_states[k][0]).abs().max() < TOL
    assert (runtime.backbone.norm(captured[6])[0] - reference.hidden_states[6][0]).abs().max() < TOL


@pytest.mark.parametrize("sizes", [(3, 3), (1, 2, 3)])
def test_tokens_crossing_stages_one_at_a_time_match_full_forward(model, sizes):
    """Pipeline order: each token runs stage s after the earlier tokens did; results equal a full forward."""
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(2))
    reference = model(ids[None]).logits[0]
    runtime = TargetRuntime(model)
    stages = _stages(sizes)
    runtime.forward(ids[:5], start=0)
    in_flight = {}  # position -> hidden state after the stages it has passed
    logits = {}
    for cycle in range(5, 12 + len(stages)):
        if cycle < 12:
            in_flight[cycle] = runtime.embed(ids[cycle : cycle + 1])
        for depth, (lo, hi) in enumerate(stages):
            position = cycle - depth
            if position in in_flight and 5 <= position:
                in_flight[position], _ = runtime.run_layers(lo, hi, in_flight[position], torch.tensor([position]))
                if depth == len(stages) - 1:
                    logits[position] = runtime.logits(in_flight.pop(position))[0]
    for position in range(5, 12):
        assert (logits[position] - reference[position]).abs().max() < TOL


def test_decode_truncate_replay_equals_never_decoding_the_rejected_tokens(model):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (7,), generator=gen)
    accepted = torch.randint(0, 256, (3,), generator=gen)
    rejected = torch.randint(0, 256, (4,), generator=gen)
    continuation = torch.randint(0, 256, (3,), generator=gen)

    clean = TargetRuntime(model)
    clean_logits, _ = clean.forward(torch.cat([prompt, accepted, continuation]), start=0)

    runtime = TargetRuntime(model)
    runtime.forward(prompt, start=0)
    for i, token in enumerate(torch.cat([accepted, rejected])):
        runtime.forward(token[None], start=7 + i)
    runtime.truncate(10)
    got = [runtime.forward(token[None], start=10 + i)[0] for i, token in enumerate(continuation)]
    assert (torch.cat(got) - clean_logits[10:]).abs().max() < TOL


def test_truncate_to_the_prompt_and_to_zero_then_replay(model):
    ids = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))
    reference = TargetRuntime(model).forward(ids, start=0)[0]
    runtime = TargetRuntime(model)
    runtime.forward(ids[:5], start=0)
    runtime.forward(ids[5:6], start=5)
    runtime.truncate(5)
    replay = torch.cat([runtime.forward(ids[i : i + 1], start=i)[0] for i in range(5, 9)])
    assert (replay - reference[5:]).abs().max() < TOL
    runtime.truncate(0)
    assert (runtime.forward(ids, start=0)[0] - reference).abs().max() < TOL


def test_linear_attention_rewind_beyond_the_window_fails_loudly():
    model = tiny_model("qwen3_5")
    runtime = TargetRuntime(model, rewind_window=2)
    runtime.forward(torch.arange(4), start=0)
    for i in range(4):
        runtime.forward(torch.tensor([i]), start=4 + i)
    with pytest.raises(ValueError, match="cannot rewind"):
        runtime.truncate(4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_rows_with_custom_mask_match_each_branch_run_alone_and_compaction_continues_exactly(arch):
    model = tiny_model(arch)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (6,), generator=gen)
    branch_a = torch.randint(0, 256, (3,), generator=gen)
    branch_b = torch.randint(0, 256, (2,), generator=gen)

    def alone(branch):
        runtime = TargetRuntime(model)
        return runtime.forward(torch.cat([prompt, branch]), start=0)[0][6:]

    runtime = TargetRuntime(model)
    runtime.forward(prompt, start=0)
    tokens = torch.cat([branch_a, branch_b])
    positions = torch.tensor([6, 7, 8, 6, 7])
    slots = torch.arange(6, 11)
    mask = torch.zeros(5, 11, dtype=torch.bool)
    mask[:, :6] = True
    for row, visible in enumerate([[0], [0, 1], [0, 1, 2], [3], [3, 4]]):
        mask[row, [6 + v for v in visible]] = True
    h, _ = runtime.run_layers(0, 6, runtime.embed(tokens), positions, slots=slots, mask=mask)
    logits = runtime.logits(h)
    assert (logits[:3] - alone(branch_a)).abs().max() < TOL
    assert (logits[3:] - alone(branch_b)).abs().max() < TOL

    runtime.cache.move(torch.tensor([9, 10]), dst_start=6)  # keep branch b
    runtime.truncate(8)
    nxt = torch.tensor([17])
    got = runtime.forward(nxt, start=8)[0]
    expected = TargetRuntime(model).forward(torch.cat([prompt, branch_b, nxt]), start=0)[0][-1:]
    assert (got - expected).abs().max() < TOL


def test_custom_mask_on_linear_attention_layers_is_refused():
    model = tiny_model("qwen3_5")
    runtime = TargetRuntime(model)
    runtime.forward(torch.arange(3), start=0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="linear-attention"):
        runtime.run_layers(0, 6, runtime.embed(torch.tensor([1, 2])), torch.tensor([3, 4]), mask=mask)
