"""Reading drafters published in other formats safely, and filing them in the drafter cache as ours.

Foreign files are read as plain tensors only (`torch.load(weights_only=True)`, never unpickled code), their config
values checked to be what they claim (integers, id lists, finite floating-point weights), and the converted drafter
written to the cache with where it came from (file name and sha256), never silently over another drafter. Each
family's interop.py knows its own format (methods/pipeline/interop.py: the reference's v11 SPD heads;
methods/eagle3/interop.py: EAGLE-3 folders).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import torch

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError, first_line
from harness.runtime.target import TargetRuntime


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
    except (RuntimeError, EOFError, ValueError, OSError, KeyError) as exc:
        raise HarnessError(f"{path} is not a readable {what} ({first_line(exc, 160)}); pass a valid file") from None


def read_config(folder: Path, kind: str):
    """A published drafter folder's config.json, or one line saying it is missing or not JSON (`kind`: "an EAGLE-3
    head folder", say)."""
    if not (folder / "config.json").is_file():
        raise HarnessError(f"{folder} has no config.json; pass {kind}")
    try:
        return json.loads((folder / "config.json").read_text())
    except ValueError as exc:
        raise HarnessError(f"{folder}/config.json is not JSON ({exc}); restore the file") from None


def integer(path: Path, name: str, value, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise HarnessError(f"{path}: config {name} must be an integer >= {low}, got {value!r}; the file is damaged "
                           f"or not of this format")
    return value


def integers(path: Path, name: str, value, signed: bool = False) -> list[int]:
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


def save_imported(module, method: str, tag: str, section: dict, target: TargetRuntime, source: Path,
                   force: bool, about: dict, replace_with: str) -> Path:
    """Write an imported drafter to the cache with where it came from; never silently over another drafter
    (`replace_with`: the command that does replace it)."""
    identity = target.identity.to_dict() if target.identity else {}
    folder = checkpoints.drafter_dir(target.identity, method, tag)
    digest = sha256(source) if source.is_file() else _folder_sha256(source)
    if (folder / checkpoints.CONFIG).exists() and not force:
        if checkpoints.load_config(folder).get("source", {}).get("sha256") != digest:
            raise HarnessError(f"{folder} already holds another drafter; replace it with `{replace_with}`, or pass "
                               f"that folder as --checkpoint")
    checkpoints.save(folder, module, {**section, "target": identity, "method": method,
                                      "source": {"file": source.name, "sha256": digest, **about}})
    return folder


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _folder_sha256(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(path.name.encode())
        digest.update(sha256(path).encode())
    return digest.hexdigest()

