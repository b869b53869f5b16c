"""The CPU kernel path of the target's Linears: the row kernel (fp32 and bf16 weights in panels) and oneDNN's packed
fp32 weights give the plain values, a row's result does not depend on the rows beside it (nor, inside a compiled
graph, on the graph), tied weights stay tied, gradients take the plain path, a packed copy never outlives the weight
it was made from, the ops refuse what they cannot serve, and the build is keyed by what decides it."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model

from harness.runtime import kernels
from harness.runtime.errors import HarnessError
from harness.runtime.kernels import PackedLinear, kernel_for, pack_linears
from harness.runtime.target import TargetRuntime


def _linear(*shape, **kwargs) -> torch.nn.Linear:
    """A Linear made outside inference mode (the tests run inside it), as load_model makes a model's."""
    with torch.inference_mode(False):
        return torch.nn.Linear(*shape, **kwargs)


def test_packed_linears_compute_the_plain_values_and_rows_alone_equal_rows_together():
    torch.manual_seed(0)
    linear = _linear(64, 96)
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
    linear = _linear(72, 136, dtype=dtype)  # 17 panels: a one-row call reads eight at once, others three or one
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


@pytest.mark.parametrize("choice", ["auto", "torch"])
def test_a_bf16_runtimes_logits_are_the_heads_fp32_sums_never_rounded_to_bf16(choice, monkeypatch):
    """bf16 logits would round near-ties into exact ties the fp32 sums do not have (the reference decodes from fp32
    logits): the head's sums come out unrounded, on the row kernel and on torch's path, and the row kernel's
    rounded output is those sums rounded once."""
    monkeypatch.setenv(kernels.CHOICE_VARIABLE, choice)
    model = tiny_model("llama", dtype=torch.bfloat16)
    target = TargetRuntime(model, max_len=32)
    assert target.linears == ("rows" if choice == "auto" else "default")
    with torch.inference_mode():
        h = target.run_layers(0, target.num_layers, target.embed(torch.arange(5)), range(5))[0]
        logits = target.logits(h)
        normed = target.final_norm(h)
        exact = F.linear(normed.double(), model.lm_head.weight.double())[0]
        rounded = model.lm_head(normed)[0]
    assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())
    assert torch.allclose(logits.double(), exact, rtol=1e-5, atol=1e-4)
    if choice == "auto":
        assert torch.equal(rounded, logits.bfloat16())


@torch.inference_mode(False)
def test_weights_the_row_kernel_does_not_take_keep_onednn_or_the_plain_path(monkeypatch):
    assert kernel_for(torch.zeros(12, 16)) == "onednn"  # not a multiple of eight outputs
    assert kernel_for(torch.zeros(12, 16, dtype=torch.bfloat16)) is None
    monkeypatch.setattr(kernels, "rows_ready", lambda: False)  # not built, or did not build
    assert kernel_for(torch.zeros(16, 16)) == "onednn"
    assert kernel_for(torch.zeros(16, 16, dtype=torch.bfloat16)) is None


def test_a_bf16_runtime_takes_the_row_kernel_with_tied_weights_still_tied():
    model = tiny_model("llama", dtype=torch.bfloat16)
    model.lm_head.weight = model.model.embed_tokens.weight
    target = TargetRuntime(model, max_len=32)
    assert target.linears == "rows" and isinstance(model.lm_head, PackedLinear)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_dtypes_no_kernel_serves_keep_the_default_path():
    model = tiny_model("llama", dtype=torch.float16)
    assert pack_linears(model) == "default"
    assert isinstance(model.lm_head, torch.nn.Linear)


