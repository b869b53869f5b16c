"""The row attention (harness/runtime/attention.py): torch's values within rounding, a row's result the same alone,
beside other rows and under masked slots after its own, HF's own calls served or handed to sdpa, and with it every
method's T=0 tokens in bf16 exactly greedy AR's."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from harness.bench.selfcheck import check_methods
from harness.runtime.attention import rows_attention
from harness.runtime.kernels import rows_kernel_problem
from harness.runtime.target import TargetRuntime


def _qkv(dtype, rows=5, slots=40, heads=6, kv_heads=2, dim=24, seed=0):
    torch.manual_seed(seed)
    query = torch.randn(1, rows, heads, dim).to(dtype).transpose(1, 2)  # as HF hands it over: a transposed view
    key, value = (torch.randn(1, kv_heads, slots, dim).to(dtype) for _ in range(2))
    return query, key, value


def _op(query, key, value, mask, scale=0.2):
    assert rows_kernel_problem() is None  # built (and loaded) once per process
    return torch.ops.spd_bench.rows_attention(query, key, value, mask, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_it_computes_torchs_attention_with_grouped_heads_and_any_mask(dtype):
    query, key, value = _qkv(dtype)
    torch.manual_seed(1)
    mask = torch.rand(5, 40) < 0.6
    mask[:, 0] = True  # every row sees something
    got = _op(query, key, value, mask[None, None])
    expected = F.scaled_dot_product_attention(query.float(), key.float().repeat_interleave(3, 1),
                                              value.float().repeat_interleave(3, 1), attn_mask=mask, scale=0.2)
    assert got.shape == (1, 5, 6, 24) and got.dtype == dtype
    assert torch.allclose(got.float(), expected.transpose(1, 2), atol=1e-5 if dtype == torch.float32 else 2e-2)
    causal = torch.ones(5, 40, dtype=torch.bool).tril(35)  # no mask: each row sees the slots up to its own
    assert torch.equal(_op(query, key, value, None), _op(query, key, value, causal[None, None]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_among_others_and_under_masked_slots(dtype):
    query, key, value = _qkv(dtype)
    together = _op(query, key, value, None)
    for row in range(5):
        own = 35 + row  # the row's slot: it sees 0..own
        alone = _op(query[:, :, row: row + 1], key[:, :, : own + 1], value[:, :, : own + 1], None)
        assert torch.equal(alone[:, 0], together[:, row])
    tree = torch.zeros(5, 40, dtype=torch.bool)  # a branch's rows see the prefix and their ancestors only
    tree[:, :35] = True
    for row, ancestors in enumerate([[35], [35, 36], [35, 37], [35, 36, 38], [35, 37, 39]]):
        tree[row, ancestors] = True
    branched = _op(query, key, value, tree[None, None])
    path = [35, 36, 38]  # row 3's path, as consecutive slots would hold it once accepted
    moved_key, moved_value = (torch.cat([t[:, :, :35], t[:, :, path]], 2) for t in (key, value))
    alone = _op(query[:, :, 3:4], moved_key, moved_value, None)
    assert torch.equal(alone[:, 0], branched[:, 3])


def test_hfs_own_calls_are_served_or_handed_to_sdpa():
    model = tiny_model("llama")
    ids = torch.arange(3, 20)[None]
    with torch.inference_mode():
        before = model(ids).logits
        TargetRuntime(model, max_len=32)  # sets the row attention on the model
        assert model.config._attn_implementation == "spd_rows"
        after = model(ids).logits  # HF's forward builds its masks as for sdpa
    assert torch.allclose(before, after, atol=1e-5)
    layer = model.model.layers[0].self_attn
    with torch.inference_mode(False), torch.enable_grad():  # gradients take sdpa, which has a backward
        query, key, value = _qkv(torch.float32, heads=4, kv_heads=2, dim=16)
        query.requires_grad_(True)
        out, _ = rows_attention(layer, query, key, value, None, scaling=0.25)
        assert out.requires_grad


def test_a_bf16_runtime_verifies_rows_exactly_as_it_steps():
    target = TargetRuntime(tiny_model("llama", dtype=torch.bfloat16), max_len=64)
    assert target.engine()["attention"] == "rows" and target.numerics().startswith("rows-rows-eager-")
    prompt, tokens = torch.arange(10, 30), torch.tensor([5, 77, 3, 200, 41])
    with torch.inference_mode():
        target.forward(prompt, 0)
        steps = torch.cat([target.forward(tokens[i: i + 1], 20 + i)[0] for i in range(5)])
        target.truncate(20)
        verified, _ = target.forward(tokens, 20)
    assert torch.equal(steps, verified)


def test_every_method_decodes_greedy_ars_tokens_in_bf16():
    """No tie allowed: a bf16 tiny model's logits tie often, and the kernels leave none to chance."""
    prompts = [list(range(10, 30)), [3, 4, 5, 6] * 5]
    checks = list(check_methods("tiny llama, bf16", tiny_model("llama", dtype=torch.bfloat16), prompts, 16))
    assert len(checks) > 5
    assert all(c.identical == c.samples for c in checks), [(c.method, c.identical, c.ties) for c in checks]


