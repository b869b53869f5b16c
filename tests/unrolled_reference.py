"""The depth-unrolled training layout, written densely as the reference the grouped layout must reproduce: every
position unrolled into n+1 depth rows with a [(n+1)S, (n+1)S] visibility mask."""

import torch

from methods.pipeline.speculator import Speculator


def unrolled_mask(n: int, segment_start: torch.Tensor) -> torch.Tensor:
    """Visibility of the unrolled layout: rows (d, T) in depth-major order, [(n+1)S, (n+1)S] bool.

    Row (d, T) sees, for every T' <= T, exactly the row whose depth the pipeline holds for T' at that moment:
    n if T' lies before T's segment start (prefill or the last flush: those tokens finished), else min(n, d + T - T').
    """
    size = segment_start.shape[0]
    pos = torch.arange(size, device=segment_start.device)
    t, t_key = pos[:, None], pos[None, :]
    depths = torch.arange(n + 1, device=pos.device)
    # seen[d, T, T']: the depth of T' that row (d, T) attends to
    seen = torch.where(t_key < segment_start[:, None], n, torch.clamp(depths[:, None, None] + t - t_key, max=n))
    mask = (seen[:, :, None, :] == depths[None, None, :, None]) & (t_key <= t)[None, :, None, :]
    return mask.reshape((n + 1) * size, (n + 1) * size)


def unrolled_logits(speculator: Speculator, features: dict[int, torch.Tensor], segment_start: torch.Tensor
                    ) -> torch.Tensor:
    """Training forward: every position unrolled into n+1 depth rows; returns the query rows' draft logits [B, S, V'].

    `features` maps target layer -> teacher hidden states [B, S, D]; `segment_start` [B, S] gives, per position, the
    first position of its pipeline segment (0, the prompt end, or a simulated flush).
    """
    config = speculator.config
    batch, size = segment_start.shape
    rows = torch.cat([speculator.project(d, features) for d in range(config.n + 1)], dim=1)  # [B, (n+1)S, D]
    positions = torch.arange(size, device=rows.device).repeat(config.n + 1)
    mask = torch.stack([unrolled_mask(config.n, s) for s in segment_start])[:, None]
    out = speculator.decode(rows, positions, mask, cache=None)
    query = out[:, config.query_depth * size:(config.query_depth + 1) * size]
    return speculator.head_logits(query)
