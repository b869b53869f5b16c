"""Losslessness: greedy AR reference outputs (cached on disk) and the per-sample comparison against them."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.runtime.models import LoadedModel
from harness.runtime.paths import cache_dir
from harness.runtime.results import append_line
from harness.runtime.target import TargetRuntime
from harness.runtime.verdict import classify

# Config fields that cannot change a greedy output: where the folder is and which library wrote it (the dtype is
# keyed on its own).
_INERT_CONFIG = ("_name_or_path", "transformers_version", "dtype", "torch_dtype")


def greedy_context(loaded: LoadedModel, stop_ids: set[int]) -> str:
    """A hash of what besides the weights, dtype and device decides a greedy output: the stop ids (a folder with the
    same weights and another end-of-turn id stops elsewhere) and the model config (e.g. rope scaling). The prompt's
    rendering (chat template) and the length are in each line's key: prompt ids and max_new_tokens."""
    config = {k: v for k, v in loaded.model.config.to_dict().items() if k not in _INERT_CONFIG}
    text = json.dumps({"stop_ids": sorted(stop_ids), "config": config}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


class ReferenceCache:
    """AR outputs keyed by (model weights, dtype, device, the runtime's numerics, greedy context) file and (prompt
    ids, max_new_tokens, variant) line: the greedy output (no variant) or a sampled one (the variant names the sampling
    and the seed). The numerics (`TargetRuntime.numerics`: its kernels, compiled step and the machine that picks
    them) are in the key because each kernel sums in its own order: a reference decoded on other kernels can fall
    the other way at a near-tie, and a method would be marked DIVERGED for tokens its own runtime's AR would have
    chosen too."""

    def __init__(self, loaded: LoadedModel, dtype: str, stop_ids: set[int], numerics: str, root: Path | None = None):
        root = root or cache_dir() / "references"
        weights, device = loaded.identity.weights_sha256[:16], loaded.device.type
        self.path = root / f"{weights}-{dtype}-{device}-{numerics}-{greedy_context(loaded, stop_ids)}.jsonl"
        self._entries: dict[str, list[int]] | None = None

    @staticmethod
    def key(prompt_ids: list[int], max_new_tokens: int, variant: str = "") -> str:
        key = f"{hashlib.sha256(json.dumps(prompt_ids).encode()).hexdigest()[:24]}-{max_new_tokens}"
        return f"{key}-{variant}" if variant else key

    def _load(self) -> dict[str, list[int]]:
        if self._entries is None:
            self._entries = {}
            if self.path.exists():
                for line in self.path.read_text().splitlines():
                    try:
                        row = json.loads(line)
                        self._entries[row["key"]] = row["output_ids"]
                    except (ValueError, KeyError):
                        continue  # a torn line from an interrupted write: that entry is recomputed
        return self._entries

    def get(self, prompt_ids: list[int], max_new_tokens: int, variant: str = "") -> list[int] | None:
        return self._load().get(self.key(prompt_ids, max_new_tokens, variant))

    def put(self, prompt_ids: list[int], max_new_tokens: int, output_ids: list[int], variant: str = "") -> None:
        key = self.key(prompt_ids, max_new_tokens, variant)
        self._load()[key] = output_ids
        append_line(self.path, {"key": key, "output_ids": output_ids})


def first_divergence(output: list[int], reference: list[int]) -> int | None:
    """Index of the first differing token (a length difference counts), or None if identical."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return None if len(output) == len(reference) else min(len(output), len(reference))


def top2_margin(target: TargetRuntime, prompt_ids: list[int], reference: list[int], index: int) -> float:
    """The target's top-1 minus top-2 logit where the reference chose token `index` (teacher-forced, one prefill):
    for an output whose makers' logits cannot be replayed here (HF `generate`)."""
    target.reset()
    ids = torch.tensor(prompt_ids + reference[:index])
    logits, _ = target.forward(ids, start=0, last=True)
    top = torch.topk(logits[-1], 2).values
    return float(top[0] - top[1])


@dataclass
class Replay:
    """How to decode a sample's two sides again at T=0, for the verdict (harness/runtime/verdict.py): the method
    (its whole output, on the runtime compared) and greedy AR (n tokens, on `ar_target`: default the same)."""

    method: Callable[[], list[int]]
    ar: Callable[[int], list[int]]
    ar_target: TargetRuntime | None = None


def compare(target: TargetRuntime, prompt_ids: list[int], output: list[int], reference: list[int],
            replay: Replay | None = None) -> dict:
    """The record's `lossless` field for a T=0 run: identical or not, where it first differs and, with `replay`, the
    verdict ("identical", "flip": a near-tie the two forms' rounding decided apart, "logic": anything else) with its
    evidence and AR's own top-2 gap there as the margin."""
    index = first_divergence(output, reference)
    if index is None:
        return {"checked": True, "identical": True, "first_divergence": None, "margin": None, "verdict": "identical"}
    row = {"checked": True, "identical": False, "first_divergence": index, "margin": None, "verdict": "logic"}
    if index >= min(len(output), len(reference)):  # one stopped where the other went on: no near-tie decides that
        return {**row, "evidence": {"reason": "one output stops where the other goes on"}}
    if replay is None:
        return {**row, "verdict": None, "margin": top2_margin(target, prompt_ids, reference, index)}
    verdict, evidence = classify(target, replay.method, replay.ar, output, reference, index, replay.ar_target)
    return {**row, "verdict": verdict, "margin": evidence.gap, "evidence": evidence.to_dict()}


def not_checked(reason: str) -> dict:
    return {"checked": False, "identical": None, "first_divergence": None, "margin": None, "verdict": None,
            "reason": reason}
