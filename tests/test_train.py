"""Training on the real corpus with a tiny target: checkpoints round-trip, resume, and feed `spd-bench run`."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from harness.cli import main
from harness.runtime import checkpoints
from harness.training.corpus import conversations, encode


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)  # the train record goes to ./results


def test_sharegpt_is_decoded_record_by_record_and_masks_assistant_tokens(smollm2_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    first = next(conversations())
    assert first[0]["role"] == "user" and first[1]["role"] == "assistant"
    example = encode(tokenizer, first, max_tokens=400)
    reply = tokenizer.decode([t for t, a in zip(example.ids, example.assistant) if a])
    assert reply.startswith(first[1]["content"][:40]) and "<|im_start|>user" not in reply


def test_train_then_resume_then_run_the_trained_drafter(tiny_dir, eval_dir, tmp_path, cache):  # noqa: F811
    train = ["train", "--model", str(tiny_dir), "--n", "2", "--ls", "1", "--seq-len", "32", "--batch-size", "2",
             "--draft-vocab", "512", "--save-every", "2", "--warmup", "0.5"]
    result = CliRunner().invoke(main, train + ["--tokens", "128"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "cache" / "drafters"
    (checkpoint,) = folder.glob("*/spd-n2-ls1-input")
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["train"]["step"] == 2 and saved["train"]["tokens"] == 128
    assert len(saved["train"]["validation"]["top1_by_fill"]) == 2
    decoding = saved["train"]["validation"]["decoding"]  # replayed greedy decoding of held-out prompts
    assert decoding["prompts"] == 8 and len(decoding["drafts_by_fill"]) == 2 and decoding["drafts_by_fill"][0] > 0
    assert 0 <= decoding["acceptance"] <= 1 and decoding["tokens_per_step"] > 0

    again = CliRunner().invoke(main, train + ["--tokens", "128"])
    assert again.exit_code == 2 and "--resume" in again.output
    resumed = CliRunner().invoke(main, train + ["--tokens", "256", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    resumed_train = json.loads((checkpoint / "config.json").read_text())["train"]
    assert resumed_train["step"] == 4
    assert [(c["step"], c["tokens"]) for c in resumed_train["curve"]] == [(2, 128), (4, 256)]  # the learning curve
    record = json.loads((tmp_path / "results" / tiny_dir.name / "train.jsonl").read_text().splitlines()[-1])
    assert record["tokens"] == 256 and "spd-bench train" in record["command"] and "--warmup 0.5" in record["command"]
    assert record["config"]["warmup"] == 0.5

    out = tmp_path / "spd.jsonl"
    run = CliRunner().invoke(main, ["run", "--method", "spd", "--n", "2", "--ls", "1", "--model", str(tiny_dir),
                                    "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "10",
                                    "--data-dir", str(eval_dir), "--out", str(out)])
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["lossless"]["identical"] and r["baseline"]["new_tokens"] == 10 for r in rows)
    assert rows[0]["params"] == {"n": 2, "ls": 1, "schedule": "input", "width": 1}


def test_run_without_a_drafter_names_the_train_command(tiny_dir, eval_dir, tmp_path, cache):  # noqa: F811
    out = tmp_path / "spd.jsonl"
    result = CliRunner().invoke(main, ["run", "--method", "spd", "--n", "3", "--ls", "2", "--model", str(tiny_dir),
                                       "--dataset", "gsm8k", "--limit", "1", "--data-dir", str(eval_dir),
                                       "--out", str(out)])
    assert result.exit_code == 2
    assert "spd-bench train --method spd --n 3 --ls 2 --schedule input" in result.output
    assert not out.exists()


def test_one_teacher_pass_trains_spd_and_eagle3_heads_that_then_decode(tiny_dir, eval_dir, tmp_path, cache):  # noqa: F811
    result = CliRunner().invoke(main, ["train", "--method", "ppsd,eagle3", "--n", "2", "--ttt", "3", "--model",
                                       str(tiny_dir), "--seq-len", "32", "--batch-size", "2", "--draft-vocab", "512",
                                       "--tokens", "128"])
    assert result.exit_code == 0, result.output
    folder = tmp_path / "cache" / "drafters"
    (head,) = folder.glob("*/eagle3-ttt3")
    assert folder.glob("*/ppsd-n2-ls1-output")
    saved = json.loads((head / "config.json").read_text())
    assert saved["eagle"]["ttt"] == 3 and len(saved["train"]["validation"]["top1_by_step"]) == 3
    for width in ("1", "4"):
        out = tmp_path / f"eagle3-{width}.jsonl"
        run = CliRunner().invoke(main, ["run", "--method", "eagle3", "--m", "2", "--width", width, "--param", "ttt=3",
                                        "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "2",
                                        "--max-new-tokens", "10", "--data-dir", str(eval_dir), "--out", str(out)])
        assert run.exit_code == 0, run.output
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert all(r["lossless"]["identical"] for r in rows)
        assert rows[0]["stats"]["draft"] == {"num_layers": 4, "ls": 1, "m": 2, "width": int(width)}
    _sweep_simulates_what_ran(tiny_dir, eval_dir, tmp_path)
    _check_reruns_the_baseline(tiny_dir, eval_dir, tmp_path)


def _check_reruns_the_baseline(tiny_dir, eval_dir, tmp_path):  # noqa: F811
    """`check --rerun` runs a baseline's configurations again (same prompts, seed, lengths) and passes; a
    configuration whose drafter is not in the cache is listed with its train command and fails as missing."""
    baseline = tmp_path / "baseline.json"
    write = ["check", "--baseline", str(baseline), "--results", str(tmp_path / "eagle3-4.jsonl"), "--write"]
    assert CliRunner().invoke(main, write).exit_code == 0
    (entry,) = json.loads(baseline.read_text())
    assert entry["run"]["samples"] == {"gsm8k": [0, 1]} and entry["run"]["params"]["width"] == 4
    rerun = ["check", "--baseline", str(baseline), "--rerun", "--model", str(tiny_dir), "--data-dir", str(eval_dir),
             "--results", str(tmp_path / "rerun"), "--margin", "0"]
    result = CliRunner().invoke(main, rerun)
    assert result.exit_code == 0 and "all configurations pass" in result.output, result.output
    (made,) = (tmp_path / "rerun").glob(f"rerun-*/{tiny_dir.name}/eagle3.jsonl")  # the rerun's own folder
    assert len(made.read_text().splitlines()) == 2
    entry["run"]["params"]["ttt"], entry["label"] = 5, "untrained head"
    baseline.write_text(json.dumps([entry]))
    result = CliRunner().invoke(main, rerun[:-4])  # a fresh temporary folder
    assert result.exit_code == 1 and "no drafter; train it with: spd-bench train --method eagle3" in result.output
    assert "missing" in result.output


def _sweep_simulates_what_ran(tiny_dir, eval_dir, tmp_path):  # noqa: F811
    """A simulated sweep over the drafters just trained: the same accepted counts as the executed runs (T=0),
    resumable, and the point without a drafter listed with its train command (exit 1)."""
    sweep = ["sweep", "--method", "ppsd,eagle3", "--n", "2,3", "--m", "2", "--ttt", "3", "--width", "1,4",
             "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "2", "--max-new-tokens", "10",
             "--data-dir", str(eval_dir), "--results", str(tmp_path / "sweep"), "--simulate"]
    result = CliRunner().invoke(main, sweep)
    assert result.exit_code == 1, result.output
    assert "no drafter; train it with: spd-bench train --method ppsd --n 3 --ls 1 --schedule output" in result.output
    assert "4 of 6 configurations complete (4 ran now)" in result.output
    simulated = [json.loads(line) for f in (tmp_path / "sweep").rglob("eagle3.jsonl") for line in f.open()]
    assert len(simulated) == 4 and all(r["simulated"] and not r["lossless"]["checked"] for r in simulated)
    for width in ("1", "4"):
        executed = [json.loads(line) for line in (tmp_path / f"eagle3-{width}.jsonl").open()]
        replayed = [r for r in simulated if r["params"]["width"] == int(width)]
        assert [r["accepted"] for r in replayed] == [r["accepted"] for r in executed]
    again = CliRunner().invoke(main, sweep)
    assert "(0 ran now)" in again.output
    _sampled_sweep_replays_one_trajectory_per_prompt(sweep, tmp_path)


def _sampled_sweep_replays_one_trajectory_per_prompt(sweep: list[str], tmp_path):
    """At T>0 every configuration of a simulated sweep replays on the same sampled AR output per prompt and seed,
    decoded once and cached beside the greedy references."""
    sampled = [*sweep, "--temperature", "1", "--top-k", "50", "--top-p", "0.95"]
    sampled[sampled.index("--method") + 1], sampled[sampled.index("--width") + 1] = "eagle3", "1"
    sampled[sampled.index("--m") + 1] = "1,2"
    result = CliRunner().invoke(main, sampled)
    assert result.exit_code == 0 and "2 of 2 configurations complete (2 ran now)" in result.output, result.output
    rows = [json.loads(line) for line in (tmp_path / "sweep").rglob("eagle3.jsonl").__next__().open()]
    rows = [r for r in rows if r["temperature"] == 1]
    assert len(rows) == 4 and {(r["top_k"], r["top_p"]) for r in rows} == {(50, 0.95)}
    by_prompt = {}
    for r in rows:
        by_prompt.setdefault(r["question_id"], []).append(r["output_ids"])
    assert all(a == b for a, b in by_prompt.values())
    lines = [line for f in (tmp_path / "cache" / "references").iterdir() for line in f.read_text().splitlines()]
    assert sum("-t1-k50-p0.95-seed" in line for line in lines) == 2  # one per prompt, not per configuration


@pytest.mark.parametrize("kind", ["spd", "eagle3"])
def test_float32_drafters_train_on_a_bfloat16_target(kind):
    """GPU training keeps the target in bf16: the teacher's features reach the float32 drafter as float32."""
    import random

    import torch
    from tiny_models import tiny_model

    from harness.runtime.models import ModelIdentity
    from harness.runtime.target import TargetRuntime
    from harness.training.features import teacher_pass
    from methods.eagle3.objective import EagleSpec
    from methods.pipeline.objective import PipelineSpec

    with torch.inference_mode(False), torch.enable_grad():  # as inside harness.training.train.train
        target = TargetRuntime(tiny_model("qwen3", dtype=torch.bfloat16), max_len=32,
                               identity=ModelIdentity("tiny", "0" * 64))
        spec = PipelineSpec("spd", 2, 1, "input", "multi_depth") if kind == "spd" else EagleSpec(3)
        module = spec.build(target, None).float().train()
        ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            features, _, _ = teacher_pass(target, ids, module.config.all_feature_layers())
        predictions = spec.predictions(module, features, ids, [random.Random(row) for row in range(2)])
        sum(p.logits.logsumexp(-1).mean() for p in predictions).backward()
    assert all(p.logits.dtype == torch.float32 for p in predictions)
    assert all(p.grad is not None for p in module.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", ["spd", "eagle3"])
def test_the_bf16_working_copy_computes_autocasts_gradient(kind, cache):
    """A step runs on a bf16 copy of the drafter (activations stay bf16): its gradient is the one autocast gives on
    the fp32 master weights, to bf16 precision, and the copy takes the updated master weights."""
    import copy
    import random

    import torch
    from tiny_models import tiny_model

    from harness.runtime.models import ModelIdentity
    from harness.runtime.target import TargetRuntime
    from harness.training.features import draft_probabilities, teacher_pass
    from harness.training.train import DrafterTrainer, TrainConfig, _aligned, _cross_entropy
    from methods.eagle3.objective import EagleSpec
    from methods.pipeline.objective import PipelineSpec

    with torch.inference_mode(False), torch.enable_grad():
        target = TargetRuntime(tiny_model("llama"), max_len=32, identity=ModelIdentity("tiny", "0" * 64))
        spec = PipelineSpec("spd", 4, 2, "input", "multi_depth", init="identity") if kind == "spd" else EagleSpec(3)
        config = TrainConfig(drafters=[spec], lr=1e-3)
        trainer = DrafterTrainer(spec, config, target, None)
        for p in trainer.module.parameters():  # away from the identity start, so every layer has a gradient
            p.data.add_(torch.randn_like(p), alpha=0.02)
        trainer._sync()
        reference = copy.deepcopy(trainer.module)
        ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids, dtype=torch.bool)
        with torch.no_grad():
            features, final, lse = teacher_pass(target, ids, reference.config.all_feature_layers())
            p_draft = draft_probabilities(target, final, lse, None)
        trainer.train_step(features, ids, p_draft, mask, [random.Random(row) for row in range(2)])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            predictions = spec.predictions(reference, features, ids, [random.Random(row) for row in range(2)])
        sum(p.weight * _cross_entropy(p, p_draft, mask, _aligned(p, p_draft, mask)[1].sum())
            for p in predictions).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), config.clip)
    pairs = [(ours.grad, theirs.grad) for ours, theirs in zip(trainer.module.parameters(), reference.parameters())
             if theirs.grad is not None]
    assert len(pairs) == sum(p.requires_grad for p in reference.parameters())
    for ours, theirs in pairs:
        assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.999
        assert (ours.norm() / theirs.norm() - 1).abs() < 0.01
    assert all(torch.equal(work, master.to(torch.bfloat16)) for master, work in trainer._pairs)
    assert all(work.dtype == torch.bfloat16 for work in trainer.work.parameters())


