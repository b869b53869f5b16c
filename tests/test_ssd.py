"""SSD on tiny models: token-identical to greedy AR at T=0 through cache hits, misses and both fallbacks; the target
distribution at T=1 with and without Saguaro sampling; the replay equal to execution at T=0; the drafter in a rank of
its own (gloo) drafting exactly what one process drafts, and sampling losslessly."""

import pytest
import torch
from tiny_models import flat_target, sampled_joint_tv, tiny_model

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.base import Timer, build_method, parse_params
from methods.eagle3.head import EagleConfig, EagleHead
from methods.eagle3.method import EAGLE3, EagleParams
from methods.rounds import target_prefill
from methods.sampling import Sampler, SamplingConfig
from methods.ssd.method import SSD, SSDParams
from methods.ssd.speculate import saguaro

GREEDY = SamplingConfig()


def _ssd(model, max_len=512, **params):
    target = TargetRuntime(model, max_len=max_len)
    head = EagleHead(EagleConfig(ttt=3, num_layers=model.config.num_hidden_layers), target).eval()
    return target, SSD(target, SSDParams(ttt=3, **params), set(), head=head)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
@pytest.mark.parametrize("fallback", ["jit", "none"])
@pytest.mark.parametrize("hit_rate", [0.0, 0.7, 1.0])
def test_greedy_output_is_token_identical_to_ar_through_hits_misses_and_fallbacks(arch, fallback, hit_rate):
    model = tiny_model(arch)
    target, method = _ssd(model, k=3, fan_out=2, fallback=fallback, saguaro_x=0.5)
    ar = build_method("autoregressive", target, {}, set())
    hits = misses = 0
    for prompt in ([7], [3, 4], list(range(10, 19))):
        reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
        oracle = method.with_oracle({len(prompt) + i: t for i, t in enumerate(reference)}, hit_rate)
        generation = oracle.generate(prompt, 24, Sampler(GREEDY))
        assert generation.output_ids == reference
        assert sum(generation.accepted) == len(reference) - 1 and generation.steps == len(generation.stats.hits)
        stats = generation.stats
        assert stats.cache_hits == sum(stats.hits) and stats.hits[0] == 0  # nothing cached before round 1
        hits += stats.cache_hits
        misses += generation.steps - stats.cache_hits
        assert stats.fallback_drafts == (0 if fallback == "none" else generation.steps - stats.cache_hits)
        if hit_rate == 1.0:  # every draft and every guess right: all k accepted, and every later round a hit
            assert stats.cache_hits == generation.steps - 1
            assert generation.accepted[0] == (1 if fallback == "none" else 4)  # "none" verifies no drafts first
            assert all(count == 4 for count in generation.accepted[1:-1])
    if hit_rate == 0.7:
        assert hits > 0 and misses > 0


def test_a_cache_hit_skips_drafting_and_counts_in_the_modeled_time():
    model = tiny_model("llama")
    target, method = _ssd(model, k=3, fan_out=2)
    reference = build_method("autoregressive", target, {}, set()).generate([5, 6], 20, Sampler(GREEDY)).output_ids
    oracle = method.with_oracle({2 + i: t for i, t in enumerate(reference)}, 1.0)
    generation = oracle.generate([5, 6], 20, Sampler(GREEDY))
    timing = generation.timing
    assert generation.stats.fallback_drafts == 1  # the first round only
    assert 0 < timing["modeled"] < timing["decode"]  # drafting hidden behind verification, not added to it
    assert timing["modeled"] >= timing["verify"] + timing["head_update"]


def test_the_replay_equals_execution_at_t0_and_refuses_t1():
    model = tiny_model("llama")
    target, method = _ssd(model, k=3, fan_out=2)
    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], list(range(10, 19))):
        reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
        oracle = method.with_oracle({len(prompt) + i: t for i, t in enumerate(reference)}, 0.7)
        executed = oracle.generate(prompt, 24, Sampler(GREEDY))
        oracle.speculation.rng.manual_seed(0)
        simulated = oracle.simulate(prompt, reference, 24, Sampler(GREEDY))
        assert (simulated.output_ids, simulated.accepted) == (executed.output_ids, executed.accepted)
        assert simulated.stats.hits == executed.stats.hits
    with pytest.raises(HarnessError, match="only at T=0"):
        method.simulate([7], reference, 24, Sampler(SamplingConfig(temperature=1.0)))


