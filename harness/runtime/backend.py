"""A runtime's backend: what serves a target's Linears, attention, LM head and compiled step on its device, chosen
once per runtime (harness/runtime/backends.py) and applied by an explicit `prepare` of the model; methods never
see it. Each backend's knowledge lives in a module of its own: backend_rows.py (the CPU row kernels),
backend_cuda.py (CUDA: sdpa and CUDA graphs). This one is torch's own kernels as they come (a CPU under
`--kernels torch` or where the row kernels cannot build, and any other device), the others' common ground.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.runtime.grouped_attention import use_grouped_attention
from harness.runtime.kernels import float_linear


@dataclass(frozen=True)
class Prepared:
    """What a record says served a prepared model: its Linears' kernel and its attention."""

    linears: str
    attention: str


class Backend:
    """torch's kernels: Linears as they are, HF's sdpa in its grouped form (grouped_attention.py), a dynamic
    compiled step (a run of alike layers one graph), no CUDA graphs."""

    name = "torch"
    static_step = False  # the compiled step's form (harness/runtime/compiled.py): static shapes, padded to buckets
    graphed = False  # the static step's calls replayed as CUDA graphs (harness/runtime/cuda_graphs.py)

    def prepare(self, model: torch.nn.Module) -> Prepared:
        """Points the model's attention (and, in a backend with kernels of its own, its Linears) at what serves
        them; returns what does."""
        return Prepared("default", use_grouped_attention(model))  # another than sdpa stays as it is

    def prepare_module(self, module: torch.nn.Module) -> None:
        """A drafter's module, to decode on the kernels the target's Linears take (training keeps the plain path)."""

    def logits(self, head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The LM head's outputs in fp32, whatever its weights' dtype: logits as the reference decodes from them
        (bf16 logits round near-ties into exact ties the fp32 sums do not have): `kernels.float_linear`, which
        also takes a packed head's own fp32 sums."""
        return float_linear(head, x)

    def numerics(self) -> list[str]:
        """What else of the backend decides its sums (a kernel build, the kernels a device may take)."""
        return []
