"""The EAGLE-3 draft head and its training-time-test forward.

A head row for the token at position r reads the token's embedding and one feature: the fused low/mid/high target
hidden states of position r-1 (rows the target verified) or, when drafting beyond the first token, the head's own
output for the row before it. One decoder layer of the target's shape, the target's final norm and a trainable head
(optional draft vocabulary) predict the token at r+1. Decoding (methods/eagle3/method.py) and training (`ttt_logits`) go
through the same `rows`, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.state_cache import call_layer
from harness.runtime.target import TargetRuntime
from methods.draft_module import DraftModule
from methods.rounds import Node, tree_mask


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, mid and high target layers (outputs h[k], pre-norm), near 2, L/2 and L-3 as in EAGLE-3."""
    return min(2, num_layers), max(1, num_layers // 2), max(1, num_layers - 3)


LAYOUTS = ("harness", "eagle3")


@dataclass
class EagleConfig:
    ttt: int = 7  # training-time-test steps the head was trained to draft from its own states
    num_layers: int = 0
    feature_layers: tuple[int, ...] = ()
    target: dict = field(default_factory=dict)  # name + weights_sha256 of the target it was trained for
    draft_vocab_size: int | None = None
    # harness: combine(cat(embedding, feature)) into one decoder layer of the target's class, the target's final
    # norm. eagle3: the EAGLE-3 authors' layer (its q/k/v read cat(norm(embedding), norm(feature)), the feature is
    # the residual) and a norm of its own, so heads load from and export to their folder format.
    layout: str = "harness"
    shape: dict = field(default_factory=dict)  # eagle3: heads, kv heads, head_dim, intermediate size, eps

    def __post_init__(self):
        if self.ttt < 1:
            raise ValueError(f"ttt steps must be >= 1, got {self.ttt}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"EAGLE-3 head layout must be one of {LAYOUTS}, got {self.layout!r}")
        self.feature_layers = tuple(self.feature_layers) or default_feature_layers(self.num_layers)
        if len(self.feature_layers) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got {self.feature_layers}")

    def all_feature_layers(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.feature_layers)))

    def to_dict(self) -> dict:
        return asdict(self)


