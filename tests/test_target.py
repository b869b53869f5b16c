"""The staged target runtime reproduces HF's own forward, and rewinds exactly."""

import pytest
import torch
from tiny_models import tiny_model

from harness.runtime.target import TargetRuntime

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
    h, positions, captured = runtime.embed(ids), range(17), {}
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
                in_flight[position], _ = runtime.run_layers(lo, hi, in_flight[position], range(position, position + 1))
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


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
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
    parents = torch.tensor([5, 6, 7, 5, 9])  # linear layers: the slot each token continues
    h, _ = runtime.run_layers(0, 6, runtime.embed(tokens), positions, slots=slots, mask=mask, parents=parents)
    logits = runtime.logits(h)
    assert (logits[:3] - alone(branch_a)).abs().max() < TOL
    assert (logits[3:] - alone(branch_b)).abs().max() < TOL

    runtime.cache.move([9, 10], dst_start=6)  # keep branch b
    runtime.truncate(8)
    nxt = torch.tensor([17])
    got = runtime.forward(nxt, start=8)[0]
    expected = TargetRuntime(model).forward(torch.cat([prompt, branch_b, nxt]), start=0)[0][-1:]
    assert (got - expected).abs().max() < TOL


def test_a_tree_through_linear_attention_layers_without_parents_is_refused():
    model = tiny_model("qwen3_5")
    runtime = TargetRuntime(model)
    runtime.forward(torch.arange(3), start=0)
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="parent slot"):
        runtime.run_layers(0, 6, runtime.embed(torch.tensor([1, 2])), torch.tensor([3, 4]), slots=torch.tensor([3, 4]),
                           mask=mask)


def test_siblings_through_linear_layers_match_each_branch_alone_over_several_levels_and_rewind():
    """Three levels of a pipeline-like tree, one call per level: level k continues chosen parents of level k-1."""
    model = tiny_model("qwen3_5")
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 256, (5,), generator=gen)
    runtime = TargetRuntime(model)
    runtime.forward(prompt, start=0)
    # level at 5: siblings A, B; level at 6: A1, B1, B2 (children of A, B, B); level at 7: B2a (child of B2)
    tokens = {name: int(t) for name, t in zip(["A", "B", "A1", "B1", "B2", "B2a"], torch.randint(0, 256, (6,), generator=gen))}
    levels = [(5, [("A", 5, 4), ("B", 8, 4)]), (6, [("A1", 6, 5), ("B1", 9, 8), ("B2", 12, 8)]), (7, [("B2a", 7, 12)])]
    parents_of = {"A1": "A", "B1": "B", "B2": "B", "B2a": "B2"}
    seen: dict[str, list[str]] = {}  # each token's branch from the prompt on
    slot_of, got = {}, {}
    for position, rows in levels:
        names = [r[0] for r in rows]
        for name in names:
            seen[name] = seen.get(parents_of.get(name), []) + [name]
        slot_of.update({name: slot for name, slot, _ in rows})
        mask = torch.zeros(len(rows), 16, dtype=torch.bool)
        mask[:, :5] = True
        for r, name in enumerate(names):
            mask[r, [slot_of[a] for a in seen[name]]] = True
        h, _ = runtime.run_layers(0, 6, runtime.embed(torch.tensor([tokens[n] for n in names])),
                                  torch.full((len(rows),), position), slots=torch.tensor([r[1] for r in rows]),
                                  mask=mask, parents=torch.tensor([r[2] for r in rows]))
        got.update({name: runtime.logits(h)[r] for r, name in enumerate(names)})
    for name, path in seen.items():
        alone = TargetRuntime(model).forward(torch.cat([prompt, torch.tensor([tokens[a] for a in path])]), 0)[0][-1]
        assert (got[name] - alone).abs().max() < TOL, name
    runtime.cache.move([8, 12], dst_start=5)  # accept B then B2: their states are filed at 5, 6
    runtime.truncate(7)
    nxt = torch.tensor([3])
    expected = TargetRuntime(model).forward(torch.cat([prompt, torch.tensor([tokens["B"], tokens["B2"]]), nxt]), 0)[0]
    assert (runtime.forward(nxt, start=7)[0] - expected[-1:]).abs().max() < TOL


def test_contiguous_positions_travel_as_a_range_and_a_tensor_without_slots_is_refused():
    model = tiny_model("llama")
    runtime = TargetRuntime(model)
    with pytest.raises(TypeError, match="as a range"):
        runtime.run_layers(0, 2, runtime.embed(torch.tensor([1, 2])), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="needs its mask="):
        runtime.cache.begin(torch.tensor([0]), slots=torch.tensor([0]))
