"""What a generation's drafter proposed: every round's draft tokens, accepted or not, with their tree's parents,
folded into one digest. At T=0 every proposal is deterministic, so the regression gate compares digests prompt by
prompt: a drafter whose weights or code changed shows there even where acceptance happens to hold.

The verifiers note each round's drafts (`note`) from what their one read-back already holds; the runner opens a log
around a generation (`drafted`). Outside a log, `note` does nothing. A replay (`--simulate`) notes what its own
verifier sees: an EAGLE-3 tree replay the executed rounds' drafts, a batched replay (chains, the pipeline at width
1) none, so a replayed configuration is compared with its own baseline only, as the gate does."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class DraftLog:
    rounds: int = 0
    _hash: object = field(default_factory=hashlib.sha256, repr=False)

    def add(self, tokens: list[int], parents: list[int]) -> None:
        self._hash.update(json.dumps([tokens, parents], separators=(",", ":")).encode() + b"\n")
        self.rounds += 1

    def record(self) -> dict:
        """What a record keeps: the digest of every round's drafts in order and how many rounds proposed any."""
        return {"digest": self._hash.hexdigest()[:16], "rounds": self.rounds}


_log: ContextVar[DraftLog | None] = ContextVar("draft_log", default=None)


@contextmanager
def drafted() -> Iterator[DraftLog]:
    """A log of the drafts the verifiers see while the block runs."""
    log = DraftLog()
    token = _log.set(log)
    try:
        yield log
    finally:
        _log.reset(token)


def note(tokens: list[int], parents: list[int] | None = None) -> None:
    """One round's proposed drafts (in the order the round verifies them) and each one's parent (-1: the round's
    root; None: a chain, each the child of the one before)."""
    log = _log.get()
    if log is not None and tokens:
        log.add(list(tokens), list(range(-1, len(tokens) - 1)) if parents is None else list(parents))
