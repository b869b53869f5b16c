"""The CUDA backend: torch's sdpa in its grouped form (no copy of GQA's keys and values: grouped_attention.py), the
LM head's fp32 sums straight from the matmul, and a static compiled step whose calls replay as CUDA graphs the
runtime records itself (compiled.py, cuda_graphs.py). Nothing of the CPU row kernels is built or loaded."""

from __future__ import annotations

import torch

from harness.runtime.backend import Backend


class Cuda(Backend):
    name = "cuda"
    static_step = True  # the cache length grows every step: graphs replay static shapes (compiled.py)
    graphed = True

    def logits(self, head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The matmul writes its fp32 sums out as they are: no fp32 copy of a bf16 head's weight."""
        if head.weight.dtype == torch.float32:
            return head(x)
        out = torch.mm(x.reshape(-1, x.shape[-1]), head.weight.t(), out_dtype=torch.float32)
        out = out.view(*x.shape[:-1], -1)
        return out if head.bias is None else out + head.bias.float()

    def numerics(self) -> list[str]:
        """The sdpa backends CUDA may take (each sums in its own order)."""
        cuda = torch.backends.cuda
        return [f"sdpa:{cuda.flash_sdp_enabled()}{cuda.mem_efficient_sdp_enabled()}{cuda.math_sdp_enabled()}"
                f"{cuda.cudnn_sdp_enabled()}"]
