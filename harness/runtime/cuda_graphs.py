"""CUDA graphs of the static step (`--compile` on CUDA: harness/runtime/compiled.py), recorded and looked up by the
runtime itself.

Each layer's call in one padded shape is one graph, recorded the first time the layer meets the shape: the compiled
layer (inductor, without its own CUDA graphs) run twice on a side stream, then captured into a pool all graphs
share. A call finds its graph in a dict, by (layer, shape, KV buffer): constant time, where inductor's own graphs
(`mode="reduce-overhead"`) keep one function's recordings in a list that every call searches, checking each
recording's input addresses in turn, and every layer of a model is a recording of the same function (its weights
live apart): a search as long as the model is deep, at every layer of every step. A replay runs no dynamo guard
either: the guards ran when the graph was recorded.

A graph reads its inputs from static tensors, one per argument and shape that every graph of the shape shares (the
mask, positions and rope of one call are one copy for all its layers), filled by the call before the replay; it
writes the model's KV buffer in place (the step's own, at an address that stays put) and its output into the pool,
copied out before the next replay can overwrite it. A layer whose weights were replaced since its graph was
recorded is recorded again (the graph would read the old tensors). On a CPU a stand-in (`_Rerun`) runs the call
where a graph would replay, so the bookkeeping is tested here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.utils._pytree as pytree


class _CudaGraph:
    """`run()` captured once into `pool`; `replay()` runs it again on what its inputs hold then."""

    def __init__(self, run: Callable[[], torch.Tensor], pool):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compiles and warms cuBLAS and the allocator outside the capture
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()

    def replay(self) -> None:
        self.graph.replay()


class _Rerun:
    """What a graph does, on a CPU: the recorded call run again on the static inputs."""

    def __init__(self, run: Callable[[], torch.Tensor], pool=None):
        self.run = run
        self.out = run()

    def replay(self) -> None:
        self.out = self.run()


class _Recorded:
    """One layer's graph in one shape, and where the weights and buffers it was recorded on lived."""

    def __init__(self, graph, layer: torch.nn.Module):
        self.graph = graph
        self.layer = layer  # kept, so its id names it while the graph lives
        # Each weight's slot, found once (walking the modules at every call costs more than the check itself).
        self._slots = [(tensors, name) for module in layer.modules()
                       for tensors in (module._parameters, module._buffers)
                       for name, tensor in tensors.items() if tensor is not None]
        self._addresses = self._now()

    def _now(self) -> tuple[int, ...]:
        return tuple(tensors[name].data_ptr() if tensors.get(name) is not None else 0 for tensors, name in self._slots)

    def current(self) -> bool:
        """Whether the layer still holds its weights where the graph reads them (a replaced Parameter, `.data = `
        or a load with assign=True moves one)."""
        return self._now() == self._addresses


class GraphedCalls:
    """The static step's calls as CUDA graphs: `__call__` replays a layer's graph for the call's shape, recording it
    first where there is none (or its weights were replaced); `recordings` counts what it recorded."""

    def __init__(self, device_type: str):
        self._graph = _CudaGraph if device_type == "cuda" else _Rerun
        self._pool = None  # one memory pool for every graph, made with the first
        self._recorded: dict[tuple, _Recorded] = {}
        self._slots: dict[tuple, torch.Tensor] = {}  # static inputs: (argument index, shape, dtype) -> tensor
        self._held: dict[tuple, torch.Tensor] = {}  # the tensor each slot was last filled from
        self.recordings = 0

    def __call__(self, step, layer: torch.nn.Module, args: tuple, kwargs: dict, cache) -> torch.Tensor:
        """step(layer, *args, cache=cache, **kwargs) through the layer's graph; `cache` a compiled.LayerKV over the
        whole buffer, writing the slots `cache.write`."""
        leaves, spec = pytree.tree_flatten((args, kwargs, cache.write))
        form = tuple((i, t.shape, t.dtype) if isinstance(t, torch.Tensor) else (i, t) for i, t in enumerate(leaves))
        static = [self._fill(key, value) if isinstance(value, torch.Tensor) else value
                  for key, value in zip(form, leaves)]
        key = (id(layer), form, cache.keys.data_ptr(), cache.values.data_ptr())
        recorded = self._recorded.get(key)
        if recorded is None or not recorded.current():
            recorded = self._recorded[key] = self._record(step, layer, pytree.tree_unflatten(static, spec), cache)
        recorded.graph.replay()  # (a capture itself computes nothing)
        return recorded.graph.out.clone()  # the pool is written by the next replay

    def _fill(self, key: tuple, value: torch.Tensor) -> torch.Tensor:
        """The static input for `key`, holding `value` (copied only where it does not already: the layers of one
        call pass the same mask, positions and rope, which the runtime never writes once made)."""
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = torch.empty_like(value)
        if self._held.get(key) is not value:
            slot.copy_(value)
            self._held[key] = value
        return slot

    def _record(self, step, layer: torch.nn.Module, static: tuple, cache) -> _Recorded:
        args, kwargs, write = static
        kv = type(cache)(cache.keys, cache.values, write)  # the buffer itself, written at the static slots
        if self._pool is None and self._graph is _CudaGraph:
            self._pool = torch.cuda.graph_pool_handle()
        graph = self._graph(lambda: step(layer, *args, cache=kv, **kwargs), self._pool)
        self.recordings += 1
        return _Recorded(graph, layer)
