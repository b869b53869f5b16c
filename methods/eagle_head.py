"""The EAGLE-3 draft head and its training-time-test forward.

A head row for the token at position r reads the token's embedding and one feature: the fused low/mid/high target
hidden states of position r-1 (rows the target verified) or, when drafting beyond the first token, the head's own
output for the row before it. One decoder layer of the target's shape, the target's final norm and a trainable head
(optional draft vocabulary) predict the token at r+1. Decoding (methods/eagle3.py) and training (`ttt_logits`) go
through the same `rows`, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from harness.target import TargetRuntime
from methods.draft_module import DraftModule


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, mid and high target layers (outputs h[k], pre-norm), near 2, L/2 and L-3 as in EAGLE-3."""
    return min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)


@dataclass
class EagleConfig:
    ttt: int = 7  # training-time-test steps the head was trained to draft from its own states
    num_layers: int = 0
    feature_layers: tuple[int, ...] = ()
    target: dict = field(default_factory=dict)  # name + weights_sha256 of the target it was trained for
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if self.ttt < 1:
            raise ValueError(f"ttt steps must be >= 1, got {self.ttt}")
        self.feature_layers = tuple(self.feature_layers) or default_feature_layers(self.num_layers)
        if len(self.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {self.feature_layers}")

    def all_feature_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.feature_layers)))

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(DraftModule):
    """fuse(low, mid, high) -> combine with the token embedding -> one decoder layer -> target norm -> head."""

    def __init__(self, config: EagleConfig, target: TargetRuntime, draft_ids: torch.Tensor | None = None):
        super().__init__(target, 1, draft_ids)
        self.config = config
        hidden = target.config.hidden_size
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        self.combine = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the high feature plus the embedding": training refines it
            self.fuse.weight.zero_()
            self.fuse.weight[:, 2 * hidden:].copy_(torch.eye(hidden))
            self.combine.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
        self.to(device=target.device, dtype=target.dtype)

    def fused(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target features {layer: [..., D]} -> the head's feature input [..., D]."""
        return self.fuse(torch.cat([features[layer] for layer in self.config.feature_layers], dim=-1))

    def rows(self, token_embeddings: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Head rows [B, R, D] (embedding, feature) at `positions`; returns their output states (pre-norm)."""
        x = torch.cat([token_embeddings.to(feature.dtype), feature], dim=-1)  # the embedding table is the target's
        return self.decode(self.combine(x), positions, mask, cache)


class ConcatCache:
    """KV of earlier training-time-test steps, concatenated without in-place writes (autograd sees through it)."""

    def __init__(self):
        self.keys = self.values = None

    def update(self, key, value, layer_idx, **_):
        self.keys = key if self.keys is None else torch.cat([self.keys, key], dim=2)
        self.values = value if self.values is None else torch.cat([self.values, value], dim=2)
        return self.keys, self.values


def ttt_mask(size: int, step: int, device=None) -> torch.Tensor:
    """[S, step * S]: step-k rows see the target-feature rows (step 1) causally and their own chain's rows of
    steps 2..k (the same chain root t), exactly what a k-th draft row sees at decode time."""
    t = torch.arange(size, device=device)
    blocks = [t[None, :] <= t[:, None]] + [t[None, :] == t[:, None]] * (step - 1)
    return torch.cat(blocks, dim=1)


def ttt_logits(head: EagleHead, features: dict[int, torch.Tensor], ids: torch.Tensor, steps: int
               ) -> list[torch.Tensor]:
    """Training-time test over a batch ids [B, S] with teacher features {layer: [B, S, D]}.

    Step k's row for chain root t reads token ids[t+k] and (k = 1) the fused target features at t or (k > 1) its own
    step k-1 output, at position t+k; it predicts the token at t+k+1. Returns draft logits [B, S, V'] per step
    (rows with t+k >= S are padding for the caller to mask).
    """
    batch, size = ids.shape
    embeddings = head.embed(ids)
    feature = head.fused(features)
    cache = ConcatCache()
    out = []
    for step in range(1, steps + 1):
        shifted = torch.cat([embeddings[:, step:], embeddings.new_zeros(batch, min(step, size), embeddings.shape[-1])],
                            dim=1)
        positions = torch.arange(step, size + step, device=ids.device)
        mask = ttt_mask(size, step, ids.device)[None, None]
        feature = head.rows(shifted, feature, positions, mask, cache)
        out.append(head.head_logits(feature))
    return out
