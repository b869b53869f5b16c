"""The teacher's outputs on disk: one frozen-target pass per training chunk, reused by every later epoch and run.

A chunk's file holds its token ids, the hidden states at the layers drafters read (bf16: drafters train under bf16
autocast, so their projections see bf16 inputs anyway) and the target's final normed state plus the log-normaliser
of its next-token logits (float32), from which any draft vocabulary's probabilities are recomputed exactly:
p[v] = exp(lm_head[v] . state - lse). A folder serves one (target, corpus, sequence length); a file whose ids differ
from the chunk's, or that lacks a layer now asked for, is recomputed (with the union of the layers). Files are
written whole (temporary file, then rename), so a killed run leaves no torn file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness.runtime.errors import HarnessError
from harness.runtime.paths import cache_dir
from harness.runtime.target import TargetRuntime

FINAL, LSE, IDS = "final", "lse", "ids"


@dataclass
class TeacherBatch:
    """What a drafter's training step reads: features {layer: [B, S, D]} (float32) and the target's
    next-token probabilities over the draft vocabulary [B, S, V']."""

    features: dict[int, torch.Tensor]
    p_draft: torch.Tensor


def bytes_per_token(hidden: int, layers: int) -> int:
    """A chunk file's bytes per token (less its header): `layers` hidden states in bf16, the final normed state and
    the log-normaliser in float32, the id in int64."""
    return 2 * hidden * layers + 4 * hidden + 4 + 8


def folder(target: TargetRuntime, corpus: str, seq_len: int) -> Path:
    identity = target.identity
    return cache_dir() / "features" / f"{identity.name}-{identity.weights_sha256[:12]}" / f"{corpus}-s{seq_len}"


def teacher_pass(target: TargetRuntime, ids: torch.Tensor, layers: tuple[int, ...]
                 ) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Frozen target on a batch [B, S]: hidden states at `layers`, final normed state [B, S, D] and the
    log-normaliser [B, S] of the next-token logits (all float32: drafters train in float32 whatever the target's
    dtype)."""
    target.reset()
    h = target.backbone.embed_tokens(ids)
    h, captured = target.run_layers(0, target.num_layers, h, range(ids.shape[1]), capture=layers)
    final = target.backbone.norm(h)
    lse = torch.logsumexp(target.model.lm_head(final).float(), dim=-1)
    return {k: v.float() for k, v in captured.items()}, final.float(), lse


def draft_probabilities(target: TargetRuntime, final: torch.Tensor, lse: torch.Tensor, draft_ids) -> torch.Tensor:
    """The target's next-token probabilities over the draft vocabulary (all of it when `draft_ids` is None)."""
    weight = target.model.lm_head.weight
    weight = weight if draft_ids is None else weight[draft_ids.to(weight.device)]
    return torch.exp(final @ weight.float().T - lse[..., None])


class FeatureCache:
    """Teacher outputs of the run's chunks (by index), computed once and read back on every later visit
    (`store=False`: computed on every visit, nothing written; `offline`: never computed, a chunk must be on disk)."""

    def __init__(self, target: TargetRuntime, corpus: str, seq_len: int, layers: tuple[int, ...], draft_ids,
                 store: bool = True, root: Path | None = None, offline: bool = False):
        self.target, self.layers, self.draft_ids, self.store, self.offline = target, layers, draft_ids, store, offline
        self.root = root or folder(target, corpus, seq_len)
        if store:
            self.root.mkdir(parents=True, exist_ok=True)
        self.computed = self.read = 0  # chunks passed through the teacher / loaded from disk this run

    def batch(self, index: list[int], ids: torch.Tensor) -> TeacherBatch:
        """Teacher outputs of chunks `index` (their ids [B, S]): from disk where cached, else computed and stored."""
        loaded = [self._load(i, ids[row]) if self.store else (None, set()) for row, i in enumerate(index)]
        rows = [row for row, _ in loaded]
        missing = [row for row, got in enumerate(rows) if got is None]
        if missing and self.offline:
            raise HarnessError(f"--teacher offline: chunk {index[missing[0]]} is not in the feature cache "
                               f"{self.root} with layers {list(self.layers)}; prepare it with the same command and "
                               f"--prepare-features")
        if missing:  # a file's other layers are recomputed too, so no run loses the layers it cached
            layers = tuple(sorted(set(self.layers).union(*(kept for _, kept in loaded))))
            features, final, lse = teacher_pass(self.target, ids[missing], layers)
            # Stored features are bf16: a computed visit rounds them alike, so a run reads what it would compute.
            kept = torch.bfloat16 if self.store else torch.float32
            for k, row in enumerate(missing):
                rows[row] = ({layer: h[k].to(kept) for layer, h in features.items()}, final[k], lse[k])
                if self.store:
                    self._store(index[row], ids[row], rows[row])
            self.computed += len(missing)
        device = self.target.device
        features = {layer: torch.stack([r[0][layer] for r in rows]).to(device).float() for layer in self.layers}
        final, lse = (torch.stack([r[j] for r in rows]).to(device) for j in (1, 2))
        return TeacherBatch(features, draft_probabilities(self.target, final, lse, self.draft_ids))

    def absent(self, indices) -> list[int]:
        """The chunks of `indices` with no file (a cheap check before an offline run; `batch` checks contents)."""
        return [i for i in indices if not self._path(i).exists()]

    def bytes_on_disk(self, indices) -> int:
        return sum(self._path(i).stat().st_size for i in indices if self._path(i).exists())

    def _path(self, index: int) -> Path:
        return self.root / f"chunk-{index:07d}.safetensors"

    def _load(self, index: int, ids: torch.Tensor) -> tuple[tuple | None, set[int]]:
        """The chunk's stored row, or None (a miss) with the layers its file holds (to keep when rewriting it)."""
        path = self._path(index)
        if not path.exists():
            return None, set()
        try:
            with safe_open(str(path), framework="pt") as f:
                if not torch.equal(f.get_tensor(IDS), ids.cpu()):
                    return None, set()
                cached = {int(name[1:]) for name in f.keys() if name.startswith("h")}  # noqa: SIM118 (safe_open)
                if not set(self.layers) <= cached:
                    return None, cached
                self.read += 1
                return ({layer: f.get_tensor(f"h{layer}") for layer in self.layers}, f.get_tensor(FINAL),
                        f.get_tensor(LSE)), cached
        except Exception:  # noqa: BLE001 - an unreadable file is only a cache miss: it is recomputed and rewritten
            return None, set()

    def _store(self, index: int, ids: torch.Tensor, row) -> None:
        features, final, lse = row
        tensors = {f"h{layer}": h.cpu().contiguous() for layer, h in features.items()}
        tensors.update({IDS: ids.cpu().contiguous(), FINAL: final.cpu().contiguous(), LSE: lse.cpu().contiguous()})
        path = self._path(index)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        save_file(tensors, str(partial))
        os.replace(partial, path)
