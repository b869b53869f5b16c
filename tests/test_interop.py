"""Reference speculation heads (v11 .pt): read safely, checked against the target, equal to a forward written here
from the format description, and lossless when decoding."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner

from harness.cli import main
from harness.errors import HarnessError
from harness.interop import import_spd
from harness.models import ModelIdentity
from harness.target import TargetRuntime
from methods.base import build_method
from methods.pipeline import Drafter
from methods.pipeline_tree import Token
from methods.sampling import Sampler, SamplingConfig
from methods.spd import SPD
from test_cli import tiny_dir  # noqa: F401  (fixture)
from test_spd import _oracle
from tiny_models import tiny_model

N, LS = 4, 2
BOUNDS = [0, 3, 5, 7]  # 8-layer targets: depth d reaches index 2d, so depths 0..4 use projections 0,0,1,2,3


def _spec_layers(model, count):
    """Fresh decoder layers as the format stores them: the target's class forced to full attention (a Qwen3 layer
    for a Llama target)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * count
    if config.model_type == "llama":
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

        config = Qwen3Config(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                             num_attention_heads=config.num_attention_heads, head_dim=config.head_dim,
                             num_key_value_heads=config.num_key_value_heads, num_hidden_layers=count,
                             vocab_size=config.vocab_size)
        config._attn_implementation = "sdpa"
        return [Qwen3DecoderLayer(config, j) for j in range(count)]
    return [type(model.model.layers[0])(config, j) for j in range(count)]


def _v11(model, draft_ids=None, seed=0):
    """A random head with the exact key names and shapes (bf16, as the reference saves them)."""
    torch.manual_seed(seed)
    hidden = model.config.hidden_size
    state = {f"aggr_projs.{i}.weight": torch.randn(hidden, (i + 1) * hidden) / (hidden * (i + 1)) ** 0.5
             for i in range(len(BOUNDS))}
    for j, layer in enumerate(_spec_layers(model, LS)):
        for key, value in layer.state_dict().items():
            state[f"spec_layers.{j}.{key}"] = value + 0.1 * torch.randn_like(value)  # norms away from their init
    rows = model.config.vocab_size if draft_ids is None else len(draft_ids)
    state["lm_head.weight"] = torch.randn(rows, hidden) / hidden ** 0.5
    config = {"hidden_size": hidden, "vocab_size": model.config.vocab_size, "draft_vocab_size": rows,
              "num_stages": N, "num_spec_layers": LS, "num_aggr_types": len(BOUNDS), "version": 11,
              "trained_with_use_deepest": True, "aggr_feature_bound": BOUNDS, "base_model_path": "tiny",
              "spec_intermediate_size_fallback": model.config.intermediate_size}
    if draft_ids is not None:
        config["draft_token_ids"] = draft_ids
    return {"state_dict": {k: v.to(torch.bfloat16) for k, v in state.items()}, "config": config}


def _target(arch):
    model = tiny_model(arch, num_layers=8)
    return model, TargetRuntime(model, max_len=128, identity=ModelIdentity(f"tiny-{arch}", "0" * 64))


def _reference_forward(model, saved, features, depths):
    """The format description, independently: row t = aggr_projs[a](cat(hs[b_0..b_a])) with a = max{i : b_i <= d*L/n};
    the spec layers over all rows (causal by position); logits = lm_head(target norm(last row)) over the draft ids."""
    state = {k: v.float() for k, v in saved["state_dict"].items()}
    layers_per_stage = model.config.num_hidden_layers // N
    rows = []
    for t, depth in enumerate(depths):
        a = max(i for i, b in enumerate(BOUNDS) if b <= depth * layers_per_stage)
        x = torch.cat([features[t][b] for b in BOUNDS[: a + 1]], dim=-1)
        rows.append(x @ state[f"aggr_projs.{a}.weight"].T)
    h = torch.stack(rows)[None]
    positions = torch.arange(len(depths))
    rope = model.model.rotary_emb(h, positions[None])
    mask = torch.tril(torch.ones(len(depths), len(depths), dtype=torch.bool))[None, None]
    for j, layer in enumerate(_spec_layers(model, LS)):
        layer.load_state_dict({k[len(f"spec_layers.{j}."):]: v for k, v in state.items()
                               if k.startswith(f"spec_layers.{j}.")})
        h = layer(h, attention_mask=mask, position_ids=positions[None], position_embeddings=rope)
        h = h[0] if isinstance(h, tuple) else h
    return model.model.norm(h[0, -1]) @ state["lm_head.weight"].T


