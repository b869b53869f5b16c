"""The method contract: every decoding method is built from the target runtime and returns a `Generation`.

The runner, metrics and reports only see `Generation`; they never look inside a method.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar, Protocol

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


class ParityCheck(Protocol):
    """A family's parity figures over one trajectory, pooled with `add` over prompts."""

    lossless: bool  # the method's output equalled the trajectory

    @property
    def disagree(self) -> int: ...  # states where decoding and training disagree beyond near-ties

    def add(self, other) -> None: ...

    def record(self) -> dict: ...  # the record's figures

    def table(self) -> str: ...  # what the command prints


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
class ExportFormat:
    """A family's records in another tool's per-sample format (`spd-bench export --format NAME`)."""

    sample: Callable[[dict, int, str | None], dict]  # (record, index in its file, the prompt text) -> one line
    suffix: str  # after the configuration's name in the file name
    about: str  # for --help


@dataclass(frozen=True)
class ImportFormat:
    """A drafter published in another tool's format: `spd-bench import --NAME PATH` (and `run --checkpoint PATH`,
    through `Method.import_checkpoint`) converts it into the drafter cache."""

    about: str  # for --help
    convert: Callable[[Path, TargetRuntime, object, bool], Path]  # (path, target, params, force) -> cached folder
    params: tuple[str, ...] = ()  # the method's parameters that say where it is filed (options of `import`)


@dataclass(frozen=True)
class HeadExport:
    """A trained drafter written in another tool's format (`spd-bench export-head`)."""

    about: str  # for --help
    check: Callable[[Path, bool], None]  # (out, replace): the destination is usable, before anything loads
    write: Callable[[str, object, str | None, Path, bool], Path]  # (model, params, checkpoint, out, replace) -> out
    params: tuple[str, ...] = ()  # the method's parameters that pick the drafter (options of `export-head`)


@dataclass(frozen=True)
class PositionAxis:
    """What a family's accepts per position count (Generation.position_accepts): a round's draft positions, or a
    pipeline's fill levels; the report gives each axis a table and a figure panel."""

    label: str  # a column's prefix: "pos 0"
    title: str  # the table's title
    name: str  # the figure's axis


@dataclass(frozen=True)
class NoParams:
    """Parameters of a method that has none."""