def test_copies_and_conversions_pack_again_or_take_the_plain_path():
    import copy

    linear = _linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(2, 16)
    with torch.inference_mode(False):
        copied = copy.deepcopy(packed)
        half = copy.deepcopy(packed).to(torch.bfloat16)
        fp16 = copy.deepcopy(packed).to(torch.float16)
    with torch.inference_mode():
        assert copied.packed is not None and torch.equal(copied(x), packed(x))
        assert half.kernel == "rows" and half.packed.dtype == torch.bfloat16
        assert torch.allclose(half(x.bfloat16()).float(), linear(x), atol=0.1)
        assert fp16.kernel is None and torch.allclose(fp16(x.half()).float(), linear(x), atol=0.1)


def _like(tensor):
    return None if tensor is None else torch.randn_like(tensor)


def _changes():
    """Every route by which a module's weight can change after it was packed (fails on a16459a: the replaced
    Parameter, assign=True and .data = ... served the old panels)."""
    def replaced(m):
        m.weight = torch.nn.Parameter(torch.randn(40, m.in_features))
        m.bias = None if m.bias is None else torch.nn.Parameter(torch.randn(40))

    def assigned(m):
        m.load_state_dict({name: _like(t) for name, t in m.state_dict().items()}, assign=True)

    def in_place(m):
        with torch.no_grad():
            m.weight.mul_(-2.0)

    def data_set(m):
        m.weight.data = _like(m.weight)

    def under_inference_mode(m):
        with torch.inference_mode():
            m.weight.mul_(0.5)

    def loaded(m):
        m.load_state_dict({name: _like(t) for name, t in m.state_dict().items()})

    return [replaced, assigned, in_place, data_set, under_inference_mode, loaded]


@pytest.mark.parametrize("change", _changes(), ids=lambda f: f.__name__)
@pytest.mark.parametrize("out", [8, 12])  # the row kernel's panels; oneDNN's layout
def test_a_changed_weight_is_never_served_from_its_old_copy(change, out):
    with torch.inference_mode(False):
        torch.manual_seed(0)
        module = PackedLinear(torch.nn.Linear(16, out))
        assert module.kernel == ("rows" if out == 8 else "onednn")
        change(module)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.allclose(module(x), F.linear(x, module.weight, module.bias), atol=1e-5)


def test_a_compiled_graph_reads_the_weight_as_it_is_now():
    """A graph holds the panels it was handed: the compiled step packs again before it runs (fails on a16459a:
    the graph read the old panels after an in-place change, recompiles included). One compiled runtime meets every
    route in turn (a compile costs seconds)."""
    from harness.runtime.compiled import CompiledStep

    with torch.inference_mode(False):
        torch.manual_seed(0)
        target = TargetRuntime(tiny_model("llama"), max_len=32, compile="on")
    eager = TargetRuntime(target.model, max_len=32)
    prompt = torch.arange(3, 12)
    assert isinstance(target.compiled, CompiledStep)
    for change in _changes()[1:]:
        with torch.inference_mode():
            target.reset()
            target.forward(prompt, 0)  # a graph holding the panels as they are
        with torch.inference_mode(False):
            change(target.layers[2].mlp.down_proj)
        with torch.inference_mode():
            target.reset()
            compiled, _ = target.forward(prompt, 0)
            eager.reset()
            expected, _ = eager.forward(prompt, 0)
        assert torch.allclose(compiled, expected, atol=1e-4), change.__name__


def test_a_weight_made_under_inference_mode_is_never_copied():
    """Such a tensor keeps no version counter, so a write to it could not be seen: it takes the plain path."""
    linear = torch.nn.Linear(16, 8)  # the tests run under inference mode
    assert linear.weight.is_inference() and kernel_for(linear.weight) is None
    packed = PackedLinear(linear)
    linear.weight.mul_(3.0)
    x = torch.randn(2, 16)
    assert torch.allclose(packed(x), F.linear(x, linear.weight, linear.bias), atol=1e-5)


def _panels(n=16, k=24, dtype=torch.float32):
    return kernels.pack_rows(torch.randn(n, k, dtype=dtype))


