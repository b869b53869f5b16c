"""Published drafters as this harness's own, and ours in their format: the reference's SPD speculation heads
("v11" `.pt` files) and EAGLE-3 heads (the authors' and SpecForge's folders, both ways).

A v11 file is `{"state_dict", "config"}` of plain tensors (read with `torch.load(weights_only=True)`, never
unpickled): `aggr_projs.{i}` (projection i reads the features at `aggr_feature_bound[0..i]`), `spec_layers.{j}.*`
(the target's layer class forced to full attention; Qwen3-style layers for Llama targets), `lm_head` over the
ascending `draft_token_ids`. It maps onto the speculator's bounds configuration (methods/pipeline/speculator.py) key by key;
the converted drafter is written to the cache as safetensors with a config naming the target and the source file's
sha256, so `run`, `sweep` and `report` use it like a trained one (input schedule, the reference's).

An EAGLE-3 folder (`config.json` naming LlamaForCausalLMEagle3, `model.safetensors` or `pytorch_model.bin` read
weights-only) maps onto the head's eagle3 layout (methods/eagle3/head.py): `fc` -> `fuse`, `midlayer.*` and `norm` as
they are, `lm_head` -> `head`, `d2t` -> the draft ids; features at `eagle_aux_hidden_state_layer_ids` (default 2,
L/2, L-3). Heads trained here in that layout export back to the same folder format.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
from pathlib import Path

import torch

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError, first_line
from harness.runtime.paths import check_out_path
from harness.runtime.target import TargetRuntime

VERSION = 11
RENAMES = (("aggr_projs.", "projections."), ("spec_layers.", "layers."), ("lm_head.", "head."))
NATIVE_QWEN3_LAYERS = ("qwen3", "qwen3_5", "qwen3_5_text")  # targets whose own layers carry q/k norms


def load_weights_only(path: Path, what: str):
    """`torch.load(weights_only=True)`: plain tensors, lists, numbers and strings, never code objects."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "unsupported global" in str(exc).lower():  # a class or function the file would construct
            raise HarnessError(f"{path} holds code objects besides tensors (a full pickle), which are refused: only "
                               f"plain tensors are read; save its state_dict and config alone") from None
        raise HarnessError(f"{path} is not a readable {what} (not a torch file of plain tensors); pass a valid "
                           f"file") from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise HarnessError(f"{path} is not a readable {what} ({first_line(exc, 160)}); pass a valid file") from None


def _integer(path: Path, name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HarnessError(f"{path}: config {name} must be an integer >= {low}, got {value!r}; the file is damaged "
                           f"or not of this format")
    return value


def _integers(path: Path, name: str, value, signed: bool = False) -> list[int]:
    """A flat list of integers, non-negative unless `signed` (a list, or a 1-D integer tensor)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise HarnessError(f"{path}: {name} must be a 1-D tensor of integer ids, got {value.dtype} of shape "
                               f"{list(value.shape)}")
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise HarnessError(f"{path}: {name} must be a list of integers, got {str(value)[:60]!r}")
    if not signed and any(v < 0 for v in value):
        raise HarnessError(f"{path}: {name} holds negative values; the file is damaged")
    return list(value)


def check_weights(path: Path, weights: dict, exempt: tuple[str, ...] = ()) -> None:
    """Every tensor (but the id maps in `exempt`) floating point and finite: an int8 or NaN weight is refused, not
    cast or carried into decoding."""
    for key, value in weights.items():
        if key in exempt:
            continue
        if not isinstance(value, torch.Tensor):
            raise HarnessError(f"{path}: {key} is a {type(value).__name__}, not a tensor")
        if not value.is_floating_point():
            raise HarnessError(f"{path}: weight {key} is {str(value.dtype).removeprefix('torch.')}, not floating "
                               f"point; pass the unquantized head")
        if not bool(torch.isfinite(value).all()):
            raise HarnessError(f"{path}: weight {key} holds NaN or infinite values; the head is damaged")


def read_v11(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The file's config and state dict, or one line saying why it is not a v11 speculation head."""
    if not path.is_file():
        raise HarnessError(f"{path} is not a file; pass a reference speculation head such as Qwen3.5-4B_s8_l4.pt")
    saved = load_weights_only(path, "speculation head")
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict) or not isinstance(
            saved.get("state_dict"), dict):
        raise HarnessError(f"{path} holds no {{'state_dict', 'config'}} pair; pass a v11 speculation head")
    config, state = saved["config"], saved["state_dict"]
    if config.get("version") != VERSION:
        raise HarnessError(f"{path} is a version {config.get('version')} speculation head; only version {VERSION} "
                           f"is supported")
    missing = [k for k in ("hidden_size", "vocab_size", "num_stages", "num_spec_layers", "aggr_feature_bound")
               if k not in config]
    if missing:
        raise HarnessError(f"{path} config lacks {', '.join(missing)}; the file is not a complete v11 head")
    for name in ("hidden_size", "vocab_size", "num_stages", "num_spec_layers"):
        _integer(path, f"{name}", config[name])
    config["aggr_feature_bound"] = _integers(path, "aggr_feature_bound", config["aggr_feature_bound"])
    if config.get("draft_token_ids") is not None:
        config["draft_token_ids"] = _integers(path, "draft_token_ids", config["draft_token_ids"])
    check_weights(path, state)
    return config, state


