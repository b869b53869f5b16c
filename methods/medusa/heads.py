"""Medusa heads (Cai et al., 2024): head k reads the target's last hidden state at the newest verified token,
after the target's final norm, through residual blocks x + SiLU(W x + b), and guesses the token k + 1 places after
the one the target itself predicts there.

Heads trained here share one trainable projection over the draft vocabulary (initialised from the target's LM head
rows), so a drafter for the embedded model stays a few MB; a published head (methods/medusa/interop.py) keeps its
own projection over the full vocabulary per head, as the Medusa authors' `medusa_lm_head` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from harness.runtime import checkpoints
from harness.runtime.target import TargetRuntime
from methods.draft_module import full_vocab


@dataclass
class MedusaConfig:
    heads: int = 4
    layers: int = 1  # residual blocks per head
    num_layers: int = 0  # the target's: the heads read its output h[num_layers]
    own_heads: bool = False  # each head projects through its own LM head (a published folder's form)
    target: dict = field(default_factory=dict)  # name + weights_sha256 of the target it was trained for
    draft_vocab_size: int | None = None

    def __post_init__(self):
        if min(self.heads, self.layers, self.num_layers) < 1:
            raise ValueError(f"Medusa needs heads, layers and the target's num_layers >= 1, got heads={self.heads}, "
                             f"layers={self.layers}, num_layers={self.num_layers}")

    def all_feature_layers(self) -> tuple[int, ...]:
        return (self.num_layers,)

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W starting at zero (the head starts as the target's own LM head, shifted by SiLU(b))."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        with torch.no_grad():
            self.linear.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig, target: TargetRuntime, draft_ids: torch.Tensor | None = None):
        super().__init__()
        self.config = config
        hidden = target.config.hidden_size
        self.blocks = nn.ModuleList(nn.Sequential(*(ResBlock(hidden) for _ in range(config.layers)))
                                    for _ in range(config.heads))
        weight = target.model.lm_head.weight.detach()
        if config.own_heads or draft_ids is None or draft_ids.numel() == 0:
            self.register_buffer("draft_ids", torch.empty(0, dtype=torch.long))
        else:
            self.register_buffer("draft_ids", draft_ids.to(torch.long))
            weight = weight[draft_ids]
        self.projections = nn.ModuleList(nn.Linear(hidden, weight.shape[0], bias=False)
                                         for _ in range(config.heads if config.own_heads else 1))
        with torch.no_grad():
            for projection in self.projections:
                projection.weight.copy_(weight)
        self.vocab_size = target.config.vocab_size
        self._norm = (target.backbone.norm,)  # the target's, frozen (a tuple keeps it out of the parameters)
        self.to(device=target.device, dtype=target.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Every head's logits [heads, B, S, V'] (float32, V' the draft vocabulary) from h[L] [B, S, D]."""
        x = self._norm[0](hidden)
        last = len(self.projections) - 1
        return torch.stack([self.projections[min(k, last)](block(x)) for k, block in enumerate(self.blocks)]).float()

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return full_vocab(logits, self.draft_ids, self.vocab_size)

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids as the target's."""
        return ids if self.draft_ids.numel() == 0 else self.draft_ids[ids]


def heads_tag(heads: int) -> str:
    return f"heads{heads}"


def train_command(heads: int) -> str:
    return f"spd-bench train --method medusa --heads {heads}"


def load_heads(target: TargetRuntime, heads: int, checkpoint: str | None) -> MedusaHeads:
    """The trained heads for this target (the shipped, cached or `checkpoint` folder)."""
    folder, saved = checkpoints.locate(target.identity, "medusa", heads_tag(heads), train_command(heads), checkpoint)
    config = checkpoints.config_section(folder, saved, "medusa", MedusaConfig, "Medusa heads")
    weights = checkpoints.load_weights(folder)
    module = MedusaHeads(config, target, draft_ids=weights.get("draft_ids"))
    checkpoints.load_into(module, weights, folder)
    return module.eval()
