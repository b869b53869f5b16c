"""The compiled step (`--compile`): the target's attention layers, and its drafters' (an EAGLE-3 head's, the SPD
speculator's, a draft model's), run through `torch.compile`d functions (inductor), so methods keep calling the runtime
(`TargetRuntime.run_layers`, `StateCache.call`) and never learn about it.

On a CPU the unit is a run of alike attention layers (one class, equal weight shapes: a Llama's 30), compiled as one
graph, `_layers_step`. Its layer is a nested compile region (`torch.compiler.nested_compile_region`): dynamo traces one
layer and stamps it out for the others (the layer's weights are the region's inputs), so a long range compiles in
seconds where tracing it whole does not finish. A graph per layer instead pays dynamo's guard check and inductor's
wrapper on every call, as much as fusing saves on a CPU (the figures: docs/performance.md, "The compiled step").
The region reuse is keyed by hand (`reuse_hash_fn`): dynamo's own check refuses HF's layers, whose forward sets a
context variable, so the runtime hands a graph only layers it has checked alike (`alike_runs`). A layer reads and writes its own keys and values tensors (nothing aliases another
input) up to the call's end, a Python int, so nothing is looked up by index inside the graph. Shapes are static until
one changes (dynamo's automatic dynamic shapes): a step compiles once for its first cache length and once more, with
the length symbolic, for every later one; dynamo notes which sizes varied in its on-disk profile, so the next process
compiles the dynamic graph first. Single layers (an EAGLE-3 head's, the SPD speculator's) run through the layer step,
`_layer_step`, one graph per layer class and call form. Linear-attention layers, whose state lives in Python
dictionaries, stay eager. Inductor keeps what it compiled in its on-disk cache, so a second run compiles in a
fraction of the time.

On CUDA the step is static and graphed, one layer a graph (harness/runtime/cuda_graphs.py records them and finds
them by layer and shape): a graph is recorded per shape, and the cache length grows every step, so a static call
(`StaticCall`) reads and writes the whole preallocated buffer under a mask and pads its query rows to a bucket (1,
2, 4, .. 64 rows): a handful of shapes per layer class, whatever the length. A padded row writes a scratch slot, the
buffer's last, and sees only it. Calls longer than the largest bucket (a prompt's prefill) run eagerly. Each call's
output is copied out of the graphs' memory pool, so a tensor a method keeps across steps (a pipeline stage's output,
captured features) is never overwritten by a later replay. The step and its buffers belong to the loaded model
(`step_for`, `CompiledStep.buffer`), sized for the longest run it served so far, so a sweep's configurations replay
the graphs its first one recorded. Tests run the static form on CPU (`static=True`); on a CPU the dynamic step is
the faster one, since attending over the whole buffer costs more than the launches it saves there.
"""

from __future__ import annotations

import functools
import sys
import time
import weakref

import torch

from harness.runtime.cuda_graphs import GraphedCalls
from harness.runtime.errors import HarnessError, first_line
from harness.runtime.kernels import packed_modules, refresh


GRAPHS = 64  # the most graphs the layer step may hold
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the query lengths a static call pads to; longer calls run eagerly


def bucket(rows: int) -> int | None:
    """The static shape a call of `rows` query rows pads to (None: longer than any)."""
    return next((size for size in BUCKETS if size >= rows), None)


def alike_runs(layers, kinds: list[str]) -> list[int]:
    """ends[i]: where the run of alike attention layers holding layer i ends (i + 1 for a linear-attention layer).
    Alike: one class, the same submodule classes and equal parameter shapes and dtypes, so one stamped-out layer
    subgraph (`_any_layer`) serves every layer of a run."""
    def form(layer) -> tuple:
        return (tuple(type(m) for m in layer.modules()),
                tuple((name, p.shape, p.dtype) for name, p in layer.named_parameters()))

    ends, forms = list(range(1, len(layers) + 1)), [form(layer) for layer in layers]
    for i in reversed(range(len(layers) - 1)):
        if kinds[i] == kinds[i + 1] == "full_attention" and forms[i] == forms[i + 1]:
            ends[i] = ends[i + 1]
    return ends


