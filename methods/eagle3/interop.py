"""EAGLE-3 heads in the EAGLE authors' and SpecForge's folder format, both ways.

An EAGLE-3 folder (`config.json` naming LlamaForCausalLMEagle3, `model.safetensors` or `pytorch_model.bin` read
weights-only) maps onto the head's eagle3 layout (methods/eagle3/head.py): `fc` -> `fuse`, `midlayer.*` and `norm` as
they are, `lm_head` -> `head`, `d2t` -> the draft ids; features at `eagle_aux_hidden_state_layer_ids` (default 2,
L/2, L-3). Heads trained here in that layout export back to the same folder format.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError, first_line
from harness.runtime.files import Outputs
from harness.runtime.foreign import check_weights, integer, integers, load_weights_only, read_config, save_imported
from harness.runtime.paths import check_out_path
from harness.runtime.target import TargetRuntime
from methods.eagle3.head import EagleConfig, EagleHead, default_feature_layers, head_tag, target_shape, train_command

EAGLE3_RENAMES = (("fc.", "fuse."), ("midlayer.", "midlayer."), ("norm.", "norm."), ("lm_head.", "head."))
EAGLE3_IGNORED = ("t2d", "embed_tokens.weight")  # t2d follows from d2t; the embedding is always the target's


def _rope_theta(config) -> float | None:
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    parameters = get("rope_parameters") or get("rope_scaling") or {}
    return get("rope_theta") or (parameters.get("rope_theta") if isinstance(parameters, dict) else None)


def is_eagle3_folder(path: Path) -> bool:
    """A folder in the EAGLE-3 authors' format (its config names an Eagle3 architecture; ours never does)."""
    try:
        return any("Eagle3" in a for a in json.loads((path / "config.json").read_text()).get("architectures", []))
    except (OSError, ValueError, AttributeError):
        return False


def read_eagle3(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the weights (model.safetensors, else pytorch_model.bin read weights-only)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder, "an EAGLE-3 head folder")
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(isinstance(a, str) and "Eagle3" in a for a in architectures):
        raise HarnessError(f"{folder} is not an EAGLE-3 head (architectures {architectures}); pass one whose "
                           f"config.json is an object naming LlamaForCausalLMEagle3")
    for name in ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size"):
        if config.get(name) is not None:
            integer(folder / "config.json", name, config[name])
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        name = "eagle_aux_hidden_state_layer_ids"
        config[name] = integers(folder / "config.json", name, config[name])
    try:
        if (folder / "model.safetensors").is_file():
            weights = load_file(str(folder / "model.safetensors"))
        elif (folder / "pytorch_model.bin").is_file():
            weights = load_weights_only(folder / "pytorch_model.bin", "EAGLE-3 weights file")
        else:
            raise HarnessError(f"{folder} has neither model.safetensors nor pytorch_model.bin")
    except HarnessError:
        raise
    except Exception as exc:  # safetensors and torch.load each have their own error types for damaged files
        raise HarnessError(f"{folder}: the weights are not readable ({first_line(exc, 160)}); restore them") from None
    if not isinstance(weights, dict):
        raise HarnessError(f"{folder}: the weights file holds a {type(weights).__name__}, not a state dict")
    check_weights(folder, weights, exempt=("d2t", "t2d"))
    if "d2t" in weights:
        integers(folder, "d2t", weights["d2t"], signed=True)  # target id = draft id + d2t: one whole number each
    return config, weights


