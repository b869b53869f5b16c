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

Only rows that the logits depend on are computed: a group slot with no token (near a segment start) has no row, and
in the last layer every row but the queries serves only as a key and value (see `_last_layer_at_queries`). On the
flagship layout (n=8, Ls=4) the two cut the decoder's row-layer count by about a third.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

GROUPED = "spd_grouped"


@dataclass
class GroupLayout:
    """Visibility and order of the packed rows: the B*S finished rows sequence by sequence, then the live slots of
    every group in (sequence, position, slot) order. A slot holding no token has no row: on a flushed sequence
    about a third of the slots are dead."""

    batch: int
    size: int
    slots: int
    before: torch.Tensor  # [B, S, S] bool: query T's group sees finished row T''
    within: torch.Tensor  # [B, S, K, K] bool: slot k of query T's group sees slot j
    live: torch.Tensor  # [B, S, K] bool: slot k of query T's group holds a token (and so has a row)
    queries_only: bool = False  # the attention is asked for the query rows only (all rows still serve as keys)

    @classmethod
    def build(cls, segment_start: torch.Tensor, slots: int) -> GroupLayout:
        batch, size = segment_start.shape
        t = torch.arange(size, device=segment_start.device)
        first = torch.maximum(segment_start, t - slots + 1)  # [B, S]: the group's oldest position
        before = t[None, None, :] < first[:, :, None]
        k = torch.arange(slots, device=t.device)
        live = (t[None, :, None] - k) >= first[:, :, None]
        # A dead slot (zeros, no row) sees itself only, so its discarded output stays finite.
        within = ((k[None, :] >= k[:, None])[None, None] & live[:, :, None, :]) | torch.eye(slots, dtype=torch.bool,
                                                                                            device=t.device)
        return cls(batch, size, slots, before, within, live)

    @property
    def finished_rows(self) -> int:
        return self.batch * self.size

    def query_rows(self) -> torch.Tensor:
        """[B*S]: the packed row of every query (slot 0 of its group, always live), in (sequence, position) order."""
        in_groups = (self.live.flatten().cumsum(0) - 1).view_as(self.live)[:, :, 0]
        return self.finished_rows + in_groups.flatten()

    def finished(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head rows [1, H, R, d] -> the finished rows [B, H, S, d]."""
        return x[0, :, : self.finished_rows].unflatten(1, (self.batch, self.size)).transpose(0, 1)

    def groups(self, x: torch.Tensor) -> torch.Tensor:
        """Per-head rows [1, H, R, d] -> every group's slots [B, H, S, K, d], zeros in dead slots."""
        full = x.new_zeros(x.shape[1], self.batch, self.size, self.slots, x.shape[-1])
        full[:, self.live] = x[0, :, self.finished_rows:]
        return full.transpose(0, 1)

    def pack(self, finished: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
        """Finished [B, H, S, d] and group [B, H, S, K, d] outputs -> the packed rows [1, R, H, d]."""
        rows = [finished.transpose(0, 1).flatten(1, 2), groups.transpose(0, 1)[:, self.live]]
        return torch.cat(rows, dim=1).transpose(0, 1)[None].contiguous()


class _KeysOnly:
    """Attention mask that asks the kernel for nothing: the call runs for the keys and values it hands the cache."""


POSITION_BLOCK = 64  # group queries attend in blocks of positions: a block reads the finished rows before its end


def grouped_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Attention over packed grouped rows when handed a GroupLayout; anything else is plain sdpa."""
    if isinstance(attention_mask, _KeysOnly):
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3]), None
    if not isinstance(attention_mask, GroupLayout):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    layout = attention_mask
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    kf, vf, kg, vg = layout.finished(key), layout.finished(value), layout.groups(key), layout.groups(value)
    if layout.queries_only:  # query rows [1, H, B*S, d] are slot 0 of their groups
        qg = query[0].unflatten(1, (layout.batch, layout.size)).transpose(0, 1)[:, :, :, None]
        within = layout.within[:, :, :1]
    else:
        qg, within = layout.groups(query), layout.within
    qg = qg * scale  # on the queries, not on the 8x larger scores
    blocks = []
    # split, not sliced (as for the scores below); the group of position T sees finished rows before T only (before
    # its oldest position, the segment start or T - K + 1), so a block reads the finished rows before its last
    # position: the scores above that diagonal (about half of them) are never computed
    parts = (part.split(POSITION_BLOCK, dim=2) for part in (qg, kg, vg))
    masks = (mask.split(POSITION_BLOCK, dim=1) for mask in (layout.before, within))
    seen = -1  # finished rows before the block's last position
    for q, k, v, before, visible in zip(*parts, *masks):
        seen += q.shape[2]
        blocks.append(_attend_groups(q, kf[:, :, :seen], vf[:, :, :seen], k, v, before[..., :seen], visible))
    grouped = torch.cat(blocks, dim=2)
    if layout.queries_only:
        return grouped[:, :, :, 0].transpose(1, 2).flatten(0, 1)[None].contiguous(), None
    finished = torch.nn.functional.scaled_dot_product_attention(layout.finished(query), kf, vf, is_causal=True,
                                                                scale=scale)
    return layout.pack(finished, grouped), None


def _attend_groups(q, kf, vf, kg, vg, before, within) -> torch.Tensor:
    """Scaled group queries q [B, H, P, Q, d] of P positions over the finished rows kf, vf [B, H, F, d] (visible
    where before [B, P, F]) and their own group's rows kg, vg [B, H, P, K, d] (within [B, P, Q, K])."""
    to_finished = torch.einsum("bhtkd,bhsd->bhtks", q, kf)
    to_group = torch.einsum("bhtkd,bhtjd->bhtkj", q, kg)
    blocked = torch.finfo(to_finished.dtype).min
    scores = torch.cat([to_finished.masked_fill(~before[:, None, :, None, :], blocked),
                        to_group.masked_fill(~within[:, None], blocked)], dim=-1)
    # split, not sliced: a slice's backward fills a zero tensor of the whole score shape per slice
    to_finished, to_group = torch.softmax(scores, dim=-1).split([kf.shape[2], kg.shape[3]], dim=-1)
    return torch.einsum("bhtks,bhsd->bhtkd", to_finished, vf) + torch.einsum("bhtkj,bhtjd->bhtkd", to_group, vg)


AttentionInterface.register(GROUPED, grouped_attention)


class _PackedKeys:
    """The last layer's cache: the other rows' keys and values arrive first, the queries' second, and the
    attention gets them back in packed row order."""

    def __init__(self, order: torch.Tensor):
        self.order = order  # packed row -> its index in (other rows, query rows)
        self.parts = []

    def update(self, key, value, layer_idx, **_):
        self.parts.append((key, value))
        if len(self.parts) == 1:
            return key, value
        keys, values = (torch.cat(part, dim=2) for part in zip(*self.parts))
        return keys[:, :, self.order], values[:, :, self.order]


def _last_layer_at_queries(layer, x: torch.Tensor, rope, positions: torch.Tensor, layout: GroupLayout
                           ) -> torch.Tensor:
    """The last decoder layer's output [B*S, D] at the query rows of packed rows x [1, R, D]. Every other row is
    read there only as a key and value, so it goes through the attention's projections alone (its attention and
    MLP outputs would be discarded); the query rows then run the whole layer, unchanged, against those keys."""
    queries = layout.query_rows()
    is_query = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    is_query[queries] = True
    others = (~is_query).nonzero().squeeze(1)
    order = torch.empty(x.shape[1], dtype=torch.long, device=x.device)
    order[torch.cat([others, queries])] = torch.arange(x.shape[1], device=x.device)
    cache = _PackedKeys(order)
    layer.self_attn(hidden_states=layer.input_layernorm(x[:, others]), attention_mask=_KeysOnly(),
                    position_embeddings=tuple(part[:, others] for part in rope), cache=cache)
    return layer(x[:, queries], attention_mask=replace(layout, queries_only=True), position_ids=positions[None, queries],
                 position_embeddings=tuple(part[:, queries] for part in rope), cache=cache)[0]


def grouped_logits(speculator, features: dict[int, torch.Tensor], segment_start: torch.Tensor) -> torch.Tensor:
    """Draft logits [B, S, V'] of every position's query row, from teacher features {layer: [B, S, D]} and the
    per-position segment starts [B, S] (0, the prompt end, or a simulated flush)."""
    config = speculator.config
    n, query = config.n, config.query_depth
    slots = max(0, n - query)
    batch, size = segment_start.shape
    finished = speculator.project(n, features)
    if not slots:  # n = 1, output schedule: the query rows are the finished rows, a plain causal pass
        return speculator.head_logits(speculator.decode(finished, torch.arange(size, device=finished.device), None,
                                                        cache=None))
    layout = GroupLayout.build(segment_start, slots)
    t = torch.arange(size, device=segment_start.device)
    seq, at, slot = layout.live.nonzero(as_tuple=True)  # the group rows in packed order: slot k of T is T - k
    x = torch.cat([finished.flatten(0, 1), _slot_rows(speculator, features, seq, at - slot, query + slot)])[None]
    positions = torch.cat([t.repeat(batch), at - slot])
    x = speculator.decode(x, positions, layout, cache=None, layers=config.ls - 1)
    out = _last_layer_at_queries(speculator.layers[-1], x, speculator.rope(x, positions), positions, layout)
    return speculator.head_logits(out.unflatten(0, (batch, size)))


def _slot_rows(speculator, features: dict[int, torch.Tensor], seq: torch.Tensor, position: torch.Tensor,
               depth: torch.Tensor) -> torch.Tensor:
    """Projected inputs [R, D] of the group rows (sequence, position, depth), one projection call per projection
    the depths use (depths that share one, as under aggregation bounds, share the call)."""
    config = speculator.config
    projection = torch.tensor([config.projection_of(d) for d in range(config.n + 1)], device=depth.device)[depth]
    rows = None
    for index in projection.unique().tolist():
        picked = (projection == index).nonzero().squeeze(1)
        first = int(depth[picked[0]])
        inputs = {layer: features[layer][seq[picked], position[picked]] for layer in config.layers_for(first)}
        projected = speculator.project(first, inputs)
        rows = projected.new_zeros(len(depth), projected.shape[-1]) if rows is None else rows
        rows = rows.index_copy(0, picked, projected)
    return rows
