"""The compiled layer step (`--compile`): every full-attention decoder layer, the target's and its drafters'
(an EAGLE-3 head's, the SPD speculator's, a draft model's), runs through one `torch.compile`d function (inductor),
so methods keep calling the runtime (`StateCache.call`) and never learn about it.

The unit is one layer, not the layer range: the layers of a model share their code and shapes, so one graph serves
all of them (the layer's weights are the graph's inputs, and its index is left symbolic), which keeps compiling to
a few graphs whatever the depth (a 30-layer range traced whole took over 15 minutes on 2 CPU cores; one layer about
30 s). Token and cache lengths are dynamic. A layer reads and writes its KV buffer through `LayerKV`, the one
layer's views, so nothing inside the graph looks a layer up by index. Linear-attention layers, whose state lives
in Python dictionaries, stay eager. Inductor keeps what it compiled in its on-disk cache, so a second run compiles
in a fraction of the time.

What it buys depends on the machine. On a 2-core AVX2 CPU the embedded model's step is bound by its Linear kernels
(76% of its op time in oneDNN's packed Linear), and inside a graph the Linears run inductor's choice (MKL's `mm`:
its oneDNN lowering packs only weights frozen as constants, which a step shared by every layer takes as inputs), so
the compiled step measured 45.0 ms against eager's 43.4. CUDA graphs (`mode="reduce-overhead"`) are not used: the
cache length grows every step, and a graph is recorded per shape, so they wait for a step over the whole
preallocated cache with a mask.
"""

from __future__ import annotations

import sys
import time

import torch

from harness.runtime.errors import HarnessError, first_line


GRAPHS = 64  # the most graphs the layer step may hold


class LayerKV:
    """One attention layer's keys and values up to the call's end ([B, heads, kv_end, head dim] views of the
    runtime's buffer) and the slots this call writes: the cache a decoder layer is handed."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor):
        self.keys, self.values, self.write = keys, values, write

    def update(self, key, value, layer_idx=None, **_):
        with torch.no_grad():  # the cache is never trained through; unbind's views may only be written so
            self.keys.index_copy_(2, self.write, key)
            self.values.index_copy_(2, self.write, value)
        return self.keys, self.values


def _layer_step(layer, *args, **kwargs):
    return layer(*args, **kwargs)


class CompiledStep:
    """The compiled layer call and what compiling cost: `seconds` spent in calls that compiled a graph, the
    `graphs` they compiled (dynamo's cache is the process's: a graph another runtime compiled is reused). `auto`
    falls back to eager, saying why once, where `on` stops with a one-line error."""

    def __init__(self, mode: str):
        if mode not in ("on", "auto"):
            raise ValueError(f"compile mode {mode!r} is not one of on, auto")
        # A layer's index is an int attribute; specialising on it would compile one graph per layer.
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        # One graph per layer class (target, drafter, the EAGLE-3 authors' layer) and call form (one row or many,
        # tree or chain): more than dynamo's default of 8 for one function, and a bounded set.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS)
        self.mode = mode
        self.step = torch.compile(_layer_step, dynamic=True, fullgraph=True)
        self.seconds, self.graphs, self.failed = 0.0, 0, None

    def __call__(self, layer, *args, cache: LayerKV, **kwargs) -> torch.Tensor:
        """layer(*args, cache=cache, **kwargs), compiled."""
        if self.failed is not None:
            return _layer_step(layer, *args, cache=cache, **kwargs)
        before, start = _graphs(), time.perf_counter()
        try:
            out = self.step(layer, *args, cache=cache, **kwargs)
        except Exception as exc:  # a graph that cannot be built fails before it runs: nothing was written
            return self._fail(exc, layer, *args, cache=cache, **kwargs)
        if _graphs() > before:
            self.seconds += time.perf_counter() - start
            self.graphs += _graphs() - before
        return out

    def _fail(self, exc, *args, **kwargs) -> torch.Tensor:
        why = f"cannot compile the layer step ({type(exc).__name__}: {first_line(exc)})"
        if self.mode == "on":
            raise HarnessError(f"--compile {why}; run with --compile auto to fall back to eager, or --compile off")
        self.failed = why
        print(f"warning: --compile auto: {why}; running eager", file=sys.stderr)
        return _layer_step(*args, **kwargs)

    def conditions(self) -> dict:
        """What a record says about the engine: compiled or fallen back, graphs and compile seconds so far."""
        if self.failed is not None:
            return {"mode": self.mode, "engine": "eager", "why": self.failed}
        return {"mode": self.mode, "engine": "inductor", "graphs": self.graphs, "compile_s": round(self.seconds, 1)}


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
