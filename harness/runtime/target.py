"""The staged target runtime every decoding method shares.

It runs any contiguous range of an HF decoder's layers on a set of tokens at explicit positions. Attention layers
write their keys/values into preallocated, position-indexed buffers, so truncating the sequence costs nothing: the
next write overwrites the rejected slots. Linear-attention layers (Qwen3.5 Gated DeltaNet) keep their state after
each recent token, filed under the token's slot, so the last few updates can be rewound and draft branches (rows of
a batch, one tree level per call) each continue their parent's state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from harness.runtime.attention import use_rows_attention
from harness.runtime.compiled import CompiledStep, LayerKV, StaticCall, alike_runs, bucket
from harness.runtime.kernels import pack_linears

SUPPORTED_LAYER_TYPES = {"full_attention", "linear_attention"}
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


def stage_bounds(num_layers: int, n: int) -> list[tuple[int, int]]:
    """Contiguous near-even split: sizes differ by at most one, larger stages first."""
    if not 1 <= n <= num_layers:
        raise ValueError(f"n must be between 1 and the number of layers ({num_layers}), got {n}")
    base, extra = divmod(num_layers, n)
    bounds, lo = [], 0
    for stage in range(n):
        hi = lo + base + (stage < extra)
        bounds.append((lo, hi))
        lo = hi
    return bounds


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
                self._columns = torch.arange(self.max_len + 1, device=key.device)
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


@dataclass
class _Level:
    """The tokens of a tree call at one position: their row indices, parent slots and own slots."""

    position: int
    rows: torch.Tensor
    parents: list[int]
    labels: list[int]


def _levels(positions: torch.Tensor, slots: torch.Tensor, parents: torch.Tensor) -> list[_Level]:
    """A tree call's tokens grouped by position (`_host_levels`), the tree read back once."""
    at, own, parent = torch.stack([positions, slots.to(positions.device), parents.to(positions.device)]).tolist()
    return _host_levels(at, own, parent, positions.device)


def _host_levels(at: list[int], own: list[int], parent: list[int], device) -> list[_Level]:
    """A tree call's tokens grouped by position, shallowest first (a level's parents lie one position before)."""
    levels = []
    for position in sorted(set(at)):
        rows = [row for row, p in enumerate(at) if p == position]
        levels.append(_Level(position, torch.tensor(rows, device=device), [parent[r] for r in rows],
                             [own[r] for r in rows]))
    return levels


def call_layer(layer, layer_idx: int, cache, *args, **kwargs) -> torch.Tensor:
    """`layer(*args, cache=cache, **kwargs)` for attention layer `layer_idx` of any cache: a StateCache runs it as its
    engine does (compiled or eager); another cache (training's, or None) eagerly."""
    if isinstance(cache, StateCache):
        return cache.call(layer, layer_idx, *args, **kwargs)
    return layer(*args, cache=cache, **kwargs)


def _stack(states: list[torch.Tensor]) -> torch.Tensor:
    return states[0] if len(states) == 1 else torch.cat(states)


