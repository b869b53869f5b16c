"""Prompt lookup decoding on tiny models: the n-gram search drafts what followed the latest earlier match, the
output is token-identical to greedy AR at T=0 (with rounds that accept copied drafts), the target's distribution
at T=1, and the trajectory replay equals execution."""

import json

import pytest
from click.testing import CliRunner
from tiny_models import flat_target, sampled_joint_tv, tiny_model

from harness.cli import main
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.lookup.length import DraftLength, expected_tokens
from methods.lookup.method import LookupParams, PromptLookup, lookup
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()


def test_the_search_prefers_the_longest_suffix_then_the_latest_match():
    tokens = [1, 2, 3, 4, 9, 3, 5, 2, 3]
    assert lookup(tokens, 3, 3, 1) == [4, 9, 3]  # [2, 3] matched at the start (the last token alone is later)
    assert lookup(tokens, 3, 1, 1) == [5, 2, 3]  # [3] alone: its latest earlier occurrence
    assert lookup(tokens, 1, 3, 1) == [4]  # capped at k
    assert lookup([5, 6, 7], 4, 3, 1) == []  # nothing repeats
    assert lookup([7, 7], 4, 3, 2) == []  # the suffix itself is not a match


def test_a_round_offers_the_drafts_whose_expected_tokens_per_cost_are_highest():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 2) == 1.75
    # a two-token forward at 1.37x a step pays when a draft is kept more often than 37% of the time
    costs = [1.0, 1.37, 1.45, 1.5, 1.52, 1.6]
    length = DraftLength(costs)
    assert length.rate(2) == 0.5 and length.choose(5, 2) == 4  # the even prior: 1.94 tokens for 1.52x
    assert length.choose(2, 2) == 2  # never more than were found
    for _ in range(10):
        length.record(2, 1, 0)  # one suffix length's drafts keep failing: it stops drafting
        length.record(3, 4, 4)  # another's keep passing: it offers all it may
    assert length.choose(5, 2) == 0 and length.choose(5, 3) == 5
    assert length.tried == {2: 10, 3: 40} and length.accepted == {2: 0, 3: 40}
    length.record(3, 4, 1)  # judged up to the first rejection
    assert length.tried[3] == 42 and length.accepted[3] == 41
    assert DraftLength([1.0, 3.0, 5.0]).choose(2, 1) == 0  # verifying costs more than any draft can earn


def test_the_cost_policy_is_lossless_and_drafts_less_where_drafts_fail():
    model = tiny_model("llama")
    target = TargetRuntime(model, max_len=256)
    costs = target.forward_costs(5)
    assert len(costs) == 5 and costs[0] == 1.0 and costs == sorted(costs)
    assert target.forward_costs(5) is costs  # measured once per target
    ar = build_method("autoregressive", target, {}, set())
    every = build_method("lookup", target, {"k": 4}, set())
    cost = build_method("lookup", target, {"k": 4, "length": "cost"}, set())
    assert cost.costs is costs
    for prompt in ([7], list(range(10, 19)), [3, 4, 5, 6] * 5):
        reference = ar.generate(prompt, 32, Sampler(GREEDY)).output_ids
        assert cost.generate(prompt, 32, Sampler(GREEDY)).output_ids == reference
        assert cost.simulate(prompt, reference, 32, Sampler(GREEDY)).output_ids == reference
    # with verify forwards made dear, no round drafts: every step is a plain one, and the output the same
    target._costs[5] = [1.0, 9.0, 9.0, 9.0, 9.0]
    dear = build_method("lookup", target, {"k": 4, "length": "cost"}, set())
    generation = dear.generate([3, 4, 5, 6] * 5, 32, Sampler(GREEDY))
    assert generation.output_ids == every.generate([3, 4, 5, 6] * 5, 32, Sampler(GREEDY)).output_ids
    assert generation.stats.candidates == 0 and generation.stats.matched_rounds > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_cost_policy_samples_the_target_distribution(arch):
    vocab = 4
    model = flat_target(vocab, arch)
    method = PromptLookup(TargetRuntime(model, max_len=64), LookupParams(k=2, length="cost"), set())
    method.costs = [1.0, 1.0, 1.0]  # drafting is free: every round drafts what it found
    assert sampled_joint_tv(method, model, vocab, prompt=(1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)) < 0.07


