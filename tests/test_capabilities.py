"""The narrow method contract: a method that declares no capability decodes, is checked lossless, is timed and
reported, and is refused one line where a capability is asked of it; each family's declared capabilities answer."""

import json
from dataclasses import fields

import pytest
from click.testing import CliRunner

import methods  # noqa: F401  (fills the registry)
from harness.bench.config import RunConfig, validate
from harness.cli import main
from harness.runtime.errors import HarnessError
from methods import base
from methods.autoregressive import Autoregressive
from methods.base import REGISTRY, Method, parse_params
from methods.capabilities import (ChecksParity, Drafted, HFPeer, Imports, Reports, SelfChecks, Serves, Simulates,
                                  Trains)


class Bare(Method):
    """A method written against the contract alone: a name and `generate` (AR's loop, which needs nothing else)."""

    name = "bare"
    generate = Autoregressive.generate


@pytest.fixture
def bare(monkeypatch):
    monkeypatch.setitem(base.REGISTRY, Bare.name, Bare)
    return Bare


def test_method_is_name_params_stats_generate_and_check_model():
    assert sorted(n for n in vars(Method) if not n.startswith("_")) == ["Params", "Stats", "check_model", "generate"]


def test_a_method_without_capabilities_runs_lossless_timed_and_reported(bare, tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "bare.jsonl"
    result = CliRunner().invoke(main, ["run", "--method", "bare", "--model", str(tiny_dir), "--dataset", "gsm8k",
                                       "--limit", "2", "--max-new-tokens", "8", "--data-dir", str(eval_dir),
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2 and all(r["lossless"]["identical"] for r in rows)
    assert all({"prefill", "decode"} <= set(r["timing"]) and r["baseline"]["timing"]["decode"] > 0 for r in rows)
    report = CliRunner().invoke(main, ["report", "--results", str(out)])
    assert report.exit_code == 0 and "bare" in report.output, report.output


@pytest.mark.parametrize("options, message", [
    ({"simulate": True}, "has no acceptance simulation"),
    ({"checkpoint": "somewhere"}, "uses no drafter"),
    ({"executor": "distributed"}, "--executor distributed runs"),
])
def test_a_capability_asked_of_a_method_without_it_is_one_line(bare, options, message):
    with pytest.raises(HarnessError, match=message):
        validate(RunConfig(method="bare", **options))


def test_each_family_answers_for_the_capabilities_it_declares():
    for name, cls in REGISTRY.items():
        params = parse_params(cls, {})
        assert issubclass(cls, Reports), name  # every shipped family has a report row of its own
        if issubclass(cls, Drafted):
            found = cls.drafter(params)
            assert found is None or (isinstance(found[0], str) and "spd-bench train" in found[1]), name
        if issubclass(cls, Trains):
            assert cls.training_specs({}) and set(cls.training_params) <= {f.name for f in fields(cls.Params)}, name
        if issubclass(cls, Serves):
            count, why = cls.served(params)
            assert count >= 1 and why and cls.serves and cls.relative_cost(params, False) > cls.relative_cost(
                params, True), name
        if issubclass(cls, HFPeer):
            assert isinstance(cls.hf_peer(params), dict), name
        if issubclass(cls, Imports):
            assert cls.imports or cls.head_export or name == "ppsd", name
        for kind in (Simulates, SelfChecks, ChecksParity):
            if issubclass(cls, kind):
                assert all(callable(getattr(cls, hook)) for hook in vars(kind) if not hook.startswith("_")), name


def test_every_run_option_is_generated_from_its_runconfig_field():
    command = main.commands["run"]
    options = {p.name: p for p in command.params}
    for f in fields(RunConfig):
        if not f.metadata["help"]:
            continue
        param = options["compile_mode" if f.name == "compile" else f.name]
        default = RunConfig.default(f.name)
        assert param.default == (",".join(default) if isinstance(default, tuple) else default), f.name
        assert param.help.startswith(f.metadata["help"].rstrip(".")), f.name
        if f.metadata["choices"]:
            assert tuple(param.type.choices) == tuple(f.metadata["choices"]), f.name