class EagleHead(DraftModule):
    """fuse(low, mid, high) -> with the token embedding through one layer -> norm -> head (layout: see EagleConfig)."""

    def __init__(self, config: EagleConfig, target: TargetRuntime, draft_ids: torch.Tensor | None = None):
        eagle3 = config.layout == "eagle3"
        super().__init__(target, 0 if eagle3 else 1, draft_ids)
        self.config = config
        hidden = target.config.hidden_size
        self.fuse = nn.Linear(3 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the high feature plus the embedding": training refines it
            self.fuse.weight.zero_()
            self.fuse.weight[:, 2 * hidden:].copy_(torch.eye(hidden))
        if eagle3:
            self.midlayer = Eagle3Layer(hidden, target_shape(target.config, config.shape))
            self.norm = RMSNorm(hidden, self.midlayer.eps)
        else:
            self.combine = nn.Linear(2 * hidden, hidden, bias=False)
            with torch.no_grad():
                self.combine.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], dim=1))
        self.to(device=target.device, dtype=target.dtype)

    def head_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.layout == "eagle3":
            return self.head(self.norm(x)).float()
        return super().head_logits(x)

    def fused(self, features: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target features {layer: [..., D]} -> the head's feature input [..., D]."""
        return self.fuse(torch.cat([features[layer] for layer in self.config.feature_layers], dim=-1))

    def rows(self, token_embeddings: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None, cache) -> torch.Tensor:
        """Head rows [B, R, D] (embedding, feature) at `positions`; returns their output states (pre-norm)."""
        embeddings = token_embeddings.to(feature.dtype)  # the embedding table is the target's
        if self.config.layout == "eagle3":
            return call_layer(self.midlayer, 0, cache, embeddings, feature, self.rope(feature, positions), mask)
        return self.decode(self.combine(torch.cat([embeddings, feature], dim=-1)), positions, mask, cache)


def target_shape(target_config, shape: dict) -> dict:
    """The EAGLE-3 layer's sizes: `shape` where given, else the target's."""
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // target_config.num_attention_heads
    defaults = {"num_attention_heads": target_config.num_attention_heads,
                "num_key_value_heads": target_config.num_key_value_heads, "head_dim": head_dim,
                "intermediate_size": target_config.intermediate_size,
                "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6)}
    return {**defaults, **shape}


class RMSNorm(nn.Module):
    """Plain (Llama) RMSNorm: x / rms(x) * w, computed in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


class Eagle3Attention(nn.Module):
    """Attention whose queries, keys and values read the 2H-wide cat(norm(embedding), norm(feature)) rows."""

    def __init__(self, hidden: int, shape: dict):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], \
            shape["head_dim"]
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope, mask: torch.Tensor | None, cache) -> torch.Tensor:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

        batch, rows, _ = x.shape
        q, k, v = (proj(x).view(batch, rows, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *rope)
        k, v = cache.update(k, v, 0)
        groups = self.heads // self.kv_heads
        out = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                                               attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """The EAGLE-3 authors' decoder layer (their "midlayer"); parameter names are theirs, so weights map 1:1."""

    def __init__(self, hidden: int, shape: dict):
        super().__init__()
        self.eps = shape["rms_norm_eps"]
        self.hidden_norm = RMSNorm(hidden, self.eps)
        self.input_layernorm = RMSNorm(hidden, self.eps)
        self.post_attention_layernorm = RMSNorm(hidden, self.eps)
        self.self_attn = Eagle3Attention(hidden, shape)
        self.mlp = Eagle3MLP(hidden, shape["intermediate_size"])

    def forward(self, embeddings: torch.Tensor, feature: torch.Tensor, rope, mask: torch.Tensor | None, cache
                ) -> torch.Tensor:
        x = torch.cat([self.input_layernorm(embeddings), self.hidden_norm(feature)], dim=-1)
        h = feature + self.self_attn(x, rope, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


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


def head_tag(ttt: int, layout: str = "harness") -> str:
    """The checkpoint tag of a head trained with `ttt` training-time-test steps in `layout`."""
    return f"ttt{ttt}" + ("" if layout == "harness" else f"-{layout}")


def train_command(ttt: int, layout: str = "harness") -> str:
    return f"spd-bench train --method eagle3 --ttt {ttt}" + ("" if layout == "harness" else f" --eagle-layout {layout}")


def load_head(target: TargetRuntime, ttt: int, layout: str, checkpoint: str | None) -> EagleHead:
    """The trained head for this target (the shipped, cached or `checkpoint` folder), checked against `layout`."""
    folder, saved = checkpoints.locate(target.identity, "eagle3", head_tag(ttt, layout), train_command(ttt, layout),
                                       checkpoint)
    config = checkpoints.config_section(folder, saved, "eagle", EagleConfig, "an EAGLE-3 head")
    if config.layout != layout:
        raise HarnessError(f"{folder} holds a {config.layout}-layout EAGLE-3 head; pass --param layout={config.layout}")
    weights = checkpoints.load_weights(folder)
    head = EagleHead(config, target, draft_ids=weights.get("draft_ids"))
    checkpoints.load_into(head, weights, folder)
    return head.eval()


class HeadSession:
    """The head's side of one generation. Its KV cache holds the row of the token at position q in slot q - 1, so
    the target-feature rows fill slots 0 .. base - 1 and a round's draft rows follow from slot base."""

    def __init__(self, head: EagleHead, max_len: int):
        self.head = head
        self.device = head.head.weight.device
        self.cache = head.state_cache(max_len)
        self.root: torch.Tensor | None = None  # output state of the newest target-feature row

    @classmethod
    def started(cls, head: EagleHead, max_len: int, prompt_ids: list[int], first: int, captured: dict) -> HeadSession:
        """The head after the prefill: rows for the prompt's tokens after the first and the first sampled token."""
        started = cls(head, max_len)
        started.append(prompt_ids[1:] + [first], captured, start=1)
        return started

    def append(self, tokens: list[int], features: dict[int, torch.Tensor], start: int) -> None:
        """Rows for `tokens` at positions start.. with the target features of the positions before them; the
        newest row's output becomes the root the next draft starts from."""
        head = self.head
        positions = torch.arange(start, start + len(tokens), device=self.device)
        mask = self.cache.begin(range(start - 1, start - 1 + len(tokens)))
        out = head.rows(head.embed(positions.new_tensor(tokens)[None]), head.fused(features), positions, mask, self.cache)
        self.root = out[:, -1:]

    def chain_row(self, token: torch.Tensor, state: torch.Tensor, base: int, depth: int) -> torch.Tensor:
        """The row of a chain's draft `token` [1] at depth `depth` (slot base + depth - 1), reading the state of the
        row before it: it sees every slot below its own, so no mask is needed and nothing is read back."""
        head, slot = self.head, base + depth - 1
        mask = self.cache.begin(range(slot, slot + 1))
        return head.rows(head.embed(token[None]), state, self.cache.write + 1, mask, self.cache)

    def beam_rows(self, tokens: torch.Tensor, feature: torch.Tensor, base: int, depth: int, own: torch.Tensor,
                  ancestors: torch.Tensor) -> torch.Tensor:
        """Rows for one level of a Beam (nodes `own`, tokens [W], their parents' states [1, W, D]); node i sits in
        slot base + i and sees the prefix and its ancestors, all decided on the device."""
        head, width = self.head, len(tokens)
        positions = torch.full((width,), base + depth, device=self.device)
        mask = torch.cat([torch.ones(width, base, dtype=torch.bool, device=self.device),
                          ancestors[own, : depth * width]], dim=1)
        mask = self.cache.begin(positions, base + own, mask)
        return head.rows(head.embed(tokens[None]), feature, positions, mask, self.cache)

    def draft_rows(self, nodes: list[Node], level: list[int], base: int, tokens: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """Rows for the nodes of one level, reading their parents' states; node i sits in slot base + i. `tokens`:
        the level's tokens where they are still on the device (default: the nodes')."""
        head = self.head
        if tokens is None:
            tokens = torch.tensor([nodes[i].token for i in level], device=self.device)
        feature = torch.cat([nodes[nodes[i].parent].state if nodes[i].parent >= 0 else self.root for i in level], 1)
        positions = torch.tensor([base + nodes[i].depth for i in level], device=self.device)
        slots = torch.tensor([base + i for i in level], device=self.device)
        layout = tree_mask(nodes, level, base, base, base + len(nodes))
        mask = self.cache.begin(positions, slots, layout.to(self.device))
        return head.rows(head.embed(tokens[None]), feature, positions, mask, self.cache)
