"""The staged target runtime every decoding method shares.

It runs any contiguous range of an HF decoder's layers on a set of tokens at explicit positions. Attention layers
write their keys/values into preallocated, position-indexed buffers, so truncating the sequence costs nothing: the
next write overwrites the rejected slots. Linear-attention layers (Qwen3.5 Gated DeltaNet) keep a ring of the states
they held after each call, so the last few updates can be rewound.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

SUPPORTED_LAYER_TYPES = {"full_attention", "linear_attention"}


@dataclass
class _LinearState:
    """Conv and recurrent state of one linear-attention layer after `length` tokens, plus earlier snapshots."""

    length: int
    conv: torch.Tensor | None
    recurrent: torch.Tensor | None
    history: deque

    def restore(self, length: int, layer: int) -> None:
        if length == 0:
            self.length, self.conv, self.recurrent = 0, None, None
            self.history.clear()
            return
        while self.history and self.history[-1][0] > length:
            self.history.pop()
        if not self.history or self.history[-1][0] != length:
            raise ValueError(
                f"linear-attention layer {layer} cannot rewind to length {length}: no snapshot there "
                f"(rewind window exceeded or a multi-token call spanned it)"
            )
        self.length, self.conv, self.recurrent = self.history[-1]


class StateCache:
    """Duck-typed HF cache handed to decoder layers: KV buffers by slot, snapshot rings for linear layers."""

    def __init__(self, layer_types: list[str], max_len: int, rewind_window: int):
        self.layer_types = layer_types
        self.max_len = max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.linear = {
            i: _LinearState(0, None, None, deque(maxlen=rewind_window + 1))
            for i, kind in enumerate(layer_types)
            if kind == "linear_attention"
        }
        self.write: slice | torch.Tensor = slice(0, 0)
        self.kv_end = 0
        self._pending_len = 0

    def begin(self, positions: torch.Tensor, slots: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Set where this call's KV goes (default: slots = positions) and return its attention mask.

        `mask` [T, kv_end] says which cache slots each token sees (its width sets kv_end, so a row may see
        slots above its own); the default is every slot up to its own (causal). Returns a boolean [1, 1, T, kv_end] mask, or None when a single query may see every slot.
        """
        if slots is None:
            start = int(positions[0])
            self.write, self.kv_end, slots = slice(start, start + len(positions)), start + len(positions), positions
        else:  # linear-attention layers refuse this form: they need contiguous appends
            self.write = slots
            self.kv_end = mask.shape[-1] if mask is not None else int(slots.max()) + 1
            if int(slots.max()) >= self.kv_end:
                raise ValueError(f"slot {int(slots.max())} lies outside the mask's {self.kv_end} columns")
        if self.kv_end > self.max_len:
            raise ValueError(f"sequence length {self.kv_end} exceeds the cache's max_len {self.max_len}")
        if mask is None:
            if len(slots) == 1:
                return None
            keys = torch.arange(self.kv_end, device=slots.device)
            return (keys[None, :] <= slots[:, None])[None, None]
        if mask.shape != (len(slots), self.kv_end):
            raise ValueError(f"mask shape {tuple(mask.shape)} != (tokens, kv_end) = {(len(slots), self.kv_end)}")
        return mask.to(torch.bool)[None, None]

    # --- attention layers -------------------------------------------------------------------------------------
    def update(self, key, value, layer_idx, **_):
        if layer_idx not in self.keys:
            shape = (key.shape[0], key.shape[1], self.max_len, key.shape[3])
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape)
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        if isinstance(self.write, slice):  # the decode hot path: narrow().copy_() avoids generic indexing
            k_buf.narrow(2, self.write.start, key.shape[2]).copy_(key)
            v_buf.narrow(2, self.write.start, value.shape[2]).copy_(value)
        else:
            k_buf[:, :, self.write] = key
            v_buf[:, :, self.write] = value
        return k_buf.narrow(2, 0, self.kv_end), v_buf.narrow(2, 0, self.kv_end)

    def move(self, src: torch.Tensor, dst_start: int) -> None:
        """Copy the KV of slots `src` to contiguous slots from `dst_start` (keeps an accepted tree path)."""
        dst = slice(dst_start, dst_start + len(src))
        for buf in (*self.keys.values(), *self.values.values()):
            buf[:, :, dst] = buf[:, :, src]

    # --- linear-attention layers ------------------------------------------------------------------------------
    def get_conv_state(self, layer_idx, state_idx=0):
        return self.linear[layer_idx].conv

    def get_recurrent_state(self, layer_idx, state_idx=0):
        return self.linear[layer_idx].recurrent

    def is_recording_past(self, layer_idx):
        # Forces HF's functional conv path, so stored snapshots are never modified in place.
        return True

    def update_conv_state(self, new, layer_idx, conv_kernel_size=None, **_):
        state = self.linear[layer_idx]
        start = self.write.start if isinstance(self.write, slice) else None
        if start != state.length:
            raise ValueError(
                f"linear-attention layer {layer_idx} holds {state.length} tokens but was given position "
                f"{start}; linear layers need contiguous appends: truncate or reset the runtime first"
            )
        full = new if state.conv is None else torch.cat([state.conv, new], dim=-1)
        tail = full[..., -conv_kernel_size:]
        if tail.shape[-1] < conv_kernel_size:
            tail = torch.nn.functional.pad(tail, (conv_kernel_size - tail.shape[-1], 0))
        state.conv = tail
        self._pending_len = new.shape[-1]
        return full

    def update_recurrent_state(self, recurrent, layer_idx, **_):
        state = self.linear[layer_idx]
        state.recurrent = recurrent
        state.length += self._pending_len
        state.history.append((state.length, state.conv, state.recurrent))
        return recurrent

    def truncate(self, length: int) -> None:
        """Forget everything at positions >= length. O(1) for attention; snapshot restore for linear layers."""
        for layer_idx, state in self.linear.items():
            if state.length > length:
                state.restore(length, layer_idx)


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every Linear weight column-major (in place, same values and shapes).

    Single-token decode is a matrix-vector product per weight; on CPU, MKL reads a column-major weight at
    roughly twice the bandwidth of the default row-major one (lm_head of SmolLM2: 4.8 ms vs 10.2 ms).
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight.stride(0) != 1:
                module.weight.data = module.weight.data.t().contiguous().t()


