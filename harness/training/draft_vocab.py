"""Draft vocabularies from a file: the reference's `draft_vocab/*.json` (what its `--draft_vocab_json` takes: the
top-k target ids of a corpus, `token_ids`, beside `vocab_size`, `draft_vocab_size` and how they were counted), or a
plain JSON list of ids. A drafter built on one predicts those ids (an EAGLE-3 head's `d2t` is target id minus draft
id, methods/eagle3/interop.py), so a head trained here shares the reference's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.runtime.errors import HarnessError


def read_draft_vocab(path: Path, vocab_size: int) -> torch.Tensor:
    """The sorted target ids the file names, checked against the target's vocabulary size."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise HarnessError(f"--draft-vocab-file {path}: cannot read it as JSON ({exc})") from None
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise HarnessError(f"--draft-vocab-file {path}: no 'token_ids' list of whole numbers (the reference's "
                           f"draft_vocab/*.json form, or a plain list of ids)")
    if isinstance(data, dict) and data.get("draft_vocab_size") not in (None, len(ids)):
        raise HarnessError(f"--draft-vocab-file {path}: draft_vocab_size {data['draft_vocab_size']} but "
                           f"{len(ids)} token_ids")
    if isinstance(data, dict) and data.get("vocab_size") not in (None, vocab_size) and max(ids) >= vocab_size:
        raise HarnessError(f"--draft-vocab-file {path}: counted on a vocabulary of {data['vocab_size']} ids, the "
                           f"target has {vocab_size}; count one for this target")
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= vocab_size:
        raise HarnessError(f"--draft-vocab-file {path}: ids must be distinct and within the target's vocabulary of "
                           f"{vocab_size}")
    return torch.tensor(sorted(ids))