def check_against(path: Path, config: dict, target: TargetRuntime) -> None:
    """Hidden size, vocabulary and stage split must fit the target."""
    hidden, vocab, layers = target.config.hidden_size, target.config.vocab_size, target.num_layers
    n = int(config["num_stages"])
    for name, theirs, ours in (("hidden size", config["hidden_size"], hidden),
                               ("vocabulary", config["vocab_size"], vocab)):
        if int(theirs) != ours:
            raise HarnessError(f"{path} was made for a {name} of {theirs}, the target has {ours}; pass the head of "
                               f"this target")
    if n < 1 or layers % n:
        raise HarnessError(f"{path} splits into {n} stages, which does not divide the target's {layers} layers")


def to_harness(config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict under this harness's names (plus the draft vocabulary buffer)."""
    renamed = {}
    for key, value in state.items():
        for theirs, ours in RENAMES:
            if key.startswith(theirs):
                renamed[ours + key[len(theirs):]] = value
                break
        else:
            raise HarnessError(f"unexpected tensor {key!r} in the speculation head; only aggr_projs, spec_layers and "
                               f"lm_head belong in a v11 file")
    ids = config.get("draft_token_ids")
    renamed["draft_ids"] = torch.as_tensor(ids if ids is not None else [], dtype=torch.long)
    return renamed


def import_spd(path: Path, target: TargetRuntime, force: bool = False, expect: tuple[int, int] | None = None) -> Path:
    """Convert `path` into the cache entry of (target, spd, n, Ls, input); returns its folder. `expect`: the run's
    (n, Ls), checked before anything is written."""
    from methods.pipeline.speculator import Speculator, SpeculatorConfig

    path = Path(path)
    config, state = read_v11(path)
    check_against(path, config, target)
    n, ls = int(config["num_stages"]), int(config["num_spec_layers"])
    if expect is not None and (n, ls) != tuple(expect):
        raise HarnessError(f"{path} is a head for n={n}, Ls={ls}; pass --n {n} --ls {ls}")
    identity = target.identity.to_dict() if target.identity else {}
    weights = to_harness(config, state)
    draft = weights["draft_ids"]
    if draft.numel() and (bool((draft[1:] <= draft[:-1]).any()) or int(draft[-1]) >= target.config.vocab_size):
        raise HarnessError(f"{path} draft_token_ids must rise strictly inside the vocabulary of "
                           f"{target.config.vocab_size}")
    model_type = getattr(target.config, "model_type", "")
    try:
        spec_config = SpeculatorConfig(
            n=n, ls=ls, schedule="input", num_layers=target.num_layers, target=identity,
            draft_vocab_size=int(draft.numel()) or None, aggr_bounds=tuple(int(b) for b in config["aggr_feature_bound"]),
            layer_kind="target" if model_type in NATIVE_QWEN3_LAYERS else "qwen3")
    except ValueError as exc:
        raise HarnessError(f"{path}: {exc}") from None
    module = Speculator(spec_config, target, draft_ids=draft if draft.numel() else None)
    try:
        module.load_state_dict(weights)
    except RuntimeError as exc:
        detail = " ".join(str(exc).split())[:300]
        raise HarnessError(f"{path} does not fit a v11 head of n={n}, Ls={ls} for this target ({detail})") from None
    return _save_imported(module, "spd", f"n{n}-ls{ls}-input", {"speculator": spec_config.to_dict()}, target, path,
                          force, {"format": f"reference v{VERSION}", "base_model_path": config.get("base_model_path")},
                          f"spd-bench import --spd {path} --force")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# --- EAGLE-3 heads (the EAGLE authors' and SpecForge's folder format) -------------------------------------------
EAGLE3_RENAMES = (("fc.", "fuse."), ("midlayer.", "midlayer."), ("norm.", "norm."), ("lm_head.", "head."))
EAGLE3_IGNORED = ("t2d", "embed_tokens.weight")  # t2d follows from d2t; the embedding is always the target's


def _rope_theta(config) -> float | None:
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    parameters = get("rope_parameters") or get("rope_scaling") or {}
    return get("rope_theta") or (parameters.get("rope_theta") if isinstance(parameters, dict) else None)


def read_eagle3(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and the weights (model.safetensors, else pytorch_model.bin read weights-only)."""
    from safetensors.torch import load_file

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise HarnessError(f"{folder} has no config.json; pass an EAGLE-3 head folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise HarnessError(f"{folder}/config.json is not JSON ({exc}); restore the file") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not isinstance(architectures, list) or not any(isinstance(a, str) and "Eagle3" in a for a in architectures):
        raise HarnessError(f"{folder} is not an EAGLE-3 head (architectures {architectures}); pass one whose "
                           f"config.json is an object naming LlamaForCausalLMEagle3")
    for name in ("hidden_size", "target_hidden_size", "vocab_size", "draft_vocab_size", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size"):
        if config.get(name) is not None:
            _integer(folder / "config.json", name, config[name])
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:
        name = "eagle_aux_hidden_state_layer_ids"
        config[name] = _integers(folder / "config.json", name, config[name])
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
        _integers(folder, "d2t", weights["d2t"], signed=True)  # target id = draft id + d2t: one whole number each
    return config, weights


def eagle3_config(path: Path, config: dict, target: TargetRuntime, ttt: int):
    """The head's EagleConfig, after checking it against the target."""
    from methods.eagle3.head import EagleConfig, default_feature_layers

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
    features = tuple(config.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(layers))
    if len(features) != 3 or not all(0 <= f <= layers for f in features):
        raise HarnessError(f"{path} reads hidden states {list(features)}; the target has {layers} layers")
    shape = {k: config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                    "rms_norm_eps") if k in config}
    draft = config.get("draft_vocab_size")
    return EagleConfig(ttt=ttt, num_layers=layers, feature_layers=features, layout="eagle3", shape=shape,
                       target=target.identity.to_dict() if target.identity else {},
                       draft_vocab_size=None if draft in (None, vocab) else int(draft))


def import_eagle3(folder: Path, target: TargetRuntime, ttt: int = 7, force: bool = False) -> Path:
    """Convert an EAGLE-3 head folder into the cache entry of (target, eagle3, ttt, eagle3 layout)."""
    from methods.eagle3.head import EagleHead
    from methods.eagle3.method import EagleParams

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
    return _save_imported(head, "eagle3", EagleParams(ttt=ttt, layout="eagle3").tag,
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


def export_eagle3(checkpoint: Path, out: Path, text_config, replace: bool = False) -> Path:
    """A harness EAGLE-3 head of the eagle3 layout as the authors' folder (config.json + model.safetensors);
    `text_config` is its target's (vocabulary, rotary embedding, default layer sizes). Both files are written beside
    the target and moved in, so a failure leaves `out` as it was."""
    from safetensors.torch import save_file

    from methods.eagle3.head import target_shape

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
              "eagle_aux_hidden_state_layer_ids": list(head["feature_layers"]),
              "spd_bench": {"target": saved.get("target", {}), "ttt": head["ttt"]}}
    out.mkdir(parents=True, exist_ok=True)  # with the user's umask, as any folder they make
    staged = [Path(tempfile.mkstemp(dir=out, prefix=f".{name}-")[1]) for name in EAGLE3_FILES]
    try:
        (staged[0]).write_text(json.dumps(config, indent=2))
        save_file(theirs, str(staged[1]))
        mode = 0o666 & ~_umask()
        for tmp, name in zip(staged, EAGLE3_FILES):
            os.chmod(tmp, mode)
            os.replace(tmp, out / name)
    finally:
        for tmp in staged:
            tmp.unlink(missing_ok=True)
    return out


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _save_imported(module, method: str, tag: str, section: dict, target: TargetRuntime, source: Path,
                   force: bool, about: dict, replace_with: str) -> Path:
    """Write an imported drafter to the cache with where it came from; never silently over another drafter
    (`replace_with`: the command that does replace it)."""
    identity = target.identity.to_dict() if target.identity else {}
    folder = checkpoints.drafter_dir(target.identity, method, tag)
    digest = _sha256(source) if source.is_file() else _folder_sha256(source)
    if (folder / checkpoints.CONFIG).exists() and not force:
        if checkpoints.load_config(folder).get("source", {}).get("sha256") != digest:
            raise HarnessError(f"{folder} already holds another drafter; replace it with `{replace_with}`, or pass "
                               f"that folder as --checkpoint")
    checkpoints.save(folder, module, {**section, "target": identity, "method": method,
                                      "source": {"file": source.name, "sha256": digest, **about}})
    return folder


def _folder_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(_sha256(path).encode())
    return digest.hexdigest()