class TargetRuntime:
    """Layer-range execution of one sequence (batch 1) on a frozen HF causal LM."""

    def __init__(self, model: torch.nn.Module, max_len: int = 4096, rewind_window: int = 32, identity=None):
        self.model = model
        self.identity = identity  # ModelIdentity of the weights, for drafter checkpoints to match against
        self.config = model.config.get_text_config()
        self.backbone = model.model
        self.layers = self.backbone.layers
        self.num_layers = len(self.layers)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)
        unsupported = set(self.layer_types) - SUPPORTED_LAYER_TYPES
        if unsupported:
            raise ValueError(f"layer types {sorted(unsupported)} are not supported by the target runtime")
        self.max_len = max_len
        self.rewind_window = rewind_window
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cpu":
            column_major_linears(model)
        self.cache = StateCache(self.layer_types, max_len, rewind_window)

    @property
    def has_linear_layers(self) -> bool:
        return "linear_attention" in self.layer_types

    def reset(self) -> None:
        self.cache = StateCache(self.layer_types, self.max_len, self.rewind_window)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hidden states [1, T, D] (h[0])."""
        return self.backbone.embed_tokens(ids.to(self.device)[None])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on pre-norm hidden states [1, T, D] -> float32 logits [T, V]."""
        return self.model.lm_head(self.backbone.norm(h))[0].float()

    def run_layers(
        self,
        lo: int,
        hi: int,
        h: torch.Tensor,
        positions: torch.Tensor,
        *,
        slots: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run layers [lo, hi) on h [1, T, D] at `positions` [T].

        KV goes to `slots` (default: the positions). `mask` [T, kv_end] says which cache slots each token sees
        (default: every slot up to its own, i.e. causal). Returns the output and the hidden states h[k] for k in
        `capture` within [lo, hi] (h[0] = embedding, h[k] = output of layer k, pre-norm).
        """
        positions = positions.to(self.device)
        attn_mask = self.cache.begin(positions, None if slots is None else slots.to(self.device),
                                     None if mask is None else mask.to(self.device))
        if mask is not None and any(t == "linear_attention" for t in self.layer_types[lo:hi]):
            raise ValueError("custom attention masks cannot be applied to linear-attention layers")
        rope = self.backbone.rotary_emb(h, positions[None])
        captured = {lo: h} if lo in capture else {}
        for i in range(lo, hi):
            h = self.layers[i](
                h,
                attention_mask=attn_mask if self.layer_types[i] == "full_attention" else None,
                position_ids=positions[None],
                position_embeddings=rope,
                cache=self.cache,
            )
            if i + 1 in capture:
                captured[i + 1] = h
        return h, captured

    def forward(self, ids: torch.Tensor, start: int, capture: tuple[int, ...] = ()):
        """All layers on contiguous tokens from position `start`; returns logits [T, V] and captured states."""
        positions = torch.arange(start, start + len(ids), device=self.device)
        h, captured = self.run_layers(0, self.num_layers, self.embed(ids), positions, capture=capture)
        return self.logits(h), captured
