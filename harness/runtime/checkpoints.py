"""Drafter checkpoints: safetensors weights plus a JSON config that names the target they were trained for."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from harness.runtime.errors import HarnessError
from harness.runtime.paths import cache_dir

SHIPPED = Path(__file__).resolve().parents[2] / "drafters"  # drafters the main job needs, shipped in the repository
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
TRAIN_STATE = "train_state.safetensors"  # optimiser state, for --resume


def drafter_dir(identity, method: str, tag: str) -> Path:
    """Cache folder of a drafter, keyed by target weights and method configuration (e.g. `n8-ls4-input`)."""
    return cache_dir() / "drafters" / identity.slug / f"{method}-{tag}"


def recover(folder: Path) -> None:
    """Put back the previous checkpoint when a run was killed between `save`'s two renames (no folder, its .old
    beside it), so the last checkpoint is never lost."""
    old = folder.with_name(f".{folder.name}.old")
    if not folder.exists() and old.exists():
        os.replace(old, folder)


def save(folder: Path, module: torch.nn.Module, config: dict, extra: dict[str, torch.Tensor] | None = None) -> None:
    """Write weights (+ optional extra tensors, e.g. optimizer state) and config atomically (temp dir + rename)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    tensors = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    save_file(tensors, tmp / WEIGHTS)
    if extra:
        save_file({k: v.contiguous().cpu() for k, v in extra.items()}, tmp / TRAIN_STATE)
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    old = folder.with_name(f".{folder.name}.old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def shipped_dir(identity, method: str, tag: str) -> Path:
    """Where a drafter shipped in the repository for this target lives (bf16 weights + config)."""
    return SHIPPED / identity.name.replace("/", "--") / f"{method}-{tag}"


def find(identity, method: str, tag: str, checkpoint: str | None = None) -> Path:
    """The drafter's folder: `checkpoint` if given, else the cache entry, else the shipped one, else the cache path
    (where `spd-bench train` would write it)."""
    if checkpoint:
        return Path(checkpoint)
    cached = drafter_dir(identity, method, tag)
    shipped = shipped_dir(identity, method, tag)
    return shipped if not (cached / CONFIG).exists() and (shipped / CONFIG).exists() else cached


def load_config(folder: Path) -> dict:
    path = Path(folder) / CONFIG
    if not path.exists():
        raise HarnessError(f"{folder} is not a drafter checkpoint (no {CONFIG}); pass a folder written by spd-bench train")
    try:
        return json.loads(path.read_text())
    except (ValueError, OSError) as exc:
        raise HarnessError(f"{path} is not a readable drafter config ({exc}); retrain or restore it") from None


def load_weights(folder: Path, name: str = WEIGHTS) -> dict[str, torch.Tensor]:
    path = Path(folder) / name
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for every kind of damage
        raise HarnessError(f"{path} is not a readable safetensors file ({exc}); retrain or restore it") from None


def config_section(folder: Path, saved: dict, name: str, config_class, wanted: str):
    """The drafter config under `name` (e.g. "speculator") as `config_class`, or one line saying what the folder
    holds instead (`wanted` names the kind expected, e.g. "an EAGLE-3 head")."""
    if name not in saved:
        raise HarnessError(f"{folder} holds a {saved.get('method', 'different')} drafter, not {wanted}; pass a "
                           f"checkpoint of that kind")
    try:
        return config_class(**saved[name])
    except (TypeError, ValueError) as exc:
        raise HarnessError(f"{folder}/{CONFIG} has an invalid {name} config ({exc}); retrain it") from None


def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], folder: Path) -> None:
    """Load a checkpoint's weights into the module its config describes, or say which file does not fit."""
    try:
        module.load_state_dict(weights)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else "mismatched tensors"
        raise HarnessError(f"{Path(folder) / WEIGHTS} does not fit its config ({first}); retrain it") from None


SHIP_LIMIT = 40_000_000  # bytes of weights a drafter shipped in the repository may take


def ship(folder: Path, dest: Path) -> Path:
    """Copy a trained drafter into `dest` as the repository ships it: bf16 weights (the draft vocabulary stays
    int64) and its config, without the optimiser state; written atomically, refused over SHIP_LIMIT."""
    weights = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_weights(folder).items()}
    size = sum(v.numel() * v.element_size() for v in weights.values())
    if size > SHIP_LIMIT:
        raise HarnessError(f"{folder} takes {size / 1e6:.1f} MB in bf16, over the {SHIP_LIMIT / 1e6:.0f} MB a shipped "
                           f"drafter may take; train a smaller one (--aggr-bounds, a smaller --draft-vocab)")
    config = load_config(folder)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}-"))
    save_file({k: v.contiguous() for k, v in weights.items()}, tmp / WEIGHTS)
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(tmp, dest)
    return dest


def fingerprint(folder: Path) -> str:
    """Short hash of a drafter's weights: part of a run's config key, so a retrained drafter never passes for a
    finished run."""
    digest = hashlib.sha256()
    with open(Path(folder) / WEIGHTS, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def check_target(config: dict, identity, folder: Path | None = None) -> None:
    trained_for = config.get("target", {})
    if identity is not None and trained_for.get("weights_sha256") != identity.weights_sha256:
        raise HarnessError(
            f"drafter{f' {folder}' if folder else ''} was trained for {trained_for.get('name')} "
            f"({str(trained_for.get('weights_sha256'))[:12]}) "
            f"but the target is {identity.name} ({identity.weights_sha256[:12]}); train one for this target"
        )


def locate(identity, method: str, tag: str, train_command: str, checkpoint: str | None) -> tuple[Path, dict]:
    """A drafter's folder and config: `checkpoint` if given, else the cache entry for (target, method, tag), else the
    shipped one."""
    folder = find(identity, method, tag, checkpoint)
    if not (folder / CONFIG).exists():
        if checkpoint:
            raise HarnessError(f"checkpoint {folder} not found; pass a folder written by spd-bench train")
        raise HarnessError(f"no {method} drafter for {identity.name} with {tag}; train one with: {train_command}")
    saved = load_config(folder)
    check_target(saved, identity, folder)
    return folder, saved
