"""The target's attention on CPU, row by row (rows_attention.cpp): each query row is computed over exactly the keys
it sees, in slot order, so its result depends neither on the rows beside it nor on how many masked slots the call
spans. A verify row sees more slots than the step that would have produced it; torch's attention sums over the
call's whole key range in blocks sized by the call, so the row comes out an ulp apart, which in bf16 survives the
layer's rounding and flips near-tied tokens. With this kernel and the row kernel's Linears (kernels.py), a bf16
verify reproduces greedy AR's steps bit for bit through full-attention layers.

It is one of HF's attention functions (`AttentionInterface`, the name `spd_rows`, masks built as for `sdpa`), set on
the runtime's model only: HF `generate` runs on copies of its own. Calls it does not serve (gradients, dropout, a
sliding window, attention sinks, a batch's own masks, another dtype or device) take HF's `sdpa` function.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from harness.runtime.grouped_attention import NAME as GROUPED, register
from harness.runtime.kernels import rows_kernel_problem

NAME = "spd_rows"
DTYPES = (torch.float32, torch.bfloat16)  # what the kernel computes in


def use_rows_attention(model: torch.nn.Module) -> str:
    """Point a CPU model's attention at the row kernel where it serves the model's calls (its dtype, head size and
    layers: no sliding window); returns the attention a record names: "rows" or the implementation that serves."""
    config = model.config.get_text_config()
    current = config._attn_implementation
    if current in (NAME, GROUPED):  # an earlier runtime of this model chose: chosen anew (--kernels may differ)
        model.set_attn_implementation(current := "sdpa")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = next(model.parameters()).dtype
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if current != "sdpa" or head_dim % 8 or dtype not in DTYPES or windowed or rows_kernel_problem() is not None:
        return current
    register(NAME, rows_attention)
    model.set_attn_implementation(NAME)
    return "rows" if config._attn_implementation == NAME else current


def rows_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs):
    """HF's attention function signature; [B, T, H, D] out, no weights. Without a mask the op is causal (each row
    sees the slots up to its own); a call that is not (`is_causal=False`, or the module's own `is_causal` False)
    sees every slot, through a mask of all of them."""
    if not _served(module, query, key, value, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]  # as sdpa's function cuts it
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if mask is None and not causal:
        mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device)
    return torch.ops.spd_bench.rows_attention(query, key, value, mask, scale), None


def _served(module, query, key, value, mask, dropout: float, kwargs: dict) -> bool:
    if query.device.type != "cpu" or query.dtype not in DTYPES:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        return False
    if (dropout and module.training) or kwargs.get("sliding_window") or kwargs.get("s_aux") is not None:
        return False
    return mask is None or mask.dtype == torch.bool and mask.shape[0] * mask.shape[1] == 1
