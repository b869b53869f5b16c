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
    """Three rows at slots 5..7 padded to four: the fourth writes and sees only the scratch slot, the buffer's last
    (max_len 16 and a scratch slot take a buffer of 32), the real rows see the slots up to their own, and every
    layer is handed the same padded rope and positions."""
    target = TargetRuntime(tiny_model("llama"), max_len=16, compile=CompiledStep("on", static=True))
    target.forward(torch.arange(5), 0)  # the prefill shapes the buffer
    mask = target.cache.begin(range(5, 8))
    static = target.cache._static
    assert target.cache.kv[0].shape[2] == 32
    assert (static.rows, static.size, static.write.tolist()) == (3, 4, [5, 6, 7, 31])
    assert mask.shape == (1, 1, 4, 32)
    assert mask[0, 0, :3].tolist() == [[c <= row for c in range(32)] for row in (5, 6, 7)]
    assert mask[0, 0, 3].nonzero().flatten().tolist() == [31]
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
    model = tiny_model("llama")  # a model of its own: a step belongs to its model, and this one fails
    with pytest.raises(HarnessError, match=r"^--compile cannot compile the layer step \(RuntimeError: no compiler "
                                           r"here\); run with --compile auto"):
        _outputs(_built("autoregressive", TargetRuntime(model, max_len=256, compile="on")))
    target = TargetRuntime(model, max_len=256, compile="auto")
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
    """A CUDA-graphed step says `cuda_graphs` only once a graph was recorded (asking for them is not running them),
    and `warm` decodes again after a call that recorded a graph, as after one that compiled."""
    from harness.runtime.compiled import warm

    step = CompiledStep("on", "cuda")  # built only: nothing compiles or records until it is called
    assert step.graphed and step.conditions()["cuda_graphs"] is False
    assert step.conditions()["cuda_graph_recordings"] == 0

    def records_a_graph():
        step.recorded.recordings += 1
        return "out"

    calls = []

    def decode():
        calls.append(len(calls))
        return step._compiled(records_a_graph if len(calls) == 1 else lambda: "out", None)

    assert warm(step, decode) == "out" and len(calls) == 2  # the call that recorded is not the one returned
    assert step.conditions()["cuda_graphs"] is True and step.conditions()["cuda_graph_recordings"] == 1


@pytest.mark.parametrize("name", ["autoregressive", "eagle3-tree"])
def test_each_layers_graph_is_found_by_its_shape_and_a_replaced_weight_is_recorded_again(name, monkeypatch):
    """Fails on 90451cc (inductor's graphs: every layer a recording of one function, searched in turn at every
    call). The runtime's graphs, on a CPU re-run where a GPU replays them, on torch's kernels as a GPU runs: the
    tokens equal eager's; one graph per layer and padded shape, in a dict; the static inputs are one set per shape,
    not per layer; a second pass records nothing; a layer whose weight was replaced is recorded again and decodes
    with the new weight."""
    from harness.runtime import kernels

    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "torch")
    model = tiny_model("llama")
    eager = _outputs(_built(name, TargetRuntime(model, max_len=256)))
    step = CompiledStep("on", static=True, graphed=True)
    target = TargetRuntime(model, max_len=256, compile=step)
    method = _built(name, target)
    assert _outputs(method) == eager
    graphs = step.recorded._recorded
    layers = {key[0] for key in graphs}
    forms = {key[1] for key in graphs}
    assert len(layers) >= target.num_layers and len(graphs) <= len(layers) * len(forms)
    assert len(step.recorded._slots) <= sum(len(form) for form in forms)  # shared by every layer of a shape
    recordings = step.recorded.recordings
    assert recordings == len(graphs) and step.conditions()["cuda_graph_recordings"] == recordings
    assert _outputs(method) == eager and step.recorded.recordings == recordings  # replays only
    with torch.inference_mode(False):
        down = model.model.layers[1].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight * -1.5)
    changed = _outputs(_built(name, TargetRuntime(model, max_len=256)))
    assert changed != eager and _outputs(method) == changed
    assert step.recorded.recordings > recordings


def test_a_models_static_buffer_serves_shorter_runs_and_grows_by_powers_of_two():
    """The KV set a static step keeps per model and layout: a shorter run takes the held set, a longer one a set of
    the next power of two slots (so graphs are recorded anew at most log2(context) times)."""
    step, owner = CompiledStep("on", static=True), object()
    first = step.buffer(owner, 2, (1, 2, 300, 8), torch.float32, torch.device("cpu"))
    assert first[0].shape == (1, 2, 512, 8)
    assert step.buffer(owner, 2, (1, 2, 100, 8), torch.float32, torch.device("cpu")) is first
    grown = step.buffer(owner, 2, (1, 2, 513, 8), torch.float32, torch.device("cpu"))
    assert grown[0].shape == (1, 2, 1024, 8) and step.buffer(owner, 2, (1, 2, 300, 8), torch.float32,
                                                              torch.device("cpu")) is grown
    assert step.buffer(object(), 2, (1, 2, 300, 8), torch.float32, torch.device("cpu")) is not grown


