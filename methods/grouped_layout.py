"""The training forward of a pipeline drafter: every position's query sees exactly the rows the pipeline holds.

For the query at position T (segment start s: the prompt end or the last flush; query depth q: 0 for the input
schedule, 1 for output) the tokens T' > T - K (K = n - q) of its segment are in flight at depth q + T - T', and every
earlier token is finished (depth n). Finished rows see only finished rows, so one causal pass over the sequence
computes all of them. The in-flight rows of query T form a group of at most K rows, slot k holding position T - k at
depth q + k; a group sees the finished rows before its first position and its own rows causally.

Each in-flight row belongs to exactly one query, so this is the depth-unrolled layout ((n+1) rows per position, a
dense [(n+1)S]^2 mask) with its rows regrouped: the same rows, the same visibility, hence the same logits. Attention
is block-sparse here: [K, S] scores to the finished rows and [K, K] within the group per query, instead of the dense
mask (tests/unrolled_reference.py writes that layout out as the reference this one reproduces). Decoder layers run
unchanged; only their attention kernel, registered with transformers as GROUPED, reads the layout. Any other mask
goes to the usual sdpa kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

GROUPED = "spd_grouped"


@dataclass
class GroupLayout:
    """Visibility of the grouped rows: S finished rows, then S groups of K slots."""

    size: int
    slots: int
    before: torch.Tensor  # [B, S, S] bool: query T's group sees finished row T''
    within: torch.Tensor  # [B, S, K, K] bool: slot k of query T's group sees slot j

    @classmethod
    def build(cls, segment_start: torch.Tensor, slots: int) -> GroupLayout:
        size = segment_start.shape[-1]
        t = torch.arange(size, device=segment_start.device)
        first = torch.maximum(segment_start, t - slots + 1)  # [B, S]: the group's oldest position
        before = t[None, None, :] < first[:, :, None]
        k = torch.arange(slots, device=t.device)
        live = (t[None, :, None] - k) >= first[:, :, None]  # [B, S, K]: slot k holds a token of the group
        # A dead slot sees itself only, so its (unused) row stays finite.
        within = ((k[None, :] >= k[:, None])[None, None] & live[:, :, None, :]) | torch.eye(slots, dtype=torch.bool,
                                                                                            device=t.device)
        return cls(size, slots, before, within)


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention over grouped rows when handed a GroupLayout; anything else is plain sdpa."""
    if not isinstance(attention_mask, GroupLayout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout, size = attention_mask, attention_mask.size
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    finished = torch.nn.functional.scaled_dot_product_attention(
        query[:, :, :size], key[:, :, :size], value[:, :, :size], is_causal=True, scale=scale)
    if layout.slots == 0:
        return finished.transpose(1, 2).contiguous(), None
    qg, kg, vg = (x[:, :, size:].unflatten(2, (size, layout.slots)) for x in (query, key, value))
    to_finished = torch.einsum("bhtkd,bhsd->bhtks", qg, key[:, :, :size]) * scale
    to_group = torch.einsum("bhtkd,bhtjd->bhtkj", qg, kg) * scale
    blocked = torch.finfo(to_finished.dtype).min
    scores = torch.cat([to_finished.masked_fill(~layout.before[:, None, :, None, :], blocked),
                        to_group.masked_fill(~layout.within[:, None], blocked)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    grouped = (torch.einsum("bhtks,bhsd->bhtkd", probs[..., :size], value[:, :, :size])
               + torch.einsum("bhtkj,bhtjd->bhtkd", probs[..., size:], vg))
    out = torch.cat([finished, grouped.flatten(2, 3)], dim=2)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED, grouped_attention)


def grouped_logits(speculator, features: dict[int, torch.Tensor], segment_start: torch.Tensor) -> torch.Tensor:
    """Draft logits [B, S, V'] of every position's query row, from teacher features {layer: [B, S, D]} and the
    per-position segment starts [B, S] (0, the prompt end, or a simulated flush)."""
    config = speculator.config
    n, query = config.n, config.query_depth
    slots, size = max(0, n - query), segment_start.shape[-1]
    device = segment_start.device
    rows = [speculator.project(n, features)]
    t = torch.arange(size, device=device)
    if slots:
        shifted = [_shift(speculator.project(query + k, features), k) for k in range(slots)]
        rows.append(torch.stack(shifted, dim=2).flatten(1, 2))  # [B, S*K, D], slot k of T = position T - k
    x = torch.cat(rows, dim=1)
    positions = torch.cat([t, (t[:, None] - torch.arange(slots, device=device)).clamp(min=0).flatten()])
    out = speculator.decode(x, positions, GroupLayout.build(segment_start, slots), cache=None)
    queries = out[:, :size] if slots == 0 else out[:, size:].unflatten(1, (size, slots))[:, :, 0]
    return speculator.head_logits(queries)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [B, S, D] moved k positions later (row T holds x[T - k]; the first k rows are zeros)."""
    return torch.cat([x.new_zeros(x.shape[0], k, x.shape[2]), x[:, : x.shape[1] - k]], dim=1) if k else x
