"""What every trained drafter shares: decoder layers of the target's class, the target's frozen final norm and
rotary embedding, and a trainable LM head initialised from the target's rows over an optional draft vocabulary; and
the `Prediction`s a drafter's training forward makes, which the training loop scores against the target."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from harness.runtime.state_cache import StateCache, call_layer
from harness.runtime.target import TargetRuntime


def module_layer_config(target_config, count: int, attention: str | None = None):
    """The target's layer config for a `count`-layer drafter (all full attention: drafters use masks and trees),
    optionally with another registered attention kernel."""
    config = copy.deepcopy(target_config)
    config.num_hidden_layers = count
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = ["full_attention"] * count
    if attention is not None:
        config._attn_implementation = attention
    return config


def qwen3_layers(config):
    """Qwen3 decoder layers (attention with q/k norms) of another target's shapes: the reference's spec layers for
    Llama targets. Rotary embeddings stay the target's."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    shapes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
              "vocab_size", "max_position_embeddings", "num_hidden_layers", "hidden_act", "attention_bias")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    qwen3 = Qwen3Config(**{k: getattr(config, k) for k in shapes if hasattr(config, k)}, head_dim=head_dim)
    qwen3._attn_implementation = config._attn_implementation
    qwen3.layer_types = ["full_attention"] * config.num_hidden_layers
    return Qwen3DecoderLayer, qwen3


def full_vocab(logits: torch.Tensor, draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [..., V'] as the target's [..., V] (-inf off the draft vocabulary; an empty
    `draft_ids`: already the full vocabulary)."""
    if draft_ids.numel() == 0:
        return logits
    full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
    full[..., draft_ids] = logits
    return full


class DraftModule(nn.Module):
    """Base of the SPD speculator and the EAGLE-3 head: `layers`, `head`, `draft_ids` and the frozen target parts."""

    def __init__(self, target: TargetRuntime, num_layers: int, draft_ids: torch.Tensor | None,
                 attention: str | None = None, layer_kind: str = "target"):
        super().__init__()
        hidden = target.config.hidden_size
        layer_class = type(target.layers[0])
        layer_config = module_layer_config(target.config, num_layers, attention)
        if layer_kind == "qwen3":
            layer_class, layer_config = qwen3_layers(layer_config)
        self.layers = nn.ModuleList(layer_class(layer_config, i) for i in range(num_layers))
        head_weight = target.model.lm_head.weight.detach()
        if draft_ids is None or draft_ids.numel() == 0:  # the full vocabulary (a saved one is an empty buffer)
            self.register_buffer("draft_ids", torch.empty(0, dtype=torch.long))
        else:
            self.register_buffer("draft_ids", draft_ids.to(torch.long))
            head_weight = head_weight[draft_ids]
        self.head = nn.Linear(hidden, head_weight.shape[0], bias=False)
        with torch.no_grad():
            self.head.weight.copy_(head_weight)
        self.vocab_size = target.config.vocab_size
        # Shared with the target and never trained (a tuple keeps them out of this module's parameters).
        self._frozen = (target.backbone.norm, target.backbone.rotary_emb, target.backbone.embed_tokens)
        self._step = target.compiled  # decoding runs the layers as the target's do (compiled or eager)
        self._prepare = target.prepare_module  # and its Linears on the target's kernels

    def state_cache(self, max_len: int) -> StateCache:
        """A KV cache over `max_len` slots for decoding with this module's layers (at least one: a layout with a
        layer of its own uses slot 0), whose calls run as the target's layers do; decoding starts here, so this is
        where the module's Linears take the target's kernels (packed once; training keeps the plain path)."""
        self._prepare(self)
        return StateCache(["full_attention"] * max(1, len(self.layers)), max_len, rewind_window=0,
                          device=next(self.parameters()).device, step=self._step, owner=self)

    def start_as_identity(self) -> DraftModule:
        """Zero every layer's residual-branch output (attention o_proj, MLP down_proj): training then starts from
        the module's input passed straight to the head (for an SPD drafter, an early exit from its deepest
        feature) instead of from random layers."""
        with torch.no_grad():
            for name, module in self.named_modules():
                if name.endswith(("o_proj", "down_proj")):  # a Linear, packed or not
                    module.weight.zero_()
        return self

    def start_from_target(self, target: TargetRuntime) -> DraftModule:
        """Copy the target's last layers into the module's layers (the reference's init from base layers): the
        module starts as the top of the target, fed the drafter's rows."""
        with torch.no_grad():
            for mine, theirs in zip(self.layers, target.layers[len(target.layers) - len(self.layers):]):
                mine.load_state_dict(theirs.state_dict())
        return self

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's rotary (cos, sin) [1, R, head_dim] for rows at `positions` [R]."""
        return self._frozen[1](x, positions[None])

    def decode(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
               layers: int | None = None) -> torch.Tensor:
        """The decoder layers (the first `layers` of them, None: all) over rows x [B, R, D] at `positions` [R];
        `mask` [B, 1, R, K] bool (None: one row)."""
        rope = self.rope(x, positions)
        for i, layer in enumerate(self.layers[:layers]):
            x = call_layer(layer, i, cache, x, attention_mask=mask, position_ids=positions[None],
                           position_embeddings=rope)
        return x

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (float32), after the target's final norm."""
        return self.head(self._frozen[0](x)).float()

    def full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Map draft-vocabulary logits back to the target's ids (-inf elsewhere)."""
        return full_vocab(logits, self.draft_ids, self.vocab_size)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self._frozen[2](ids)


@dataclass
class Prediction:
    logits: torch.Tensor  # [B, S', V'] draft logits; row t is scored against the target at t + offset
    offset: int
    weight: float
    groups: torch.Tensor | int  # validation group per row (fill level) or for all rows (TTT step)


class DrafterKind(Protocol):
    """A kind of drafter the training loop trains (each family's objective.py: one per checkpoint tag). The loop
    builds and initialises its module, asks it for predictions on the teacher's features each step, and replays
    decoding on held-out trajectories to validate it as decoding counts."""

    method: str  # the registered method that decodes with it
    group_name: str  # what its validation groups are (fill level, training-time-test step)
    config_name: str  # the checkpoint JSON's section for its module config

    @property
    def tag(self) -> str: ...

    @property
    def params(self) -> dict: ...

    @property
    def groups(self) -> int: ...

    def build(self, target, draft_ids) -> nn.Module: ...

    def initialise(self, module, target): ...

    def predictions(self, module, features: dict, ids: torch.Tensor, rngs: list[random.Random],
                    validating: bool = False) -> list[Prediction]: ...
    # rngs: one generator per row (training-time draws); validating: the kind's held-out view (no such draws)

    def replay(self, module, teacher, max_new_tokens: int, stop_ids: set[int]): ...
