"""The compiled layer step (`--compile`) on tiny models: every method's T=0 tokens equal eager's, the layer step
compiles to a few graphs without graph breaks and never recompiles once warm, and a step that cannot compile
stops in one line (`on`) or runs eager saying why (`auto`). Compiling costs tens of seconds per graph on 2 cores;
dynamo's cache is the process's, so later tests reuse the graphs the first one built."""

import json

import pytest
import torch
import torch._dynamo
from click.testing import CliRunner
from tiny_models import tiny_model

from harness.bench.runner import Runner
from harness.cli import main
from harness.runtime.compiled import CompiledStep, StaticCall, alike_runs
from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.eagle3.head import EagleConfig, EagleHead
from methods.eagle3.method import EAGLE3, EagleParams
from methods.pipeline.ppsd import PPSD
from methods.pipeline.spd import SPD
from methods.pipeline.speculator import Speculator, SpeculatorConfig
from methods.sampling import Sampler, SamplingConfig
from methods.ssd.method import SSD, SSDParams

PROMPTS = [list(range(10, 30)), [3, 4, 5, 6] * 5]
MODEL = tiny_model("llama")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("draft")
    tiny_model("llama", num_layers=4, seed=1).save_pretrained(folder)
    return str(folder)


def _built(name: str, target: TargetRuntime, seed: int = 0, draft: str | None = None):
    """Each method on `target`; drafters made from `seed`, so an eager and a compiled runtime get equal ones."""
    torch.manual_seed(seed)
    if name == "eagle3":
        return EAGLE3(target, EagleParams(m=3, width=1, ttt=3), set(), head=_head(target))
    if name == "eagle3-layout":  # the EAGLE-3 authors' layer (published heads)
        head = EagleHead(EagleConfig(ttt=3, num_layers=6, layout="eagle3"), target).eval()
        return EAGLE3(target, EagleParams(m=3, width=1, ttt=3, layout="eagle3"), set(), head=head)
    if name == "eagle3-tree":
        return EAGLE3(target, EagleParams(m=3, width=4, ttt=3), set(), head=_head(target))
    if name in ("spd", "ppsd"):
        cls = SPD if name == "spd" else PPSD
        speculator = Speculator(SpeculatorConfig(n=3, ls=1, num_layers=6), target).eval()
        return cls(target, cls.Params(n=3, ls=1), set(), speculator=speculator)
    if name == "ssd":
        return SSD(target, SSDParams(ttt=3), set(), head=_head(target))
    if name == "ssd-model":  # a standalone draft model, run on the target's engine
        return SSD(target, SSDParams(draft_model=draft), set())
    return build_method(name, target, {}, set())


def _head(target):
    return EagleHead(EagleConfig(ttt=3, num_layers=6), target).eval()


def _outputs(method) -> list[list[int]]:
    return [method.generate(ids, 16, Sampler(SamplingConfig())).output_ids for ids in PROMPTS]


DRAFTED = {"eagle3", "eagle3-layout", "eagle3-tree", "spd", "ppsd", "ssd", "ssd-model"}  # methods whose drafters' layers decode


@pytest.mark.parametrize("name", ["autoregressive", "lookup", "eagle3", "eagle3-layout", "eagle3-tree", "spd", "ppsd", "ssd",
                                  "ssd-model"])
def test_every_method_decodes_the_same_tokens_compiled_as_eager(name, monkeypatch, draft_dir):
    eager = _outputs(_built(name, TargetRuntime(MODEL, max_len=256), draft=draft_dir))
    compiled = []  # the layers each compiled call ran: one layer, or a run of layers as one graph
    one, run = CompiledStep.__call__, CompiledStep.layers
    monkeypatch.setattr(CompiledStep, "__call__", lambda self, layer, *args, **kwargs: (
        compiled.append(layer), one(self, layer, *args, **kwargs))[1])
    monkeypatch.setattr(CompiledStep, "layers", lambda self, layers, *args: (
        compiled.extend(layers), run(self, layers, *args))[1])
    target = TargetRuntime(MODEL, max_len=256, compile="on")
    assert _outputs(_built(name, target, draft=draft_dir)) == eager
    assert target.engine()["compile"]["engine"] == "inductor"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    own = {id(layer) for layer in target.layers}
    assert own <= {id(layer) for layer in compiled}  # every target layer ran compiled
    drafter_calls = [layer for layer in compiled if id(layer) not in own]
    assert bool(drafter_calls) == (name in DRAFTED), name  # the drafter's layers compile as well


