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

from harness.cli import main
from harness.runtime.compiled import CompiledStep
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
    compiled = []  # the layers each compiled call ran
    original = CompiledStep.__call__
    monkeypatch.setattr(CompiledStep, "__call__", lambda self, layer, *args, **kwargs: (
        compiled.append(layer), original(self, layer, *args, **kwargs))[1])
    target = TargetRuntime(MODEL, max_len=256, compile="on")
    assert _outputs(_built(name, target, draft=draft_dir)) == eager
    assert target.engine()["compile"]["engine"] == "inductor"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    own = {id(layer) for layer in target.layers}
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


def _failing(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here\nsecond line")

    original = CompiledStep.__init__

    def init(self, mode):
        original(self, mode)
        self.step = broken

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

