"""What a method family may offer beyond decoding, each as a mixin it declares on its Method class: report figures,
a trained drafter (and its training), foreign drafter formats, ranks of its own, acceptance replay, self-check
drafters, train/decode parity and an HF `generate` peer. The harness finds them with `issubclass` (or `offered`, for
the figure hooks every report row reads); a family that declares none of them still decodes, is checked lossless
and is timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, TypeVar

from harness.runtime.target import TargetRuntime
from methods.sampling import Sampler

Kind = TypeVar("Kind")


def offered(cls: type | None, kind: type[Kind]) -> type[Kind]:
    """The family's hooks of this capability, or the capability's defaults where it declares none."""
    return cls if cls is not None and issubclass(cls, kind) else kind


@dataclass(frozen=True)
class PositionAxis:
    """What a family's accepts per position count (Generation.position_accepts): a round's draft positions, or a
    pipeline's fill levels; the report gives each axis a table and a figure panel."""

    label: str  # a column's prefix: "pos 0"
    title: str  # the table's title
    name: str  # the figure's axis


@dataclass(frozen=True)
class ExportFormat:
    """A family's records in another tool's per-sample format (`spd-bench export --format NAME`)."""

    sample: Callable[[dict, int, str | None], dict]  # (record, index in its file, the prompt text) -> one line
    suffix: str  # after the configuration's name in the file name
    about: str  # for --help


class Reports:
    """Figures of the family's own in the report. The hooks read a pooled summary (harness/reporting/metrics.py's
    `Summary`: tokens/step, the family's pooled `stats`, the summed timings); None where a figure is undefined."""

    positions: ClassVar[PositionAxis | None] = None  # what position_accepts counts (None: the method drafts nothing)
    breakdown_note: ClassVar[str] = ""  # what the phases of `cycle_breakdown` are (the note under the report's table)
    figures_note: ClassVar[str] = ""  # how `figures` are defined (the note under the family's report table)
    exports: ClassVar[dict[str, ExportFormat]] = {}  # formats of the family's own (Spec-Bench's is every method's)

    @classmethod
    def theoretical_speedup(cls, summary) -> float | None:
        return None

    @classmethod
    def modeled_speedup(cls, summary) -> float | None:
        """The theoretical formula with measured component times (simulated runs have none)."""
        return None

    @classmethod
    def l_acc(cls, summary) -> float | None:
        """Accepted layers per cycle relative to the slowest device's (pipeline families)."""
        return None

    @classmethod
    def reference_speedup(cls, summary) -> float | None:
        """The theoretical speedup as the family's reference code defines it, where that differs from ours."""
        return None

    @classmethod
    def cycle_breakdown(cls, summary) -> dict[str, float | None] | None:
        """Executed runs: ms per step of each serial phase on the driver, in order (they add up to the next key,
        "cycle"), then any further figure (None where not measured); None: the family times none."""
        return None

    @classmethod
    def figures(cls, summary) -> dict[str, float | None]:
        """Figures of the family's own: the report gives each family with any a table."""
        return {}


class Drafted:
    """The family decodes with a trained drafter, found in the drafter cache or drafters/ by its tag."""

    drafts_with: ClassVar[str | None] = None  # the family whose trained drafter it uses, where not its own

    @classmethod
    def drafter(cls, params) -> tuple[str, str] | None:
        """The trained drafter these parameters need: (checkpoint tag, the command that trains it); None: none."""
        raise NotImplementedError

    @classmethod
    def drafter_family(cls) -> str:
        """The family its trained drafter is filed under (the drafter cache's and drafters/' folder names)."""
        return cls.drafts_with or cls.name


def drafter_of(cls: type, params) -> tuple[str, str] | None:
    """The trained drafter a family needs with these parameters (`Drafted.drafter`); None: it needs none."""
    return cls.drafter(params) if issubclass(cls, Drafted) else None


class Trains(Drafted):
    """`spd-bench train` builds the family's drafters (each family's objective.py says what it trains on)."""

    training_params: ClassVar[tuple[str, ...]] = ()  # Params fields `spd-bench train` takes as comma lists
    training_options: ClassVar[dict[str, tuple[type, str]]] = {}  # training-only options: name -> (type, help)

    @classmethod
    def training_specs(cls, values: dict[str, list]) -> list:
        """The drafters to build from the option values listed (an empty list: the family's default)."""
        raise NotImplementedError