def test_a_warm_step_never_recompiles():
    """After one generation has compiled its graphs, other prompt and cache lengths reuse them (dynamic shapes)."""
    target = TargetRuntime(MODEL, max_len=256, compile="on")
    method = _built("lookup", target)
    method.generate(PROMPTS[0], 16, Sampler(SamplingConfig()))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for ids in ([7] * 3 + list(range(40, 77)), PROMPTS[1][:9], list(range(100, 160))):
        method.generate(ids, 24, Sampler(SamplingConfig()))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_a_graph_takes_only_runs_of_alike_attention_layers():
    """One stamped-out layer subgraph serves a whole run (`_any_layer`), so a run never spans a linear-attention layer
    or a layer of another class or weight shape."""
    llama, qwen = tiny_model("llama", num_layers=3), tiny_model("qwen3", num_layers=2)
    assert alike_runs(list(llama.model.layers), ["full_attention"] * 3) == [3, 3, 3]
    mixed = [*llama.model.layers, *qwen.model.layers]  # Qwen3's layers carry q and k norms: another form
    assert alike_runs(mixed, ["full_attention"] * 5) == [3, 3, 3, 5, 5]
    kinds = ["linear_attention", "full_attention", "full_attention", "linear_attention", "full_attention"]
    assert alike_runs(mixed[:3] + mixed[:2], kinds) == [1, 3, 3, 4, 5]
    hybrid = TargetRuntime(tiny_model("qwen3_5", num_layers=8), max_len=64, compile="on")
    assert hybrid._runs == list(range(1, 9))  # one attention layer in four: each runs alone


STATIC_SHAPES: set[tuple] = set()  # the call signatures (`_signature`) the static step ran in this process
BUFFERS: dict[int, torch.Tensor] = {}  # every KV buffer a signature names, kept alive so no later one reuses its address


def _signature(layer, padded: tuple, cache) -> tuple:
    """A static call told apart from others: the model it is a layer of (its KV buffer, which the model's layers
    share and keep from one generation to the next), the layer's class and its padded arguments' shapes. A buffer
    freed by an earlier test could come back at the same address for a new runtime, whose graphs dynamo compiles
    anew (it guards on the buffer itself): held here, an address names one buffer for the whole process."""
    address = cache.keys.untyped_storage().data_ptr()
    BUFFERS.setdefault(address, cache.keys)
    return (address, type(layer).__name__, *_shapes(padded))


def _shapes(values: tuple) -> list:
    flat = []
    for value in values:
        flat += _shapes(value) if isinstance(value, tuple) else [tuple(getattr(value, "shape", (value,)))]
    return flat


@pytest.mark.parametrize("name", ["autoregressive", "lookup", "eagle3-tree", "spd", "ssd"])
def test_the_static_step_decodes_the_same_tokens_with_one_graph_per_layer_class_and_bucket(name, monkeypatch):
    """The shapes CUDA graphs replay (the whole buffer under a mask, rows padded to a bucket), run here on a CPU: the
    tokens equal eager's, and whatever the prompt and cache lengths, a graph is compiled only for a call signature
    (model, layer class, padded shapes) the process had not run before (dynamo's cache is the process's): never per
    layer, per length or per generation."""
    shapes = []
    original = StaticCall.__call__
    monkeypatch.setattr(StaticCall, "__call__", lambda self, step, layer, args, kwargs, cache: (
        shapes.append(_signature(layer, self._pad((args, tuple(kwargs.values()))), cache)),
        original(self, step, layer, args, kwargs, cache))[1])
    eager = _outputs(_built(name, TargetRuntime(MODEL, max_len=256)))
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    target = TargetRuntime(MODEL, max_len=256, compile=CompiledStep("on", static=True))
    method = _built(name, target)
    assert _outputs(method) == eager
    for ids in ([7] * 3 + list(range(40, 77)), list(range(100, 160))):
        method.generate(ids, 24, Sampler(SamplingConfig()))
    assert target.engine()["compile"]["shapes"] == "static"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert shapes  # the decode steps ran in the static shapes
    new = set(shapes) - STATIC_SHAPES
    STATIC_SHAPES.update(shapes)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - before <= len(new), sorted(new)


def test_a_static_call_pads_its_rows_and_masks_the_rest_of_the_buffer():
    """Three rows at slots 5..7 padded to four: the fourth writes and sees only the scratch slot above max_len, the
    real rows see the slots up to their own, and every layer is handed the same padded rope and positions."""
    target = TargetRuntime(MODEL, max_len=16, compile=CompiledStep("on", static=True))
    target.forward(torch.arange(5), 0)  # the prefill shapes the buffer
    mask = target.cache.begin(range(5, 8))
    static = target.cache._static
    assert (static.rows, static.size, static.write.tolist()) == (3, 4, [5, 6, 7, 16])
    assert mask.shape == (1, 1, 4, 17)
    assert mask[0, 0, :3].tolist() == [[c <= row for c in range(17)] for row in (5, 6, 7)]
    assert mask[0, 0, 3].nonzero().flatten().tolist() == [16]
    positions = torch.arange(5, 8)[None]
    assert static._pad(positions) is static._pad(positions)  # padded once per call
    assert static._pad(positions).tolist() == [[5, 6, 7, 7]]


def test_the_self_check_runs_every_method_through_the_compiled_step():
    """`make gpu-check`'s compiled pass (`selfcheck --compile on`), here on a CPU's dynamic step."""
    from harness.bench.selfcheck import check_methods

    checks = list(check_methods("tiny llama", MODEL, PROMPTS, 8, "on"))
    assert {c.model for c in checks} == {"tiny llama, compiled"} and len(checks) > 5
    assert all(c.ok for c in checks), [(c.method, c.identical) for c in checks if not c.ok]
    assert checks[0].note.startswith("dynamic shapes: ")


