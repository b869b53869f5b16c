"""The cache a target's decoder layers are handed: attention layers write their keys/values into preallocated,
position-indexed tensors, so truncating the sequence costs nothing (the next write overwrites the rejected slots);
linear-attention layers (Qwen3.5 Gated DeltaNet) keep their state after each recent token, filed under the token's
slot, so the last few updates can be rewound and draft branches (rows of a batch, one tree level per call) each
continue their parent's state. The runtime that drives it: harness/runtime/target.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.compiled import CompiledStep, LayerKV, StaticCall, bucket

# A call's token positions: contiguous ones as a range (the host knows them, nothing is read back), any others as a
# tensor beside the slots they go to.
Positions = range | torch.Tensor


@dataclass
class _Row:
    """A linear-attention layer's conv and recurrent state right after the token at `position` ([1, ...] each)."""

    position: int
    conv: torch.Tensor
    recurrent: torch.Tensor


@dataclass
class _LinearCall:
    """The rows one linear-attention call continues and writes: the call consumes the tokens from `position` on
    (one token per row for a tree level), row b continues the state of slot `parents[b]` and its new state is filed
    under `labels[b]` at `last`, the position of the call's last token."""

    position: int
    last: int
    parents: list[int]
    labels: list[int]


class StateCache:
    """Duck-typed HF cache handed to decoder layers: KV buffers by slot; for linear layers, the state after each
    recent token, filed under the token's slot.

    A linear layer's state after a token is what its next token needs, so keeping it per token makes both rewind
    (the state after the last kept token) and branching (a draft branch continues its parent's state, and the
    siblings of one tree level run as rows of a batch) lookups. States older than `rewind_window` positions behind
    the newest are dropped; a sibling level's rows are copied apart so a pruned sibling frees its memory.
    """

    def __init__(self, layer_types: list[str], max_len: int, rewind_window: int, device: torch.device | str = "cpu",
                 step: CompiledStep | None = None, owner=None):
        self.layer_types = layer_types
        self.step = step  # the compiled layer step attention layers run through (None: eager)
        self.owner = owner  # the model whose layers it serves: a static step keeps its buffer from one cache to the next
        self.device = torch.device(device)
        self.max_len = max_len
        # Every attention layer's keys and values, a tensor each [B, heads, max_len, head dim] (layer i's at
        # 2 * pair[i] and the next): apart, so a compiled run of layers takes them as inputs that alias none other.
        self.pair = {i: k for k, i in enumerate(i for i, kind in enumerate(layer_types) if kind == "full_attention")}
        self.kv: tuple[torch.Tensor, ...] | None = None
        self._static: StaticCall | None = None  # this call in the static step's shapes (None: as it comes)
        self._columns: torch.Tensor | None = None  # the static buffer's slot indices, built once with it
        self.rewind_window = rewind_window
        self.linear: dict[int, dict[int, _Row]] = {i: {} for i, kind in enumerate(layer_types)
                                                   if kind == "linear_attention"}
        self.write = torch.zeros(0, dtype=torch.long)  # the slots this call's tokens write
        self.kv_end = 0
        self._call = _LinearCall(0, -1, [], [])
        self._rows: list[_Row] | None = None  # the states the current linear-layer call continues
        self._rows_layer: int | None = None  # the layer they were looked up for (None: not yet in this call)
        self._conv_in: torch.Tensor | None = None
        self._conv_out: torch.Tensor | None = None

    def begin(self, positions: Positions, slots: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """Set where this call's KV goes (default: slots = positions) and return its attention mask.

        Contiguous positions come as a `range`, so the host knows where they start without reading a tensor back.
        `mask` [T, kv_end] says which cache slots each token sees (its width sets kv_end, so a row may see slots above
        its own); the default is every slot up to its own (causal). Returns a boolean [1, 1, T, kv_end] mask, or None
        when a single query may see every slot.
        """
        if slots is None:
            if not isinstance(positions, range):
                raise TypeError("contiguous positions go to the cache as a range (slots= places any others)")
            start, end = positions.start, positions.stop
            self.write, self.kv_end = torch.arange(start, end, device=self.device), end
            self._call = _LinearCall(start, end - 1, [start - 1], [end - 1])
            count = end - start
        else:  # linear layers take a tree level by level (see `branch`)
            if mask is None:
                raise ValueError("a call with slots= needs its mask=, whose width says how many slots it sees")
            self.write, self.kv_end, count = slots, mask.shape[-1], len(slots)
            torch._assert_async((slots < self.kv_end).all(), "a slot lies outside the mask's columns")
        if self.kv_end > self.max_len:
            raise ValueError(f"sequence length {self.kv_end} exceeds the cache's max_len {self.max_len}")
        self._rows_layer, self._static = None, None
        if mask is not None and mask.shape != (count, self.kv_end):
            raise ValueError(f"mask shape {tuple(mask.shape)} != (tokens, kv_end) = {(count, self.kv_end)}")
        size = bucket(count) if self.step is not None and self.step.static and self.kv is not None else None
        if size is not None:
            self._static = self._static_call(count, size, mask)
            return self._static.mask
        if mask is None:
            if count == 1:
                return None
            keys = torch.arange(self.kv_end, device=self.device)
            return (keys[None, :] <= self.write[:, None])[None, None]
        return mask.to(torch.bool)[None, None]

    def _static_call(self, rows: int, size: int, mask: torch.Tensor | None) -> StaticCall:
        """This call over the whole buffer, its rows padded to `size` (the last slot is the padded rows' scratch)."""
        slots, columns = self.kv[0].shape[2], self._columns
        if mask is not None:
            seen = torch.cat([mask.to(torch.bool), mask.new_zeros((rows, slots - self.kv_end), dtype=torch.bool)], 1)
        elif rows == 1:
            seen = (columns < self.kv_end)[None]
        else:  # causal
            seen = columns[None, :] <= self.write[:, None]
        write = self.write
        if size > rows:
            seen = torch.cat([seen, (columns == slots - 1)[None].expand(size - rows, slots)])
            write = torch.cat([write, write.new_full((size - rows,), slots - 1)])
        return StaticCall(rows, size, write, seen[None, None])

    # --- attention layers -------------------------------------------------------------------------------------
    def call(self, layer, layer_idx: int, *args, **kwargs) -> torch.Tensor:
        """Attention layer `layer_idx`'s `layer(*args, cache=..., **kwargs)`: through the compiled step when there
        is one and the buffer exists (the first call shapes it, eagerly), else eagerly with this cache."""
        if self.step is None or self.kv is None:
            return layer(*args, cache=self, **kwargs)
        if self._static is not None:
            pair = 2 * self.pair[layer_idx]
            return self._static(self.step, layer, args, kwargs,
                                LayerKV(self.kv[pair], self.kv[pair + 1], self._static.write))
        if self.step.static:  # longer than any static shape (a prompt): eagerly
            return layer(*args, cache=self.layer(layer_idx), **kwargs)
        return self.step(layer, *args, cache=self.layer(layer_idx), **kwargs)

    def call_run(self, layers: list, first: int, h: torch.Tensor, mask, position_ids, rope
                 ) -> tuple[torch.Tensor, ...]:
        """A run of alike attention layers from layer `first` (`alike_runs`) as one compiled graph; returns each
        layer's output."""
        kv = [t for i in range(first, first + len(layers)) for t in self.kv[2 * self.pair[i]: 2 * self.pair[i] + 2]]
        return self.step.layers(layers, h, kv, self.kv_end, self.write, mask, position_ids, rope)

    def update(self, key, value, layer_idx, **_):
        if self.kv is None:  # shaped and typed after the first keys
            count, shape = 2 * len(self.pair), (key.shape[0], key.shape[1], self.max_len, key.shape[3])
            if self.step is not None and self.step.static:  # the owner's tensors, one slot more for padded rows
                self.kv = self.step.buffer(self.owner, count, (*shape[:2], self.max_len + 1, shape[3]), key.dtype,
                                           key.device)
                self._columns = torch.arange(self.kv[0].shape[2], device=key.device)
            else:
                self.kv = tuple(key.new_zeros(shape) for _ in range(count))
        return self.layer(layer_idx).update(key, value)

    def layer(self, layer_idx: int) -> LayerKV:
        """Attention layer `layer_idx`'s keys and values up to this call's end (once they exist)."""
        pair = 2 * self.pair[layer_idx]
        return LayerKV(self.kv[pair].narrow(2, 0, self.kv_end), self.kv[pair + 1].narrow(2, 0, self.kv_end),
                       self.write)

    def kv_bytes(self, layers: range) -> int:
        """Bytes of keys and values one slot holds in `layers`."""
        if self.kv is None:
            return 0
        count = sum(i in self.pair for i in layers)
        return 2 * count * self.kv[0][:, :, 0].numel() * self.kv[0].element_size()

    def move(self, src: list[int], dst_start: int) -> None:
        """Copy the KV of slots `src` to contiguous slots from `dst_start` (keeps an accepted tree path); linear
        layers file its states under those positions."""
        if self.kv is not None:
            dst, index = slice(dst_start, dst_start + len(src)), torch.tensor(src, device=self.kv[0].device)
            for tensor in self.kv:
                tensor[:, :, dst] = tensor[:, :, index]
        self.move_linear(src, dst_start)

    # --- linear-attention layers ------------------------------------------------------------------------------
    def branch(self, position: int, parents: list[int], labels: list[int]) -> None:
        """The next linear-layer call is one tree level: tokens at `position`, row b continuing slot parents[b]."""
        self._call, self._rows_layer = _LinearCall(position, position, parents, labels), None

    def get_conv_state(self, layer_idx, state_idx=0):
        rows = self._rows_of(layer_idx)
        self._conv_in = None if rows is None else _stack([r.conv for r in rows])
        return self._conv_in

    def get_recurrent_state(self, layer_idx, state_idx=0):
        rows = self._rows_of(layer_idx)
        return None if rows is None else _stack([r.recurrent for r in rows])

    def _rows_of(self, layer_idx: int) -> list[_Row] | None:
        """The states this layer's call continues, looked up once per layer and call: HF's layer asks for its conv
        and its recurrent state in an order that differs between versions."""
        if self._rows_layer != layer_idx:
            self._rows, self._rows_layer = self._continued(layer_idx), layer_idx
        return self._rows

    def is_recording_past(self, layer_idx):
        # Forces HF's functional conv path, so stored states are never modified in place.
        return True

    def get_recurrent_states_to_keep(self, layer_idx=None):
        # No intermediate states from a multi-token call: a call whose states matter runs one tree level a call.
        return 0

    def update_conv_state(self, new, layer_idx, conv_kernel_size=None, **_):
        full = new if self._conv_in is None else torch.cat([self._conv_in, new], dim=-1)
        tail = full[..., -conv_kernel_size:]
        if tail.shape[-1] < conv_kernel_size:
            tail = torch.nn.functional.pad(tail, (conv_kernel_size - tail.shape[-1], 0))
        self._conv_out = tail
        return full

    def update_recurrent_state(self, recurrent, layer_idx, **_):
        store, call = self.linear[layer_idx], self._call
        for position in range(call.position, call.last):  # a multi-token call has no states between its tokens
            store.pop(position, None)
        for b, label in enumerate(call.labels):
            conv, state = self._conv_out[b: b + 1], recurrent[b: b + 1]
            if len(call.labels) > 1:  # a view would keep every sibling's state alive as long as one survives
                conv, state = conv.clone(), state.clone()
            store[label] = _Row(call.last, conv, state)
        for label in [k for k, row in store.items() if row.position < call.last - self.rewind_window]:
            del store[label]
        return recurrent

    def _continued(self, layer_idx) -> list[_Row] | None:
        """The states this call continues (None at position 0)."""
        store, call = self.linear[layer_idx], self._call
        if call.position == 0:
            return None
        rows = [store.get(parent) for parent in call.parents]
        if any(row is None or row.position != call.position - 1 for row in rows):
            raise ValueError(
                f"linear-attention layer {layer_idx} holds no state for slot(s) {call.parents} at position "
                f"{call.position - 1}; linear layers continue the token before: truncate or reset the runtime first"
            )
        return rows

    def move_linear(self, src: list[int], dst_start: int) -> None:
        """An accepted branch's states are filed under its positions, in the layers that have run it."""
        for store in self.linear.values():
            rows = [store.get(slot) for slot in src]
            for k, row in enumerate(rows):
                if row is not None and row.position == dst_start + k:
                    store[dst_start + k] = row

    def truncate(self, length: int) -> None:
        """Forget everything at positions >= length. O(1) for attention; a lookup for linear layers, which also drop
        the branches below the cut that were not accepted (rows filed under a slot other than their position)."""
        for layer_idx, store in self.linear.items():
            if length == 0:
                store.clear()
                continue
            ran_past = any(row.position >= length for row in store.values())
            for label in [k for k, row in store.items() if row.position >= length or k != row.position]:
                del store[label]
            if ran_past:
                row = store.get(length - 1)
                if row is None or row.position != length - 1:
                    raise ValueError(
                        f"linear-attention layer {layer_idx} cannot rewind to length {length}: no state there "
                        f"(rewind window exceeded or a multi-token call spanned it)"
                    )


def call_layer(layer, layer_idx: int, cache, *args, **kwargs) -> torch.Tensor:
    """`layer(*args, cache=cache, **kwargs)` for attention layer `layer_idx` of any cache: a StateCache runs it as its
    engine does (compiled or eager); another cache (training's, or None) eagerly."""
    if isinstance(cache, StateCache):
        return cache.call(layer, layer_idx, *args, **kwargs)
    return layer(*args, cache=cache, **kwargs)


def _stack(states: list[torch.Tensor]) -> torch.Tensor:
    return states[0] if len(states) == 1 else torch.cat(states)
