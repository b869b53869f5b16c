"""The CPU kernel path of the target's Linears: the row kernel (fp32 and bf16 weights in panels) and oneDNN's packed
fp32 weights give the plain values, a row's result does not depend on the rows beside it (nor, inside a compiled
graph, on the graph), tied weights stay tied, and gradients take the plain path."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from harness.runtime import kernels
from harness.runtime.kernels import PackedLinear, kernel_for, pack_linears
from harness.runtime.target import TargetRuntime


def test_packed_linears_compute_the_plain_values_and_rows_alone_equal_rows_together():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    packed = PackedLinear(linear)
    x = torch.randn(1, 7, 64)
    with torch.inference_mode():
        together = packed(x)
        assert torch.allclose(together, linear(x), atol=1e-5)
        alone = torch.cat([packed(x[:, i: i + 1]) for i in range(7)], dim=1)
    assert torch.equal(together, alone)  # drafts verified together see what steps of their own would


def test_a_runtime_packs_its_fp32_linears_once_and_keeps_tied_weights_tied():
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the embedded model's are
    before = {name: p.clone() for name, p in model.named_parameters()}
    target = TargetRuntime(model, max_len=32)
    assert target.linears == "rows" and isinstance(model.lm_head, PackedLinear)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert {name: p for name, p in model.named_parameters()}.keys() == before.keys()  # same names, same values
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert TargetRuntime(model, max_len=32).linears == "rows"  # a second runtime finds them packed
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_gradients_flow_through_the_plain_path():
    with torch.inference_mode(False), torch.enable_grad():
        linear = torch.nn.Linear(8, 4)
        packed = PackedLinear(linear)
        x = torch.randn(3, 8, requires_grad=True)
        packed(x).sum().backward()
    assert torch.allclose(x.grad, linear.weight.sum(0).expand(3, 8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 40])
def test_the_row_kernel_sums_in_fp32_and_rows_alone_equal_rows_together(rows, dtype):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(72, 136).to(dtype)  # 17 panels: a one-row call reads eight at once, others three or one
    packed = PackedLinear(linear)
    assert packed.kernel == "rows" and packed.packed.shape == (17, 72, 8)
    x = torch.randn(1, rows, 72).to(dtype)
    with torch.inference_mode():
        together = packed(x)
        exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
        alone = torch.cat([packed(x[:, i: i + 1]) for i in range(rows)], dim=1)
        compiled = torch.compile(packed, fullgraph=True, dynamic=True)(x)  # one opaque op in a graph
    assert together.dtype == dtype and together.shape == (1, rows, 136)
    tolerance = {"rtol": 2 ** -7, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    assert torch.allclose(together.double(), exact, **tolerance)  # one rounding of an fp32 sum
    assert torch.equal(together, alone)
    assert torch.equal(compiled, together)


def test_weights_the_row_kernel_does_not_take_keep_onednn_or_the_plain_path(monkeypatch):
    assert kernel_for(torch.zeros(12, 16)) == "onednn"  # not a multiple of eight outputs
    assert kernel_for(torch.zeros(12, 16, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(kernels, "rows_kernel_problem", lambda: "the row kernels did not build: no compiler")
    assert kernel_for(torch.zeros(16, 16)) == "onednn"
    assert kernel_for(torch.zeros(16, 16, dtype=torch.bfloat16)) is None


def test_a_bf16_runtime_takes_the_row_kernel_with_tied_weights_still_tied():
    model = tiny_model("llama").to(torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    target = TargetRuntime(model, max_len=32)
    assert target.linears == "rows" and isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtypes_no_kernel_serves_keep_the_default_path():
    model = tiny_model("llama").to(torch.float16)
    assert pack_linears(model) == "default"
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_copies_and_conversions_pack_again_or_take_the_plain_path():
    import copy

    linear = torch.nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        copied = copy.deepcopy(packed)
        assert copied.packed is not None and torch.equal(copied(x), packed(x))
        half = copy.deepcopy(packed).to(torch.bfloat16)
        assert half.kernel == "rows" and half.packed.dtype == torch.bfloat16
        assert torch.allclose(half(x.bfloat16()).float(), linear(x), atol=0.1)
        fp16 = copy.deepcopy(packed).to(torch.float16)
        assert fp16.kernel is None and torch.allclose(fp16(x.half()).float(), linear(x), atol=0.1)


def test_a_weight_changed_in_place_is_packed_again():
    with torch.inference_mode(False):  # a tensor made under inference mode keeps no version to watch
        torch.manual_seed(0)
        linear = torch.nn.Linear(16, 8)
        packed = PackedLinear(linear)
        x = torch.randn(2, 16)
        with torch.no_grad():
            linear.weight.mul_(-2.0)  # an optimizer step or a loaded checkpoint writes in place
            assert torch.allclose(packed(x), linear(x), atol=1e-5)


def test_a_drafter_decodes_on_the_targets_kernels_and_trains_on_the_plain_path():
    from methods.pipeline.speculator import Speculator, SpeculatorConfig

    with torch.inference_mode(False), torch.enable_grad():
        target = TargetRuntime(tiny_model("llama"), max_len=32)
        speculator = Speculator(SpeculatorConfig(n=2, ls=1, num_layers=6), target)
        assert any(type(m) is torch.nn.Linear for m in speculator.modules())  # built for training: plain
        speculator.state_cache(16)  # decoding starts
        assert not any(type(m) is torch.nn.Linear for m in speculator.modules())
        x = torch.randn(1, 3, 64, requires_grad=True)
        speculator.head(x).sum().backward()  # gradients still reach the weights
    assert speculator.head.weight.grad is not None and x.grad is not None