@pytest.mark.parametrize("x, fallback", [(1.0, "jit"), (0.3, "jit"), (0.3, "none")])
def test_sampled_tokens_follow_the_target_distribution(x, fallback):
    """T=1, with and without Saguaro sampling: tokens 1 and 2 come from round one or, through the cache, round two."""
    vocab = 4
    model = flat_target(vocab)
    _, method = _ssd(model, k=2, fan_out=2, saguaro_x=x, fallback=fallback)
    with torch.no_grad():  # a head far from the target, so a wrong rule would show
        method.drafter.head.head.weight.copy_(torch.randn(vocab, 64, generator=torch.Generator().manual_seed(0)))
    assert sampled_joint_tv(method, model, vocab) < 0.07


def test_saguaro_scales_the_top_probabilities_and_stays_a_distribution():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]])
    scaled = saguaro(probs, 0.5, fan_out=1)  # the top 2 scaled by 0.5
    expected = torch.tensor([[0.25, 0.15, 0.1, 0.06, 0.04]]) / 0.6
    assert torch.allclose(scaled, expected) and saguaro(probs, 1.0, 3) is probs


def test_parameters_are_checked_and_numbers_parse_from_words():
    assert parse_params(SSD, {"k": 2, "saguaro_x": "0.5", "fan_out_list": "3,2,1"}).saguaro_x == 0.5
    assert SSDParams(k=2, fan_out_list="3,2,1").fan_outs == [3, 2, 1]
    for bad, message in [({"k": 2, "fan_out_list": "3,2"}, "k \\+ 1 = 3"), ({"fallback": "draft"}, "fallback"),
                         ({"saguaro_x": 0.0}, "saguaro_x"), ({"k": 8, "fan_out": 8}, "rows per round")]:
        with pytest.raises(ValueError, match=message):
            SSDParams(**bad)
    with pytest.raises(ValueError, match="wants a number"):
        parse_params(SSD, {"saguaro_x": "fast"})


def test_the_report_gives_ssd_its_own_table():
    from harness.reporting.metrics import OVERALL, summarize
    from harness.reporting.report import family_tables

    row = {"config_key": "ssd", "method": "ssd", "params": {"k": 3}, "model": {"name": "m"}, "simulated": False,
           "temperature": 0.0, "dataset": "gsm8k", "question_id": 0, "new_tokens": 11, "steps": 5,
           "accepted": [4, 1, 2, 2, 1], "position_accepts": [3, 1, 1],
           "timing": {"decode": 2.0, "modeled": 1.0, "verify": 0.8, "synchronous_decode": 4.0},
           "lossless": {"checked": True, "identical": True},
           "baseline": {"new_tokens": 11, "timing": {"decode": 2.0}},
           "stats": {"hits": [0, 1, 1, 0, 1], "cache_hits": 3, "fallback_drafts": 2, "synchronous_tokens": 11,
                     "synchronous_samples": 1, "draft": {"num_layers": 30, "ls": 1, "m": 3, "width": 1}}}
    older = {**row, "config_key": "older", "params": {"k": 2}, "timing": {"decode": 2.0},
             "stats": {k: v for k, v in row["stats"].items() if not k.startswith("synchronous")}}
    overall = [s for s in summarize([row, older]) if s.dataset == OVERALL]
    (table,) = family_tables(overall)
    assert table.title == "ssd figures" and table.header[3:] == ["cache hit rate", "tokens/forward", "theoretical x",
                                                                 "modeled x", "wall-clock x", "vs synchronous x",
                                                                 "engine"]
    # 3 hits in the 4 rounds that could hit; tau = 10 / 5; 2 of 5 rounds drafted 3 tokens: 2 * 30 / (30 + 0.4 * 3);
    # 10 tokens in 2 s against the synchronous run's 10 in 4 s
    rows = {r[0]: [cell.split(" [")[0] for cell in r[3:-1]] for r in table.rows}  # the figures, not their intervals
    assert rows["ssd k=3"] == ["0.75", "2.00", f"{60 / 31.2:.2f}", "2.00", "1.00", "2.00"]
    assert rows["ssd k=2"][-1] == "—"  # a record from before the synchronous run was timed beside SSD


