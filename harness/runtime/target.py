"""The staged target runtime every decoding method shares.

It runs any contiguous range of an HF decoder's layers on a set of tokens at explicit positions, through the
`StateCache` (harness/runtime/state_cache.py): attention keys/values in preallocated, position-indexed tensors,
linear-attention states per recent token, so truncating costs nothing and draft branches continue their parent's
state.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from harness.runtime.compiled import CompiledStep, alike_runs, step_for
from harness.runtime.conditions import processor
from harness.runtime.backends import backend_for
from harness.runtime.kernels import chosen
from harness.runtime.state_cache import Positions, StateCache

SUPPORTED_LAYER_TYPES = {"full_attention", "linear_attention"}


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
        self.backend = backend_for(self.device.type)  # what serves Linears, attention, head and compiled step
        prepared = self.backend.prepare(model)
        self.linears, self.attention = prepared.linears, prepared.attention
        # `compile`: a mode (the model's own step: `step_for`), or the step of the runtime this one drafts for
        self.compiled = compile if isinstance(compile, CompiledStep) else \
            None if compile == "off" else step_for(model, compile, self.backend, self.device.type)
        self._compile_start = self.compiled.tally() if self.compiled else None  # what this runtime's records count
        # A stage rank keeps only its stage's layers (the others are Identity): caches for the layers it holds.
        self._cached_types = [kind if not isinstance(layer, torch.nn.Identity) else "dropped"
                              for kind, layer in zip(self.layer_types, self.layers)]
        self.cache = StateCache(self._cached_types, max_len, rewind_window, self.device, self.compiled, model)
        # Where each layer's run of alike attention layers ends: a dynamic compiled step takes such a run whole.
        self._runs = alike_runs(self.layers, self.layer_types) if self.compiled and not self.compiled.static else None
        self._costs: dict[int, list[float]] = {}
        self._watchers: list[Callable[[torch.Tensor], None]] = []  # see `watching`

    def engine(self) -> dict:
        """What a record says about how the target ran: the --kernels choice, the kernels its Linears and attention
        took and, when asked for, the compiled step."""
        return {"kernels": chosen(), "linears": self.linears, "attention": self.attention,
                **({"compile": self.compiled.conditions(self._compile_start)} if self.compiled else {})}

    @property
    def compile_mode(self) -> str:
        """The `--compile` mode this runtime was built with (off, on, auto): a rank serving it builds its own so."""
        return self.compiled.mode if self.compiled else "off"

    def numerics(self) -> str:
        """What besides the weights, dtype and device decides this runtime's greedy tokens: its Linears' and
        attention's kernels (the row kernels' sources by their hash: a changed kernel may sum in another order) and
        the compiled step's form (each sums in its own order, so a near-tie can fall either way between two of
        them)."""
        step = "eager" if self.compiled is None else "static" if self.compiled.static else "runs"
        return "-".join([self.linears, self.attention, step, *self.backend.numerics(), self._platform()])

    def _platform(self) -> str:
        """The rest of what picks the kernels that run, by its hash: the processor or GPU model, torch's and CUDA's
        versions, the sdpa backends CUDA may take, and for linear-attention layers whether flash-linear-attention
        and causal-conv1d serve them (else torch's fallbacks), so a cache shared by mixed nodes never compares
        across them."""
        from transformers.utils import import_utils

        parts = [processor(self.device.type), torch.__version__, str(torch.version.cuda)]
        if self.has_linear_layers:
            parts += [f"fla:{import_utils.is_flash_linear_attention_available()}",
                      f"conv1d:{import_utils.is_causal_conv1d_available()}"]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:8]

    @property
    def has_linear_layers(self) -> bool:
        return "linear_attention" in self.layer_types

    def prepare_module(self, module: torch.nn.Module) -> None:
        """A drafter's module, made to decode on the kernels this runtime's Linears take."""
        self.backend.prepare_module(module)

    def alike(self, model: torch.nn.Module, identity=None) -> TargetRuntime:
        """A runtime for another model (a draft model) run as this one is: its length and compiled step."""
        return TargetRuntime(model, max_len=self.max_len, identity=identity, compile=self.compiled or "off")

    def reset(self) -> None:
        self.cache = StateCache(self._cached_types, self.max_len, self.rewind_window, self.device, self.compiled,
                                self.model)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> hidden states [1, T, D] (h[0])."""
        return self.backbone.embed_tokens(ids.to(self.device)[None])

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm + LM head on pre-norm hidden states [1, T, D] -> float32 logits [T, V], the head's sums never
        rounded to the model's dtype (`Backend.logits`)."""
        logits = self.backend.logits(self.model.lm_head, self.final_norm(h))[0]
        for watcher in self._watchers:
            watcher(logits)
        return logits

    @contextmanager
    def watching(self, watcher: Callable[[torch.Tensor], None]) -> Iterator[None]:
        """Every logits block this runtime computes while the block runs is passed to `watcher` (the losslessness
        verdict's replay reads the rows a method decided from: harness/runtime/verdict.py)."""
        self._watchers.append(watcher)
        try:
            yield
        finally:
            self._watchers.remove(watcher)

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

    def forward(self, ids: torch.Tensor, start: int, capture: tuple[int, ...] = (), last: bool = False):
        """All layers on contiguous tokens from position `start`; returns logits [T, V] (with `last`, the last
        token's alone, [1, V]: a prompt's prefill needs no more, and 2k positions of a 248k vocabulary in fp32 are
        2 GB) and captured states."""
        h, captured = self.run_layers(0, self.num_layers, self.embed(ids), range(start, start + len(ids)),
                                      capture=capture)
        return self.logits(h[:, -1:] if last else h), captured