class LayerKV:
    """One attention layer's keys and values up to the call's end ([B, heads, kv_end, head dim] views of the
    runtime's KV tensors) and the slots this call writes: the cache a decoder layer is handed."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, write: torch.Tensor):
        self.keys, self.values, self.write = keys, values, write

    def update(self, key, value, layer_idx=None, **_):
        with torch.no_grad():  # the cache is never trained through; unbind's views may only be written so
            self.keys.index_copy_(2, self.write, key)
            self.values.index_copy_(2, self.write, value)
        return self.keys, self.values


def _layer_step(layer, *args, **kwargs):
    return layer(*args, **kwargs)


def _any_layer(*args, **kwargs) -> int:
    """Every call of `_one_layer` inside one range graph takes the same subgraph: the runtime hands a graph only
    alike layers (one class, equal weight shapes)."""
    return 0


@torch.compiler.nested_compile_region(reuse_hash_fn=_any_layer)
def _one_layer(layer, h, keys, values, end: int, write, mask, position_ids, rope):
    cache = LayerKV(keys.narrow(2, 0, end), values.narrow(2, 0, end), write)
    return layer(h, cache=cache, attention_mask=mask, position_ids=position_ids, position_embeddings=rope)


def _layers_step(layers, h, kv, end: int, write, mask, position_ids, rope) -> tuple[torch.Tensor, ...]:
    """`layers` in turn on h, layer i reading and writing its keys kv[2i] and values kv[2i + 1] up to slot `end`;
    returns every layer's output (a caller captures some: one graph whatever it keeps)."""
    outputs = []
    for i, layer in enumerate(layers):
        h = _one_layer(layer, h, kv[2 * i], kv[2 * i + 1], end, write, mask, position_ids, rope)
        outputs.append(h)
    return tuple(outputs)


def _static_layer_step(layer, *args, **kwargs):
    """The static step's own function, so its graphs (static shapes) and the dynamic step's never share a cache."""
    return layer(*args, **kwargs)


class StaticCall:
    """One runtime call (`StateCache.begin`) in the static step's shapes: its `rows` query rows padded to `size`, the
    slots they `write` (a padded row's: the scratch slot) and the `mask` [1, 1, size, slots] over the whole buffer
    (a padded row sees only the scratch slot, so its softmax stays finite). A layer's per-token arguments ([B, rows,
    ...]: hidden states, positions, rope) are padded with their last row, once per call for those every layer shares,
    and a layer's padded output goes to the next layer as it is."""

    def __init__(self, rows: int, size: int, write: torch.Tensor, mask: torch.Tensor):
        self.rows, self.size, self.write, self.mask = rows, size, write, mask
        self._padded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(argument) -> (argument, padded)

    def __call__(self, step: CompiledStep, layer, args: tuple, kwargs: dict, cache: LayerKV) -> torch.Tensor:
        out = step(layer, *self._pad(args), cache=cache, **{name: self._pad(v) for name, v in kwargs.items()})
        if self.size == self.rows:
            return out
        view = out[:, : self.rows]
        self._padded[id(view)] = (view, out)
        return view

    def _pad(self, value):
        if isinstance(value, tuple):
            return tuple(self._pad(v) for v in value)
        if (self.size == self.rows or not isinstance(value, torch.Tensor) or value is self.mask or value.dim() < 2
                or value.shape[1] != self.rows):
            return value
        known = self._padded.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        padded = torch.cat([value, value[:, -1:].expand(-1, self.size - self.rows, *value.shape[2:])], 1)
        self._padded[id(value)] = (value, padded)
        return padded