@pytest.mark.parametrize("args, message", [
    ((torch.randn(3, 24), _panels(), torch.randn(4)), "bias"),  # fails on a16459a: read past the bias
    ((torch.randn(3, 24), _panels(), torch.randn(16, dtype=torch.bfloat16)), "bias"),
    ((torch.randn(3, 24), _panels(), torch.randn(2, 8)), "bias"),
    ((torch.randint(0, 5, (3, 24)), _panels(), None), "x is Long"),  # fails on a16459a: cast silently
    ((torch.randn(3, 24, dtype=torch.bfloat16), _panels(), None), "x is BFloat16"),
    ((torch.randn(3, 20), _panels(), None), "input features"),
    ((torch.randn(3, 24), _panels().transpose(0, 1), None), "contiguous panels"),
    ((torch.randn(3, 24), torch.randn(2, 24, 4), None), "panels"),
    ((torch.randn(3, 24), torch.randn(2, 24, 8, dtype=torch.float64), None), "fp32 or bf16"),
    ((torch.randn(3, 0), torch.randn(2, 0, 8), None), "K > 0"),
    ((torch.randn(()), _panels(), None), "against panels"),
])
def test_the_linear_op_refuses_inconsistent_inputs_in_one_line(args, message):
    with pytest.raises(RuntimeError, match=message) as error:
        torch.ops.spd_bench.rows_linear(*args)
    assert "\n" not in str(error.value).split("Exception raised from")[0].strip()


def _qkv(batch=1, heads=4, rows=3, dim=16, kv_batch=None, kv_heads=2, slots=10, kv_dim=None, dtype=torch.float32):
    query = torch.randn(batch, heads, rows, dim, dtype=dtype)
    key = torch.randn(kv_batch or batch, kv_heads, slots, kv_dim or dim, dtype=dtype)
    return query, key, key.clone()


@pytest.mark.parametrize("args, message", [
    ((*_qkv(batch=2, kv_batch=1), None, 0.25), "batch"),  # fails on a16459a: read past the keys and values
    ((*_qkv(dim=16, kv_dim=8), None, 0.25), "head dimension"),  # fails on a16459a
    ((*_qkv(dim=16, kv_dim=32), None, 0.25), "head dimension"),
    ((*_qkv(kv_heads=3), None, 0.25), "key heads"),
    ((*_qkv(dim=12), None, 0.25), "multiple of 8"),
    ((*_qkv(rows=12, slots=10), None, 0.25), "last of the keys"),
    ((*_qkv(), torch.ones(3, 9, dtype=torch.bool), 0.25), "mask"),
    ((*_qkv(), torch.ones(2, 3, 10, dtype=torch.bool), 0.25), "mask"),
    ((*_qkv(), torch.ones(3, 10), 0.25), "mask"),
    ((*_qkv(), torch.ones(30, dtype=torch.bool), 0.25), "mask"),
    ((torch.randn(1, 4, 3, 16), torch.randn(1, 2, 10, 16), torch.randn(1, 2, 11, 16), None, 0.25), "differ"),
    ((torch.randn(4, 3, 16), torch.randn(2, 10, 16), torch.randn(2, 10, 16), None, 0.25), r"\[B, H, T, D\]"),
    ((*_qkv(dtype=torch.float16), None, 0.25), "fp32 or bf16"),
])
def test_the_attention_op_refuses_inconsistent_inputs_in_one_line(args, message):
    with pytest.raises(RuntimeError, match=message) as error:
        torch.ops.spd_bench.rows_attention(*args)
    assert "\n" not in str(error.value).split("Exception raised from")[0].strip()


