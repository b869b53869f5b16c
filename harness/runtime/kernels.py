"""The kernel path of a model's Linear layers on CPU: a row kernel of our own over weights packed once into panels,
or oneDNN's blocked layout where the row kernel cannot build.

A decode step is a few-row matrix product per weight. MKL's default path handles one row well but packs the weight
on every call once there are two or more rows, so a verify forward over 2, 4 and 11 tokens cost 1.6, 2.2 and 2.5x
a one-token step on the embedded model. A weight packed once serves any row count from its packed copy, and a row's
result must not depend on how many rows share the call, so that drafts verified together get the logits a step of
their own would (greedy AR decodes one row a call, a verify several).

rows_linear.cpp keeps that invariance by construction (each output one fp32 sum in input-feature order) and reads a
bf16 weight as bf16, widening it to fp32 in registers; oneDNN computes bf16 only on CPUs with bf16 units and
torch's bf16 product is slower than fp32 elsewhere. The embedded model's step-sized weights (211 of them, 538 MB in
fp32), 2 threads, measured on 2026-12-05 on an AVX512-BF16 CPU (ms for 1 / 2 / 4 / 11 / 100 rows):

    fp32  oneDNN 24.9 / 29.0 / 23.3 / 28.9 / 135.7    row kernel 16.8 / 18.5 / 18.8 / 26.6 / 130.8
    bf16  oneDNN 15.2 / 16.7 / 14.4 / 17.6 / 76.1     row kernel 10.6 / 12.9 / 15.0 / 25.9 / 165.5

and on an AVX2 CPU without bf16 units, bf16: torch 43 (one row) and 209 (four), an earlier row kernel of ours 30
and 57. Where the CPU has AVX-512, calls of several rows take a 512-bit tile with the same per-output sums (the same
bits): on an Intel Xeon with AVX-512 on 2026-12-06, fp32 20.4 / 23.2 / 28.7 / 112.3 ms for 2 / 4 / 11 / 100 rows
against the AVX2 tiles' 19.7 / 24.4 / 33.1 / 144.1, bf16 13.7 / 14.7 / 21.7 / 110.5 against 14.8 / 17.2 / 27.9 / 158.4
(one row unchanged: 19.4 fp32, 13.3 bf16, bound by memory). It is built once per machine with its compiler
(torch.utils.cpp_extension, cached outside the repository); a machine that cannot build it keeps oneDNN for fp32
and torch's path for bf16, and says why. Inside a compiled step it stays one opaque op, so inductor fuses what lies
between the products.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


class PackedLinear(torch.nn.Module):
    """A Linear computed by a CPU kernel chosen for its weight (`kernel_for`) from a packed copy: the row kernel's
    panels (`kernel` "rows"), oneDNN's reordered fp32 weight ("onednn"), or None for the plain path.
    The weight and bias stay the same Parameters (tied weights stay tied; readers of .weight see the values), and
    anything that needs gradients through it takes the plain path: neither kernel has a backward. A copy or a
    conversion (deepcopy, .to(dtype or device)) packs again from the weight it then holds, or takes the plain path
    where no kernel serves it, and so does a weight changed in place (an optimizer step, a loaded checkpoint: its
    version counter moved; a write through `.data` moves none, and a tensor made under inference mode keeps none)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach()
        self.kernel = kernel_for(weight)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if self.kernel == "onednn" else \
            pack_rows(weight) if self.kernel == "rows" else None
        self._packed_version = _version(self.weight)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pack()
        return self

    def __getstate__(self):
        return {**self.__dict__, "packed": None}  # oneDNN's layout has no storage to copy: both packed again on load

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None or x.dtype != self.weight.dtype or torch.is_grad_enabled() and self._tracked(x):
            return F.linear(x, self.weight, self.bias)
        if self.kernel == "rows":  # an opaque op inside a compiled graph too (its shape rule: rows_kernel_problem)
            return torch.ops.spd_bench.rows_linear(x, self._current(), self.bias)
        # Inside a compiled graph (harness/runtime/compiled.py) inductor picks oneDNN's kernel: its lowering packs
        # only weights it owns as constants, and a layer step shared by every layer takes them as inputs.
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self._current(), self.bias, "none", [], "")

    def _current(self) -> torch.Tensor:
        """The packed copy, packed again first where the weight changed in place since (eager only: a compiled
        graph reads the copy it was handed)."""
        if not torch.compiler.is_compiling() and _version(self.weight) != self._packed_version:
            self._pack()
        return self.packed

    def _tracked(self, x: torch.Tensor) -> bool:
        return any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def kernel_for(weight: torch.Tensor) -> str | None:
    """The kernel that serves a weight: "rows" for an fp32 or bf16 weight of a multiple of eight outputs where the
    row kernel builds, "onednn" for another fp32 weight, None (the plain path) for anything else."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if weight.shape[0] % 8 == 0 and rows_kernel_problem() is None:
        return "rows"
    return "onednn" if weight.dtype == torch.float32 and torch.backends.mkldnn.is_available() else None


def pack_linears(model: torch.nn.Module) -> str:
    """Swap every fp32 or bf16 Linear of a CPU model for a PackedLinear; returns the kernel its Linears take
    ("rows", "onednn"), or "default" where none serves them."""
    packed = [module.kernel for module in model.modules() if isinstance(module, PackedLinear)]
    if packed:
        return packed[0] or "default"  # a runtime built on this model before packed it
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and kernel_for(child.weight) is not None]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return kernel_for(linears[0][2].weight) if linears else "default"


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """The row kernel's layout of a [N, K] weight: panels of eight outputs, [N/8, K, 8], each read as one stream."""
    return weight.reshape(weight.shape[0] // 8, 8, weight.shape[1]).transpose(1, 2).contiguous()


# The row kernels, built together (rows_load.h, which both include, is read through them).
EXTENSION, SOURCES = "spd_bench_rows", ("rows_linear.cpp", "rows_attention.cpp")


@functools.cache
def rows_kernel_problem() -> str | None:
    """Builds and loads the row kernels (Linear and attention) once per process; returns why they cannot serve this
    machine, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    from torch.utils import cpp_extension

    if not (Path(cpp_extension._get_build_directory(EXTENSION, verbose=False)) / f"{EXTENSION}.so").exists():
        print("building the row kernels (once per machine: about a minute)", file=sys.stderr)
    try:
        cpp_extension.load(EXTENSION, [str(Path(__file__).with_name(name)) for name in SOURCES],
                           extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False)
    except Exception as error:  # no compiler or no ninja: oneDNN (fp32), torch's bf16 path and sdpa still work
        why = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        print(f"warning: Linears take oneDNN's or torch's path and attention sdpa's: the row kernels did not build "
              f"({why})", file=sys.stderr)
        return f"the row kernels did not build: {why}"
    torch.library.register_fake("spd_bench::rows_linear", _rows_linear_shape)
    torch.library.register_fake("spd_bench::rows_attention", _rows_attention_shape)
    return None


def _rows_linear_shape(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The row kernel's output as a compiled graph sees it before running it."""
    return x.new_empty((*x.shape[:-1], panels.shape[0] * 8))


def _rows_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """The attention kernel's output ([B, T, H, D], as HF's attention functions return it) before running it."""
    batch, heads, rows, dim = query.shape
    return query.new_empty((batch, rows, heads, dim))
