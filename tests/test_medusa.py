"""Medusa on tiny models: the candidate tree from the heads' top guesses, lossless at T=0 (identical to greedy AR)
and at T=1 (the target's distribution), the replay equal to execution, bad parameters refused in one line, a
published head folder imported (safetensors or weights-only .pt), and heads trained by `spd-bench train`."""

import json

import pytest
import torch
from click.testing import CliRunner
from tiny_models import flat_target, sampled_joint_tv, tiny_model

from harness.cli import main
from harness.runtime.errors import HarnessError
from harness.runtime.models import ModelIdentity
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.medusa.heads import MedusaConfig, MedusaHeads
from methods.medusa.interop import import_medusa
from methods.medusa.method import Medusa, MedusaParams
from methods.medusa.tree import MC_SIM_7B_63, CandidateTree, read_paths
from methods.sampling import Sampler, SamplingConfig

GREEDY = SamplingConfig()


def _medusa(model, heads: int = 4, **params) -> tuple[TargetRuntime, Medusa]:
    target = TargetRuntime(model, max_len=256)
    module = MedusaHeads(MedusaConfig(heads=heads, num_layers=target.num_layers), target).eval()
    with torch.no_grad():  # away from the pass-through init, so the heads' blocks matter
        for p in module.blocks.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return target, Medusa(target, MedusaParams(heads=heads, **params), set(), heads=module)


def test_the_default_tree_is_the_papers_sparse_tree_in_verification_order():
    tree = CandidateTree.of(MC_SIM_7B_63, torch.device("cpu"))
    parents, depths = tree.shape.host
    assert len(parents) == 63 and tree.shape.levels == 4 and tree.top == 10
    assert depths == sorted(depths) and all(p < i for i, p in enumerate(parents))
    assert tree.heads.tolist()[:10] == [0] * 10 and tree.ranks.tolist()[:10] == list(range(10))
    assert depths.count(1) == 10 and depths.count(4) == 2


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_greedy_output_is_identical_to_ar_and_the_replay_equals_execution(arch):
    target, method = _medusa(tiny_model(arch))
    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], list(range(10, 19))):
        reference = ar.generate(prompt, 32, Sampler(GREEDY)).output_ids
        by_position = {len(prompt) + i: t for i, t in enumerate(reference)}
        executed = method.with_oracle(by_position, 0.7).generate(prompt, 32, Sampler(GREEDY))
        replayed = method.with_oracle(by_position, 0.7).simulate(prompt, reference, 32, Sampler(GREEDY))
        assert executed.output_ids == reference and replayed.output_ids == reference
        assert executed.accepted == replayed.accepted and executed.position_accepts == replayed.position_accepts
        # accepted second children: the accepted branch's KV moved into place
        assert executed.position_accepts[1] > 0 and executed.steps < len(reference) - 1
        assert method.with_oracle({}, 0.0).generate(prompt, 32, Sampler(GREEDY)).output_ids == reference
    assert executed.stats.candidates == 63 * executed.steps


def test_sampled_tokens_follow_the_target_distribution():
    vocab = 4
    model = flat_target(vocab)  # the tree's linear-attention path is Qwen3.5's greedy test's (a T=1 run costs 40 s)
    tree = [[0], [1], [0, 0], [0, 1], [1, 0]]
    target = TargetRuntime(model, max_len=64)
    module = MedusaHeads(MedusaConfig(heads=2, num_layers=target.num_layers), target).eval()
    path = _tree_file(tree)
    method = Medusa(target, MedusaParams(heads=2, tree=str(path)), set(), heads=module)
    assert sampled_joint_tv(method, model, vocab) < 0.07


def _tree_file(paths, name="tree.json"):
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp()) / name
    path.write_text(paths if isinstance(paths, str) else json.dumps(paths))
    return path


def test_bad_parameters_are_refused_in_one_line(tiny_dir, eval_dir, tmp_path, cache):
    with pytest.raises(ValueError, match="heads must be >= 1"):
        MedusaParams(heads=0)
    with pytest.raises(ValueError, match="4 deep but there are 2 heads"):
        MedusaParams(heads=2)
    with pytest.raises(ValueError, match="is not JSON"):
        MedusaParams(tree=str(_tree_file("[[0], [0, 0")))
    with pytest.raises(ValueError, match="no parent"):
        read_paths(str(_tree_file([[0], [1, 0]])))
    with pytest.raises(ValueError, match="twice"):
        read_paths(str(_tree_file([[0], [0]])))
    with pytest.raises(ValueError, match="no such file"):
        read_paths(str(tmp_path / "missing.json"))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--method", "medusa", "--heads", "2",
                                       "--dataset", "gsm8k", "--limit", "1", "--data-dir", str(eval_dir),
                                       "--out", str(out)])
    assert result.exit_code == 2 and "4 deep but there are 2 heads" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
    missing = CliRunner().invoke(main, ["run", "--model", str(tiny_dir), "--method", "medusa", "--dataset", "gsm8k",
                                        "--limit", "1", "--data-dir", str(eval_dir), "--out", str(out)])
    assert missing.exit_code == 2 and "spd-bench train --method medusa --heads 4" in missing.output


