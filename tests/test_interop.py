"""Reference speculation heads (v11 .pt): read safely, checked against the target, equal to a forward written here
from the format description, and lossless when decoding."""

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from test_spd import _oracle
from tiny_models import tiny_model

from harness.cli import main
from harness.runtime.errors import HarnessError
from harness.runtime.models import ModelIdentity
from harness.runtime.target import TargetRuntime
from methods.base import build_method
from methods.pipeline.drafter import Drafter
from methods.pipeline.interop import import_spd
from methods.pipeline.spd import SPD
from methods.pipeline.tree import Token
from methods.sampling import Sampler, SamplingConfig

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
    (lambda s: s["config"].update(num_stages="two"), r"config num_stages must be an integer >= 1, got 'two'"),
    (lambda s: s["config"].update(num_stages=None), r"config num_stages must be an integer >= 1, got None"),
    (lambda s: s["config"].update(hidden_size="big"), r"config hidden_size must be an integer"),
    (lambda s: s["config"].update(aggr_feature_bound=5), "aggr_feature_bound must be a list of integers"),
    (lambda s: s["config"].update(draft_token_ids="abc"), "draft_token_ids must be a list of integers"),
    (lambda s: s["config"].update(draft_token_ids=torch.tensor([[1, 2], [3, 4]])), "draft_token_ids must be a 1-D"),
    (lambda s: s["config"].update(draft_token_ids=[-3, 4, 5]), "draft_token_ids holds negative values"),
    (lambda s: s["state_dict"].update({"lm_head.weight": s["state_dict"]["lm_head.weight"].to(torch.int32)}),
     "weight lm_head.weight is int32, not floating point"),
    (lambda s: s["state_dict"]["lm_head.weight"].fill_(float("nan")), "weight lm_head.weight holds NaN"),
    (lambda s: s["config"].update(draft_vocab_size=7), "contradicts itself on the draft vocabulary"),
    (lambda s: s["config"].update(draft_token_ids=[1, 2, 3]), "contradicts itself on the draft vocabulary"),
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
    with pytest.raises(HarnessError, match=r"holds code objects besides tensors \(a full pickle\), which are "
                                           r"refused: only plain tensors are read; save its state_dict") as refused:
        import_spd(tmp_path / "object.pt", target)
    assert "torch." not in str(refused.value)  # no advice to load it unsafely


def test_run_takes_a_head_file_as_checkpoint(tiny_dir, eval_dir, tmp_path, monkeypatch):  # noqa: F811
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    from harness.runtime.models import load_model

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
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "fresh-cache"))
    wrong = CliRunner().invoke(main, [*args[:4], "4", *args[5:]])
    assert wrong.exit_code == 2 and "is a head for n=2, Ls=2; pass --n 2 --ls 2" in wrong.output
    assert not list((tmp_path / "fresh-cache").rglob("*.safetensors"))  # checked first: nothing imported
    saved["state_dict"]["lm_head.weight"].mul_(2)  # another head under the same tag
    torch.save(saved, tmp_path / "other_s2_l2.pt")
    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    clash = CliRunner().invoke(main, [*args[:-1], str(tmp_path / "other_s2_l2.pt")])
    assert clash.exit_code == 2 and len(clash.output.strip().splitlines()) == 1
    assert f"replace it with `spd-bench import --spd {tmp_path / 'other_s2_l2.pt'} --force`" in clash.output


