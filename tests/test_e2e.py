"""End-to-end on the embedded SmolLM2-135M-Instruct model (fp32): real weights, tokenizer and prompts."""

import json
import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from harness.bench.data import load_samples, render_prompt
from harness.cli import main
from harness.runtime.models import load_model, stop_ids
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.sampling import Sampler, SamplingConfig

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m")


def test_harness_ar_equals_hf_generate_greedy_on_the_embedded_model(smollm2):
    stops = stop_ids(smollm2)
    method = build_method("autoregressive", TargetRuntime(smollm2.model, max_len=1024), {}, stops)
    for sample in load_samples("mt_bench", limit=2) + load_samples("humaneval", limit=1):
        prompt = render_prompt(smollm2.tokenizer, sample.prompt)
        ours = method.generate(prompt, 40, Sampler(SamplingConfig())).output_ids
        hf = smollm2.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                                    eos_token_id=sorted(stops), pad_token_id=2)[0, len(prompt):].tolist()
        assert ours == hf


def test_cli_run_on_the_embedded_model_is_lossless_and_reported(tmp_path):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(main, ["run", "--dataset", "mt_bench,humaneval", "--limit", "1", "--max-new-tokens", "24",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["dataset"] for r in rows] == ["mt_bench", "humaneval"]
    assert all(r["lossless"]["identical"] and r["model"]["name"] == "smollm2-135m" for r in rows)
    report = CliRunner().invoke(main, ["report", "--results", str(out)])
    assert report.exit_code == 0 and "| overall | no | 2 |" in re.sub(r" {2,}", " ", report.output)


def test_parity_command_finds_the_engines_drafter_states_equal_the_training_layouts(tmp_path, monkeypatch):
    """`spd-bench parity` on the embedded model with a freshly trained two-stage drafter: every state decoding
    visits gives the training layout's top-1 (exit 0), the figures go to results/<model>/parity.jsonl."""
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    shape = ["--method", "spd", "--n", "2", "--ls", "1"]
    trained = CliRunner().invoke(main, ["train", *shape, "--tokens", "2048", "--seq-len", "128", "--batch-size", "4",
                                        "--draft-vocab", "4096", "--lr", "3e-3", "--val-prompts", "0"])
    assert trained.exit_code == 0, trained.output
    result = CliRunner().invoke(main, ["parity", *shape, "--dataset", "mt_bench,gsm8k", "--limit", "1",
                                       "--max-new-tokens", "32"])
    assert result.exit_code == 0, result.output
    (record,) = [json.loads(line) for line in (tmp_path / "results" / "smollm2-135m" / "parity.jsonl").open()]
    fills = record["fills"]
    assert record["lossless"] and not record["mismatches"] and len(fills) == 2
    assert fills[0]["states"] > 0 and all(f["disagree"] == 0 and f["replay_disagree"] == 0 for f in fills)
    assert fills[1]["all_states"] > 0


def _gate(tmp_path, monkeypatch, keep, dataset=None) -> Path:
    """The committed gate's entries that `keep` selects (with `dataset`: rewritten from their records of that dataset
    alone), as a baseline of their own, decoded with the shipped drafters (a fresh cache: not one trained here)."""
    from dataclasses import asdict

    from harness.reporting.check import baseline_from

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    entries = [e for e in json.loads((Path(__file__).parent / "baselines" / "regression.json").read_text())
               if keep(e["run"])]
    if dataset:
        entries = [asdict(part) for e in entries
                   for part in baseline_from([r for r in e["records"] if r["dataset"] == dataset])]
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(entries))
    return baseline


