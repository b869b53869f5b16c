"""MT-Bench's second turn (`--turns all`): a later turn's prompt is the conversation so far with the method's own
answers, every turn gets a record and a losslessness check, resumes keep the history, the report and the Spec-Bench
export keep the turns apart, and a set with one turn says so once."""

import json

import pytest
import torch
from click.testing import CliRunner

from harness.bench.data import load_samples, render_conversation
from harness.cli import main
from harness.reporting.export import export
from harness.reporting.metrics import config_label, find, summarize
from harness.reporting.render import markdown
from harness.runtime.models import load_model, stop_ids
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.eagle3.head import EagleConfig, EagleHead
from methods.eagle3.method import EAGLE3, EagleParams
from methods.pipeline.ppsd import PPSD
from methods.pipeline.spd import SPD
from methods.pipeline.speculator import Speculator, SpeculatorConfig
from methods.sampling import Sampler, SamplingConfig
from methods.ssd.method import SSD, SSDParams

TOKENS = 8


def _run(tiny_dir, data_dir, out, *extra):
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--dataset", "mt_bench", "--limit", "2",
                                       "--max-new-tokens", str(TOKENS), "--data-dir", str(data_dir), "--out",
                                       str(out), *extra])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()], result


def _second_prompt(tokenizer, sample, first_answer: list[int]) -> list[int]:
    return render_conversation(tokenizer, sample.turns("all"), [tokenizer.decode(first_answer,
                                                                                skip_special_tokens=True)])


def test_a_two_turn_conversation_decoded_by_ar_equals_hf_generate(tiny_dir, eval_dir, tmp_path, cache):
    rows, _ = _run(tiny_dir, eval_dir, tmp_path / "r.jsonl", "--turns", "all")
    assert [(r["question_id"], r["turn"], r["turns"]) for r in rows] == [(81, 1, "all"), (81, 2, "all"),
                                                                          (82, 1, "all"), (82, 2, "all")]
    loaded = load_model(str(tiny_dir), "cpu", "float32")
    stops = sorted(stop_ids(loaded))
    for sample, (first, second) in zip(load_samples("mt_bench", eval_dir, 2), zip(rows[::2], rows[1::2])):
        prompt = _second_prompt(loaded.tokenizer, sample, first["output_ids"])
        assert second["prompt_tokens"] == len(prompt) > first["prompt_tokens"] + 4  # the history is in it
        hf = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                                   eos_token_id=stops, pad_token_id=stops[0])[0, len(prompt):].tolist()
        assert second["output_ids"] == hf
        assert second["lossless"]["checked"] and second["lossless"]["identical"]


def test_every_turn_is_a_record_and_a_resume_keeps_the_history(tiny_dir, eval_dir, tmp_path, cache):
    out = tmp_path / "r.jsonl"
    rows, _ = _run(tiny_dir, eval_dir, out, "--turns", "all", "--method", "lookup")
    assert all(r["lossless"]["identical"] for r in rows) and [r["turn"] for r in rows] == [1, 2, 1, 2]
    first_only, _ = _run(tiny_dir, eval_dir, tmp_path / "first.jsonl", "--method", "lookup")
    assert [(r["turn"], r["turns"]) for r in first_only] == [(1, "first"), (1, "first")]
    assert first_only[0]["config_key"] != rows[0]["config_key"]  # the protocols never share a configuration
    assert first_only[0]["output_ids"] == rows[0]["output_ids"]  # the first turn is the same prompt
    # A run killed after the first question's first turn resumes with its second turn, on the recorded answer.
    out.write_text(json.dumps(rows[0]) + "\n")
    resumed, _ = _run(tiny_dir, eval_dir, out, "--turns", "all", "--method", "lookup")
    assert [(r["question_id"], r["turn"]) for r in resumed] == [(81, 1), (81, 2), (82, 1), (82, 2)]
    assert [r["output_ids"] for r in resumed] == [r["output_ids"] for r in rows]
    assert [r["prompt_tokens"] for r in resumed] == [r["prompt_tokens"] for r in rows]


def test_a_set_with_one_turn_runs_it_under_all_and_says_so_once(tiny_dir, tmp_path, cache):
    data = tmp_path / "data"
    data.mkdir()
    (data / "mt_bench.jsonl").write_text("".join(json.dumps({"question_id": i, "category": "writing",
                                                             "turns": [f"Say {i} things."]}) + "\n"
                                                 for i in (1, 2)))
    rows, result = _run(tiny_dir, data, tmp_path / "r.jsonl", "--turns", "all")
    assert [r["turn"] for r in rows] == [1, 1]
    said = [line for line in result.stderr.splitlines() if "have one user turn" in line]
    assert len(said) == 1 and "2 mt_bench question(s)" in said[0], result.stderr


def test_the_turns_option_is_checked(tiny_dir, eval_dir, tmp_path, cache):
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--turns", "both"])
    assert result.exit_code == 2 and "'both' is not one of 'first', 'all'" in result.output


def _method(name: str, target: TargetRuntime, stops: set[int]):
    """Each method with a random drafter (seeded), so the target's verification decides every token."""
    torch.manual_seed(0)
    layers = target.num_layers
    if name == "eagle3":
        return EAGLE3(target, EagleParams(m=3, width=4, ttt=3), stops,
                      head=EagleHead(EagleConfig(ttt=3, num_layers=layers), target).eval())
    if name in ("spd", "ppsd"):
        cls = SPD if name == "spd" else PPSD
        speculator = Speculator(SpeculatorConfig(n=2, ls=1, num_layers=layers), target).eval()
        return cls(target, cls.Params(n=2, ls=1), stops, speculator=speculator)
    if name == "ssd":
        return SSD(target, SSDParams(ttt=3), stops, head=EagleHead(EagleConfig(ttt=3, num_layers=layers), target))
    return build_method(name, target, {}, stops)