class CompiledStep:
    """The compiled calls (a layer, or a run of alike layers on a CPU) and what compiling cost: `seconds` spent in
    calls that compiled a graph, the `graphs` they compiled (dynamo's cache is the process's: a graph another runtime
    compiled is reused). `auto` falls back to eager, saying why once, where `on` stops with a one-line error."""

    def __init__(self, mode: str, device_type: str = "cpu", static: bool | None = None, graphed: bool | None = None):
        if mode not in ("on", "auto"):
            raise ValueError(f"compile mode {mode!r} is not one of on, auto")
        # Static shapes where CUDA graphs replay them (see the module doc); a test asks for them (and for graphs,
        # re-run where a GPU would replay them: harness/runtime/cuda_graphs.py) on a CPU.
        self.static = device_type == "cuda" if static is None else static
        self.graphed = self.static and (device_type == "cuda" if graphed is None else graphed)
        _dynamo_for_layer_steps()
        self.mode = mode
        self.step = torch.compile(_static_layer_step, dynamic=False, fullgraph=True) if self.static else \
            torch.compile(_layer_step, dynamic=True, fullgraph=True)
        # The graphs the runtime records and looks up itself, one per layer and shape (inductor's own would search
        # every layer's recording at every call).
        self.recorded = GraphedCalls(device_type) if self.graphed else None
        # A run of alike layers as one graph (the module doc); the static step keeps one graph per layer.
        self.ranges = None if self.static else torch.compile(_layers_step, fullgraph=True)
        self.seconds, self.graphs, self.recordings, self.failed = 0.0, 0, 0, None
        self._buffers: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._packed: dict[int, tuple] = {}  # a layer's packed Linears, found once (`_refresh`)

    def buffer(self, owner, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, ...]:
        """The `count` KV tensors (each layer's keys, then its values; `shape` [B, heads, slots, head dim] with at
        least the slots asked for) a static cache of `owner` (the model whose layers it serves) writes. One set per
        owner and layout, kept from one runtime and generation to the next, so the graphs recorded on them replay for
        every run the model serves (dynamo guards on these tensors: fresh ones would compile and record every graph
        anew, per configuration of a sweep, up to its recompile limit). A run longer than the set holds replaces it
        with one of the next power of two slots (a shorter run uses the longer set: its mask hides the rest), so a
        process grows its graphs at most log2(context) times. Runtimes of one model share the set: one sequence at a
        time, as the runtime decodes batch 1."""
        key = (id(owner), count, shape[:2], shape[3:], dtype, str(device))
        held = self._buffers.get(key)
        if held is None or held[0].shape[2] < shape[2]:
            slots = 1 << (shape[2] - 1).bit_length()
            tensors = tuple(torch.zeros((*shape[:2], slots, *shape[3:]), dtype=dtype, device=device)
                            for _ in range(count))
            for tensor in tensors:  # graphs write them in place: addresses that stay put, not inputs to copy in
                torch._dynamo.mark_static_address(tensor)
            self._buffers[key] = tensors
        return self._buffers[key]

    def __call__(self, layer, *args, cache: LayerKV, **kwargs) -> torch.Tensor:
        """layer(*args, cache=cache, **kwargs), compiled."""
        self._refresh([layer])
        return self._compiled(self.step if self.recorded is None else self._replay, _layer_step, layer, *args,
                              cache=cache, **kwargs)

    def _replay(self, layer, *args, cache: LayerKV, **kwargs) -> torch.Tensor:
        """The call through the layer's CUDA graph for its shape (recorded on first use), its output copied out."""
        return self.recorded(self.step, layer, args, kwargs, cache)

    def layers(self, layers: list, h: torch.Tensor, kv: list[torch.Tensor], end: int, write: torch.Tensor, mask,
               position_ids, rope) -> tuple[torch.Tensor, ...]:
        """`_layers_step` on a run of alike layers (`alike_runs`), compiled as one graph."""
        self._refresh(layers)
        return self._compiled(self.ranges, _layers_step, layers, h, kv, end, write, mask, position_ids, rope)

    def _refresh(self, layers: list) -> None:
        """Packs again the Linears of these layers whose weights changed, before a graph reads their packed copies
        (a graph cannot look: kernels.PackedLinear checks only when eager)."""
        for layer in layers:
            if id(layer) not in self._packed:
                self._packed[id(layer)] = (layer, packed_modules(layer))  # the layer kept: its id stays its own
            refresh(self._packed[id(layer)][1])

    def _compiled(self, compiled, eager, *args, **kwargs):
        """compiled(*args, **kwargs), counting the graphs it compiles and their seconds; eager(...) once failed."""
        if self.failed is not None:
            return eager(*args, **kwargs)
        before, recorded, start = _graphs(), self._recorded(), time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as exc:  # a graph that cannot be built fails before it runs: nothing was written
            self._fail(exc)
            return eager(*args, **kwargs)
        if _graphs() > before or self._recorded() > recorded:
            self.seconds += time.perf_counter() - start
            self.graphs += _graphs() - before
            self.recordings += self._recorded() - recorded
        return out

    def _recorded(self) -> int:
        return self.recorded.recordings if self.recorded is not None else 0

    @property
    def work(self) -> int:
        """Graphs compiled plus CUDA graphs recorded so far: a call that moved it held one-off work."""
        return self.graphs + self.recordings

    def _fail(self, exc: Exception) -> None:
        exc = getattr(exc, "inner_exception", None) or exc  # dynamo wraps the backend's error: name that one
        why = f"cannot compile the layer step ({type(exc).__name__}: {first_line(exc)})"
        if self.mode == "on":
            raise HarnessError(f"--compile {why}; run with --compile auto to fall back to eager, or --compile off")
        self.failed = why
        print(f"warning: --compile auto: {why}; running eager", file=sys.stderr)

    def tally(self) -> tuple[int, int, float]:
        """Graphs compiled, CUDA graphs recorded and compile seconds so far (a runtime's `conditions` count from
        the tally it started at: the step is its model's, shared by every run)."""
        return self.graphs, self.recordings, self.seconds

    def conditions(self, since: tuple[int, int, float] = (0, 0, 0.0)) -> dict:
        """What a record says about the engine: compiled or fallen back, the graphs and compile seconds spent since
        `since` (a runtime's start), and whether CUDA graphs ran: recorded (not only asked for; by this run or an
        earlier one of the model), with those this run recorded."""
        if self.failed is not None:
            return {"mode": self.mode, "engine": "eager", "why": self.failed}
        graphs, recordings, seconds = (now - then for now, then in zip(self.tally(), since))
        return {"mode": self.mode, "engine": "inductor", "shapes": "static" if self.static else "dynamic",
                "unit": "layer" if self.static else "layer run", "cuda_graphs": self.recordings > 0,
                **({"cuda_graph_recordings": recordings} if self.graphed else {}),
                "graphs": graphs, "compile_s": round(seconds, 1)}