def test_parameters_that_cannot_search_are_refused():
    with pytest.raises(ValueError, match="max_ngram >= min_ngram"):
        LookupParams(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_greedy_output_is_token_identical_to_ar_and_copies_repeated_text(arch):
    model = tiny_model(arch)
    target = TargetRuntime(model, max_len=256)
    ar = build_method("autoregressive", target, {}, set())
    method = build_method("lookup", target, {"k": 4}, set())
    for prompt in ([7], list(range(10, 19)), [3, 4, 5, 6] * 5):
        reference = ar.generate(prompt, 32, Sampler(GREEDY)).output_ids
        generation = method.generate(prompt, 32, Sampler(GREEDY))
        assert generation.output_ids == reference
        assert sum(generation.accepted) == len(reference) - 1
    # A tiny random model falls into loops; their repeats are drafted and accepted, several tokens per forward.
    assert generation.steps < len(reference) - 1 and generation.position_accepts[0] > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_sampled_tokens_follow_the_target_distribution(arch):
    vocab = 4
    model = flat_target(vocab, arch)
    method = PromptLookup(TargetRuntime(model, max_len=64), LookupParams(k=2), set())
    # A prompt whose every suffix repeats: every round drafts, so a wrong acceptance rule would show.
    assert sampled_joint_tv(method, model, vocab, prompt=(1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)) < 0.07


def test_the_replay_equals_execution_at_t0():
    model = tiny_model("llama")
    target = TargetRuntime(model, max_len=256)
    method = build_method("lookup", target, {"k": 3}, set())
    for prompt in ([7], [3, 4, 5, 6] * 4):
        executed = method.generate(prompt, 24, Sampler(GREEDY))
        replayed = method.simulate(prompt, executed.output_ids, 24, Sampler(GREEDY))
        assert replayed.output_ids == executed.output_ids
        assert replayed.accepted == executed.accepted
        assert replayed.position_accepts == executed.position_accepts


def test_bench_peer_runs_hf_prompt_lookup_beside_ours_on_the_same_prompts_and_checks_them(tiny_dir, tmp_path, cache):
    out = tmp_path / "peer.jsonl"
    result = CliRunner().invoke(main, ["bench", "peer", "--method", "lookup", "--model", str(tiny_dir), "--dataset",
                                       "gsm8k,humaneval",
                                       "--prompts", "2", "--max-new-tokens", "12", "--param", "k=4",
                                       "--param", "length=cost", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["identical"] and record["params"]["length"] == "cost"
    assert record["hf_peer"] == {"prompt_lookup_num_tokens": 4}
    assert record["prompts"] == ["gsm8k/0", "gsm8k/1", "humaneval/0", "humaneval/1"]
    assert {side: len(s) for side, s in record["seconds"].items()} == dict.fromkeys(
        ["hf-greedy", "hf-peer", "reference", "method"], 4)
    assert len(record["steps"]["method"]) == 4 and sum(record["tokens"]) > 0
    assert "harness lookup over HF generate, prompt_lookup_num_tokens=4:" in result.output
    assert "[2 prompts: too few]" in result.output
    refused = CliRunner().invoke(main, ["bench", "peer", "--method", "lookup", "--model", str(tiny_dir), "--dataset",
                                        "gsm8k,nope"])
    assert refused.exit_code == 2 and "unknown dataset(s) 'nope'" in refused.output
    refused = CliRunner().invoke(main, ["bench", "peer", "--method", "eagle3", "--model", str(tiny_dir)])
    assert refused.exit_code != 0 and "HF generate implements no 'eagle3'; bench peer takes lookup" in refused.output