def test_dtype_auto_takes_bf16_where_the_row_kernels_build(monkeypatch):
    from harness.runtime import models

    assert models.pick_dtype("auto", "cpu") == "bfloat16" and models.pick_dtype(None, "cpu") == "float32"
    assert models.pick_dtype("auto", "cuda:0") == "bfloat16" and models.pick_dtype("float16", "cpu") == "float16"
    monkeypatch.setattr(models, "rows_kernel_problem", lambda: "the row kernels did not build: no compiler")
    assert models.pick_dtype("auto", "cpu") == "float32"


def test_a_machine_without_the_kernels_keeps_sdpa(monkeypatch):
    from harness.runtime import attention

    monkeypatch.setattr(attention, "rows_kernel_problem", lambda: "the row kernels did not build: no compiler")
    model = tiny_model("llama")
    assert attention.use_rows_attention(model) == "sdpa" and model.config._attn_implementation == "sdpa"


def test_a_non_causal_call_without_a_mask_sees_every_slot():
    """Fails on a16459a: with no mask the op was always causal, whatever `is_causal` said."""
    model = tiny_model("llama")
    layer = model.model.layers[0].self_attn
    query, key, value = _qkv(torch.float32, rows=5, slots=5, heads=4, kv_heads=4, dim=16)
    got, _ = rows_attention(layer, query, key, value, None, scaling=0.25, is_causal=False)
    expected = F.scaled_dot_product_attention(query, key, value, scale=0.25, is_causal=False)
    assert torch.allclose(got, expected.transpose(1, 2), atol=1e-5)
    causal, _ = rows_attention(layer, query, key, value, None, scaling=0.25)  # the module's own: causal
    expected = F.scaled_dot_product_attention(query, key, value, scale=0.25, is_causal=True)
    assert torch.allclose(causal, expected.transpose(1, 2), atol=1e-5)


def test_the_record_names_the_attention_that_served():
    """Fails on a16459a: an fp16 runtime said `attention: rows` while sdpa served every call."""
    fp16 = TargetRuntime(tiny_model("llama", dtype=torch.float16), max_len=32)
    assert fp16.engine()["attention"] == "sdpa_grouped"  # torch's sdpa, GQA's cache not copied
    assert fp16.model.config._attn_implementation == "spd_sdpa_grouped"
    windowed = tiny_model("llama")
    windowed.config.sliding_window = 8
    assert TargetRuntime(windowed, max_len=32).engine()["attention"] == "sdpa_grouped"
    assert TargetRuntime(tiny_model("llama"), max_len=32).engine()["attention"] == "rows"


def test_the_reference_key_names_the_machine_and_the_kernels_that_served(monkeypatch):
    """Fails on a16459a: the key held no device model, torch or CUDA version nor linear-attention kernels, so a
    cache shared by mixed nodes compared greedy tokens across them."""
    from harness.runtime import target as runtime
    from transformers.utils import import_utils

    hybrid = TargetRuntime(tiny_model("qwen3_5"), max_len=32)
    before = hybrid.numerics()
    assert before == hybrid.numerics()
    monkeypatch.setattr(runtime, "processor", lambda device_type: "NVIDIA H100 80GB HBM3")
    assert hybrid.numerics() != before
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert hybrid.numerics() != before
    monkeypatch.undo()
    monkeypatch.setattr(import_utils, "is_flash_linear_attention_available", lambda: True)
    assert hybrid.numerics() != before


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_grouped_attention_equals_hfs_sdpa_over_repeated_keys_without_copying_them(rows):
    """Fails on 90451cc: a masked call of HF's sdpa function on a GQA model copies the keys and values once per query
    head (`repeat_kv`). The grouped form computes the same attention over the cache as it is."""
    from harness.bench.dispatch import counting
    from harness.runtime.grouped_attention import grouped_attention
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model("llama")
    layer = model.model.layers[0].self_attn
    assert layer.num_key_value_groups == 2
    query, key, value = _qkv(torch.float32, rows=rows, slots=40, heads=4, kv_heads=2, dim=16)
    mask = torch.rand(1, 1, rows, 40) < 0.7
    mask[..., 0] = True
    expected, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    with counting() as counts:
        got, _ = grouped_attention(layer, query, key, value, mask, scaling=0.25)
    assert torch.allclose(got, expected, atol=1e-6) and got.shape == (1, rows, 4, 16)
    assert counts.largest < key.numel() * key.element_size()  # nothing the size of the cache is written
    with counting() as counts:
        sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    assert rows == 1 or counts.largest >= 2 * key.numel() * key.element_size()  # HF's: repeat_kv's copy
