"""Medusa heads published by the Medusa authors (FasterDecoding), imported into the drafter cache.

A head folder holds `config.json` (`medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path`) and
`medusa_lm_head.safetensors`, or `medusa_lm_head.pt` read weights-only: head i is a Sequential of its residual
blocks (`i.j.linear.weight`/`bias`; the authors' code repeats one block object, so every j may hold the same
tensors) and its LM head `i.{layers}.weight` over the full vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.foreign import check_weights, integer, load_weights_only, read_config, save_imported
from harness.runtime.target import TargetRuntime
from methods.medusa.heads import MedusaConfig, MedusaHeads, heads_tag

WEIGHT_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_medusa_folder(path: Path) -> bool:
    """A folder in the Medusa authors' format (its config names medusa_num_heads; ours never does)."""
    try:
        return "medusa_num_heads" in json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def read_medusa(folder: Path) -> tuple[int, int, dict[str, torch.Tensor]]:
    """(heads, blocks per head, weights) of a Medusa head folder, or one line saying what is wrong."""
    from safetensors.torch import load_file

    folder = Path(folder)
    config = read_config(folder, "a Medusa head folder")
    if not isinstance(config, dict) or "medusa_num_heads" not in config:
        raise HarnessError(f"{folder} is not a Medusa head folder (its config.json names no medusa_num_heads)")
    heads = integer(folder / "config.json", "medusa_num_heads", config["medusa_num_heads"])
    layers = integer(folder / "config.json", "medusa_num_layers", config.get("medusa_num_layers", 1))
    found = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not found:
        raise HarnessError(f"{folder} has neither {' nor '.join(WEIGHT_FILES)}; pass a complete Medusa head folder")
    path = found[0]
    try:
        weights = load_file(str(path)) if path.suffix == ".safetensors" else load_weights_only(path, "Medusa head")
    except HarnessError:
        raise
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        raise HarnessError(f"{path} is not a readable safetensors file ({str(exc)[:160]}); pass a valid file") from None
    if not isinstance(weights, dict):
        raise HarnessError(f"{path} holds a {type(weights).__name__}, not a state dict of tensors")
    check_weights(path, weights)
    return heads, layers, weights


def import_medusa(folder: Path, target: TargetRuntime, force: bool = False) -> tuple[Path, int]:
    """Convert a Medusa head folder into the cache entry of (target, medusa, its head count)."""
    folder = Path(folder)
    heads, layers, weights = read_medusa(folder)
    ours = {"draft_ids": torch.empty(0, dtype=torch.long)}
    for i in range(heads):
        for j in range(layers):
            for part in ("weight", "bias"):
                ours[f"blocks.{i}.{j}.linear.{part}"] = _tensor(weights, f"{i}.{j}.linear.{part}", folder)
        ours[f"projections.{i}.weight"] = _tensor(weights, f"{i}.{layers}.weight", folder)
    config = MedusaConfig(heads=heads, layers=layers, num_layers=target.num_layers, own_heads=True,
                          target=target.identity.to_dict() if target.identity else {})
    module = MedusaHeads(config, target)
    try:
        module.load_state_dict(ours)
    except RuntimeError as exc:
        raise HarnessError(f"{folder} does not fit Medusa heads for this target "
                           f"({' '.join(str(exc).split())[:300]})") from None
    saved = save_imported(module, "medusa", heads_tag(heads), {"medusa": config.to_dict()}, target, folder, force,
                          {"format": "Medusa head folder"}, f"spd-bench import --medusa {folder} --force")
    return saved, heads


def import_folder(folder: Path, target: TargetRuntime, params, force: bool) -> Path:
    """`spd-bench import --medusa DIR`: filed under the folder's own head count."""
    return import_medusa(folder, target, force)[0]


def _tensor(weights: dict, key: str, folder: Path) -> torch.Tensor:
    if key not in weights:
        raise HarnessError(f"{folder}: the Medusa weights have no {key}; the folder is damaged or of another "
                           f"medusa_num_layers")
    return weights[key]