# --- EAGLE-3 heads ------------------------------------------------------------------------------------------------
def _eagle3_folder(model, folder, draft_ids=None, seed=0, binary=False):
    """A random EAGLE-3 head folder with the format's key names, shapes and config fields."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    c = model.config
    hidden, heads, kv, hd, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, 96
    rows = c.vocab_size if draft_ids is None else len(draft_ids)
    ids = torch.arange(rows) if draft_ids is None else torch.tensor(draft_ids)

    def rand(*shape):
        return torch.randn(*shape) / shape[-1] ** 0.5

    weights = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": 1 + 0.1 * torch.randn(hidden),
               "lm_head.weight": rand(rows, hidden), "d2t": ids - torch.arange(rows),
               "t2d": torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, ids, True),
               "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * hidden),
               "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * hidden),
               "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * hidden),
               "midlayer.self_attn.o_proj.weight": rand(hidden, heads * hd),
               "midlayer.mlp.gate_proj.weight": rand(inter, hidden), "midlayer.mlp.up_proj.weight": rand(inter, hidden),
               "midlayer.mlp.down_proj.weight": rand(hidden, inter)}
    for norm in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        weights[f"midlayer.{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden, "intermediate_size": inter,
              "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "rms_norm_eps": 1e-6,
              "vocab_size": c.vocab_size, "draft_vocab_size": rows, "eagle_aux_hidden_state_layer_ids": [1, 4, 5]}
    folder.mkdir(parents=True, exist_ok=True)
    if binary:
        torch.save(weights, folder / "pytorch_model.bin")
    else:
        save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return config, weights


def _eagle3_reference(model, weights, embeddings, fused_input):
    """The format, independently: fused = fc(cat(low, mid, high)); row = cat(rms(emb) * w_in, rms(fused) * w_hid);
    h = fused + o(attn(q, k, v; rope, causal)); h += down(silu(gate(n(h))) * up(n(h))); logits = lm_head(rms(h) * w)
    on draft ids, target id = draft id + d2t."""
    w = {k: v.float() for k, v in weights.items()}
    c = model.config

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    fused = fused_input @ w["fc.weight"].T
    x = torch.cat([rms(embeddings, w["midlayer.input_layernorm.weight"]),
                   rms(fused, w["midlayer.hidden_norm.weight"])], dim=-1)
    size, hd = x.shape[0], c.head_dim
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(size, -1, hd).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(size, -1, hd).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(size, -1, hd).transpose(0, 1)
    cos, sin = model.model.rotary_emb(x[None], torch.arange(size)[None])

    def rotate(t):
        half = t.shape[-1] // 2
        return t * cos[0] + torch.cat([-t[..., half:], t[..., :half]], dim=-1) * sin[0]

    q, k = rotate(q), rotate(k)
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = (q @ k.transpose(1, 2)) / hd ** 0.5 + torch.triu(torch.full((size, size), float("-inf")), 1)
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(size, -1)
    h = fused + attn @ w["midlayer.self_attn.o_proj.weight"].T
    n = rms(h, w["midlayer.post_attention_layernorm.weight"])
    h = h + (torch.nn.functional.silu(n @ w["midlayer.mlp.gate_proj.weight"].T) * (n @ w["midlayer.mlp.up_proj.weight"].T)
             ) @ w["midlayer.mlp.down_proj.weight"].T
    logits = rms(h, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((size, c.vocab_size), float("-inf"))
    full[:, torch.arange(len(w["d2t"])) + weights["d2t"]] = logits
    return full


@pytest.mark.parametrize("arch, draft, binary", [("llama", None, False), ("qwen3", [2, 5, 9, 30, 77, 201], True)])
def test_imported_eagle3_head_equals_the_format_decodes_losslessly_and_round_trips(tmp_path, monkeypatch, arch, draft,
                                                                                 binary):
    from methods.eagle3.head import ConcatCache
    from methods.eagle3.interop import export_eagle3, import_eagle3
    from methods.eagle3.method import EAGLE3, EagleParams

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model, target = _target(arch)
    _, weights = _eagle3_folder(model, tmp_path / "theirs", draft, binary=binary)
    folder = import_eagle3(tmp_path / "theirs", target, ttt=7)
    method = EAGLE3(target, EagleParams(m=3, ttt=7, layout="eagle3"), set(), checkpoint=str(folder))
    head = method.head

    torch.manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (6,))
    assert head.config.feature_layers == (2, 5, 6)  # the outputs of layers 1, 4 and 5 (0-based): SGLang's reading
    features = {layer: torch.randn(1, 6, model.config.hidden_size) for layer in (2, 5, 6)}
    positions = torch.arange(6)
    with torch.inference_mode():
        out = head.rows(head.embed(ids[None]), head.fused(features), positions,
                        torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None], ConcatCache())
        ours = head.full_vocab(head.head_logits(out))[0]
        theirs = _eagle3_reference(model, weights, head.embed(ids[None])[0],
                                   torch.cat([features[2], features[5], features[6]], dim=-1)[0])
    finite = torch.isfinite(theirs)
    assert torch.equal(torch.isfinite(ours), finite)
    assert torch.allclose(ours[finite], theirs[finite], atol=1e-4, rtol=1e-4)

    ar = build_method("autoregressive", target, {}, set())
    for prompt in ([7], list(range(10, 21))):
        reference = ar.generate(prompt, 20, Sampler(SamplingConfig())).output_ids
        assert method.generate(prompt, 20, Sampler(SamplingConfig())).output_ids == reference

    exported = export_eagle3(folder, tmp_path / "ours", model.config)
    again = json.loads((exported / "config.json").read_text())
    assert again["architectures"] == ["LlamaForCausalLMEagle3"] and again["eagle_aux_hidden_state_layer_ids"] == [1, 4, 5]
    from safetensors.torch import load_file

    round_trip = load_file(str(exported / "model.safetensors"))
    assert set(round_trip) == set(weights)
    assert all(torch.equal(round_trip[k].to(weights[k].dtype), weights[k]) for k in weights)


def test_stated_eagle3_layer_ids_name_what_sglang_captures_both_ways():
    """SGLang's rule (`set_eagle3_layers_to_capture`): an id i is kept as i + 1 and the hidden state is captured
    before that layer runs, i.e. the output of 0-based layer i, HF's hidden_states[i + 1]. Fails on a16459a, which
    read ids [1, 14, 26] as h[1], h[14], h[26], one layer early, and wrote them back so."""
    from methods.eagle3.interop import captured_state, layer_id

    model, target = _target("llama")
    ids = torch.arange(3, 15)
    with torch.inference_mode():
        hf = model(ids[None], output_hidden_states=True).hidden_states  # [i]: the input of 0-based layer i
        target.reset()
        _, captured = target.forward(ids, 0, tuple(captured_state(i) for i in (0, 2, 4)))
    for i in (0, 2, 4):
        sglang = hf[i + 1]  # captured before layer i + 1 runs
        assert torch.allclose(captured[captured_state(i)], sglang, atol=1e-5)
        assert layer_id(captured_state(i)) == i


def test_eagle3_heads_that_do_not_fit_are_one_line(tmp_path, monkeypatch):
    from methods.eagle3.interop import import_eagle3

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model, target = _target("llama")
    config, _ = _eagle3_folder(model, tmp_path / "head")
    for change, message in ((dict(architectures=["LlamaForCausalLM"]), "is not an EAGLE-3 head"),
                            (dict(architectures=None), "is not an EAGLE-3 head"),
                            (dict(eagle_aux_hidden_state_layer_ids=["2", "4", "5"]), "must be a list of integers"),
                            (dict(draft_vocab_size="abc"), "draft_vocab_size must be an integer"),
                            (dict(draft_vocab_size=5), "states a draft vocabulary of 5"),
                            (dict(hidden_size=32), "hidden size of 32"),
                            (dict(rope_theta=1.0), "rope theta 1.0"),
                            (dict(eagle_aux_hidden_state_layer_ids=[1, 2, 40]),
                             r"reads the outputs of layers \[1, 2, 40\]")):
        (tmp_path / "head" / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(HarnessError, match=message):
            import_eagle3(tmp_path / "head", target)
    (tmp_path / "head" / "config.json").write_text("[]")
    with pytest.raises(HarnessError, match="not an EAGLE-3 head"):
        import_eagle3(tmp_path / "head", target)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("change, message", [
    (lambda w: w.update(d2t=torch.tensor(3)), "d2t must be a 1-D tensor of integer ids"),
    (lambda w: w.update(d2t=w["d2t"].double() + 0.5), "d2t must be a 1-D tensor of integer ids"),
    (lambda w: w.update({"fc.weight": w["fc.weight"].to(torch.int8)}), "weight fc.weight is int8, not floating point"),
    (lambda w: w["norm.weight"].fill_(float("inf")), "weight norm.weight holds NaN or infinite values"),
])
def test_eagle3_weights_that_are_not_float_or_not_finite_or_ids_that_are_not_integers_are_refused(
        tmp_path, monkeypatch, change, message):
    from safetensors.torch import load_file, save_file

    from methods.eagle3.interop import import_eagle3

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model, target = _target("llama")
    _eagle3_folder(model, tmp_path / "head", draft_ids=[2, 5, 9, 30, 77, 201])
    weights = load_file(str(tmp_path / "head" / "model.safetensors"))
    change(weights)
    save_file(weights, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(HarnessError, match=message):
        import_eagle3(tmp_path / "head", target)
    assert not (tmp_path / "cache").exists()


def test_a_harness_layout_head_is_not_exported_and_eagle3_layout_heads_train(tmp_path):
    from harness.runtime import checkpoints
    from methods.eagle3.head import EagleConfig, EagleHead, ttt_logits
    from methods.eagle3.interop import export_eagle3

    model, target = _target("llama")
    checkpoints.save(tmp_path / "harness", EagleHead(EagleConfig(num_layers=8), target), {"eagle": {"layout": "harness"}})
    with pytest.raises(HarnessError, match="harness-layout head, which EAGLE-3 code cannot load"):
        export_eagle3(tmp_path / "harness", tmp_path / "out", model.config)
    with torch.inference_mode(False), torch.enable_grad():  # as inside harness.training.train.train
        head = EagleHead(EagleConfig(num_layers=8, layout="eagle3"), target).start_as_identity()
        features = {layer: torch.randn(2, 12, model.config.hidden_size) for layer in head.config.feature_layers}
        steps = ttt_logits(head, features, torch.randint(0, 256, (2, 12)), 3)
        sum(s.float().logsumexp(-1).mean() for s in steps).backward()
    assert len(steps) == 3 and head.midlayer.self_attn.q_proj.weight.grad is not None
    assert float(head.midlayer.mlp.down_proj.weight.abs().sum()) == 0.0  # the identity start zeroes residual branches


def test_eagle3_folders_through_the_cli_import_run_and_export(tiny_dir, eval_dir, tmp_path, monkeypatch):  # noqa: F811
    from harness.runtime.models import load_model

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    model = load_model(str(tiny_dir), "cpu", "float32").model
    config, _ = _eagle3_folder(model, tmp_path / "head", draft_ids=list(range(0, 49152, 7)))
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}))
    run = ["run", "--method", "eagle3", "--model", str(tiny_dir), "--dataset", "gsm8k", "--limit", "1",
           "--max-new-tokens", "8", "--data-dir", str(eval_dir)]
    direct = CliRunner().invoke(main, [*run, "--checkpoint", str(tmp_path / "head"), "--out", str(tmp_path / "a.jsonl")])
    assert direct.exit_code == 0, direct.output
    imported = CliRunner().invoke(main, ["import", "--eagle3", str(tmp_path / "head"), "--model", str(tiny_dir)])
    assert imported.exit_code == 0 and "eagle3-ttt7-eagle3" in imported.output  # the same file again: no --force
    cached = CliRunner().invoke(main, [*run, "--param", "layout=eagle3", "--out", str(tmp_path / "b.jsonl")])
    assert cached.exit_code == 0, cached.output
    rows = [json.loads(line) for name in ("a", "b") for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    assert all(r["lossless"]["identical"] and r["params"]["layout"] == "eagle3" for r in rows)
    exported = CliRunner().invoke(main, ["export-head", "--model", str(tiny_dir), "--out", str(tmp_path / "out")])
    assert exported.exit_code == 0, exported.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["draft_vocab_size"] == len(range(0, 49152, 7))


def test_export_head_never_deletes_what_it_did_not_write_and_refuses_files_with_one_line(tiny_dir, tmp_path,  # noqa: F811
                                                                                         monkeypatch):
    import os
    import stat

    from harness.runtime import checkpoints
    from harness.runtime.models import load_model
    from methods.eagle3.head import EagleConfig, EagleHead

    monkeypatch.setenv("SPD_BENCH_CACHE", str(tmp_path / "cache"))
    loaded = load_model(str(tiny_dir), "cpu", "float32")
    target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
    head = checkpoints.drafter_dir(loaded.identity, "eagle3", "ttt7-eagle3")
    config = EagleConfig(num_layers=4, layout="eagle3")
    checkpoints.save(head, EagleHead(config, target), {"eagle": config.to_dict(), "target": loaded.identity.to_dict()})
    export = ["export-head", "--model", str(tiny_dir), "--out"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("a file")
    for out, message in ((busy, "is not empty; pass an empty or new folder, or --replace"),
                         (tmp_path / "file", "is a file; pass a folder"),
                         (tmp_path / "file" / "sub", "lies under the file")):
        result = CliRunner().invoke(main, [*export, str(out)])
        assert result.exit_code == 2 and message in result.output and len(result.output.strip().splitlines()) == 1
    assert [p.name for p in busy.iterdir()] == ["notes.txt"] and (tmp_path / "file").read_text() == "a file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy", "cache", "file"]  # no staging leftovers
    replaced = CliRunner().invoke(main, [*export, str(busy), "--replace"])
    assert replaced.exit_code == 0, replaced.output
    assert sorted(p.name for p in busy.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    fresh = tmp_path / "fresh"
    old = os.umask(0o022)
    try:
        assert CliRunner().invoke(main, [*export, str(fresh)]).exit_code == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o755 and stat.S_IMODE((fresh / "config.json").stat().st_mode) == 0o644


def test_a_damaged_torch_file_that_raises_key_error_is_one_line(tmp_path, monkeypatch):
    """torch.load raises KeyError on some damaged archives (a storage the pickle names but the file lacks)."""
    from harness.runtime import foreign

    def damaged(*args, **kwargs):
        raise KeyError("data/0")

    monkeypatch.setattr(foreign.torch, "load", damaged)
    with pytest.raises(HarnessError, match="is not a readable speculation head"):
        foreign.load_weights_only(tmp_path / "head.pt", "speculation head")
