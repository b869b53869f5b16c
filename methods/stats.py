"""A generation's stats as typed records: each family declares a dataclass (a `Stats` subclass) with its counters and
its shape; the family fills it (`Generation.stats`), the record stores `record()`, and the report reads it back
through the family (`Method.Stats.read`) and pools a configuration's samples with `pooled`.

Pooling, field by field: numbers add up, lists of numbers add element-wise, and a field marked `same()` (a run's
shape, its devices) is what every sample of one configuration shares, so the latest sample's value stands.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Self


def same(default=None):
    """A field every sample of a configuration shares (a shape, a device list): pooled by keeping it, not adding."""
    return field(default=default, metadata={"same": True})


class Record:
    """A dataclass the record stores as a JSON object: None fields are left out, nested records are objects."""

    def record(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = value.record() if isinstance(value, Record) else value
        return out

    @classmethod
    def read(cls, raw: dict) -> Self:
        """The record's object as this class; keys it does not declare (the runner's own) are not its business."""
        values = {}
        for f in fields(cls):
            if f.name in raw:
                nested = _nested(cls).get(f.name)
                value = raw[f.name]
                values[f.name] = nested.read(value) if nested is not None and isinstance(value, dict) else value
        return cls(**values)

    def leaves(self) -> dict[tuple, float]:
        """The numbers pooling adds up, by path: field name, then a list index or the nested record's path."""
        out: dict[tuple, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("same") or value is None:
                continue
            if isinstance(value, Record):
                out.update({(f.name, *path): v for path, v in value.leaves().items()})
            elif isinstance(value, list):
                out.update({(f.name, i): v for i, v in enumerate(value) if _number(v)})
            elif _number(value):
                out[(f.name,)] = value
        return out

    def with_leaves(self, values: dict[tuple, float]) -> Self:
        """A copy with the numbers at these paths replaced (a bootstrap replicate's sums; see `leaves`)."""
        mine: dict[str, dict[tuple, float]] = {}
        for path, v in values.items():
            mine.setdefault(path[0], {})[path[1:]] = v
        changes = {}
        for name, part in mine.items():
            value = getattr(self, name)
            if isinstance(value, Record):
                changes[name] = value.with_leaves(part)
            elif isinstance(value, list):
                changes[name] = [part.get((i,), v) for i, v in enumerate(value)]
            else:
                changes[name] = part[()]
        return dataclasses.replace(self, **changes)

    def pooled(self, other: Self) -> Self:
        """This sample's stats with another sample's of the same configuration added (see the module's rules)."""
        return type(self)(**{f.name: _pool(f, getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})


@functools.cache
def _nested(cls: type[Record]) -> dict[str, type[Record]]:
    """The fields of `cls` that hold a Record (also as `X | None`), with its class (read once per class: every
    record row is read through it)."""
    found = {}
    for name, hint in typing.get_type_hints(cls).items():
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        record = next((o for o in options if isinstance(o, type) and issubclass(o, Record)), None)
        if record is not None:
            found[name] = record
    return found


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _pool(f: dataclasses.Field, a, b):
    if a is None or b is None or f.metadata.get("same"):
        return a if b is None else b
    if isinstance(a, Record):
        return a.pooled(b)
    if isinstance(a, list):
        size = max(len(a), len(b))
        return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)]
    if _number(a):
        return a + b
    return b


@dataclass
class Executor(Record):
    """Where a generation's served ranks ran: "local" (one process) or "distributed", with the group's facts."""

    kind: str = same("local")
    backend: str | None = same()
    world_size: int | None = same()
    devices: list | None = same()
    stage_forward_s: list[float] | None = None  # pipeline stage ranks: each one's summed forward seconds


@dataclass
class Stats(Record):
    """What every generation may record beside its tokens and timings; families add their own fields."""

    expected_accepts: float | None = None  # replayed runs: summed acceptance probabilities of the verified drafts
    executor: Executor | None = None  # families with served ranks

    def drafts(self, steps: int, positions: int) -> list[int]:
        """Drafts the target verified at each draft position: by default every step offers every position."""
        return [steps] * positions

    @property
    def executor_kind(self) -> str:
        return "local" if self.executor is None else self.executor.kind