def test_synchronous_decoding_is_timed_beside_ssd_from_the_same_seed():
    """After SSD's rounds, plain draft-then-verify rounds with the same drafter and k (no cache, no Saguaro) run from
    the sample's seed; at T=0 they are EAGLE-3's chain rounds with m = k, draft for draft."""
    model = tiny_model("llama")
    target, method = _ssd(model, k=3, fan_out=2, saguaro_x=0.5)
    seeds = []
    time_synchronous = method._time_synchronous

    def spied(generation, prompt, max_new_tokens, sampler):
        seeds.append(sampler.generator.get_state())
        return time_synchronous(generation, prompt, max_new_tokens, sampler)

    method._time_synchronous = spied
    sampled = Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(3))
    generation = method.generate([5, 6], 20, sampled)
    assert len(seeds) == 1 and torch.equal(seeds[0], torch.Generator().manual_seed(3).get_state())
    assert generation.stats.synchronous_samples == 1 and generation.stats.synchronous_tokens == 20
    assert generation.timing["synchronous_decode"] > 0
    alone = SSD(target, method.params, set(), head=method.drafter.head)  # SSD's tokens do not depend on the extra run
    assert alone.generate([5, 6], 20, Sampler(SamplingConfig(temperature=1.0), torch.Generator().manual_seed(3))
                          ).output_ids == generation.output_ids

    eagle = EAGLE3(target, EagleParams(m=3, ttt=3), set(), head=method.drafter.head)
    timer = Timer(target.device)
    first, captured = target_prefill(target, eagle.layers, [5, 6], Sampler(GREEDY), timer)
    synchronous = method.synchronous_rounds([5, 6], first, captured, 20, Sampler(GREEDY), timer)
    chain = eagle.generate([5, 6], 20, Sampler(GREEDY))
    assert (synchronous.output_ids, synchronous.accepted) == (chain.output_ids, chain.accepted)


# --- a standalone draft model (--draft-model) -------------------------------------------------------------------------
def _saved(model, folder):
    model.save_pretrained(folder)  # before any runtime stores its weights column-major
    return str(folder)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_a_draft_model_drafts_losslessly_and_the_target_drafting_for_itself_hits_every_round(tmp_path, arch):
    model = tiny_model(arch)
    other = _saved(tiny_model(arch, num_layers=4, seed=1), tmp_path / "other")
    itself = _saved(model, tmp_path / "itself")
    target = TargetRuntime(model, max_len=512)
    ar = build_method("autoregressive", target, {}, set())
    drafted = SSD(target, SSDParams(k=3, fan_out=2, draft_model=other), set())
    assert SSD.drafter(drafted.params) is None and drafted.drafter.layers == ()  # no trained drafter, no features
    assert drafted.shape().ls == pytest.approx(4, rel=0.3)  # 4 layers shaped like the target's 6
    for prompt in ([7], list(range(10, 19))):
        reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
        executed = drafted.generate(prompt, 24, Sampler(GREEDY))
        assert executed.output_ids == reference
        replayed = drafted.simulate(prompt, reference, 24, Sampler(GREEDY))
        assert (replayed.accepted, replayed.stats.hits) == (executed.accepted, executed.stats.hits)
    # The target as its own draft model: every draft is accepted and every bonus token was guessed.
    perfect = SSD(target, SSDParams(k=3, fan_out=2, draft_model=itself), set())
    reference = ar.generate([7], 24, Sampler(GREEDY)).output_ids
    generation = perfect.generate([7], 24, Sampler(GREEDY))
    assert generation.output_ids == reference
    assert generation.stats.cache_hits == generation.steps - 1 and generation.stats.fallback_drafts == 1
    assert all(count == 4 for count in generation.accepted[:-1]) and perfect.shape().ls == 6


