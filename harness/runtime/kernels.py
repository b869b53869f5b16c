"""The kernel path of a target's Linear layers on CPU: weights reordered once into oneDNN's blocked layout.

A decode step is a few-row matrix product per weight. MKL's default path handles one row well but packs the weight
on every call once there are two or more rows, so a verify forward over 2, 4 and 11 tokens cost 1.6, 2.2 and 2.5x
a one-token step on the embedded model (its LM head alone: 5.4 ms for one row, 10.7 for two, 31 for four). A weight
reordered once for oneDNN serves any row count from its packed copy (the LM head: 3.9, 4.4, 5.7 ms; the forwards:
1.02, 1.11 and 1.34x a step, the step itself no slower), and a row's result does not depend on how many rows share
the call, so drafts verified together get the logits a step of their own would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PackedLinear(torch.nn.Module):
    """A Linear computed from a oneDNN-reordered copy of its weight. The weight and bias stay the same Parameters
    (tied weights stay tied; readers of .weight see the values), and anything that needs gradients through it takes
    the plain path: oneDNN's op has no backward. A copy or a conversion (deepcopy, .to(dtype or device)) packs
    again from the weight it then holds, or takes the plain path where oneDNN does not serve it, and so does a
    weight changed in place (an optimizer step, a loaded checkpoint: its version counter moved; a write through
    `.data` moves none, and a tensor made under inference mode keeps none)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach()
        served = weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if served else None
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
        if self.packed is None or x.dtype != torch.float32 or torch.is_grad_enabled() and self._tracked(x):
            return F.linear(x, self.weight, self.bias)
        if _version(self.weight) != self._packed_version:
            self._pack()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def _tracked(self, x: torch.Tensor) -> bool:
        return any(t is not None and t.requires_grad for t in (x, self.weight, self.bias))


def _version(tensor: torch.Tensor) -> int | None:
    return None if tensor.is_inference() else tensor._version


def pack_linears(model: torch.nn.Module) -> str:
    """Swap every fp32 Linear of a CPU model for a PackedLinear; returns the path its Linears take: "onednn", or
    "default" for other dtypes (oneDNN computes bf16 only on CPUs with bf16 units; MKL's default path serves them)."""
    if any(isinstance(module, PackedLinear) for module in model.modules()):
        return "onednn"  # a runtime built on this model before packed it
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32]
    if not linears or not torch.backends.mkldnn.is_available():
        return "default"
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child))
    return "onednn"