class Method(ABC):
    """A decoding method. Subclasses set `name`, `Params` (a frozen dataclass), `Stats` (what its generations record,
    methods/stats.py) and implement `generate`; a family with its own speedup model overrides the figure hooks below
    (they read a pooled summary: harness/reporting/metrics.py's `Summary`, with tokens/step, the family's pooled
    `stats` and the summed timings)."""

    name: ClassVar[str]
    Params: ClassVar[type] = NoParams
    Stats: ClassVar[type[Stats]] = Stats
    positions: ClassVar[PositionAxis | None] = None  # what position_accepts counts (None: the method drafts nothing)
    trainable: ClassVar[bool] = False  # whether `spd-bench train` builds drafters for it (`training_specs`)
    training_params: ClassVar[tuple[str, ...]] = ()  # Params fields `spd-bench train` takes as comma lists
    training_options: ClassVar[dict[str, tuple[type, str]]] = {}  # training-only options: name -> (type, help)
    imports: ClassVar[dict[str, ImportFormat]] = {}  # foreign drafter formats `spd-bench import` converts
    head_export: ClassVar[HeadExport | None] = None  # `spd-bench export-head`: the trained drafter, foreign format
    serves: ClassVar[str] = ""  # what `--executor distributed` gives ranks of their own (see `served`)
    drafts_with: ClassVar[str | None] = None  # the family whose trained drafter it uses, where not its own

    @classmethod
    def drafter_family(cls) -> str:
        """The family its trained drafter is filed under (the drafter cache's and drafters/' folder names)."""
        return cls.drafts_with or cls.name

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """The drafters `spd-bench train` builds for this family from the option values it lists (n, ls, schedule,
        ttt, layout; an empty list: the family's default); each family's objective.py says what it trains on."""
        raise NotImplementedError(f"{cls.name} trains no drafter")

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        return None

    @classmethod
    def modeled_speedup(cls, summary) -> float | None:
        return None

    @classmethod
    def l_acc(cls, summary) -> float | None:
        """Accepted layers per cycle relative to the slowest device's (pipeline families); None where undefined."""
        return None

    @classmethod
    def reference_speedup(cls, summary) -> float | None:
        """The theoretical speedup as the family's reference code defines it, where that differs from ours."""
        return None

    breakdown_note: ClassVar[str] = ""  # what the phases of `cycle_breakdown` are (the note under the report's table)

    @classmethod
    def cycle_breakdown(cls, summary) -> dict[str, float | None] | None:
        """Executed runs: ms per step of each serial phase on the driver, in order (they add up to the next key,
        "cycle"), then any further figure (None where not measured), for the report's breakdown table and figure;
        None: the family times none."""
        return None

    exports: ClassVar[dict[str, ExportFormat]] = {}  # formats of the family's own (Spec-Bench's is every method's)

    figures_note: ClassVar[str] = ""  # how the family's own figures are defined (the note under its report table)

    @classmethod
    def figures(cls, summary) -> dict[str, float | None]:
        """Figures of the family's own, from a pooled summary: the report gives each family with any a table."""
        return {}

    def __init__(self, target: TargetRuntime, params, stop_ids: set[int], checkpoint: str | None = None):
        self.target = target
        self.params = params
        self.stop_ids = stop_ids
        self.checkpoint = checkpoint

    @classmethod
    def hf_peer(cls, params) -> dict | None:
        """HF `generate`'s own implementation of this method with these parameters, as keyword arguments to
        `generate` (`spd-bench bench peer`); None: HF has none."""
        return None

    @classmethod
    def drafter(cls, params) -> tuple[str, str] | None:
        """The trained drafter these parameters need: (checkpoint tag, the command that trains it); None: no drafter.
        It is filed under the family `drafts_with` names, or this one's."""
        return None

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params) -> tuple[Path, dict] | None:
        """`--checkpoint path` naming a drafter published in a foreign format this family reads, converted into the
        drafter cache for the target `loaded`: (the cached folder, parameters the run takes with it). None: not
        such a drafter (a drafter folder of ours is used as it is)."""
        return None

    @classmethod
    def served(cls, params) -> tuple[int, str] | None:
        """How many ranks `--executor distributed` serves besides the driver, and why that many (for errors); None:
        the family runs in one process only. A family that serves ranks also defines `distribute(group, dtype)`."""
        return None

    @classmethod
    def relative_cost(cls, params, simulate: bool) -> float:
        """A sample's rough cost against autoregressive decoding's 1 (AR timed beside it included), for balancing a
        sweep's shards: a replay costs about one teacher-forced pass beside AR; executed in one process, each rank
        the family serves (pipeline stages, a drafter) runs its share one after another."""
        served = cls.served(params)
        return 2.0 if simulate else 3.0 + (served[0] if served else 0)

    @classmethod
    def check_model(cls, params, num_layers: int) -> None:
        """Raise ValueError when these parameters cannot run on a target with `num_layers` layers."""

    @classmethod
    def check_simulation(cls, params, temperature: float) -> None:
        """Raise ValueError when `--simulate` cannot replay these parameters at `temperature` (checked before
        anything loads)."""

    @abstractmethod
    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampler: Sampler) -> Generation:
        """Decode up to `max_new_tokens` tokens (stopping after any stop id) for one prompt."""

    @classmethod
    def selfcheck_cases(cls, target: TargetRuntime) -> list[tuple[str, Method]]:
        """`spd-bench selfcheck`: (label, method) instances on `target` with random drafters (no checkpoints)."""
        return []

    @classmethod
    def selfcheck_distributed(cls, target: TargetRuntime, scratch: Path) -> tuple[str, Method, int] | None:
        """`spd-bench selfcheck`: one instance for `--executor distributed` (label, method, served ranks), with what
        its ranks load saved under `scratch`; None: the family serves no ranks."""
        return None

    def with_oracle(self, reference: dict[int, int], hit_rate: float) -> Method:
        """The method with a drafter that proposes `reference`'s token at a position with probability `hit_rate`, so
        self-checks on random drafters reach the accept paths; a method without a drafter is itself."""
        return self

    checks_parity: ClassVar[bool] = False  # whether `parity` below is the family's (`spd-bench parity`)

    def parity(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int) -> ParityCheck:
        """Train/decode parity of the drafter on `trajectory` (the greedy AR output): whether decoding hands it the
        states training taught it on (families whose drafter trains on a layout of its own)."""
        raise HarnessError(f"{self.name} has no parity check")

    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler
                 ) -> Generation:
        """Acceptance replayed on `trajectory` (the AR output) instead of executed (methods/teacher.py)."""
        raise HarnessError(f"{self.name} has no acceptance simulation; run it without --simulate")


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