def test_a_draft_model_samples_the_target_distribution(tmp_path):
    vocab = 4
    model = flat_target(vocab)
    draft = tiny_model("llama", num_layers=2, vocab_size=vocab, seed=5)  # far from the target
    target = TargetRuntime(model, max_len=64)
    folder = _saved(draft, tmp_path / "draft")
    method = SSD(target, SSDParams(k=2, fan_out=2, saguaro_x=0.3, draft_model=folder), set())
    assert sampled_joint_tv(method, model, vocab) < 0.07


def test_a_draft_model_must_share_the_target_vocabulary(tmp_path):
    folder = _saved(tiny_model("llama", vocab_size=128), tmp_path / "draft")
    with pytest.raises(HarnessError, match="128 token ids, the target 256; pass a --draft-model with the target's"):
        SSD(TargetRuntime(tiny_model("llama"), max_len=64), SSDParams(draft_model=folder), set())


# --- the drafter in a rank of its own (--executor distributed) -------------------------------------------------------
def _saved_ssd(tmp_path, model, **params):
    """A tiny target saved as an HF folder and a random EAGLE-3 head saved as its checkpoint, loaded as SSD."""
    from harness.runtime import checkpoints
    from harness.runtime.models import load_model

    folder = tmp_path / "target"
    model.save_pretrained(folder)
    loaded = load_model(str(folder), "cpu", "float32", tokenizer=False)
    target = TargetRuntime(loaded.model, max_len=256, identity=loaded.identity)
    config = EagleConfig(ttt=3, num_layers=target.num_layers, target=loaded.identity.to_dict())
    torch.manual_seed(2)
    head = EagleHead(config, target).eval()
    with torch.no_grad():  # far from the target, so a wrong verification rule would show at T=1
        head.head.weight.copy_(torch.randn(head.head.weight.shape, generator=torch.Generator().manual_seed(0)))
    checkpoint = tmp_path / "head"
    checkpoints.save(checkpoint, head, {"eagle": config.to_dict(), "target": config.target, "method": "eagle3"})
    return str(folder), target, SSD(target, SSDParams(ttt=3, **params), set(), checkpoint=str(checkpoint))


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_drafter_in_its_own_rank_drafts_what_one_process_drafts(tmp_path, arch):
    """T=0: the drafter's rank (gloo, a spawned process) gives AR's tokens and exactly the one-process run's rounds,
    cache hits and fallbacks, with the cache drafted while the driver verifies."""
    from harness.runtime import distributed as launch

    folder, target, method = _saved_ssd(tmp_path, tiny_model(arch), k=3, fan_out=2, saguaro_x=0.5)
    prompt = list(range(10, 19))
    reference = build_method("autoregressive", target, {}, set()).generate(prompt, 24, Sampler(GREEDY)).output_ids
    by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
    local = method.with_oracle(by_position, 0.7).generate(prompt, 24, Sampler(GREEDY))
    remote = method.with_oracle(by_position, 0.7)
    with launch.stage_group(folder, "cpu", ["cpu"], timeout_s=120) as group:
        executor = remote.distribute(group, "float32")
        generation = remote.generate(prompt, 24, Sampler(GREEDY))
        executor.close()
    assert generation.output_ids == reference
    assert generation.accepted == local.accepted and generation.stats.hits == local.stats.hits
    assert 0 < generation.stats.cache_hits < generation.steps - 1  # hits and misses both crossed the wire
    for name in ("fallback_drafts", "speculated", "cache_hits"):
        assert getattr(generation.stats, name) == getattr(local.stats, name)
    timing = generation.timing
    assert timing["wait"] > 0 and timing["drafter_speculate"] > 0
    # modeled from each round's times on both ranks: at least the verification, at most everything in turn
    drafted = sum(timing[f"drafter_{name}"] for name in ("speculate", "head_update", "fallback"))
    assert timing["verify"] <= timing["modeled"] <= timing["verify"] + drafted
    assert generation.stats.executor.kind == "distributed" and generation.stats.executor.world_size == 2


