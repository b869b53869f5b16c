"""`spd-bench check`: passes on the results a baseline was written from, fails on a drop, a lost sample or a gap."""

import json
import random

import pytest
from click.testing import CliRunner
from test_report import _row

from harness.cli import main


def _write(path, rows):
    path.write_text("".join(json.dumps({**r, "output_ids": [1]}) + "\n" for r in rows))


def _check(*args):
    result = CliRunner().invoke(main, ["check", *map(str, args)])
    return result.exit_code, result.output


SPD = {"n": 8, "ls": 4, "schedule": "input", "width": 1}
EAGLE = {"m": 3, "width": 1, "ttt": 7}


def _prompts(method, params, seed=0, temperature=0.0, steps=lambda i: 8 + i % 3, accepts=lambda i: [2 + i % 2, i % 2]):
    """Five prompts in each of two datasets, each with its own figures (so that they spread), at one seed."""
    kind = {"schedule": "input"} if method == "spd" else {"draft": {"num_layers": 30, "ls": 1, "m": 3, "width": 1}}
    rows = []
    for dataset in ("gsm8k", "mt_bench"):
        for i in range(5):
            row = _row(method, params, dataset, temperature=temperature, **kind)
            row.update(question_id=i, seed=seed, steps=steps(i), position_accepts=accepts(i),
                       config_key=f"{row['config_key']}-seed{seed}")
            rows.append(row)
    return rows


def _with(rows, method, **changes):
    return [dict(r, **{k: f(r) for k, f in changes.items()}) if r["method"] == method else r for r in rows]


def test_check_passes_a_rerun_then_catches_a_drop_a_lost_sample_and_a_missing_config(tmp_path):
    rows = _prompts("spd", SPD) + _prompts("eagle3", EAGLE)
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 0 and "all configurations pass" in output and "+0.0% [+0.0%, +0.0%]" in output
    entry = json.loads(baseline.read_text())[0]
    assert entry["samples"] == 10 and entry["run"]["seeds"] == [0] and len(entry["records"]) == 10
    low, value, high = (entry["figures"]["tokens_per_step"][k] for k in ("low", "value", "high"))
    assert low < value < high  # the prompts spread
    _write(results, [dict(r, config_key=r["config_key"] + "-retrained") for r in rows])  # new drafter weights hash
    assert _check("--baseline", baseline, "--results", results)[0] == 0  # matched by configuration label

    slower = _with(rows, "spd", steps=lambda r: r["steps"] * 2)  # every prompt half the tokens per cycle
    _write(results, slower)
    code, output = _check("--baseline", baseline, "--results", results, "--margin", "0.1")
    assert code == 1 and "tokens/step fell beyond the 10% margin" in output and "-50.0% [-50.0%, -50.0%]" in output
    assert _check("--baseline", baseline, "--results", results, "--margin", "0.6")[0] == 0

    rejected = _with(rows, "spd", position_accepts=lambda r: [1, 0])  # every prompt accepts fewer
    _write(results, rejected)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "acceptance fell beyond" in output and "tokens/step fell" not in output
    # at T=0 any drop beyond the margin is real, even one prompt's (a rerun reproduces every prompt) ...
    one = _with(rows, "spd", position_accepts=lambda r: [0, 0] if r["question_id"] == 1 else r["position_accepts"])
    _write(results, one)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "acceptance fell beyond the 5% margin" in output
    # ... and one prompt accepting less while another accepts as much more is no change
    swapped = _with(rows, "spd", position_accepts=lambda r: {0: [1, 0], 1: [4, 1]}.get(r["question_id"],
                                                                                       r["position_accepts"]))
    _write(results, swapped)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 0 and "+0.0% [" in output, output

    lost = _with(rows, "eagle3", lossless=lambda r: {"checked": True, "identical": False, "first_divergence": 3})
    _write(results, lost)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "lost losslessness" in output
    # a numerics flip (harness/runtime/verdict.py) fails beyond --flip-rate only; a logic divergence always
    flip = {"checked": True, "identical": False, "first_divergence": 3, "verdict": "flip"}
    flipped = _with(rows, "eagle3", lossless=lambda r: flip if r["question_id"] == 0 else r["lossless"])
    _write(results, flipped)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "2 numerics flips, beyond the 0% flip rate" in output and "(+2 flips)" in output
    assert _check("--baseline", baseline, "--results", results, "--flip-rate", "0.2")[0] == 0
    logic = _with(flipped, "eagle3", lossless=lambda r: {**flip, "verdict": "logic"} if r["question_id"] == 1
                  else r["lossless"])
    _write(results, logic)
    code, output = _check("--baseline", baseline, "--results", results, "--flip-rate", "1")
    assert code == 1 and "lost losslessness (2 logic divergences)" in output

    _write(results, rows[:10])
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "missing" in output and "1 of 2 configurations failed" in output


