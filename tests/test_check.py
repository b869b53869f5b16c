"""`spd-bench check`: passes on the results a baseline was written from, fails on a drop, a lost sample or a gap."""

import json

import pytest
from click.testing import CliRunner
from test_report import _row

from harness.cli import main


def _write(path, rows):
    path.write_text("".join(json.dumps({**r, "output_ids": [1]}) + "\n" for r in rows))


def _check(*args):
    result = CliRunner().invoke(main, ["check", *map(str, args)])
    return result.exit_code, result.output


def test_check_passes_then_catches_a_drop_a_lost_sample_and_a_missing_config(tmp_path):
    spd = {"n": 8, "ls": 4, "schedule": "input", "width": 1}
    rows = [_row("spd", spd, d, "input") for d in ("gsm8k", "mt_bench")]
    for r in rows:  # 30 of 80 drafts accepted per row: enough accepts for the acceptance rate to be compared
        r["stats"]["fill_drafts"], r["position_accepts"] = [40, 40], [20, 10]
    rows += [_row("eagle3", {"m": 3, "width": 1, "ttt": 7}, "gsm8k", draft={"num_layers": 30, "ls": 1, "m": 3, "width": 1})]
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 0 and "all configurations pass" in output
    _write(results, [dict(r, config_key=r["config_key"] + "-retrained") for r in rows])  # new drafter weights hash
    assert _check("--baseline", baseline, "--results", results)[0] == 0  # matched by configuration label

    dropped = [dict(r, steps=10) if r["method"] == "spd" else r for r in rows]  # 10 tokens in 10 cycles, not 8
    _write(results, dropped)
    code, output = _check("--baseline", baseline, "--results", results, "--tolerance", "0.1")
    assert code == 1 and "tokens/step fell more than 10%" in output and "-20.0%" in output
    assert _check("--baseline", baseline, "--results", results, "--tolerance", "0.25")[0] == 0

    rejected = [dict(r, position_accepts=[10, 0]) if r["method"] == "spd" else r for r in rows]  # 10 of 80, not 30
    _write(results, rejected)
    code, output = _check("--baseline", baseline, "--results", results, "--tolerance", "0.5")
    assert code == 1 and "acceptance fell more than 50%" in output and "-66.7%" in output
    few = [dict(r, position_accepts=[0, 0]) if r["method"] == "eagle3" else r for r in rows]  # 3 accepts: noise
    _write(results, few)
    assert _check("--baseline", baseline, "--results", results, "--tolerance", "0.5")[0] == 0

    lost = [dict(r, lossless={"checked": True, "identical": False, "first_divergence": 3}) if r["method"] == "eagle3"
            else r for r in rows]
    _write(results, lost)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "lost losslessness" in output

    _write(results, rows[:2])
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "missing" in output and "1 of 2 configurations failed" in output


@pytest.mark.parametrize("change", [
    lambda r: r.update(max_new_tokens=8),  # shorter runs
    lambda r: r.update(question_id=99),  # another prompt
    lambda r: r["stats"].update(executor={"kind": "distributed"}),  # another executor
    lambda r: r.update(seed=1),
])
def test_a_run_of_the_same_label_but_another_identity_is_missing_not_ok(tmp_path, change):
    spd = {"n": 8, "ls": 4, "schedule": "input", "width": 1}
    rows = [_row("spd", spd, d, "input") for d in ("gsm8k", "mt_bench")]
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    other = [json.loads(json.dumps(r)) for r in rows]
    for r in other:
        r["config_key"] += "-other"
    change(other[0])
    _write(results, other)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "missing" in output


def test_an_unreadable_baseline_is_a_clear_error(tmp_path):
    results = tmp_path / "r.jsonl"
    _write(results, [_row("spd", {"n": 8}, "gsm8k", "input")])
    (tmp_path / "bad.json").write_text("{")
    code, output = _check("--baseline", tmp_path / "bad.json", "--results", results)
    assert code == 2 and "cannot read baseline" in output and "--write" in output


@pytest.mark.parametrize("content", ["[]", "", "[{\"config_key\": \"k\"", "{}", "[{\"config_key\": 1, \"label\": \"x\", "
                                     "\"tokens_per_step\": \"fast\", \"samples\": 2}]"],
                         ids=["empty", "blank", "truncated", "not-a-list", "wrong-types"])
def test_an_empty_or_malformed_baseline_is_an_error_not_a_pass(tmp_path, content):
    baseline = tmp_path / "b.json"
    baseline.write_text(content)
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(tmp_path)])
    assert result.exit_code == 2 and "pass" not in result.output
    assert result.output.startswith("error: cannot read baseline") and len(result.output.strip().splitlines()) == 1


def test_committed_records_keep_their_parameters_and_so_their_configuration_keys():
    """A parameter added to a method must not change what earlier records (and the gate's baseline) are keyed by."""
    from pathlib import Path

    from methods.base import REGISTRY, parse_params, recorded_params

    root = Path(__file__).resolve().parents[1]
    specs = [(e["run"]["method"], e["run"]["params"]) for e in json.loads((root / "tests/baselines/regression.json").read_text())]
    for path in (root / "results").glob("*/[!t]*.jsonl"):  # every results file but train.jsonl (training specs)
        specs += [(r["method"], r["params"]) for r in map(json.loads, path.open()) if r.get("method") in REGISTRY]
    assert specs
    for method, params in specs:
        assert recorded_params(parse_params(REGISTRY[method], params)) == params, (method, params)


def test_a_parameter_set_away_from_its_default_is_recorded():
    from methods.base import recorded_params
    from methods.eagle3.method import EagleParams

    assert recorded_params(EagleParams()) == {"m": 7, "width": 1, "ttt": 7}
    assert recorded_params(EagleParams(layout="eagle3"))["layout"] == "eagle3"
