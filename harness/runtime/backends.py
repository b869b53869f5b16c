"""Which backend a runtime on a device takes (harness/runtime/backend.py): CUDA's on a GPU, the row kernels on a
CPU where they build and `--kernels` allows, torch's kernels elsewhere. Chosen once per runtime."""

from __future__ import annotations

from harness.runtime.backend import Backend
from harness.runtime.backend_cuda import Cuda
from harness.runtime.backend_rows import RowKernels


def backend_for(device_type: str) -> Backend:
    if device_type == "cuda":
        return Cuda()
    if device_type == "cpu" and RowKernels.build() is None:
        return RowKernels()
    return Backend()
