"""The reference's SPD speculation heads ("v11" `.pt` files) as this harness's own drafters.

A v11 file is `{"state_dict", "config"}` of plain tensors (read with `torch.load(weights_only=True)`, never
unpickled): `aggr_projs.{i}` (projection i reads the features at `aggr_feature_bound[0..i]`), `spec_layers.{j}.*`
(the target's layer class forced to full attention; Qwen3-style layers for Llama targets), `lm_head` over the
ascending `draft_token_ids`. It maps onto the speculator's bounds configuration (methods/pipeline/speculator.py) key by key;
the converted drafter is written to the cache as safetensors with a config naming the target and the source file's
sha256, so `run`, `sweep` and `report` use it like a trained one (input schedule, the reference's).
"""

from __future__ import annotations

from pathlib import Path

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.foreign import check_weights, integer, integers, load_weights_only, save_imported
from harness.runtime.target import TargetRuntime
from methods.pipeline.speculator import Speculator, SpeculatorConfig, drafter_tag

VERSION = 11
RENAMES = (("aggr_projs.", "projections."), ("spec_layers.", "layers."), ("lm_head.", "head."))
NATIVE_QWEN3_LAYERS = ("qwen3", "qwen3_5", "qwen3_5_text")  # targets whose own layers carry q/k norms


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
        integer(path, f"{name}", config[name])
    config["aggr_feature_bound"] = integers(path, "aggr_feature_bound", config["aggr_feature_bound"])
    if config.get("draft_token_ids") is not None:
        config["draft_token_ids"] = integers(path, "draft_token_ids", config["draft_token_ids"])
    check_weights(path, state)
    return config, state


def check_draft_vocab(path: Path, config: dict, state: dict[str, torch.Tensor]) -> None:
    """The draft vocabulary's size as the config states it, its id list and the LM head's rows all agree."""
    head = state.get("lm_head.weight")
    rows = int(head.shape[0]) if isinstance(head, torch.Tensor) and head.dim() == 2 else None
    ids = config.get("draft_token_ids")
    stated = config.get("draft_vocab_size")
    sizes = {"lm_head rows": rows, "draft_token_ids": None if ids is None else len(ids),
             "draft_vocab_size": None if stated is None else integer(path, "draft_vocab_size", stated)}
    if ids is None and rows is not None:
        sizes["vocab_size"] = config["vocab_size"]  # no id list: the head spans the full vocabulary
    known = {name: size for name, size in sizes.items() if size is not None}
    if len(set(known.values())) > 1:
        listed = ", ".join(f"{name} {size}" for name, size in known.items())
        raise HarnessError(f"{path} contradicts itself on the draft vocabulary ({listed}); the file is damaged")


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
    check_draft_vocab(path, config, state)
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
    return save_imported(module, "spd", drafter_tag(n, ls, "input"), {"speculator": spec_config.to_dict()}, target, path,
                          force, {"format": f"reference v{VERSION}", "base_model_path": config.get("base_model_path")},
                          f"spd-bench import --spd {path} --force")