class TargetRuntime:
    """Layer-range execution of one sequence (batch 1) on a frozen HF causal LM."""

    def __init__(self, model: torch.nn.Module, max_len: int = 4096, rewind_window: int = 32, identity=None,
                 compile: str | CompiledStep = "off"):
        self.model = model
        self.identity = identity  # ModelIdentity of the weights, for drafter checkpoints to match against
        self.config = model.config.get_text_config()
        self.backbone = model.model
        self.layers = self.backbone.layers
        self._layer_list = list(self.layers)  # sliced per call, as a compiled run's list of layers
        self.num_layers = len(self.layers)
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * self.num_layers)
        unsupported = set(self.layer_types) - SUPPORTED_LAYER_TYPES
        if unsupported:
            raise ValueError(f"layer types {sorted(unsupported)} are not supported by the target runtime")
        self.max_len = max_len
        self.rewind_window = rewind_window
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.linears = pack_linears(model) if self.device.type == "cpu" else "default"
        self.attention = use_rows_attention(model) if self.device.type == "cpu" else \
            self.config._attn_implementation
        # `compile`: a mode, or the step of the runtime this one drafts for (their graphs are shared)
        self.compiled = compile if isinstance(compile, CompiledStep) else \
            None if compile == "off" else CompiledStep(compile, self.device.type)
        self.cache = StateCache(self.layer_types, max_len, rewind_window, self.device, self.compiled, model)
        # Where each layer's run of alike attention layers ends: a dynamic compiled step takes such a run whole.
        self._runs = alike_runs(self.layers, self.layer_types) if self.compiled and not self.compiled.static else None
        self._costs: dict[int, list[float]] = {}

    def engine(self) -> dict:
        """What a record says about how the target ran: its Linears' and attention's kernels and, when asked for,
        the compiled step."""
        return {"linears": self.linears, "attention": self.attention,
                **({"compile": self.compiled.conditions()} if self.compiled else {})}

    @property
    def compile_mode(self) -> str:
        """The `--compile` mode this runtime was built with (off, on, auto): a rank serving it builds its own so."""
        return self.compiled.mode if self.compiled else "off"

    def numerics(self) -> str:
        """What besides the weights, dtype and device decides this runtime's greedy tokens: its Linears' and
        attention's kernels and the compiled step's form (each sums in its own order, so a near-tie can fall either
        way between two of them)."""
        step = "eager" if self.compiled is None else "static" if self.compiled.static else "runs"
        return f"{self.linears}-{self.attention}-{step}"

    @property
    def has_linear_layers(self) -> bool:
        return "linear_attention" in self.layer_types

    def alike(self, model: torch.nn.Module, identity=None) -> TargetRuntime:
        """A runtime for another model (a draft model) run as this one is: its length and compiled step."""
        return TargetRuntime(model, max_len=self.max_len, identity=identity, compile=self.compiled or "off")

    def reset(self) -> None:
        self.cache = StateCache(self.layer_types, self.max_len, self.rewind_window, self.device, self.compiled,
                                self.model)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hidden states [1, T, D] (h[0])."""
        return self.backbone.embed_tokens(ids.to(self.device)[None])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on pre-norm hidden states [1, T, D] -> float32 logits [T, V]."""
        logits = self.model.lm_head(self.final_norm(h))[0]
        return logits if logits.dtype == torch.float32 else logits.float()

    def run_layers(
        self,
        lo: int,
        hi: int,
        h: torch.Tensor,
        positions: Positions | list[int],
        *,
        slots: torch.Tensor | list[int] | None = None,
        mask: torch.Tensor | None = None,
        parents: torch.Tensor | list[int] | None = None,
        capture: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run layers [lo, hi) on h [1, T, D] at `positions` [T] (a range where they are contiguous).

        KV goes to `slots` (default: the positions). `mask` [T, kv_end] says which cache slots each token sees
        (default: every slot up to its own, i.e. causal). A tree (slots given) through linear-attention layers also
        needs `parents` [T]: the slot of the token each one continues. A tree's positions, slots and parents may come
        as host lists (the caller knows them: then nothing about the tree is read back). Returns the output and the
        hidden states h[k] for k in `capture` within [lo, hi] (h[0] = embedding, h[k] = output of layer k, pre-norm).
        """
        host = (positions, slots, parents) if isinstance(slots, list) else None
        if host is not None:
            positions, slots = (torch.tensor(values, device=self.device) for values in host[:2])
            parents = None if host[2] is None else torch.tensor(host[2], device=self.device)
        attn_mask = self.cache.begin(positions, None if slots is None else slots.to(self.device),
                                     None if mask is None else mask.to(self.device))
        positions = self.cache.write if slots is None else positions.to(self.device)  # contiguous: where they write
        branched = slots is not None and any(t == "linear_attention" for t in self.layer_types[lo:hi])
        if branched and parents is None:
            raise ValueError("a tree through linear-attention layers needs each token's parent slot (parents=)")
        levels = [] if not branched else _host_levels(*host, self.device) if host else _levels(positions, slots, parents)
        position_ids = positions[None]
        rope = self.backbone.rotary_emb(h, position_ids)
        captured = {lo: h} if lo in capture else {}
        runs = self._runs if self._runs is not None and self.cache.kv is not None else None  # (the first call: eager)
        i = lo
        while i < hi:
            end = i + 1 if runs is None else min(runs[i], hi)
            if end > i + 1:  # a run of alike attention layers, compiled as one graph
                outputs = self.cache.call_run(self._layer_list[i:end], i, h, attn_mask, position_ids, rope)
                captured.update({k: outputs[k - i - 1] for k in capture if i < k <= end})
                h = outputs[-1]
            else:
                h = self._layer(i, h, levels, attn_mask, position_ids, rope)
                if end in capture:
                    captured[end] = h
            i = end
        return h, captured

    def _layer(self, i: int, h: torch.Tensor, levels: list[_Level], attn_mask, position_ids, rope) -> torch.Tensor:
        if self.layer_types[i] == "linear_attention" and levels:
            return self._branch_levels(i, h, levels)
        if self.layer_types[i] == "full_attention":
            return self.cache.call(self.layers[i], i, h, attention_mask=attn_mask, position_ids=position_ids,
                                   position_embeddings=rope)
        return self.layers[i](h, attention_mask=None, position_ids=position_ids, position_embeddings=rope,
                              cache=self.cache)

    def _branch_levels(self, i: int, h: torch.Tensor, levels: list[_Level]) -> torch.Tensor:
        """A linear layer on a tree: one call per level (the tokens at one position), its rows a batch that
        continues each parent's state, so every branch advances in the same call."""
        out = torch.empty_like(h)
        for level in levels:
            self.cache.branch(level.position, level.parents, level.labels)
            rows = h[0, level.rows][:, None]  # [B, 1, D]
            out[0, level.rows] = self.layers[i](rows, position_embeddings=None, attention_mask=None,
                                                cache=self.cache)[:, 0]
        return out

    def forward_costs(self, most: int, context: int = 64, repeats: int = 5) -> list[float]:
        """costs[t - 1]: the measured time of one forward over t tokens (t = 1..most) after `context` tokens, over a
        one-token forward's (the median of `repeats`; never falling as t grows). It runs the target (the cache is
        reset after), so a method measures it once, before it decodes; cached per size."""
        if most not in self._costs:
            context = max(1, min(context, self.max_len - most))
            ids = torch.zeros(context + most, dtype=torch.long, device=self.device)
            seconds = []
            with torch.inference_mode():
                for t in range(1, most + 1):
                    runs = []
                    for _ in range(repeats):
                        self.reset()
                        self.forward(ids[:context], 0)
                        self._sync()
                        start = time.perf_counter()
                        self.forward(ids[context: context + t], context)
                        self._sync()
                        runs.append(time.perf_counter() - start)
                    seconds.append(max(statistics.median(runs), seconds[-1] if seconds else 0.0))
            self.reset()
            self._costs[most] = [s / seconds[0] for s in seconds]
        return self._costs[most]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def forward(self, ids: torch.Tensor, start: int, capture: tuple[int, ...] = ()):
        """All layers on contiguous tokens from position `start`; returns logits [T, V] and captured states."""
        h, captured = self.run_layers(0, self.num_layers, self.embed(ids), range(start, start + len(ids)),
                                      capture=capture)
        return self.logits(h), captured