def _failing(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nsecond line")

    original = CompiledStep.__init__

    def init(self, mode, *args, **kwargs):
        original(self, mode, *args, **kwargs)
        self.step = self.ranges = broken

    monkeypatch.setattr(CompiledStep, "__init__", init)


def test_a_step_that_cannot_compile_stops_in_one_line_or_runs_eager_with_auto(monkeypatch, capsys):
    _failing(monkeypatch)
    with pytest.raises(HarnessError, match=r"^--compile cannot compile the layer step \(RuntimeError: no compiler "
                                           r"here\); run with --compile auto"):
        _outputs(_built("autoregressive", TargetRuntime(MODEL, max_len=256, compile="on")))
    target = TargetRuntime(MODEL, max_len=256, compile="auto")
    assert _outputs(_built("autoregressive", target)) == _outputs(_built("autoregressive", TargetRuntime(MODEL)))
    assert target.engine()["compile"] == {"mode": "auto", "engine": "eager",
                                          "why": "cannot compile the layer step (RuntimeError: no compiler here)"}
    warnings = [line for line in capsys.readouterr().err.splitlines() if "--compile auto" in line]
    assert len(warnings) == 1  # said once, not per layer


def test_run_records_the_compiled_engine_and_sweep_plans_pass_it_on(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--method", "autoregressive", "--dataset",
                                       "gsm8k", "--limit", "1", "--max-new-tokens", "4", "--data-dir", str(eval_dir),
                                       "--compile", "on", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text().splitlines()[0])
    assert record["lossless"]["checked"] and record["lossless"]["identical"]
    assert record["conditions"]["compile"]["engine"] == "inductor"
    plan = CliRunner().invoke(main, ["sweep", "--method", "autoregressive", "--model", str(tiny_dir), "--dataset",
                                     "gsm8k", "--compile", "auto", "--plan"])
    assert plan.exit_code == 0 and "--compile auto" in plan.output, plan.output



def test_a_pair_that_compiled_a_graph_decodes_again_so_no_timing_holds_compiling(tiny_dir, eval_dir, tmp_path, cache,
                                                                                monkeypatch):
    """A shape the warm-up never reached compiles inside a sample's timing (a verify of a new length: prompt lookup's
    first sample held 21 s of compiling on the embedded model); that pair decodes again and the record times the
    rerun. The first pair is made to look as if it compiled a graph, so the rule is exercised whatever the shapes."""
    pairs = []  # (graphs before, graphs after, what it returned) per decoded pair
    generate_pair = Runner._generate_pair

    def spy(self, *args):
        before = self.target.compiled.graphs
        result = generate_pair(self, *args)
        if not pairs:
            self.target.compiled.graphs += 1
        pairs.append((before, self.target.compiled.graphs, result))
        return result

    monkeypatch.setattr(Runner, "_generate_pair", spy)
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--method", "lookup", "--dataset", "gsm8k",
                                       "--limit", "2", "--max-new-tokens", "12", "--data-dir", str(eval_dir),
                                       "--compile", "on", "--out", str(out)])
    assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in out.read_text().splitlines()]
    clean = [generation for before, after, (generation, _) in pairs if before == after]
    compiled = [generation for before, after, (generation, _) in pairs if before != after]
    assert len(records) == len(clean) == 2 and len(pairs) == len(clean) + len(compiled) and compiled
    assert pairs[1][0] == pairs[1][1]  # the first sample's second pair compiled nothing: it is the one recorded
    assert [r["timing"] for r in records] == [{k: round(v, 6) for k, v in g.timing.items()} for g in clean]
    assert records[0]["output_ids"] == compiled[0].output_ids  # the rerun decodes the same tokens


def test_cuda_graphs_are_recorded_as_what_ran_and_a_recording_is_warmed_out_of_a_timing():
    """A CUDA-graphed step says `cuda_graphs` only once inductor recorded one (asking for them is not running
    them), and `warm` decodes again after a call that recorded a graph, as after one that compiled. The recording is
    announced as inductor announces it (dynamo's CUDAGRAPH_RECORDING callback), so this runs on a CPU."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    from harness.runtime.compiled import CompiledStep, warm

    step = CompiledStep("on", "cuda")  # built only: nothing compiles or records until it is called
    assert step.graphed and step.conditions()["cuda_graphs"] is False
    assert step.conditions()["cuda_graph_recordings"] == 0

    def records_a_graph():
        with callback_handler.install_callbacks(CallbackTrigger.CUDAGRAPH_RECORDING, "0/0"):
            return "out"

    calls = []

    def decode():
        calls.append(len(calls))
        return step._compiled(records_a_graph if len(calls) == 1 else lambda: "out", None)

    assert warm(step, decode) == "out" and len(calls) == 2  # the call that recorded is not the one returned
    assert step.conditions()["cuda_graphs"] is True and step.conditions()["cuda_graph_recordings"] == 1