@dataclass(frozen=True)
class ImportFormat:
    """A drafter published in another tool's format: `spd-bench import --NAME PATH` (and `run --checkpoint PATH`,
    through `Imports.import_checkpoint`) converts it into the drafter cache."""

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


class Imports:
    """Drafters published in other tools' formats: converted in (`imports`, `import_checkpoint`) or written out
    (`head_export`)."""

    imports: ClassVar[dict[str, ImportFormat]] = {}  # foreign drafter formats `spd-bench import` converts
    head_export: ClassVar[HeadExport | None] = None  # `spd-bench export-head`: the trained drafter, foreign format

    @classmethod
    def import_checkpoint(cls, path: Path, loaded, params) -> tuple[Path, dict] | None:
        """`--checkpoint path` naming a drafter published in a foreign format this family reads, converted into the
        drafter cache for the target `loaded`: (the cached folder, parameters the run takes with it). None: not
        such a drafter (a drafter folder of ours is used as it is)."""
        return None


class Serves:
    """`--executor distributed` gives parts of the family (pipeline stages, a drafter) ranks of their own."""

    serves: ClassVar[str]  # what gets the ranks (for --help)

    @classmethod
    def served(cls, params) -> tuple[int, str]:
        """How many ranks it serves besides the driver, and why that many (for errors)."""
        raise NotImplementedError

    def distribute(self, group, dtype: str):
        """Serve from the ranks of `group` from now on; returns the executor (its `close` ends the ranks)."""
        raise NotImplementedError

    @classmethod
    def relative_cost(cls, params, simulate: bool) -> float:
        return sample_cost(simulate, cls.served(params)[0])

    @classmethod
    def selfcheck_distributed(cls, target: TargetRuntime, scratch: Path) -> tuple[str, object, int] | None:
        """`spd-bench selfcheck`: one instance for `--executor distributed` (label, method, served ranks), with what
        its ranks load saved under `scratch`; None: another family's check covers the same ranks."""
        return None


def sample_cost(simulate: bool, ranks: int = 0) -> float:
    """A sample's rough cost against autoregressive decoding's 1 (AR timed beside it included), for balancing a
    sweep's shards: a replay costs about one teacher-forced pass beside AR; executed in one process, each rank a
    family serves runs its share one after another."""
    return 2.0 if simulate else 3.0 + ranks


class Simulates:
    """`--simulate`: acceptance replayed on the greedy AR trajectory instead of executed (methods/teacher.py)."""

    @classmethod
    def check_simulation(cls, params, temperature: float) -> None:
        """Raise ValueError when these parameters cannot be replayed at `temperature` (before anything loads)."""

    def simulate(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int, sampler: Sampler):
        """The Generation replayed on `trajectory` (the AR output)."""
        raise NotImplementedError


class SelfChecks:
    """`spd-bench selfcheck` runs the family on random drafters (no checkpoints) against AR."""

    @classmethod
    def selfcheck_cases(cls, target: TargetRuntime) -> list[tuple[str, object]]:
        """(label, method) instances on `target`."""
        return []

    def with_oracle(self, reference: dict[int, int], hit_rate: float):
        """The method with a drafter that proposes `reference`'s token at a position with probability `hit_rate`, so
        random drafters reach the accept paths; a family without one returns itself."""
        return self


class ParityCheck(Protocol):
    """A family's parity figures over one trajectory, pooled with `add` over prompts."""

    lossless: bool  # the method's output equalled the trajectory

    @property
    def disagree(self) -> int: ...  # states where decoding and training disagree beyond near-ties

    def add(self, other) -> None: ...

    def record(self) -> dict: ...  # the record's figures

    def table(self) -> str: ...  # what the command prints


class ChecksParity:
    """`spd-bench parity`: whether decoding hands the drafter the states training taught it on (families whose
    drafter trains on a layout of its own)."""

    def parity(self, prompt_ids: list[int], trajectory: list[int], max_new_tokens: int) -> ParityCheck:
        """Train/decode parity on `trajectory` (the greedy AR output)."""
        raise NotImplementedError


class HFPeer:
    """HF `generate` implements the method too (`spd-bench bench peer` runs both)."""

    @classmethod
    def hf_peer(cls, params) -> dict | None:
        """`generate`'s keyword arguments for these parameters; None: HF has no such configuration."""
        raise NotImplementedError

