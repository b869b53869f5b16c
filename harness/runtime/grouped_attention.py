"""The target's attention where torch's sdpa serves it (CUDA; a CPU under `--kernels torch`), without copying the
keys and values of grouped-query attention.

A masked call to HF's sdpa function on a model whose query heads share key/value heads (GQA) expands the keys and
values to every query head (`repeat_kv`: a copy of the layer's whole cache, `groups` times over), since sdpa's own
`enable_gqa` is served by CUDA's fused kernels only without a mask. The runtime masks every call of several rows
(a verify, a tree), and the static step CUDA graphs replay masks every call over the whole preallocated buffer
(harness/runtime/compiled.py), so there the copy would be of `max_len` slots in every layer at every step. Here the
query heads that share a key/value head become more query rows of that head instead ([B, H, T, D] ->
[B, H_kv, groups * T, D], the mask repeated per group): the same dot products over the cache as it is, whatever
its length, and a copy only of the queries and the mask. Calls that need neither (one head per key/value head, no
mask) and those it does not serve (a position bias, sinks, a softcap) take HF's function as they come.

It is one of HF's attention functions (`AttentionInterface`, the name `spd_sdpa_grouped`, masks built as for
`sdpa`), set on the runtime's model only.
"""

from __future__ import annotations

import functools

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

NAME = "spd_sdpa_grouped"


def use_grouped_attention(model: torch.nn.Module) -> str:
    """Point a model whose attention is HF's sdpa at the grouped form; returns the attention a record names:
    "sdpa_grouped", or the implementation that serves (another than sdpa is left as it is)."""
    config = model.config.get_text_config()
    if config._attn_implementation == NAME:
        return "sdpa_grouped"
    if config._attn_implementation != "sdpa":
        return config._attn_implementation
    register(NAME, grouped_attention)
    model.set_attn_implementation(NAME)
    return "sdpa_grouped" if config._attn_implementation == NAME else config._attn_implementation


@functools.cache
def register(name: str, function) -> None:
    """One of the project's attention functions made known to HF under `name`, once, its masks built as for sdpa
    (the row attention registers through here too)."""
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, **kwargs):
    """HF's attention function signature: query [B, H, T, D], key and value [B, H_kv, S, D]; [B, T, H, D] out, no
    weights."""
    groups = getattr(module, "num_key_value_groups", 1)
    if attention_mask is None or groups == 1 or not _served(attention_mask, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    batch, heads, rows, dim = query.shape
    shared = key.shape[1]
    mask = attention_mask[:, :, :, : key.shape[-2]]  # as sdpa's function cuts it
    # Query head j reads key/value head j // groups (repeat_kv's order): a head's group is adjacent, so the grouped
    # rows are (group member, row) and the mask repeats once per member.
    grouped = query.reshape(batch, shared, groups * rows, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=mask.repeat(1, 1, groups, 1), dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, rows, value.shape[-1]).transpose(1, 2).contiguous(), None


def _served(mask: torch.Tensor, kwargs: dict) -> bool:
    """A mask shared by every head (what the runtime passes), and nothing HF's function adds to the scores."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        return False
    return all(kwargs.get(name) is None for name in ("position_bias", "softcap", "s_aux", "sliding_window"))