@functools.cache
def _dynamo_for_layer_steps() -> None:
    """dynamo's process-wide settings the layer steps need, set once, with the first step."""
    # A layer's index is an int attribute; specialising on it would compile one graph per layer.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    # One graph per layer class (target, drafter, the EAGLE-3 authors' layer) and call form (one row or many, tree
    # or chain): more than dynamo's default of 8 for one function, and a bounded set.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, GRAPHS)


_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a loaded model -> its steps by form


def step_for(model: torch.nn.Module, mode: str, backend, device_type: str) -> CompiledStep:
    """The compiled step of a loaded model, in its backend's form (harness/runtime/backend.py): one per model and
    mode, whichever runtime, configuration or method runs it (each `Runner` of a sweep builds a runtime of its own),
    so its graphs and static buffers serve every run of the model in the process, and only a shape no earlier run
    met compiles."""
    form = (mode, backend.static_step, backend.graphed)
    steps = _STEPS.setdefault(model, {})
    if form not in steps:
        steps[form] = CompiledStep(mode, device_type, static=backend.static_step, graphed=backend.graphed)
    return steps[form]


def warm(compiled: CompiledStep | None, call):
    """`call()`, called again while a call compiles a graph or records a CUDA graph (a shape no warm-up reached: a
    verify of a new length), so the last call, the one a caller times, holds neither. A call repeats its own shapes
    (a rerun draws from the same seed), so the second compiles and records nothing."""
    while True:
        work = compiled.work if compiled else 0
        result = call()
        if compiled is None or compiled.work == work:
            return result


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]