def test_a_sweep_replays_its_first_configurations_graphs_in_the_static_form(tiny_dir, eval_dir, tmp_path, cache,
                                                                            monkeypatch):
    """Fails on 90451cc: each configuration's runtime built a compiled step and KV buffers of its own, which dynamo
    guards on (static addresses), so every configuration of a sweep compiled (on CUDA: recorded) its graphs anew, up
    to dynamo's recompile limit. Twelve configurations in one process, in the static form CUDA takes: a
    configuration adds no graph for a call form (layer class, padded rows) an earlier one met; every runtime is
    handed its model's one step, and each record counts only the graphs its own run compiled."""
    from harness.bench.config import RunConfig
    from harness.bench.sweep import sweep
    from harness.runtime.backend_rows import RowKernels

    monkeypatch.setattr(RowKernels, "static_step", True)  # the form CUDA's backend takes
    forms, seen, jobs_seen = [], set(), []
    original_call, original_run = StaticCall.__call__, Runner.run

    def call(self, step, layer, args, kwargs, cache):
        forms.append((type(layer).__name__, self.size))
        return original_call(self, step, layer, args, kwargs, cache)

    def run(self, samples, store, bar=None):
        forms.clear()
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        result = original_run(self, samples, store, bar)
        new = set(forms) - seen
        seen.update(forms)
        jobs_seen.append((self.config.method, self.config.params, self.config.max_new_tokens, len(new),
                          torch._dynamo.utils.counters["stats"]["unique_graphs"] - before, self.target.compiled))
        return result

    monkeypatch.setattr(StaticCall, "__call__", call)
    monkeypatch.setattr(Runner, "run", run)
    base = RunConfig(model=str(tiny_dir), datasets=("gsm8k",), limit=1, max_new_tokens=12, data_dir=str(eval_dir),
                     compile="on")
    points = [("autoregressive", {}, 12), ("lookup", {"k": 7}, 12),
              *[("lookup", {"k": k}, new) for k in range(2, 7) for new in (12, 20)][:8], ("autoregressive", {}, 20),
              ("autoregressive", {}, 28)]
    jobs = {f"{method}-{params}-{new}": RunConfig(**{**base.__dict__, "method": method, "params": params,
                                                     "max_new_tokens": new, "out": tmp_path / f"{i}.jsonl"})
            for i, (method, params, new) in enumerate(points)}
    outcome = sweep(jobs, base, tmp_path)
    assert not outcome.skipped and len(jobs_seen) == len(jobs) >= 12
    assert len({id(job[-1]) for job in jobs_seen}) == 1  # one step, the model's
    for method, params, new_tokens, new_forms, added, _ in jobs_seen[1:]:
        assert added <= new_forms, (method, params, new_tokens, new_forms, added)
    assert sum(job[3] for job in jobs_seen[2:]) < len(jobs) - 2  # later configurations mostly meet known forms
    records = [json.loads(line) for i in range(len(jobs))
               for line in (tmp_path / f"{i}.jsonl").read_text().splitlines()]
    assert all(r["lossless"]["identical"] for r in records)
    assert [r["conditions"]["compile"]["graphs"] for r in records][2:] == [job[4] for job in jobs_seen][2:]


@pytest.mark.parametrize("rows", [1, 4])
def test_the_static_step_copies_no_keys_or_values_where_sdpa_serves(rows, monkeypatch):
    """Fails on 90451cc: on torch's sdpa (CUDA's attention) a masked call of a GQA model expanded the keys and
    values to every query head (`repeat_kv`), and the static step masks every call over the whole buffer: a copy
    of the buffer, twice over here, in every layer at every step. Counted by the dispatch counter on the static
    step's shapes run eagerly (the ops a graph is traced from): no op writes as much as one layer's keys."""
    from harness.bench.dispatch import counting
    from harness.runtime import kernels

    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "torch")
    step = CompiledStep("on", static=True)
    step.failed = "counted eagerly"  # the static shapes, each op seen by the counter
    target = TargetRuntime(tiny_model("llama"), max_len=1000, compile=step)
    assert target.attention == "sdpa_grouped"
    target.forward(torch.arange(20), 0)
    with counting() as counts:
        h = target.embed(torch.arange(20, 20 + rows))
        target.run_layers(0, target.num_layers, h, range(20, 20 + rows))
    keys = target.cache.kv[0]
    assert keys.shape[2] == 1024 and target.cache._static.size == rows
    assert counts.largest < keys.nbytes, (counts.largest, keys.nbytes)
    assert counts.written < target.num_layers * keys.nbytes  # less than one buffer's worth a layer, all told
