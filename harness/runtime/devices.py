"""Device strings, made whole once where they are parsed: a bare "cuda" names the current CUDA device by its index,
since torch refuses an index-less CUDA device where a device must be chosen (`torch.cuda.set_device`)."""

from __future__ import annotations

import torch


def indexed(device: str) -> str:
    """"cuda" -> "cuda:k" (k the current CUDA device, 0 where none is visible); any other string unchanged."""
    if device != "cuda":
        return device
    return f"cuda:{torch.cuda.current_device() if torch.cuda.is_available() else 0}"