def test_the_build_is_keyed_by_its_sources_torch_and_flags_outside_torchs_shared_folder(monkeypatch, tmp_path):
    """Fails on a16459a: every checkout built into torch's per-user extensions folder, waiting on each other."""
    monkeypatch.setenv("SPD_BENCH_KERNEL_CACHE", str(tmp_path))
    folder = kernels.build_folder()
    assert folder.parent == tmp_path and folder.name.startswith("spd_bench_rows-")
    assert kernels.build_folder() == folder  # the same inputs, the same folder
    monkeypatch.setenv("SPD_BENCH_SANITIZE", "address")
    assert kernels.build_folder() != folder
    monkeypatch.delenv("SPD_BENCH_SANITIZE")
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert kernels.build_folder() != folder
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "private"))  # a private run cache shares the build
    monkeypatch.setattr(torch, "__version__", torch.__version__)


def test_a_build_failure_names_the_compilers_first_error():
    log = "[1/2] c++ x.cpp\nx.cpp:3:5: error: expected ';'\nx.cpp:9:1: error: later\nninja: build stopped."
    assert kernels._first_error(log) == "x.cpp:3:5: error: expected ';'"
    assert kernels._first_error("no compiler found\n") == "no compiler found"


def test_kernels_torch_keeps_torchs_linears_and_sdpa(monkeypatch):
    """--kernels torch (fails on a16459a: no switch): no Linear is packed, attention stays sdpa, --dtype auto
    takes fp32, and the engine says so."""
    from harness.runtime import models

    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "torch")
    target = TargetRuntime(tiny_model("llama"), max_len=32)
    assert target.engine()["kernels"] == "torch" and target.linears == "default" and target.attention == "sdpa_grouped"
    assert not any(isinstance(m, PackedLinear) for m in target.model.modules())
    assert models.pick_dtype("auto", "cpu") == "float32"


def test_a_choice_restored_after_an_answer_is_never_answered_from_the_earlier_choice(monkeypatch):
    """Fails on 90451cc: the answer was cached with the choice it was made under, so a test that set
    --kernels torch and had its environment restored left every later test in its process on torch's kernels."""
    with monkeypatch.context() as scoped:
        scoped.setenv(kernels.CHOICE_VARIABLE, "torch")
        assert kernels.rows_kernel_problem() == "the row kernels are switched off (--kernels torch)"
        assert TargetRuntime(tiny_model("llama"), max_len=32).linears == "default"
    assert kernels.chosen() == "auto" and kernels.rows_kernel_problem() is None
    assert TargetRuntime(tiny_model("llama"), max_len=32).linears == "rows"


def test_a_bad_kernels_choice_is_one_line(monkeypatch):
    with pytest.raises(HarnessError, match="--kernels must be one of auto, rows, torch"):
        kernels.choose("fast")
    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "fast")
    with pytest.raises(HarnessError, match="SPD_BENCH_KERNELS='fast'"):
        kernels.chosen()


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



def test_each_device_takes_its_backend_and_a_gpu_box_never_builds_the_cpu_kernels(monkeypatch):
    """Fails on 90451cc (no backends: device branches inside the runtime). CUDA's backend is chosen without a
    look at the row kernels (a build that would fail here fails the test); a CPU takes them where they build,
    torch's kernels where they do not; no method sees which."""
    from harness.runtime import backend_rows
    from harness.runtime.backend_cuda import Cuda
    from harness.runtime.backends import backend_for

    def no_build():
        raise AssertionError("the row kernels were built for a CUDA runtime")

    with monkeypatch.context() as scoped:
        scoped.setattr(backend_rows, "rows_kernel_problem", no_build)
        cuda = backend_for("cuda")
    assert isinstance(cuda, Cuda) and cuda.static_step and cuda.graphed and cuda.numerics()[0].startswith("sdpa:")
    assert backend_for("cpu").name == "rows"
    monkeypatch.setattr(backend_rows, "rows_kernel_problem", lambda: "the row kernels did not build: no compiler")
    target = TargetRuntime(tiny_model("llama"), max_len=32)
    assert target.backend.name == "torch" and target.linears == "default" and target.attention == "sdpa_grouped"
    assert not any(isinstance(m, PackedLinear) for m in target.model.modules())