def test_bench_train_times_the_teacher_and_each_drafter(tiny_dir, tmp_path, cache):  # noqa: F811
    out = tmp_path / "train.jsonl"
    result = CliRunner().invoke(main, ["bench", "train", "--model", str(tiny_dir), "--method", "spd,eagle3", "--n", "2",
                                       "--ls", "1", "--ttt", "2", "--seq-len", "32", "--batch-size", "2", "--steps",
                                       "1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["drafter"] for r in rows] == ["spd-n2-ls1-input", "eagle3-ttt2"]
    for r in rows:
        assert r["teacher_tokens_s"] > 0 and r["drafter_tokens_s"] > 0 and r["read_tokens_s"] > 0
        assert r["alone_tokens_s"] < min(r["teacher_tokens_s"], r["drafter_tokens_s"])
        assert r["cached_tokens_s"] < min(r["read_tokens_s"], r["drafter_tokens_s"])
        assert (r["world_size"], r["global_batch"], len(r["rank_tokens_s"])) == (1, 2, 1)
        assert r["total_tokens_s"] == r["rank_tokens_s"][0] < r["alone_tokens_s"]  # both drafters on one teacher


def test_shipped_drafter_is_found_after_the_cache_and_checked(tiny_dir, eval_dir, tmp_path, cache, monkeypatch):  # noqa: F811
    """`ship` writes bf16 weights + config (no optimiser state); `run` uses them when the cache has none; a corrupt
    or mismatched shipped drafter is one line naming its file, exit 2, nothing written."""
    import shutil

    from safetensors.torch import load_file

    from harness.runtime import checkpoints

    monkeypatch.setattr(checkpoints, "SHIPPED", tmp_path / "drafters")
    shape = ["--method", "spd", "--n", "2", "--ls", "1", "--model", str(tiny_dir)]
    trained = CliRunner().invoke(main, ["train", *shape, "--seq-len", "32", "--batch-size", "2", "--draft-vocab",
                                        "512", "--tokens", "64", "--val-prompts", "0"])
    assert trained.exit_code == 0, trained.output
    shipped = CliRunner().invoke(main, ["ship", *shape])
    assert shipped.exit_code == 0 and "MiB" in shipped.output, shipped.output
    (folder,) = (tmp_path / "drafters").glob("*/spd-n2-ls1-input")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]
    weights = load_file(folder / "model.safetensors")
    assert {str(v.dtype) for v in weights.values()} == {"torch.bfloat16", "torch.int64"}  # draft ids stay int64
    monkeypatch.setattr(checkpoints, "SHIP_LIMIT", 1000)  # a drafter over the shipped size is refused, whole
    before = (folder / "model.safetensors").read_bytes()
    refused = CliRunner().invoke(main, ["ship", *shape])
    assert refused.exit_code == 2 and "--aggr-bounds" in refused.output and len(refused.output.splitlines()) == 1
    assert (folder / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in folder.parent.iterdir()) == [folder.name]  # no temporary folder left
    monkeypatch.setattr(checkpoints, "SHIP_LIMIT", 40_000_000)
    shutil.rmtree(next((tmp_path / "cache" / "drafters").glob("*/spd-n2-ls1-input")))

    run = ["run", *shape, "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "8", "--data-dir", str(eval_dir)]
    out = tmp_path / "ok.jsonl"
    result = CliRunner().invoke(main, [*run, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert all(json.loads(line)["lossless"]["identical"] for line in out.open())

    original = (folder / "config.json").read_text()
    config = json.loads(original)
    config["target"]["weights_sha256"] = "0" * 64
    (folder / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(main, [*run, "--out", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 2 and str(folder) in result.output and len(result.output.strip().splitlines()) == 1

    (folder / "config.json").write_text(original)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    result = CliRunner().invoke(main, [*run, "--out", str(tmp_path / "bad.jsonl")])
    assert result.exit_code == 2 and "model.safetensors" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "bad.jsonl").exists()


def test_train_on_the_targets_own_replies(tiny_dir, tmp_path, cache):  # noqa: F811
    from harness.runtime.models import load_model
    from harness.training.train import TrainConfig, training_chunks

    args = ["train", "--model", str(tiny_dir), "--method", "eagle3", "--ttt", "1", "--seq-len", "32", "--batch-size",
            "2", "--draft-vocab", "512", "--val-prompts", "0", "--tokens", "128", "--corpus", "self"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (replies,) = (tmp_path / "cache" / "corpus").glob("*/greedy-*.jsonl")
    first = json.loads(replies.read_text().splitlines()[0])
    record = json.loads((tmp_path / "results" / tiny_dir.name / "train.jsonl").read_text().splitlines()[-1])
    assert "--corpus self" in record["command"] and record["config"]["corpus"] == "self"

    loaded = load_model(str(tiny_dir))
    config = TrainConfig(drafters=[], model=str(tiny_dir), tokens=128, seq_len=32, batch_size=2, corpus="self")
    chunks = training_chunks(config, loaded, [(0, messages) for messages in conversations()])
    user = next(conversations())[0]
    expected = encode(loaded.tokenizer, [user, {"role": "assistant", "content": first["reply"]}], 4096).ids
    windows = [expected[start:start + 32] for start in range(0, len(expected) - 32, 32)]
    assert chunks[0].ids.tolist() in windows  # the stream opens with the first regenerated exchange


def test_train_on_a_users_parquet_mixed_with_sharegpt(tiny_dir, tmp_path, cache):  # noqa: F811
    """Fails on 90451cc (--corpus took only sharegpt or self): a local parquet of OpenAI-form records, mixed with
    ShareGPT a conversation at a time, trains; its chunks hold the file's text and the record names the corpus."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harness.runtime.models import load_model
    from harness.training.train import TrainConfig, corpus_conversations, training_chunks

    records = [{"messages": [{"role": "user", "content": f"Name a colour, please ({i})."},
                             {"role": "assistant", "content": "Teal is a colour between green and blue. " * 4}]}
               for i in range(40)]
    path = tmp_path / "mine.parquet"
    pq.write_table(pa.Table.from_pylist(records), path)
    spec = f"{path},sharegpt"
    vocab = tmp_path / "vocab.json"  # the reference's draft_vocab/*.json form
    vocab.write_text(json.dumps({"vocab_size": 49152, "draft_vocab_size": 600, "token_ids": list(range(600))}))
    args = ["train", "--model", str(tiny_dir), "--method", "eagle3", "--ttt", "1", "--seq-len", "32", "--batch-size",
            "2", "--draft-vocab-file", str(vocab), "--val-prompts", "0", "--tokens", "128", "--corpus", spec]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "results" / tiny_dir.name / "train.jsonl").read_text().splitlines()[-1])
    assert record["config"]["corpus"] == spec and f"--corpus {spec}" in record["command"]
    folder = Path(result.output.strip().splitlines()[-1].removeprefix("checkpoint: "))
    assert checkpoints.load_weights(folder)["draft_ids"].tolist() == list(range(600))
    convs = corpus_conversations(spec)
    assert [k for k, _ in convs[:4]] == [0, 1, 0, 1]
    loaded = load_model(str(tiny_dir))
    config = TrainConfig(drafters=[], model=str(tiny_dir), tokens=128, seq_len=32, batch_size=2, corpus=spec)
    text = loaded.tokenizer.decode(training_chunks(config, loaded, convs)[0].ids)
    assert "colour" in text


def test_a_second_run_adds_drafters_beside_a_finished_one_without_touching_it(tiny_dir, tmp_path, cache):  # noqa: F811
    base = ["train", "--model", str(tiny_dir), "--n", "2", "--ls", "1", "--seq-len", "32", "--batch-size", "2",
            "--draft-vocab", "512", "--val-prompts", "0", "--tokens", "64"]
    assert CliRunner().invoke(main, [*base, "--method", "spd"]).exit_code == 0
    (finished,) = (tmp_path / "cache" / "drafters").glob("*/spd-n2-ls1-input")
    before = (finished / "model.safetensors").read_bytes(), json.loads((finished / "config.json").read_text())
    result = CliRunner().invoke(main, [*base, "--method", "spd,ppsd", "--schedule", "input,output", "--resume"])
    assert result.exit_code == 0, result.output
    folders = sorted(p.name for p in finished.parent.iterdir())
    assert folders == ["ppsd-n2-ls1-output", "spd-n2-ls1-input", "spd-n2-ls1-output"]  # ppsd drafts from outputs only
    assert before == ((finished / "model.safetensors").read_bytes(), json.loads((finished / "config.json").read_text()))
    records = [json.loads(line) for line in (tmp_path / "results" / tiny_dir.name / "train.jsonl").read_text()
               .splitlines()]
    assert [r["config_key"] for r in records] == ["spd-n2-ls1-input", "spd-n2-ls1-output", "ppsd-n2-ls1-output"]


def test_feature_cache_reads_back_what_the_teacher_computed(tmp_path):
    """Stored teacher outputs read back equal to a computed visit (bf16 features, exact draft probabilities); a
    file lacking a layer asked for is recomputed with the union of layers; a torn or foreign file is a miss."""
    import torch
    from tiny_models import tiny_model

    from harness.runtime.models import ModelIdentity
    from harness.runtime.target import TargetRuntime
    from harness.training.features import FeatureCache, teacher_pass

    target = TargetRuntime(tiny_model("llama"), max_len=32, identity=ModelIdentity("tiny", "0" * 64))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    draft_ids = torch.arange(0, 256, 3)
    with torch.no_grad():
        cache = FeatureCache(target, "self", 16, (0, 2), draft_ids, root=tmp_path)
        computed = cache.batch([5, 7], ids)
        read = cache.batch([5, 7], ids)
        assert (cache.computed, cache.read) == (2, 2)
        for layer in (0, 2):
            assert torch.equal(computed.features[layer], read.features[layer])
        assert torch.equal(computed.p_draft, read.p_draft)
        _, final, _ = teacher_pass(target, ids, ())
        full = torch.softmax(target.model.lm_head(final).float(), dim=-1)
        torch.testing.assert_close(read.p_draft, full[..., draft_ids], atol=1e-6, rtol=1e-4)

        wider = FeatureCache(target, "self", 16, (1,), draft_ids, root=tmp_path)
        wider.batch([5], ids[:1])
        assert wider.computed == 1
        again = FeatureCache(target, "self", 16, (0, 1, 2), draft_ids, root=tmp_path)
        again.batch([5], ids[:1])
        assert (again.computed, again.read) == (0, 1)  # chunk 5 now holds layers 0, 1 and 2

        (tmp_path / "chunk-0000007.safetensors").write_bytes(b"torn")
        other = FeatureCache(target, "self", 16, (0, 2), draft_ids, root=tmp_path)
        other.batch([7, 5], torch.stack([ids[1], ids[1]]))  # 7 is torn, 5 holds other ids
        assert (other.computed, other.read) == (2, 0)


def test_epochs_revisit_the_budget_from_the_feature_cache(tiny_dir, tmp_path, cache):  # noqa: F811
    """--epochs 2 trains twice the steps over the same chunks; the second pass reads every chunk from disk (the
    teacher ran once per chunk), in a seeded shuffle that a resumed run repeats."""
    from harness.training.train import TrainConfig

    train = ["train", "--model", str(tiny_dir), "--n", "2", "--ls", "1", "--seq-len", "32", "--batch-size", "2",
             "--draft-vocab", "512", "--save-every", "2", "--val-prompts", "0", "--tokens", "128", "--epochs", "2"]
    result = CliRunner().invoke(main, train)
    assert result.exit_code == 0, result.output
    (checkpoint,) = (tmp_path / "cache" / "drafters").glob("*/spd-n2-ls1-input")
    saved = json.loads((checkpoint / "config.json").read_text())["train"]
    assert saved["step"] == 4 and saved["tokens"] == 256 and "--epochs 2" in saved["config"]["command"]
    (features,) = (tmp_path / "cache" / "features").glob("*/sharegpt-s32")
    assert len(list(features.glob("chunk-*.safetensors"))) == 4  # 128 tokens: 4 chunks of 32, each passed once

    config = TrainConfig(drafters=[], tokens=128, seq_len=32, batch_size=2, epochs=3)
    first = [i for step in range(2) for i in config.batch_chunks(step)]
    assert first == [0, 1, 2, 3]
    later = [sorted(i for step in range(2 * e, 2 * e + 2) for i in config.batch_chunks(step)) for e in (1, 2)]
    assert later == [[0, 1, 2, 3]] * 2
    resumed = TrainConfig(drafters=[], tokens=128, seq_len=32, batch_size=2, epochs=3)  # a resumed run's config
    assert [resumed.batch_chunks(s) for s in range(2, 6)] == [config.batch_chunks(s) for s in range(2, 6)]
    assert config.batch_chunks(2) + config.batch_chunks(3) != first  # later epochs are shuffled (seeded)


def test_shared_projections_train_and_decode_losslessly(tiny_dir, eval_dir, tmp_path, cache):  # noqa: F811
    """--aggr-bounds trains the reference's shared projections (fewer, smaller: what fits a shipped flagship); the
    drafter keeps them and decodes losslessly; bounds that do not rise from 0 are a usage error."""
    shape = ["--method", "spd", "--n", "4", "--ls", "1", "--model", str(tiny_dir)]
    train = ["train", *shape, "--seq-len", "32", "--batch-size", "2", "--draft-vocab", "512", "--tokens", "64",
             "--val-prompts", "0"]
    bad = CliRunner().invoke(main, [*train, "--aggr-bounds", "1,2"])
    assert bad.exit_code == 2 and "aggregation bounds must start at 0 and rise strictly, got [1, 2]" in bad.output
    result = CliRunner().invoke(main, [*train, "--aggr-bounds", "0,2"])
    assert result.exit_code == 0, result.output
    (checkpoint,) = (tmp_path / "cache" / "drafters").glob("*/spd-n4-ls1-input")
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["speculator"]["aggr_bounds"] == [0, 2] and "--aggr-bounds 0,2" in saved["train"]["config"]["command"]
    from safetensors.torch import load_file

    widths = {k: v.shape[1] for k, v in load_file(checkpoint / "model.safetensors").items() if k.startswith("proj")}
    assert widths == {"projections.0.weight": 64, "projections.1.weight": 128}  # [h0] and [h0, h2] (hidden 64)

    out = tmp_path / "spd.jsonl"
    run = CliRunner().invoke(main, ["run", *shape, "--dataset", "gsm8k", "--limit", "1", "--max-new-tokens", "8",
                                    "--data-dir", str(eval_dir), "--out", str(out)])
    assert run.exit_code == 0, run.output
    assert all(json.loads(line)["lossless"]["identical"] for line in out.read_text().splitlines())