def test_at_t1_a_baseline_over_seeds_passes_a_reseeded_run_and_catches_a_drop(tmp_path):
    """Three seeds make one entry holding their spread; a fourth seed's noise passes, a drop on every prompt fails."""
    def noisy(seed):  # each prompt's figures drawn afresh at each seed
        draw = random.Random(seed)
        return _prompts("eagle3", EAGLE, seed, 1.0, steps=lambda i: draw.randint(8, 10),
                        accepts=lambda i: [draw.randint(1, 3), draw.randint(0, 1)])
    results, baseline = tmp_path / "r", tmp_path / "baseline.json"
    results.mkdir()
    _write(results / "seeds.jsonl", noisy(0) + noisy(1) + noisy(2))
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    (entry,) = json.loads(baseline.read_text())
    assert entry["run"]["seeds"] == [0, 1, 2] and entry["samples"] == 30
    assert len(set(entry["figures"]["tokens_per_step"]["seeds"])) > 1
    _write(results / "seeds.jsonl", noisy(3))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 0 and "(seeds: " in output, output
    # one prompt far slower: beyond the margin, but within what the prompts' spread allows at T>0
    _write(results / "seeds.jsonl", _with(noisy(3), "eagle3", steps=lambda r: r["steps"] * (
        3 if (r["dataset"], r["question_id"]) == ("gsm8k", 2) else 1)))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 0 and "-1" in output, output
    _write(results / "seeds.jsonl", _with(noisy(3), "eagle3", steps=lambda r: r["steps"] * 2))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "tokens/step fell beyond its noise and the 5% margin" in output


@pytest.mark.parametrize("change", [
    lambda r: r.update(max_new_tokens=8),  # shorter runs
    lambda r: r.update(question_id=99),  # another prompt
    lambda r: r["stats"].update(executor={"kind": "distributed"}),  # another executor
    lambda r: r.update(temperature=1.0),
])
def test_a_run_of_the_same_label_but_another_identity_is_missing_not_ok(tmp_path, change):
    rows = [_row("spd", SPD, d, "input") for d in ("gsm8k", "mt_bench")]
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
    _write(results, [_row("spd", SPD, "gsm8k", "input")])
    (tmp_path / "bad.json").write_text("{")
    code, output = _check("--baseline", tmp_path / "bad.json", "--results", results)
    assert code == 2 and "cannot read baseline" in output and "--write" in output


@pytest.mark.parametrize("content", ["[]", "", "[{\"label\": \"k\"", "{}",
                                     "[{\"label\": 1, \"samples\": 2, \"run\": {}, \"figures\": {}, \"records\": []}]",
                                     "[{\"config_key\": \"k\", \"label\": \"x\", \"tokens_per_step\": 1.3, "
                                     "\"samples\": 6}]"],
                         ids=["empty", "blank", "truncated", "not-a-list", "wrong-types", "older-format"])
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


def test_a_nan_margin_is_refused_in_one_line(tmp_path):
    result = CliRunner().invoke(main, ["check", "--baseline", str(tmp_path / "b.json"), "--margin", "nan"])
    assert result.exit_code == 2 and "must be a number between 0 and 1, got nan" in result.output


@pytest.mark.parametrize("figures", [{}, {"tokens_per_step": {"value": float("nan"), "low": 1.0, "high": 2.0,
                                                               "prompts": 5, "seeds": [1.5]}}],
                         ids=["no-figures", "nan-value"])
def test_a_baseline_entry_that_checks_nothing_or_nan_is_an_error_not_a_pass(tmp_path, figures):
    rows = _prompts("spd", SPD)
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    entries = json.loads(baseline.read_text())
    entries[0]["figures"] = figures
    baseline.write_text(json.dumps(entries))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 2 and output.startswith("error: cannot read baseline") and "pass" not in output


def test_a_sampled_baseline_from_one_seed_is_warned_of_and_rewriting_needs_replace(tmp_path):
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, _prompts("eagle3", EAGLE, 0, 1.0))
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results), "--write"])
    assert result.exit_code == 0 and "was measured at one seed (T>0)" in result.stderr
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results), "--write"])
    assert result.exit_code == 2 and "already exists" in result.stderr and "--replace" in result.stderr
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results), "--write",
                                       "--replace"])
    assert result.exit_code == 0
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results)])
    assert result.exit_code == 0 and "note: " in result.stderr and "one seed" in result.stderr


