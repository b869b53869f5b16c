"""The CPU row kernels' backend (harness/runtime/kernels.py, attention.py): built once, explicitly (`build`), then
every fp32 or bf16 Linear of a prepared model is a PackedLinear and its attention the row kernel, so a row's result
is independent of the rows beside it and a verified draft equals greedy AR's step bit for bit."""

from __future__ import annotations

import torch

from harness.runtime.attention import use_rows_attention
from harness.runtime.backend import Backend, Prepared
from harness.runtime.grouped_attention import use_grouped_attention
from harness.runtime.kernels import kernels_build, pack_linears, rows_kernel_problem


class RowKernels(Backend):
    name = "rows"

    @staticmethod
    def build() -> str | None:
        """Builds (once per source hash) and loads the kernels; why they cannot serve this process, or None."""
        return rows_kernel_problem()

    def prepare(self, model: torch.nn.Module) -> Prepared:
        linears, attention = pack_linears(model), use_rows_attention(model)
        return Prepared(linears, attention if attention == "rows" else use_grouped_attention(model))

    def prepare_module(self, module: torch.nn.Module) -> None:
        pack_linears(module)

    def numerics(self) -> list[str]:
        return [f"rows:{kernels_build()}"]