def _published(folder, target, heads=2, layers=1, pt=False, seed=3):
    """A head folder as the Medusa authors' code saves it (one block object repeated per head)."""
    from safetensors.torch import save_file

    hidden = target.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(heads):
        w, b = 0.05 * torch.randn(hidden, hidden, generator=g), 0.05 * torch.randn(hidden, generator=g)
        for j in range(layers):
            weights[f"{i}.{j}.linear.weight"], weights[f"{i}.{j}.linear.bias"] = w, b
        weights[f"{i}.{layers}.weight"] = target.model.lm_head.weight.detach().clone()
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                    "base_model_name_or_path": "tiny"}))
    if pt:
        torch.save(weights, folder / "medusa_lm_head.pt")
    else:
        save_file(weights, str(folder / "medusa_lm_head.safetensors"))
    return weights


def test_a_published_head_folder_imports_and_decodes_losslessly(tmp_path, cache):
    model = tiny_model("llama")
    target = TargetRuntime(model, max_len=256, identity=ModelIdentity("tiny-llama", "0" * 64))
    ar = build_method("autoregressive", target, {}, set())
    tree = str(_tree_file([[0], [1], [0, 0], [1, 0], [0, 1]]))
    for pt in (False, True):
        folder = tmp_path / f"medusa-{pt}"
        weights = _published(folder, target, pt=pt)
        saved, heads = import_medusa(folder, target, force=True)
        assert heads == 2
        method = Medusa(target, MedusaParams(heads=2, tree=tree), set(), checkpoint=str(saved))
        assert method.heads.config.own_heads and len(method.heads.projections) == 2
        assert torch.equal(method.heads.blocks[1][0].linear.weight, weights["1.0.linear.weight"])
        for prompt in ([7], list(range(10, 19))):
            reference = ar.generate(prompt, 24, Sampler(GREEDY)).output_ids
            assert method.generate(prompt, 24, Sampler(GREEDY)).output_ids == reference
    damaged = tmp_path / "damaged"
    _published(damaged, target)
    (damaged / "medusa_lm_head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HarnessError, match="not a readable safetensors"):
        import_medusa(damaged, target)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps({"medusa_num_heads": 1}))
    torch.save({"0.0.linear.weight": torch.nn.Linear(2, 2)}, pickled / "medusa_lm_head.pt")
    with pytest.raises(HarnessError, match="code objects"):
        import_medusa(pickled, target)


def test_trained_heads_decode_losslessly_through_the_cli(tiny_dir, eval_dir, tmp_path, cache, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the train record goes to ./results
    train = ["train", "--model", str(tiny_dir), "--method", "medusa", "--heads", "4", "--seq-len", "32",
             "--batch-size", "2", "--draft-vocab", "512", "--save-every", "2", "--tokens", "128"]
    result = CliRunner().invoke(main, train)
    assert result.exit_code == 0, result.output
    (checkpoint,) = (tmp_path / "cache" / "drafters").glob("*/medusa-heads4")
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved["method"] == "medusa" and saved["medusa"]["heads"] == 4
    assert len(saved["train"]["validation"]["top1_by_head"]) == 4
    assert saved["train"]["validation"]["decoding"]["tokens_per_step"] >= 1
    out = tmp_path / "medusa.jsonl"
    run = CliRunner().invoke(main, ["run", "--method", "medusa", "--model", str(tiny_dir), "--dataset", "gsm8k",
                                    "--limit", "2", "--max-new-tokens", "12", "--data-dir", str(eval_dir),
                                    "--out", str(out)])
    assert run.exit_code == 0, run.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["lossless"]["identical"] for r in rows) and rows[0]["params"] == {"heads": 4, "tree": "mc_sim_7b_63"}
    simulated = CliRunner().invoke(main, ["run", "--method", "medusa", "--model", str(tiny_dir), "--dataset", "gsm8k",
                                          "--limit", "2", "--max-new-tokens", "12", "--data-dir", str(eval_dir),
                                          "--simulate", "--out", str(tmp_path / "sim.jsonl")])
    assert simulated.exit_code == 0, simulated.output
    answers = tmp_path / "answers"
    exported = CliRunner().invoke(main, ["export", "--format", "spec-bench", "--results", str(out), "--out",
                                         str(answers)])
    assert exported.exit_code == 0, exported.output
    (answer_file,) = answers.glob("*medusa*.jsonl")
    lines = [json.loads(line) for line in answer_file.read_text().splitlines()]
    assert len(lines) == 2 and all(line["choices"][0]["new_tokens"] for line in lines)