def eagle3_config(path: Path, config: dict, target: TargetRuntime, ttt: int):
    """The head's EagleConfig, after checking it against the target."""
    text = target.config
    hidden, vocab, layers = text.hidden_size, text.vocab_size, target.num_layers
    head_dim = getattr(text, "head_dim", None) or hidden // text.num_attention_heads
    checks = (("hidden size", config.get("target_hidden_size") or config.get("hidden_size"), hidden),
              ("head's hidden size", config.get("hidden_size"), hidden), ("vocabulary", config.get("vocab_size"), vocab),
              ("head dimension (rotary)", config.get("head_dim", head_dim), head_dim))
    for name, theirs, ours in checks:
        if theirs != ours:
            raise HarnessError(f"{path} was made for a {name} of {theirs}, the target has {ours}; pass the head of "
                               f"this target")
    theirs, ours = _rope_theta(config), _rope_theta(text)
    if theirs and ours and float(theirs) != float(ours):
        raise HarnessError(f"{path} uses rope theta {theirs}, the target {ours}; the head shares the target's rotary "
                           f"embedding, so pass a head made for this target")
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    features = tuple(captured_state(i) for i in ids) if ids else default_feature_layers(layers)
    if len(features) != 3 or not all(0 <= f <= layers for f in features):
        raise HarnessError(f"{path} reads the outputs of layers {ids} (hidden states {list(features)}); the target "
                           f"has {layers} layers")
    shape = {k: config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "rms_norm_eps") if k in config}
    draft = config.get("draft_vocab_size")
    return EagleConfig(ttt=ttt, num_layers=layers, feature_layers=features, layout="eagle3", shape=shape,
                       target=target.identity.to_dict() if target.identity else {},
                       draft_vocab_size=None if draft in (None, vocab) else int(draft))


def captured_state(layer_id: int) -> int:
    """The hidden state (h[0] the embeddings, h[k] layer k's output) that an `eagle_aux_hidden_state_layer_ids`
    entry names. SGLang and SpecForge capture the output of the layer with that 0-based index, which is the input of
    the next one (SGLang's `set_eagle3_layers_to_capture` keeps `id + 1` and captures before that layer runs): id i
    is h[i + 1]. Heads that state no ids get the default (2, L/2, L-3), taken there as the inputs of those layers,
    h[2], h[L/2], h[L-3]."""
    return layer_id + 1


def layer_id(state: int) -> int:
    """The `eagle_aux_hidden_state_layer_ids` entry that names hidden state h[state] (captured_state's inverse)."""
    return state - 1


def import_eagle3(folder: Path, target: TargetRuntime, ttt: int = 7, force: bool = False) -> Path:
    """Convert an EAGLE-3 head folder into the cache entry of (target, eagle3, ttt, eagle3 layout)."""
    folder = Path(folder)
    config, weights = read_eagle3(folder)
    head_config = eagle3_config(folder, config, target, ttt)
    ours: dict[str, torch.Tensor] = {}
    for key, value in weights.items():
        if key in EAGLE3_IGNORED:
            continue
        if key == "d2t":
            ours["draft_ids"] = torch.arange(len(value)) + value.to(torch.long)
            continue
        renamed = next((mine + key[len(theirs):] for theirs, mine in EAGLE3_RENAMES if key.startswith(theirs)), None)
        if renamed is None:
            raise HarnessError(f"unexpected tensor {key!r} in {folder}; an EAGLE-3 head holds fc, midlayer, norm, "
                               f"lm_head and d2t")
        ours[renamed] = value
    draft = ours.get("draft_ids", torch.empty(0, dtype=torch.long))
    rows = ours["head.weight"].shape[0] if "head.weight" in ours else None
    stated = config.get("draft_vocab_size") or config.get("vocab_size")
    for name, size in (("lm_head rows", rows), ("d2t entries", draft.numel() if "d2t" in weights else None)):
        if size is not None and stated is not None and size != stated:
            raise HarnessError(f"{folder}/config.json states a draft vocabulary of {stated}, but its {name} are "
                               f"{size}; the folder is damaged")
    if draft.numel() == target.config.vocab_size and bool((draft == torch.arange(draft.numel())).all()):
        draft = ours["draft_ids"] = torch.empty(0, dtype=torch.long)  # the identity map: the full vocabulary
    if draft.numel() and (int(draft.min()) < 0 or int(draft.max()) >= target.config.vocab_size):
        raise HarnessError(f"{folder} d2t maps draft ids outside the target's vocabulary")
    ours.setdefault("draft_ids", draft)
    head = EagleHead(head_config, target, draft_ids=draft if draft.numel() else None)
    try:
        head.load_state_dict(ours)
    except RuntimeError as exc:
        raise HarnessError(f"{folder} does not fit an EAGLE-3 head for this target "
                           f"({' '.join(str(exc).split())[:300]})") from None
    return save_imported(head, "eagle3", head_tag(ttt, "eagle3"),
                          {"eagle": head_config.to_dict()}, target, folder, force, {"format": "EAGLE-3 folder"},
                          f"spd-bench import --eagle3 {folder} --force")