@pytest.mark.parametrize("name", ["lookup", "eagle3", "spd", "ppsd", "ssd"])
def test_every_method_is_lossless_on_the_second_turn(name, tiny_dir, eval_dir):
    loaded = load_model(str(tiny_dir), "cpu", "float32")
    stops = stop_ids(loaded)
    target = TargetRuntime(loaded.model, max_len=1024)
    ar = build_method("autoregressive", target, {}, stops)
    method = _method(name, target, stops)
    greedy = Sampler(SamplingConfig())
    for sample in load_samples("mt_bench", eval_dir, 2):
        first = render_conversation(loaded.tokenizer, [sample.prompt], [])
        answer = ar.generate(first, 16, greedy).output_ids
        assert method.generate(first, 16, greedy).output_ids == answer
        second = _second_prompt(loaded.tokenizer, sample, answer)
        assert method.generate(second, 16, greedy).output_ids == ar.generate(second, 16, greedy).output_ids


def test_the_report_shows_each_turn_apart_and_never_pools_the_protocols(tiny_dir, eval_dir, tmp_path, cache):
    both, _ = _run(tiny_dir, eval_dir, tmp_path / "both.jsonl", "--turns", "all", "--method", "lookup")
    first, _ = _run(tiny_dir, eval_dir, tmp_path / "first.jsonl", "--method", "lookup")
    summaries = summarize(both + first)
    labels = {(config_label(s), s.dataset, s.samples) for s in summaries}
    assert {("lookup k=10 max_ngram=3 min_ngram=1 (8 tokens) [all turns]", "mt_bench", 4),
            ("lookup k=10 max_ngram=3 min_ngram=1 (8 tokens) [all turns]", "mt_bench turn 1", 2),
            ("lookup k=10 max_ngram=3 min_ngram=1 (8 tokens) [all turns]", "mt_bench turn 2", 2),
            ("lookup k=10 max_ngram=3 min_ngram=1 (8 tokens)", "mt_bench", 2)} <= labels
    assert find(summaries, "lookup", {}, 0.0, "mt_bench").turns == "first"  # the paper's protocol by default
    assert find(summaries, "lookup", {}, 0.0, "mt_bench", turns="all").samples == 4
    text = markdown(summaries)
    table = text[text.index("## MT-Bench by turn"):].split("\n## ")[0]
    assert [line.split("|")[3].strip() for line in table.splitlines() if "[all turns]" in line] == [
        "turn 1", "turn 2", "both"]


def test_the_spec_bench_export_holds_both_turns_in_order(tiny_dir, eval_dir, tmp_path, cache):
    rows, _ = _run(tiny_dir, eval_dir, tmp_path / "r.jsonl", "--turns", "all", "--method", "lookup")
    files, _ = export(list(reversed(rows)), "spec-bench", tmp_path / "answers")
    answers = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [a["question_id"] for a in answers] == [81, 82]
    for answer, (first, second) in zip(answers, zip(rows[::2], rows[1::2])):
        choice = answer["choices"][0]
        assert choice["turns"] == [first["output_text"], second["output_text"]]
        assert choice["new_tokens"] == [first["new_tokens"], second["new_tokens"]]
        assert choice["accept_lengths"] == first["accepted"] + second["accepted"]
        assert len(choice["wall_time"]) == len(choice["decoding_steps"]) == 2


def test_a_sweep_plan_passes_the_protocol_on_to_a_file_of_its_own(tiny_dir, cache):
    plan = CliRunner().invoke(main, ["sweep", "--method", "lookup", "--model", str(tiny_dir), "--dataset",
                                     "mt_bench", "--turns", "all", "--plan"])
    assert plan.exit_code == 0, plan.output
    assert "--turns all" in plan.output and "-turns-all.jsonl" in plan.output


def test_a_baseline_keeps_the_protocol_and_check_takes_one_protocol_at_a_time(tiny_dir, eval_dir, tmp_path, cache):
    results = tmp_path / "results"
    _run(tiny_dir, eval_dir, results / "both.jsonl", "--turns", "all", "--method", "lookup")
    _run(tiny_dir, eval_dir, results / "first.jsonl", "--method", "lookup")
    baseline = tmp_path / "b.json"
    written = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results), "--write"])
    assert written.exit_code == 0, written.output
    specs = [entry["run"] for entry in json.loads(baseline.read_text())]
    assert sorted(spec.get("turns", "first") for spec in specs) == ["all", "first"]  # first-turn specs as before
    checked = CliRunner().invoke(main, ["check", "--baseline", str(baseline), "--results", str(results), "--turns",
                                        "all"])
    assert checked.exit_code == 0, checked.output
    labels = [line for line in checked.output.splitlines() if "lookup" in line]
    assert labels and all("[all turns]" in line for line in labels), checked.output
    only_first = tmp_path / "first.json"
    CliRunner().invoke(main, ["check", "--baseline", str(only_first), "--results", str(results), "--write",
                              "--turns", "first"])
    assert [e["run"].get("turns", "first") for e in json.loads(only_first.read_text())] == ["first"]
    refused = CliRunner().invoke(main, ["check", "--baseline", str(only_first), "--results", str(results),
                                        "--turns", "all"])
    assert refused.exit_code == 2 and "holds no configuration of --turns all" in refused.stderr