def test_the_gate_fails_when_the_drafter_reads_a_feature_from_the_wrong_depth(tmp_path, monkeypatch):
    """The committed gate's SPD configuration (the shipped flagship) rerun with every row past the embedding fed its
    deepest feature one layer too shallow (an off-by-one in capture): acceptance drops beyond the margin and `check`
    exits 1. On HumanEval's two prompts alone, to keep the suite short: there the off-by-one costs 40% of acceptance,
    on GSM8K's only 3% (inside the margin); `make regression` reruns all six."""
    from methods.pipeline.speculator import SpeculatorConfig

    original = SpeculatorConfig.layers_for

    def one_too_shallow(self, depth):
        layers = original(self, depth)
        return (*layers[:-1], layers[-1] - 1) if layers[-1] else layers

    monkeypatch.setattr(SpeculatorConfig, "layers_for", one_too_shallow)
    baseline = _gate(tmp_path, monkeypatch, lambda run: run["method"] == "spd", dataset="humaneval")
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--rerun", "--results",
                                       str(tmp_path / "rerun")])
    assert result.exit_code == 1 and "1 of 1 configurations failed" in result.output, result.output
    assert "acceptance fell beyond the 5% margin" in result.output


def test_the_gate_passes_the_same_code_rerun_with_a_seed_its_baseline_never_saw(tmp_path, monkeypatch):
    """At T=1 another seed samples other tokens: the figures move, within the spread the baseline measured over its
    seeds and prompts (one dataset's five prompts, to keep the suite short; `make regression` reruns them all)."""
    baseline = _gate(tmp_path, monkeypatch, lambda run: run["temperature"] > 0, dataset="gsm8k")
    (entry,) = json.loads(baseline.read_text())
    seed = max(entry["run"]["seeds"]) + 1
    assert len(entry["run"]["seeds"]) >= 3 and entry["run"]["samples"].keys() == {"gsm8k"}
    result = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--rerun", "--seed", str(seed),
                                       "--results", str(tmp_path / "rerun")])
    assert result.exit_code == 0 and "all configurations pass" in result.output, result.output
    rows = [json.loads(line) for path in (tmp_path / "rerun").rglob("*.jsonl") for line in path.open()]
    assert len(rows) == len(entry["run"]["samples"]["gsm8k"]) and {r["seed"] for r in rows} == {seed}


def test_ssd_with_the_shipped_eagle3_head_is_lossless_through_the_cli(tmp_path):
    """The command line takes SSD's own parameters as options; T=0 output equals AR's (checked by the run)."""
    out = tmp_path / "ssd.jsonl"
    result = CliRunner().invoke(main, ["run", "--method", "ssd", "--k", "3", "--fan-out", "2", "--saguaro-x", "0.5",
                                       "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "24", "--out", str(out)])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["lossless"]["identical"] and row["params"]["saguaro_x"] == 0.5
    assert row["stats"]["cache_hits"] == sum(row["stats"]["hits"]) and row["timing"]["modeled"] > 0


def test_bf16_on_torchs_kernels_flips_near_ties_and_the_verdict_says_so(tmp_path, monkeypatch):
    """On torch's bf16 path a k-row verify and a one-row step take different kernels (as cuBLAS and sdpa do on a
    GPU), so near-ties fall apart: each divergence is classified a numerics flip, with its evidence, none as
    logic; the report counts them apart."""
    from harness.runtime import kernels

    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "auto")
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "bf16.jsonl"
    try:
        result = CliRunner().invoke(main, ["run", "--method", "eagle3", "--m", "3", "--dtype", "bfloat16",
                                           "--kernels", "torch", "--dataset", "mt_bench", "--limit", "3",
                                           "--max-new-tokens", "64", "--out", str(out)])
    finally:
        kernels.choose("auto")  # this process's later tests run on the row kernels again
    assert result.exit_code == 0, result.output
    lossless = [json.loads(line)["lossless"] for line in out.read_text().splitlines()]
    flips = [row for row in lossless if row["verdict"] == "flip"]
    assert flips and all(row["verdict"] in ("identical", "flip") for row in lossless)
    for row in flips:
        evidence = row["evidence"]
        assert evidence["gap"] <= 2 * evidence["difference"] and evidence["difference"] <= evidence["bound"]
    report = CliRunner().invoke(main, ["report", "--results", str(out)])
    assert "numerics flips" in report.output and "~" in report.output
