"""The kernel path of a target's Linear layers on CPU: fp32 weights reordered once into oneDNN's blocked layout, bf16
weights read by a row kernel of our own where oneDNN has no bf16 path.

A decode step is a few-row matrix product per weight. MKL's default path handles one row well but packs the weight
on every call once there are two or more rows, so a verify forward over 2, 4 and 11 tokens cost 1.6, 2.2 and 2.5x
a one-token step on the embedded model (its LM head alone: 5.4 ms for one row, 10.7 for two, 31 for four). A weight
reordered once for oneDNN serves any row count from its packed copy (the LM head: 3.9, 4.4, 5.7 ms; the forwards:
1.02, 1.11 and 1.34x a step, the step itself no slower), and a row's result does not depend on how many rows share
the call, so drafts verified together get the logits a step of their own would.

oneDNN computes bf16 only on CPUs with bf16 units; elsewhere (AVX2) torch's bf16 product took 43 ms for one row of the
embedded model's step-sized weights and 209 ms for four, against oneDNN's 59 and 75 in fp32. rows_linear.cpp widens
each bf16 weight row to fp32 as it reads it, so a step reads half an fp32 model's bytes: 30 ms for one row, 57 for
four (measured on 2026-12-05 over one 233k x 576 weight, 2 threads); it keeps the row invariance above. It is built
once with the machine's compiler (torch.utils.cpp_extension, cached outside the repository); a machine that cannot
build it keeps torch's bf16 path and says why.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F


class PackedLinear(torch.nn.Module):
    """A Linear computed by a CPU kernel chosen for its weight: from a oneDNN-reordered copy of an fp32 weight, or by
    the bf16 row kernel straight from a bf16 weight (`kernel`: "onednn", "bf16-rows", or None for the plain path).
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
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if self.kernel == "onednn" else None
        self._packed_version = _version(self.weight)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self._pack()
        return self

    def __getstate__(self):
        return {**self.__dict__, "packed": None}  # oneDNN's layout has no storage to copy: packed again on load

    def __setstate__(self, state):
        super().__setstate__(state)
        self._pack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Inside a compiled graph (harness/runtime/compiled.py) inductor picks the kernel: its oneDNN lowering
        # packs only weights it owns as constants, and a layer step shared by every layer takes them as inputs.
        if torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if self.kernel is None or x.dtype != self.weight.dtype or torch.is_grad_enabled() and self._tracked(x):
            return F.linear(x, self.weight, self.bias)
        if _version(self.weight) != self._packed_version:
            self._pack()
        if self.kernel == "bf16-rows":
            return torch.ops.spd_bench.rows_linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _tracked(self, x: torch.Tensor) -> bool:
        return any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def kernel_for(weight: torch.Tensor) -> str | None:
    """The kernel that serves a weight: "onednn" for fp32, "bf16-rows" for a contiguous bf16 weight where the row
    kernel builds, None (the plain path) for anything else."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.float32:
        return "onednn" if torch.backends.mkldnn.is_available() else None
    if weight.dtype == torch.bfloat16 and weight.is_contiguous() and rows_kernel_problem() is None:
        return "bf16-rows"
    return None


def pack_linears(model: torch.nn.Module) -> str:
    """Swap every fp32 or bf16 Linear of a CPU model for a PackedLinear; returns the kernel its Linears take
    ("onednn", "bf16-rows"), or "default" where none serves them."""
    packed = [module.kernel for module in model.modules() if isinstance(module, PackedLinear)]
    if packed:
        return packed[0] or "default"  # a runtime built on this model before packed it
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and kernel_for(child.weight) is not None]
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return kernel_for(linears[0][2].weight) if linears else "default"


@functools.cache
def rows_kernel_problem() -> str | None:
    """Builds and loads the bf16 row kernel once per process; returns why it cannot serve this machine, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    from torch.utils import cpp_extension

    print("loading the bf16 row kernel (a machine's first load builds it: about a minute)", file=sys.stderr)
    try:
        cpp_extension.load("spd_bench_rows_linear", [str(Path(__file__).with_name("rows_linear.cpp"))],
                           extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           is_python_module=False)
    except Exception as error:  # no compiler or no ninja: torch's own bf16 path still works
        why = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
        print(f"warning: bf16 Linears take torch's default path: the row kernel did not build ({why})",
              file=sys.stderr)
        return f"the row kernel did not build: {why}"
    return None
