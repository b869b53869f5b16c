"""The method contract: every decoding method is built from the target runtime and returns a `Generation`.

The runner, metrics and reports only see `Generation`; they never look inside a method.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import ClassVar

import torch

from harness.runtime.errors import HarnessError
from harness.runtime.target import TargetRuntime
from methods.sampling import Sampler
from methods.stats import Stats


@dataclass
class Generation:
    output_ids: list[int]
    steps: int  # target forwards after prefill (rounds or pipeline cycles)
    accepted: list[int]  # tokens committed by each step
    position_accepts: list[int] = field(default_factory=list)  # accepted drafts per draft position
    timing: dict[str, float] = field(default_factory=dict)  # seconds: prefill, decode, components
    stats: Stats = field(default_factory=Stats)  # the family's counters and shape (its Method.Stats)
    drafts: dict = field(default_factory=dict)  # what its drafter proposed (methods/drafts.py), set by the runner


class Timer:
    """Accumulates seconds per named component, in total and per lap (a family's rounds: `lap` starts the next). On
    CUDA a component is bracketed by two events on the current stream and the events are read once, when the
    totals are asked for at the end of a generation: synchronising around each component would drain the launch
    queue several times a step, the stall a step without read-backs avoids. An event pair measures the device's
    timeline from the component's start to the end of its last kernel, idle waits for the host included, so a span
    that ends in a read-back (decode) equals its wall-clock."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self._totals: dict[str, float] = {}
        self._laps: list[dict[str, float]] = [{}]
        self._pending: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def __call__(self, name: str):
        lap = len(self._laps) - 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)  # the device's own, whichever is current
            start.record(stream)
            yield
            end.record(stream)
            self._pending.append((name, lap, start, end))
            return
        start = time.perf_counter()
        yield
        self._add(name, lap, time.perf_counter() - start)

    def lap(self) -> None:
        """What is timed from now on belongs to the next lap (spans belong to the lap they start in)."""
        self._laps.append({})

    @property
    def totals(self) -> dict[str, float]:
        """Seconds per component (on CUDA: one synchronisation, here, for everything recorded since the last read:
        read it once, at the end of a generation)."""
        self._resolve()
        return self._totals

    @property
    def laps(self) -> list[dict[str, float]]:
        """Seconds per component in each lap, the first lap being what was timed before the first `lap()`."""
        self._resolve()
        return self._laps

    def _resolve(self) -> None:
        if self._pending:
            torch.cuda.synchronize(self.device)
            for name, lap, start, end in self._pending:
                self._add(name, lap, start.elapsed_time(end) / 1000)
            self._pending.clear()

    def _add(self, name: str, lap: int, seconds: float) -> None:
        self._totals[name] = self._totals.get(name, 0.0) + seconds
        self._laps[lap][name] = self._laps[lap].get(name, 0.0) + seconds


@dataclass(frozen=True)
class NoParams:
    """Parameters of a method that has none."""


class Method(ABC):
    """A decoding method: `name`, `Params` (a frozen dataclass of `param` fields), `Stats` (what its generations
    record, methods/stats.py) and `generate`. Whatever else a family offers (report figures, a trained drafter,
    foreign formats, ranks of its own, acceptance replay, self-checks, parity, an HF peer) it declares as the
    capabilities of methods/capabilities.py."""

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    Stats: ClassVar[type[Stats]] = Stats

    def __init__(self, target: TargetRuntime, params, stop_ids: set[int], checkpoint: str | None = None):
        self.target = target
        self.params = params
        self.stop_ids = stop_ids
        self.checkpoint = checkpoint

    @classmethod
    def check_model(cls, params, num_layers: int) -> None:
        """Raise ValueError when these parameters cannot run on a target with `num_layers` layers."""

    @abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        """Decode up to `max_new_tokens` tokens (stopping after any stop id) for one prompt."""


def commit(output: list[int], tokens: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Append tokens up to the budget and the first stop id; returns those appended."""
    new = []
    for token in tokens:
        if len(output) >= max_new_tokens or output[-1] in stop_ids:
            break
        output.append(token)
        new.append(token)
    return new


REGISTRY: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    REGISTRY[cls.name] = cls
    return cls


def parse_params(cls: type[Method], raw: dict):
    """Build the method's Params from a dict, rejecting unknown names, values of the wrong type and values outside
    a parameter's `choices`."""
    types = {f.name: getattr(f.type, "__name__", str(f.type)) for f in fields(cls.Params)}
    choices = {f.name: f.metadata.get("choices") for f in fields(cls.Params)}
    unknown = set(raw) - set(types)
    if unknown:
        allowed = ", ".join(sorted(types)) or "none"
        raise ValueError(f"method {cls.name} has no parameter(s) {', '.join(sorted(unknown))} (allowed: {allowed})")
    values = dict(raw)
    for name, value in raw.items():
        if types[name] == "float" and isinstance(value, (int, str)):  # the command line gives words and integers
            try:
                values[name] = float(value)
            except ValueError:
                raise ValueError(f"parameter {name} of {cls.name} wants a number, got {value!r}") from None
        if types[name] == "int" and not isinstance(value, int):
            raise ValueError(f"parameter {name} of {cls.name} wants an integer, got {value!r}")
        if types[name] == "str" and isinstance(value, int):  # a word of digits, as the command line gives it
            values[name] = str(value)
        elif types[name] == "str" and not isinstance(value, str):
            raise ValueError(f"parameter {name} of {cls.name} wants a word, got {value!r}")
        if choices[name] and values[name] not in choices[name]:
            raise ValueError(f"parameter {name} of {cls.name} takes {' or '.join(map(str, choices[name]))}, got "
                             f"{values[name]!r}")
    return cls.Params(**values)


def param(default, help: str, recorded_when_set: bool = False, choices: tuple = (), flags: tuple[str, ...] = ()):
    """A method parameter: its default and the help line `run --help` shows for its `--name` option. A parameter
    added after records were committed is `recorded_when_set`: recorded only when it differs from its default, so
    the configuration keys of earlier records (their resumption, the regression baseline) still hold. `choices`:
    the only values it takes (a sweep skips the others for this method instead of failing); `flags`: further option
    names (ones command lines used before options were generated)."""
    return field(default=default, metadata={"help": help, "recorded_when_set": recorded_when_set,
                                            "choices": choices, "flags": flags})


def recorded_params(params) -> dict:
    """The params as a record stores them (and as they enter the configuration key)."""
    return {f.name: getattr(params, f.name) for f in fields(params)
            if not f.metadata.get("recorded_when_set") or getattr(params, f.name) != f.default}


def build_method(name: str, target: TargetRuntime, raw_params: dict, stop_ids: set[int], checkpoint=None) -> Method:
    if name not in REGISTRY:
        raise KeyError(name)
    cls = REGISTRY[name]
    return cls(target, parse_params(cls, raw_params), stop_ids, checkpoint)


def offers(cls: type[Method], params: dict) -> bool:
    """False where a value is not among its parameter's `choices` (a grid or a training list skips it for this
    method: PPSD drafts after each step only); bad values of any other kind fail in parse_params."""
    choices = {f.name: f.metadata.get("choices") for f in fields(cls.Params)}
    return not any(choices.get(name) and value not in choices[name] for name, value in params.items())


def check_fit(name: str, params: dict, num_layers: int) -> None:
    """What only the loaded model can tell: the method's parameters fit its `num_layers` layers (e.g. pipeline
    stages)."""
    cls = REGISTRY[name]
    try:
        cls.check_model(parse_params(cls, params), num_layers)
    except ValueError as exc:
        raise HarnessError(f"{exc}; fix the option") from None