def test_a_draft_model_in_its_own_rank_drafts_what_one_process_drafts(tmp_path):
    """The draft model reads no target features, so none cross the wire; rounds and hits equal one process's."""
    from harness.runtime import distributed as launch
    from harness.runtime.models import load_model

    folder = _saved(tiny_model("qwen3_5"), tmp_path / "target")
    draft = _saved(tiny_model("qwen3_5", num_layers=4, seed=1), tmp_path / "draft")
    loaded = load_model(folder, "cpu", "float32", tokenizer=False)
    target = TargetRuntime(loaded.model, max_len=256, identity=loaded.identity)
    method = SSD(target, SSDParams(k=3, fan_out=3, draft_model=draft), set())
    prompt = list(range(10, 19))
    local = method.generate(prompt, 24, Sampler(GREEDY))
    with launch.stage_group(folder, "cpu", ["cpu"], timeout_s=120) as group:
        executor = method.distribute(group, "float32")
        generation = method.generate(prompt, 24, Sampler(GREEDY))
        executor.close()
    assert generation.output_ids == local.output_ids
    assert generation.accepted == local.accepted and generation.stats.hits == local.stats.hits


def test_the_drafter_in_its_own_rank_samples_the_target_distribution(tmp_path):
    """T=1 with Saguaro sampling and the none fallback: drafts and their distributions cross ranks, the joint of
    tokens 1 and 2 is the target's."""
    from harness.runtime import distributed as launch

    vocab = 4
    model = flat_target(vocab)
    folder, _, method = _saved_ssd(tmp_path, model, k=2, fan_out=2, saguaro_x=0.3, fallback="none")
    with launch.stage_group(folder, "cpu", ["cpu"], timeout_s=120) as group:
        executor = method.distribute(group, "float32")
        assert sampled_joint_tv(method, model, vocab, runs=1000) < 0.08
        executor.close()


def test_only_families_that_serve_ranks_run_distributed(tiny_dir, eval_dir, tmp_path, monkeypatch):  # noqa: F811
    from click.testing import CliRunner

    from harness.cli import main

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    refused = CliRunner().invoke(main, ["run", "--method", "autoregressive", "--executor", "distributed",
                                        "--model", str(tiny_dir), "--data-dir", str(eval_dir)])
    assert refused.exit_code == 2 and "runs ppsd, spd, ssd, not autoregressive" in refused.output
    two = CliRunner().invoke(main, ["run", "--method", "ssd", "--executor", "distributed", "--devices", "cpu,cpu",
                                    "--model", str(tiny_dir), "--data-dir", str(eval_dir)])
    assert two.exit_code == 2 and "ssd's drafter takes one" in two.output


def test_run_drafts_with_a_draft_model_from_the_command_line(tiny_dir, eval_dir, tmp_path, monkeypatch):  # noqa: F811
    import json

    from click.testing import CliRunner

    from harness.cli import main

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ssd.jsonl"
    result = CliRunner().invoke(main, ["run", "--method", "ssd", "--k", "2", "--draft-model", str(tiny_dir),
                                       "--model", str(tiny_dir), "--data-dir", str(eval_dir), "--limit", "1",
                                       "--max-new-tokens", "12", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows and all(row["params"]["draft_model"] == str(tiny_dir) and row["lossless"]["identical"]
                        for row in rows)
    # the target drafting for itself: every round after the first found its drafts in the cache
    assert all(row["stats"]["cache_hits"] == row["steps"] - 1 and row["stats"]["synchronous_samples"] == 1
               for row in rows)


def test_ssd_finds_the_eagle3_head_it_drafts_with(cache):
    """SSD drafts with EAGLE-3's head, so it looks where EAGLE-3 files it (here the shipped one): a sweep does not
    call it missing, and SSD's records are keyed by the head's weights as EAGLE-3's are."""
    from harness.bench.config import RunConfig, drafter_fingerprint
    from harness.bench.sweep import missing_drafter
    from harness.runtime.models import ModelIdentity

    identity = ModelIdentity("smollm2-135m", "0" * 64)
    ssd, eagle = RunConfig(method="ssd"), RunConfig(method="eagle3")
    assert missing_drafter(ssd, identity) is None
    assert drafter_fingerprint(ssd, identity) == drafter_fingerprint(eagle, identity) is not None
    assert drafter_fingerprint(RunConfig(method="ssd", params={"draft_model": "x"}), identity) is None