@pytest.mark.parametrize("arch, draft", [("qwen3_5", None), ("qwen3", [3, 9, 17, 40, 41, 200]), ("llama", None)])
def test_imported_head_equals_the_format_and_decodes_losslessly(tmp_path, monkeypatch, arch, draft):
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model, target = _target(arch)
    saved = _v11(model, draft)
    torch.save(saved, tmp_path / "head.pt")
    folder = import_spd(tmp_path / "head.pt", target)
    written = json.loads((folder / "config.json").read_text())
    assert written["speculator"]["aggr_bounds"] == BOUNDS and written["source"]["format"] == "reference v11"
    method = SPD(target, SPD.Params(n=N, ls=LS), set(), checkpoint=str(folder))
    speculator = method.speculator

    # Three finished tokens and one in flight per depth below n, newest last (what the pipeline holds at fill n-1).
    torch.manual_seed(1)
    depths = [N, N, N, N - 1, N - 2, N - 3, 0]
    features = [{b: torch.randn(model.config.hidden_size) for b in BOUNDS} for _ in depths]
    tokens = [Token(t, 5, d, None, {b: f[b][None, None] for b in speculator.config.layers_for(d)})
              for t, (d, f) in enumerate(zip(depths, features))]
    finished, levels = tokens[:3], [[t] for t in tokens[3:]]
    for older, newer in zip(tokens[3:], tokens[4:]):
        newer.parent = older
    with torch.inference_mode():
        ours = Drafter(speculator, 64).logits(finished, levels)[0]
        theirs = _reference_forward(model, saved, features, depths)
    kept = torch.arange(model.config.vocab_size) if draft is None else torch.tensor(draft)
    assert torch.allclose(ours[kept], theirs, atol=1e-4, rtol=1e-4)
    assert torch.isinf(ours).sum() == model.config.vocab_size - len(kept)

    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], list(range(10, 21))):
        reference = ar.generate(prompt, 24, Sampler(SamplingConfig())).output_ids
        method.engine.drafter_class = _oracle({len(prompt) + i: t for i, t in enumerate(reference)}, 0.7)
        assert method.generate(prompt, 24, Sampler(SamplingConfig())).output_ids == reference


@pytest.mark.parametrize("change, message", [
    (lambda s: s["config"].update(version=10), "version 10 speculation head"),
    (lambda s: s["config"].update(hidden_size=32), "hidden size of 32, the target has 64"),
    (lambda s: s["config"].update(num_stages=3), "3 stages, which does not divide the target's 8 layers"),
    (lambda s: s["state_dict"].pop("lm_head.weight"), "does not fit a v11 head"),
    (lambda s: s["state_dict"].update(extra=torch.zeros(1)), "unexpected tensor 'extra'"),
    (lambda s: s["config"].update(draft_token_ids=[5, 3, 4]), "draft_token_ids must rise"),
])
def test_a_mismatched_or_malformed_head_is_one_line_and_writes_nothing(tmp_path, monkeypatch, change, message):
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model, target = _target("qwen3")
    saved = _v11(model)
    change(saved)
    torch.save(saved, tmp_path / "head.pt")
    with pytest.raises(HarnessError, match=message):
        import_spd(tmp_path / "head.pt", target)
    assert not (tmp_path / "cache").exists()


class Payload:
    """An arbitrary object: weights-only loading must refuse it, never construct it."""


def test_files_that_are_not_heads_are_refused_without_unpickling(tmp_path, monkeypatch):
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    _, target = _target("qwen3")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(HarnessError, match="not a readable speculation head"):
        import_spd(tmp_path / "junk.pt", target)

    torch.save({"config": {"version": 11}, "state_dict": {}, "object": Payload()}, tmp_path / "object.pt")
    with pytest.raises(HarnessError, match="not a readable speculation head"):
        import_spd(tmp_path / "object.pt", target)


def test_run_takes_a_head_file_as_checkpoint(tiny_dir, eval_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    from harness.models import load_model

    model = load_model(str(tiny_dir), "cpu", "float32").model
    saved = _v11(model)
    saved["config"].update(num_stages=2, aggr_feature_bound=[0, 1, 3])
    saved["state_dict"] = {k: v for k, v in saved["state_dict"].items() if not k.startswith("aggr_projs.3")}
    torch.save(saved, tmp_path / "tiny_s2_l2.pt")
    out = tmp_path / "spd.jsonl"
    args = ["run", "--method", "spd", "--n", "2", "--ls", str(LS), "--model", str(tiny_dir), "--dataset", "gsm8k",
            "--limit", "1", "--max-new-tokens", "8", "--data-dir", str(eval_dir), "--out", str(out),
            "--checkpoint", str(tmp_path / "tiny_s2_l2.pt")]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["lossless"]["identical"]
    wrong = CliRunner().invoke(main, [*args[:4], "4", *args[5:]])
    assert wrong.exit_code == 2 and "is a head for n=2" in wrong.output