EAGLE3_FILES = ("config.json", "model.safetensors")  # all that export_eagle3 writes


def check_export_target(out: Path, replace: bool) -> None:
    """The folder to write: new or empty; with `replace`, one whose files of ours get replaced (nothing else in it
    is touched)."""
    check_out_path(out, folder=True)
    if out.is_dir() and any(out.iterdir()) and not replace:
        raise HarnessError(f"--out {out} is not empty; pass an empty or new folder, or --replace to overwrite its "
                           f"{' and '.join(EAGLE3_FILES)}")


def import_folder(folder: Path, target: TargetRuntime, params, force: bool) -> Path:
    """`spd-bench import --eagle3 DIR`: the folder filed under the head tag of `params.ttt`."""
    return import_eagle3(folder, target, ttt=params.ttt, force=force)


def export_head(model: str, params, checkpoint: str | None, out: Path, replace: bool) -> Path:
    """`spd-bench export-head`: the trained eagle3-layout head of `params.ttt` for `model` (or `checkpoint`)."""
    from transformers import AutoConfig

    from harness.runtime.models import load_identity, resolve_model_dir

    folder, _ = checkpoints.locate(load_identity(model), "eagle3", head_tag(params.ttt, "eagle3"),
                                   train_command(params.ttt, "eagle3"), checkpoint)
    text = AutoConfig.from_pretrained(resolve_model_dir(model)[1]).get_text_config()
    return export_eagle3(folder, out, text, replace)


def export_eagle3(checkpoint: Path, out: Path, text_config, replace: bool = False) -> Path:
    """A harness EAGLE-3 head of the eagle3 layout as the authors' folder (config.json + model.safetensors);
    `text_config` is its target's (vocabulary, rotary embedding, default layer sizes). Both files are written beside
    the target and moved in, so a failure leaves `out` as it was."""
    from safetensors.torch import save_file

    check_export_target(out, replace)
    checkpoint = Path(checkpoint)
    saved = checkpoints.load_config(checkpoint)
    head = saved.get("eagle")
    if head is None:
        raise HarnessError(f"{checkpoint} holds no EAGLE-3 head; pass a folder written by spd-bench train --method eagle3")
    if head.get("layout", "harness") != "eagle3":
        raise HarnessError(f"{checkpoint} is a harness-layout head, which EAGLE-3 code cannot load; train one with "
                           f"--eagle-layout eagle3")
    weights = checkpoints.load_weights(checkpoint)
    draft = weights.pop("draft_ids")
    theirs = {}
    for key, value in weights.items():
        renamed = next((t + key[len(m):] for t, m in EAGLE3_RENAMES if key.startswith(m)), None)
        if renamed is None:
            raise HarnessError(f"{checkpoint} holds tensor {key!r}, which the EAGLE-3 format has no place for")
        theirs[renamed] = value.contiguous()
    rows, vocab = theirs["lm_head.weight"].shape[0], text_config.vocab_size
    ids = draft if draft.numel() else torch.arange(rows)
    theirs["d2t"] = ids - torch.arange(rows)  # target id = draft id + d2t[draft id]
    theirs["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
    shape = target_shape(text_config, head.get("shape", {}))
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": text_config.hidden_size, "target_hidden_size": text_config.hidden_size,
              "num_hidden_layers": 1, **shape, "rope_theta": _rope_theta(text_config),
              "max_position_embeddings": getattr(text_config, "max_position_embeddings", None),
              "vocab_size": vocab, "draft_vocab_size": rows, "hidden_act": "silu", "tie_word_embeddings": False,
              "eagle_aux_hidden_state_layer_ids": [layer_id(f) for f in head["feature_layers"]],
              "spd_bench": {"target": saved.get("target", {}), "ttt": head["ttt"]}}
    with Outputs(replace).staged(out) as staging:  # both files appear or neither
        (staging / EAGLE3_FILES[0]).write_text(json.dumps(config, indent=2))
        save_file(theirs, str(staging / EAGLE3_FILES[1]))
    return out
