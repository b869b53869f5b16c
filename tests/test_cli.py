"""`spd-bench run/report` on a tiny local HF model: records, resume after a kill, and clear bad-input errors."""

import json
import re

import pytest
from click.testing import CliRunner

from harness.cli import main


def _run(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_run_writes_one_lossless_record_per_sample_and_resumes_without_duplicates(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "r.jsonl"
    args = ["run", "--model", str(tiny_dir), "--dataset", "gsm8k,humaneval", "--max-new-tokens", "12",
            "--data-dir", str(eval_dir), "--out", str(out)]
    code, output = _run(*args, "--limit", "2")
    assert code == 0, output
    rows = _records(out)
    assert [(r["dataset"], r["question_id"]) for r in rows] == [("gsm8k", 0), ("gsm8k", 1), ("humaneval", 0), ("humaneval", 1)]
    row = rows[0]
    assert row["new_tokens"] == len(row["output_ids"]) == 12 and row["steps"] == 11
    assert row["lossless"]["checked"] and row["lossless"]["identical"]
    assert row["model"]["name"] == tiny_dir.name and len(row["model"]["weights_sha256"]) == 64
    assert {"prefill", "decode"} <= set(row["timing"]) and row["versions"]["torch"]
    assert row["prompt_source"]["origin"].endswith("gsm8k.jsonl") and len(row["prompt_source"]["sha256"]) == 16

    with open(out, "a") as fh:  # a run killed while writing its next record
        fh.write('{"config_key": "' + row["config_key"] + '", "dataset": "gs')
    code, output = _run(*args, "--limit", "3")
    assert code == 0, output
    keys = [(r["dataset"], r["question_id"]) for r in _records(out)]
    assert len(keys) == len(set(keys)) == 6

    code, _ = _run(*args, "--limit", "3")  # everything finished: nothing appended
    assert code == 0 and len(_records(out)) == 6


def test_sampled_run_records_that_losslessness_is_covered_by_distribution_tests(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "t1.jsonl"
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "mt_bench", "--limit", "1", "--temperature", "1",
                        "--top-k", "20", "--max-new-tokens", "6", "--data-dir", str(eval_dir), "--out", str(out))
    assert code == 0, output
    (row,) = _records(out)
    assert row["temperature"] == 1.0 and row["top_k"] == 20 and row["lossless"]["checked"] is False


def test_report_renders_markdown_and_csv(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "r.jsonl"
    _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "5",
         "--data-dir", str(eval_dir), "--out", str(out))
    code, markdown = _run("report", "--results", str(out))
    markdown = re.sub(r" {2,}", " ", markdown)  # aligned columns
    assert code == 0
    assert "| autoregressive | — | " in markdown and "| gsm8k | no | 2 | 10 |" in markdown
    assert "| overall | no | 2 | 10 |" in markdown
    result = CliRunner().invoke(main, ["report", "--results", str(out), "--format", "csv"])
    csv_text = result.stdout  # notes (e.g. a modified tree) go to stderr
    assert result.exit_code == 0 and csv_text.splitlines()[0].startswith("method,params,model,T,dataset,simulated")
    code, latex = _run("report", "--results", str(out), "--format", "latex")
    assert code == 0 and r"\begin{tabular}" in latex and r"autoregressive & --" in latex


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "nope"], "unknown method 'nope'"),
        (["--dataset", "squad"], "unknown dataset"),
        (["--temperature", "-0.5"], "temperature must be a finite number >= 0"),
        (["--limit", "0"], "--limit must be a positive integer"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--model", "/no/such/model"], "model '/no/such/model' not found"),
        (["--param", "n"], "must look like name=value"),
        (["--param", "n=4"], "has no parameter"),
        (["--simulate"], "method autoregressive has no acceptance simulation; drop --simulate"),
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--checkpoint", "/tmp"], "method autoregressive uses no drafter; drop --checkpoint"),
        (["--method", "spd", "--param", "n=abc"], "parameter n of spd wants an integer, got 'abc'"),
        (["--data-dir", "/no/such/folder"], "--data-dir /no/such/folder is not a folder"),
        (["--executor", "distributed"], "--executor distributed runs ppsd, spd, ssd, not autoregressive"),
        (["--devices", "cpu,cpu"], "--devices places the stages of --executor distributed"),
        (["--method", "spd", "--n", "2", "--executor", "distributed", "--devices", "cpu"],
         "--devices lists 1 devices but --n 2 needs one per stage"),
        (["--method", "spd", "--n", "2", "--executor", "distributed", "--devices", "tpu,cpu"],
         "--devices entry 'tpu' is neither cpu nor cuda[:k]"),
        (["--method", "spd", "--executor", "distributed", "--simulate"], "drop --executor distributed"),
        (["--method", "spd", "--executor", "distributed", "--timeout", "0"], "--timeout must be a number of seconds "
                                                                             "above 0"),
        (["--method", "spd", "--executor", "distributed", "--timeout", "inf"], "up to 604800 (a week), got inf"),
        (["--method", "spd", "--executor", "distributed", "--join-timeout", "1e14"], "--join-timeout must be"),
        (["--method", "spd", "--executor", "distributed", "--join-timeout", "0.001"],
         "--join-timeout must be a number of seconds from 1 and up to 604800 (a week), got 0.001"),
        (["--method", "spd", "--n", "2", "--executor", "distributed", "--devices", "cuda:0,cuda:1"],
         "--devices names cuda:0 but this machine has no CUDA devices"),
        (["--method", "spd", "--n", "2", "--executor", "distributed", "--devices", "cudaX,cpu"],
         "--devices entry 'cudaX' is neither cpu nor cuda[:k]"),
        (["--method", "ssd", "--saguaro-x", "inf", "--temperature", "1"], "saguaro_x must be a finite number > 0"),
        (["--method", "ssd", "--fan-out-list", "3"], "fan_out_list needs k + 1 = 5 comma-separated counts >= 0"),
        (["--method", "ssd", "--simulate", "--temperature", "1"], "ssd --simulate is exact only at T=0"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(args, message, tmp_path, eval_dir, cache):
    out = tmp_path / "r.jsonl"
    result = CliRunner().invoke(main, ["run", "--out", str(out), "--data-dir", str(eval_dir), *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("args, message", [
    ([], "pass either --preset paper or --method LIST"),
    (["--method", "spd", "--n", "0"], "n must be >= 1"),
    (["--method", "nope"], "unknown method 'nope'"),
    (["--method", "spd", "--width", "x"], "expected a comma-separated list"),
    (["--method", "spd", "--temperature", "0,nan", "--plan"], "temperature must be a finite number"),
    (["--method", "spd", "--temperature", "1", "--top-p", "5", "--plan"], "top_p must be in (0, 1], got 5"),
    (["--method", "spd", "--n", "4,,8", "--plan"], "'4,,8' has an empty entry"),
    (["--method", "spd", "--temperature", "", "--plan"], "'' has an empty entry"),
    (["--method", "spd", "--shard", "", "--plan"], "--shard '' must look like I/N"),
    (["--method", "spd", "--shard", "0/4", "--plan"], "--shard '0/4' must look like I/N"),
])
def test_bad_sweep_input_exits_2_with_one_line(args, message, cache):
    result = CliRunner().invoke(main, ["sweep", *args])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_malformed_data_line_and_unreadable_results_file_exit_2(tmp_path, tiny_dir, cache):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text("{broken\n")
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--data-dir", str(data),
                        "--out", str(tmp_path / "r.jsonl"))
    assert code == 2 and "gsm8k.jsonl:1: malformed dataset line" in output
    assert not (tmp_path / "r.jsonl").exists()

    bad = tmp_path / "bad.jsonl"
    bad.write_text("garbage\n")
    (data / "gsm8k.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n')
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--data-dir", str(data), "--out", str(bad))
    assert code == 2 and "bad.jsonl:1: not a result record" in output
    assert bad.read_text() == "garbage\n"
    code, output = _run("report", "--results", str(bad))
    assert code == 2 and "not a result record" in output


def _checkpoint(tmp_path, name: str, config: dict | str, weights: bytes | None = None):
    """A drafter folder with a given config (dict or raw text) and weights file."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights is not None:
        (folder / "model.safetensors").write_bytes(weights)
    return folder


SPD_CONFIG = {"n": 2, "ls": 1, "num_layers": 4}


@pytest.mark.parametrize("name, config, weights, method, message", [
    ("corrupt", {"method": "spd", "speculator": SPD_CONFIG}, b"\x00junk", "spd",
     "model.safetensors is not a readable safetensors file"),
    ("truncated", '{"method": "sp', None, "spd", "config.json is not a readable drafter config"),
    ("eagle", {"method": "eagle3", "eagle": {"ttt": 3}}, None, "spd", "holds a eagle3 drafter, not an spd/ppsd one"),
    ("spd", {"method": "spd", "speculator": SPD_CONFIG}, None, "eagle3", "holds a spd drafter, not an EAGLE-3 head"),
    ("wrong-config", {"method": "spd", "speculator": {**SPD_CONFIG, "bogus": 1}}, None, "spd",
     "has an invalid speculator config"),
])
def test_bad_checkpoints_exit_2_with_one_line_and_write_nothing(name, config, weights, method, message, tiny_dir,
                                                               eval_dir, tmp_path, cache):
    from harness.runtime.models import load_identity

    if isinstance(config, dict):
        config = {**config, "target": load_identity(str(tiny_dir)).to_dict()}
    folder = _checkpoint(tmp_path, name, config, weights)
    shape = ["--n", "2", "--ls", "1"] if method == "spd" else ["--param", "ttt=3"]
    out = tmp_path / "r.jsonl"
    code, output = _run("run", "--method", method, *shape, "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit",
                        "1", "--data-dir", str(eval_dir), "--checkpoint", str(folder), "--out", str(out))
    assert code == 2 and message in output and len(output.strip().splitlines()) == 1, output
    assert not out.exists()


@pytest.mark.parametrize("command", [
    ["run", "--method", "spd", "--n", "100", "--ls", "1"],
    ["sweep", "--method", "spd", "--n", "100", "--ls", "1"],
    ["train", "--method", "spd", "--n", "100", "--ls", "1", "--tokens", "64"],
])
def test_more_stages_than_layers_fails_up_front_with_the_range(command, tiny_dir, eval_dir, tmp_path, cache):
    extra = [] if command[0] == "train" else ["--dataset", "gsm8k", "--limit", "1", "--data-dir", str(eval_dir)]
    code, output = _run(*command, "--model", str(tiny_dir), *extra)
    assert code == 2 and "--n 100 is outside 1..4" in output and "train one" not in output, output
    assert len(output.strip().splitlines()) == 1


def test_too_long_a_generation_for_the_context_is_refused(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "r.jsonl"
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1", "--data-dir",
                        str(eval_dir), "--max-new-tokens", "1000000000", "--out", str(out))
    assert code == 2 and "exceeds the model's context of 512 tokens" in output, output
    assert len(output.strip().splitlines()) == 1 and not out.exists()


def test_a_turns_field_that_is_not_a_list_of_strings_names_file_and_line(tmp_path, tiny_dir, cache):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text('{"question_id": 1, "turns": ["ok"]}\n{"question_id": 2, "turns": "hi"}\n')
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--data-dir", str(data))
    assert code == 2 and "gsm8k.jsonl:2: malformed dataset line" in output


def test_run_refuses_a_results_file_another_run_is_writing_and_never_trims_a_foreign_file(tiny_dir, eval_dir,
                                                                                           tmp_path, cache):
    from harness.runtime.results import ResultStore

    args = ["run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "4",
            "--data-dir", str(eval_dir)]
    out = tmp_path / "same.jsonl"
    with ResultStore(out).writing():  # another run holds the file
        code, output = _run(*args, "--out", str(out))
    assert code == 2 and "being written by another spd-bench run" in output and len(output.strip().splitlines()) == 1
    notes = tmp_path / "notes.txt"
    notes.write_text("line one\nimportant last line")
    code, output = _run(*args, "--out", str(notes))
    assert code == 2 and notes.read_text() == "line one\nimportant last line"
    assert _run(*args, "--out", str(out))[0] == 0
    out.write_text(out.read_text().rstrip("\n"))  # a copy that lost its final newline
    before = out.read_bytes()
    code, output = _run("report", "--results", str(out))
    output = re.sub(r" {2,}", " ", output)  # aligned columns
    assert code == 0 and "| overall | no | 1 |" in output and out.read_bytes() == before


def test_a_prompt_longer_than_the_context_is_refused(tmp_path, tiny_dir, cache):
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k.jsonl").write_text(json.dumps({"question_id": 1, "turns": ["word " * 600]}) + "\n")
    out = tmp_path / "r.jsonl"
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--data-dir", str(data),
                        "--max-new-tokens", "4", "--out", str(out))
    assert code == 2 and "exceeds the model's context of 512 tokens" in output and not out.exists(), output


def test_a_folder_with_the_same_weights_and_another_stop_id_gets_its_own_greedy_reference(tiny_dir, eval_dir, tmp_path,
                                                                                          cache):
    import shutil

    args = ["--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "16", "--data-dir", str(eval_dir)]
    code, output = _run("run", "--model", str(tiny_dir), *args, "--out", str(tmp_path / "a.jsonl"))
    assert code == 0, output
    first = _records(tmp_path / "a.jsonl")[0]["output_ids"]
    stop = next(t for i, t in enumerate(first) if i >= 4 and t not in first[:i])  # a token greedy AR reaches later
    other = tmp_path / "other-stop"
    shutil.copytree(tiny_dir, other)
    generation = json.loads((other / "generation_config.json").read_text())
    (other / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": stop}))
    code, output = _run("run", "--model", str(other), *args, "--out", str(tmp_path / "b.jsonl"))
    assert code == 0, output
    rows = _records(tmp_path / "b.jsonl")
    assert rows[0]["output_ids"][-1] == stop and len(rows[0]["output_ids"]) < len(first)  # it stopped earlier
    assert all(r["lossless"]["identical"] for r in rows)  # not compared with the other folder's longer output
    assert len(list((tmp_path / "cache" / "references").glob("*.jsonl"))) == 2


def test_records_name_their_code_and_a_rerun_and_the_report_say_what_is_old(tiny_dir, eval_dir, tmp_path, cache):
    from harness.runtime.provenance import code_identity

    out = tmp_path / "r.jsonl"
    args = ["run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "4",
            "--data-dir", str(eval_dir), "--out", str(out)]
    code, output = _run(*args)
    assert code == 0, output
    (row,) = _records(out)
    assert row["versions"]["commit"] == code_identity()["commit"] and len(row["versions"]["commit"]) == 40
    assert isinstance(row["versions"]["modified"], bool)
    code, output = _run(*args)
    assert code == 0 and "1 of 1 samples already recorded in" in output and "kept, not measured again" in output
    out.write_text(json.dumps({**row, "versions": {**row["versions"], "commit": "0" * 40}}) + "\n")
    code, output = _run("report", "--results", str(out))
    assert code == 0 and "1 of 1 records were made at another commit than this checkout's" in output


def test_report_and_export_into_a_folder_or_under_a_file_are_one_line_and_leave_nothing(tiny_dir, eval_dir, tmp_path,
                                                                                          cache, monkeypatch):
    out = tmp_path / "r.jsonl"
    code, output = _run("run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "4",
                        "--data-dir", str(eval_dir), "--out", str(out))
    assert code == 0, output
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    monkeypatch.chdir(tmp_path / "folder")
    for args, message in ((["report", "--out", str(tmp_path / "folder")], "is a folder; pass a file path"),
                          (["report", "--out", "."], "is a folder; pass a file path"),
                          (["report", "--out", str(tmp_path / "file" / "r.md")], "lies under the file"),
                          (["export", "--format", "spec-bench", "--out", str(tmp_path / "file")], "is a file")):
        result = CliRunner().invoke(main, [*args, "--results", str(out)])
        assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "file", "folder", "r.jsonl"]
    assert not list((tmp_path / "folder").iterdir()) and (tmp_path / "file").read_text() == "x"


@pytest.mark.parametrize("config", ["{not json", "[]", '{"model_type": "no-such-architecture"}'])
def test_a_model_folder_with_a_broken_config_is_one_line(tiny_dir, eval_dir, tmp_path, cache, config):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    (broken / "config.json").write_text(config)
    out = tmp_path / "r.jsonl"
    for option in (["--model", str(broken)],
                   ["--method", "ssd", "--draft-model", str(broken), "--model", str(tiny_dir)]):
        result = CliRunner().invoke(main, ["run", *option, "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens",
                                           "4", "--data-dir", str(eval_dir), "--out", str(out)])
        assert result.exit_code == 2, result.output
        errors = [line for line in result.output.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "does not load as a causal LM" in errors[0] and "Traceback" not in result.output
        assert not out.exists()


def test_an_error_mid_run_starts_a_line_of_its_own_after_the_progress_bar(tiny_dir, eval_dir, tmp_path, cache,
                                                                          monkeypatch):
    from harness.bench.runner import Runner
    from harness.runtime.errors import HarnessError

    calls = []
    real = Runner._generate_pair

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise HarnessError("distributed run: a stage rank stopped answering (test)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Runner, "_generate_pair", failing)
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "3",
                                       "--max-new-tokens", "4", "--data-dir", str(eval_dir),
                                       "--out", str(tmp_path / "r.jsonl")])
    assert result.exit_code == 2
    assert "error: distributed run: a stage rank stopped answering (test)" in result.stderr.splitlines()
    assert len(_records(tmp_path / "r.jsonl")) == 1  # the finished sample is kept for a resume


def test_a_shard_count_beyond_the_plan_is_cheap_and_its_empty_shards_do_nothing(cache):
    plan = CliRunner().invoke(main, ["sweep", "--method", "spd,eagle3", "--plan", "--json", "--shard", "1/1000000000"])
    assert plan.exit_code == 0, plan.output
    assert [entry["shard"] for entry in json.loads(plan.output)] == [1]  # the largest item; each shard takes one
    empty = CliRunner().invoke(main, ["sweep", "--method", "spd,eagle3", "--shard", "999999999/1000000000"])
    assert empty.exit_code == 0 and "shard 999999999/1000000000: 0 of 2 work items" in empty.output


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0"])
def test_train_refuses_a_learning_rate_that_is_not_finite_and_positive(lr, tmp_path, cache):
    result = CliRunner().invoke(main, ["train", "--lr", lr, "--tokens", "8"])
    assert result.exit_code == 2 and "--lr" in result.output and "must be a finite number above 0" in result.output


def test_records_carry_their_conditions_and_a_busy_machine_is_warned_of_and_marked(tiny_dir, eval_dir, tmp_path, cache,
                                                                                   monkeypatch):
    import os

    import torch

    out = tmp_path / "r.jsonl"
    args = ["run", "--model", str(tiny_dir), "--method", "lookup", "--dataset", "gsm8k", "--max-new-tokens", "4",
            "--data-dir", str(eval_dir), "--out", str(out)]
    quiet = CliRunner().invoke(main, [*args, "--limit", "1"])
    assert quiet.exit_code == 0 and "warning: load average" not in quiet.stderr
    (row,) = _records(out)
    conditions = row["conditions"]
    assert conditions["cores"] == len(os.sched_getaffinity(0)) and conditions["threads"] == torch.get_num_threads()
    assert conditions["processor"] and isinstance(conditions["load_before"], float)

    monkeypatch.setattr(os, "getloadavg", lambda: (conditions["cores"] + 4.0, 0.0, 0.0))  # two other jobs, say
    busy = CliRunner().invoke(main, [*args, "--limit", "3"])
    assert busy.exit_code == 0 and busy.stderr.count("warning: load average") == 1
    assert [r["conditions"]["busy"] for r in _records(out)] == [False, True, True]
    summary = CliRunner().invoke(main, ["report", "--results", str(out), "--summary"])
    assert "(n=3, 2 busy)" in summary.output and "busy: 2 of 3 timed samples" in summary.output


def test_threads_are_sized_to_the_cores_other_jobs_leave_unless_omp_num_threads_says(monkeypatch):
    import torch

    from harness.runtime import conditions

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(conditions, "usable_cores", lambda: 2)
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(conditions, "other_load", lambda: 0.0)
        assert conditions.fit_threads() is None and torch.get_num_threads() == 2  # alone: as torch chose
        monkeypatch.setattr(conditions, "other_load", lambda: 2.0)  # two busy processes
        assert "decoding with 1 thread(s) instead of 2" in conditions.fit_threads()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert conditions.fit_threads() is None and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_record_is_modified_by_uncommitted_code_not_by_the_results_a_run_appends(tmp_path):
    """A run appending to a committed results file (or a report re-rendered) leaves its records unmodified; an
    uncommitted change to code marks them."""
    import subprocess

    from harness.runtime.provenance import tree_identity

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    (tmp_path / "results").mkdir()
    (tmp_path / "reports").mkdir()
    for name in ("code.py", "results/r.jsonl", "reports/results.md"):
        (tmp_path / name).write_text("first\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    for name in ("results/r.jsonl", "reports/results.md"):
        (tmp_path / name).write_text("first\nappended\n")
    assert tree_identity(tmp_path)["modified"] is False
    (tmp_path / "code.py").write_text("changed\n")
    assert tree_identity(tmp_path)["modified"] is True


@pytest.mark.parametrize("args, message", [
    # each fails on a16459a: decoded as `all` / a traceback / measured, then raised IsADirectoryError
    (["run", "--method", "lookup", "--length", "banana"], "parameter length of lookup takes all or cost"),
    (["run", "--method", "lookup", "--param", "length=banana"], "parameter length of lookup takes all or cost"),
    (["bench", "dispatch", "--method", "lookup:length=banana"], "parameter length of lookup takes all or cost"),
    (["bench", "peer", "--method", "lookup", "--param", "length=banana"], "takes all or cost"),
    (["bench", "peer", "--method", "lookup", "--param", "k=0"], "k and min_ngram must be >= 1"),
    (["run", "--kernels", "fast"], "'fast' is not one of 'auto', 'rows', 'torch'"),
])
def test_bad_method_parameters_are_one_line_before_anything_loads(args, message, cache):
    code, output = _run(*args)
    assert code == 2 and message in output and output.count("\n") == 1, output


@pytest.mark.parametrize("command", [["bench", "ar"], ["bench", "peer", "--method", "lookup"],
                                     ["bench", "dispatch"], ["selfcheck", "--device", "cpu", "--shapes", "tiny"]])
def test_a_benchmark_whose_out_is_a_folder_stops_before_it_measures(command, tmp_path, cache):
    code, output = _run(*command, "--out", str(tmp_path))
    assert code == 2 and "is a folder" in output and output.count("\n") == 1, output


def test_turns_all_on_single_turn_sets_says_so_once_and_runs_as_turns_first(capsys):
    """Fails on a16459a: nothing was said and the configuration was keyed as another protocol."""
    from harness.bench.config import RunConfig, validate

    for _ in range(3):  # a sweep validates every configuration
        config = RunConfig(method="autoregressive", datasets=("gsm8k",), turns="all")
        validate(config)
        assert config.turns == "first"
    assert capsys.readouterr().err.count("--turns all: gsm8k have one turn per question") == 1
    mixed = RunConfig(method="autoregressive", datasets=("mt_bench", "humaneval"), turns="all")
    validate(mixed)
    assert mixed.turns == "all" and "humaneval have one turn per question; they run it" in capsys.readouterr().err


def test_kernels_torch_is_recorded_and_keys_its_own_configuration(tiny_dir, eval_dir, tmp_path, cache, monkeypatch):
    """Fails on a16459a: no --kernels option, so no run could take torch's kernels where the row kernels build."""
    from harness.runtime import kernels

    monkeypatch.setenv(kernels.CHOICE_VARIABLE, "auto")
    base = ["run", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "6",
            "--data-dir", str(eval_dir), "--dtype", "bfloat16", "--out", str(tmp_path / "r.jsonl")]
    try:
        assert _run(*base)[0] == 0
        code, output = _run(*base, "--kernels", "torch")
        assert code == 0, output
    finally:
        kernels.choose("auto")
    rows = _records(tmp_path / "r.jsonl")
    assert [r["conditions"]["kernels"] for r in rows] == ["auto", "torch"]
    assert [r["conditions"]["linears"] for r in rows] == ["rows", "default"]
    assert [r["conditions"]["attention"] for r in rows] == ["rows", "sdpa_grouped"]
    assert rows[0]["config_key"] != rows[1]["config_key"] and all(r["lossless"]["identical"] for r in rows)