def test_a_rerun_judges_only_what_it_decoded_never_records_already_in_its_folder(tiny_dir, eval_dir, tmp_path, cache):
    """The baseline's own records, tampered to have lost losslessness, lie where a rerun would resume from: the rerun
    decodes into a folder of its own and passes on what it decoded."""
    results, baseline = tmp_path / "gate", tmp_path / "baseline.json"
    run = ["run", "--model", str(tiny_dir), "--method", "lookup", "--dataset", "gsm8k", "--limit", "2",
           "--max-new-tokens", "6", "--data-dir", str(eval_dir), "--out"]
    assert CliRunner().invoke(main, [*run, str(results / "first.jsonl")]).exit_code == 0
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    for store in results.rglob("*.jsonl"):
        store.unlink()
    assert CliRunner().invoke(main, [*run, str(results / tiny_dir.name / "lookup.jsonl")]).exit_code == 0
    resumable = results / tiny_dir.name / "lookup.jsonl"  # where the rerun's run would find them (default_out)
    tampered = [dict(json.loads(line), lossless={"checked": True, "identical": False, "first_divergence": 0})
                for line in resumable.read_text().splitlines()]
    resumable.write_text("".join(json.dumps(r) + "\n" for r in tampered))
    code, output = _check("--baseline", baseline, "--rerun", "--results", results, "--model", tiny_dir,
                          "--data-dir", eval_dir)
    assert code == 0 and "all configurations pass" in output, output
    assert f"rerun records: {results}/rerun-" in output
    assert resumable.read_text() == "".join(json.dumps(r) + "\n" for r in tampered)  # left as it was


def _drafted(rows, weights, digest=lambda r: f"d{r['dataset']}{r['question_id']}"):
    """The rows with a drafter fingerprint and a digest of what it proposed per prompt."""
    return [dict(r, stats={**r["stats"], "drafter": weights}, drafts={"digest": digest(r), "rounds": 5})
            for r in rows]


def test_a_drafter_whose_proposals_or_weights_changed_fails_and_says_which(tmp_path):
    """Fails on a16459a: a drafter with a layer scaled by 0.5 passed with the baseline's accept counts."""
    rows = _drafted(_prompts("eagle3", EAGLE), "e35e508e" + "0" * 56)
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    assert _check("--baseline", baseline, "--results", results)[0] == 0
    tampered = _drafted(rows, "64a3cc67" + "0" * 56,
                        digest=lambda r: "changed" if r["question_id"] == 1 else f"d{r['dataset']}{r['question_id']}")
    _write(results, tampered)  # the same accept counts
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "drafter weights changed (e35e508e -> 64a3cc67)" in output, output
    assert "proposed drafts changed on 2 of 10 prompts" in output
    same_weights = _drafted(rows, "e35e508e" + "0" * 56, digest=lambda r: "changed")
    _write(results, same_weights)
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "proposed drafts changed on 10 of 10 prompts with the weights unchanged" in output


def test_at_t1_proposals_follow_the_seed_and_only_the_weights_are_compared(tmp_path):
    def seeded(seed, weights):
        return _drafted(_prompts("eagle3", EAGLE, seed, 1.0), weights, digest=lambda r: f"{seed}-{r['question_id']}")
    results, baseline = tmp_path / "r", tmp_path / "baseline.json"
    results.mkdir()
    _write(results / "seeds.jsonl", seeded(0, "a" * 64) + seeded(1, "a" * 64) + seeded(2, "a" * 64))
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    _write(results / "seeds.jsonl", seeded(3, "a" * 64))
    assert _check("--baseline", baseline, "--results", results)[0] == 0
    _write(results / "seeds.jsonl", seeded(3, "b" * 64))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "drafter weights changed (aaaaaaaa -> bbbbbbbb)" in output


@pytest.mark.parametrize("cut", ["record", "figure"])
def test_a_cut_baseline_whose_figures_disagree_with_its_records_is_refused(tmp_path, cut):
    rows = _prompts("spd", SPD)
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    entries = json.loads(baseline.read_text())
    if cut == "record":  # prompts dropped to make the gate cheaper, the figures kept
        entries[0]["records"] = entries[0]["records"][:6]
        entries[0]["samples"] = 6
    else:
        entries[0]["figures"]["acceptance"]["value"] += 0.1
    baseline.write_text(json.dumps(entries))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 2 and "is not what its records pool to" in output and "write one with" in output


def test_a_gate_over_records_of_none_of_its_configurations_names_rerun(tmp_path):
    rows = _prompts("spd", SPD)
    results, baseline = tmp_path / "r.jsonl", tmp_path / "baseline.json"
    _write(results, rows)
    assert _check("--baseline", baseline, "--results", results, "--write")[0] == 0
    _write(results, _prompts("eagle3", EAGLE))
    code, output = _check("--baseline", baseline, "--results", results)
    assert code == 1 and "missing" in output and "add --rerun" in output  # fails on a16459a: no hint
