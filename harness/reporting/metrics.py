"""Pooled metrics over result records: sums per dataset and overall, never means of per-sample ratios.

Definitions (one for every method): tokens/step (the prefill token excluded) is committed tokens per target step
(a round's forward or a pipeline cycle); acceptance is accepted drafts over drafts verified, per draft position as
the family counts positions; wall-clock speedup is decode tokens/s over AR's, timed beside the method on the same
prompts. L'acc, the theoretical, modeled and reference-definition speedups and the cycle breakdown are each
family's own formulas (hooks of its method class, methods/base.py), read from the family's typed stats pooled here.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from harness.bench.config import RunConfig
from harness.bench.data import MULTI_TURN
from harness.runtime.results import timed_on
from methods.base import REGISTRY, Method
from methods.capabilities import Reports, offered
from methods.sampling import NO_TRUNCATION
from methods.stats import Stats

OVERALL = "overall"


def sampling_label(temperature: float, truncation: tuple[int, float]) -> str:
    """The temperature, with the truncation where one applied: "1 (top-k 50, top-p 0.95)"."""
    k, p = truncation
    return f"{temperature:g}" + (f" (top-k {k}, top-p {p:g})" if truncation != NO_TRUNCATION else "")


def _add(totals: dict, values: dict) -> None:
    for key, value in values.items():
        totals[key] += value


def params_label(params: dict) -> str:
    """The parameters as k=v, those left empty (an unset list, say) out."""
    return " ".join(f"{k}={v}" for k, v in sorted(params.items()) if v not in ("", None)) or "—"


def length_label(max_new_tokens: int) -> str:
    """A label's length suffix: runs of another length than `run`'s default are other configurations."""
    return "" if max_new_tokens in (0, RunConfig.max_new_tokens) else f" ({max_new_tokens} tokens)"


def config_label(s: Summary) -> str:
    """A configuration as tables and figures name it: method, parameters (the width apart), length, how it ran."""
    params = {k: v for k, v in s.params.items() if k != "width"}
    name = (f"{s.method} {params_label(params)}" if params else s.method) + length_label(s.max_new_tokens)
    return (name + (" (sim)" if s.simulated else "") + (" [distributed]" if s.distributed else "")
            + protocol_label(s.turns))


def protocol_label(turns: str) -> str:
    """A label's suffix for the MT-Bench turns protocol: none for the first turn's (the paper's), else "[all turns]"."""
    return "" if turns == "first" else f" [{turns} turns]"


def turn_label(dataset: str, turn: int) -> str:
    """The dataset label of one turn's records in a run of every turn: "mt_bench turn 2"."""
    return f"{dataset} turn {turn}"


def _datasets(row: dict) -> list[str]:
    """The summaries a record pools into: its dataset, its turn of it (a run of every turn of a multi-turn set),
    and its configuration's overall."""
    own = [row["dataset"]]
    if row.get("turns", "first") != "first" and row["dataset"] in MULTI_TURN:
        own.append(turn_label(row["dataset"], row.get("turn", 1)))
    return [*own, OVERALL]


def family(method: str) -> type[Method] | None:
    """The method's class: it owns its figure formulas and reads its stats; None for a method not installed here."""
    return REGISTRY.get(method)


@dataclass(frozen=True, order=True)
class Block:
    """Runs shown side by side in a table or a figure panel: one temperature with its truncation, one draft width."""

    temperature: float
    truncation: tuple[int, float]
    width: int

    @property
    def title(self) -> str:
        return f"T={sampling_label(self.temperature, self.truncation)}, width {self.width}"


_LINEARS = {"rows": "row kernel", "onednn": "packed Linears", "bf16-rows": "bf16 row kernel",
            "default": "default Linears"}


def engine_label(row: dict) -> str:
    """How a record's target ran: its dtype, eager or compiled, its Linears' kernels and the row attention where it
    ran (records older than the lean engine did not say: "engine not recorded")."""
    conditions = row.get("conditions") or {}
    if "linears" not in conditions:
        return f"{row.get('dtype', '?')}, engine not recorded"
    compiled = conditions.get("compile") or {}
    engine = "eager" if compiled.get("engine") != "inductor" else \
        "compiled, CUDA graphs" if compiled.get("cuda_graphs") else "compiled"
    linears = _LINEARS.get(conditions["linears"], conditions["linears"])
    attention = ", row attention" if conditions.get("attention") == "rows" else ""
    return f"{row.get('dtype', '?')}, {engine}, {linears}{attention}"


@dataclass
class Summary:
    method: str
    params: dict
    model: str
    temperature: float
    dataset: str
    config_key: str = ""
    top_k: int = 0  # sampling truncation (0 / 1.0: off); runs that differ only here are different configurations
    top_p: float = 1.0
    max_new_tokens: int = 0  # the run's length limit (0: not recorded)
    turns: str = "first"  # the turns protocol: the first user turn of each question, or every turn ("all")
    samples: int = 0
    new_tokens: int = 0
    steps: int = 0
    checked: int = 0
    identical: int = 0
    flips: int = 0  # checked samples whose first divergence is a numerics flip (harness/runtime/verdict.py)
    divergences: list = field(default_factory=list)  # (question id, first divergence, verdict) of each
    timing: dict = field(default_factory=lambda: defaultdict(float))
    stats: Stats | None = None  # the family's stats (Method.Stats), pooled over the samples
    lengths: list = field(default_factory=list)  # (new tokens, steps) of each sample
    position_drafts: list = field(default_factory=list)  # drafts verified per draft position (the family's axis)
    position_accepts: list = field(default_factory=list)
    baseline_tokens: int = 0
    baseline_decode_s: float = 0.0
    simulated: bool = False  # acceptance replayed on the AR output, not executed
    busy: int = 0  # samples timed while the machine was loaded beyond its cores (runtime/conditions.py)
    units: list = field(default_factory=list, repr=False)  # each sample: (its record, its family's stats)

    def empty(self) -> Summary:
        """A summary of the same configuration and dataset with no samples yet (a bootstrap replicate's start)."""
        return Summary(self.method, self.params, self.model, self.temperature, self.dataset, self.config_key,
                       self.top_k, self.top_p, self.max_new_tokens, self.turns, simulated=self.simulated)

    def add(self, row: dict) -> None:
        self.add_unit((row, (self.family.Stats if self.family else Stats).read(row.get("stats") or {})))

    def add_unit(self, unit: tuple[dict, Stats]) -> None:
        """Pool one sample: its record and its stats as the family reads them (read once, pooled by every replicate)."""
        row, stats = unit
        self.units.append(unit)
        self.samples += 1
        self.new_tokens += row["new_tokens"]
        self.steps += row["steps"]
        self.lengths.append((row["new_tokens"], row["steps"]))
        self.checked += bool(row["lossless"].get("checked"))
        self.identical += bool(row["lossless"].get("identical"))
        self.busy += bool((row.get("conditions") or {}).get("busy"))
        if row["lossless"].get("checked") and not row["lossless"].get("identical"):
            verdict = row["lossless"].get("verdict") or "logic"  # a record from before the verdict: not a flip
            self.flips += verdict == "flip"
            self.divergences.append((row["question_id"], row["lossless"].get("first_divergence"), verdict))
        _add(self.timing, row["timing"])
        self.stats = stats if self.stats is None else self.stats.pooled(stats)
        accepts = row.get("position_accepts", [])
        self.position_drafts = _vector_sum(self.position_drafts, stats.drafts(row["steps"], len(accepts)))
        self.position_accepts = _vector_sum(self.position_accepts, accepts)
        if row.get("baseline"):
            self.baseline_tokens += row["baseline"]["new_tokens"]
            self.baseline_decode_s += row["baseline"]["timing"].get("decode", 0.0)

    @property
    def finished(self) -> str:
        """When its last record was written ("" where none says)."""
        return max(((row.get("stats") or {}).get("finished_at") or "" for row, _ in self.units), default="")

    @property
    def engine(self) -> str:
        """The dtypes and kernels its timed samples ran with (`engine_label`), distinct ones joined."""
        return "; ".join(sorted({engine_label(row) for row, _ in self.units if not row.get("simulated")}))

    def prompts(self) -> dict[str, list[list]]:
        """Each dataset's prompts in the order first met, each as the samples that decoded it (one per run: several
        when runs with different seeds are pooled, as in a regression baseline)."""
        found: dict[str, dict[str, list]] = {}
        for unit in self.units:
            found.setdefault(unit[0]["dataset"], {}).setdefault(str(unit[0]["question_id"]), []).append(unit)
        return {dataset: list(by_id.values()) for dataset, by_id in found.items()}

    def units_by_prompt(self) -> dict[tuple[str, str], list]:
        return {(dataset, str(group[0][0]["question_id"])): group
                for dataset, groups in self.prompts().items() for group in groups}

    @property
    def fewest_prompts(self) -> int:
        """The fewest prompts of any dataset this summary pools (an interval's reliability)."""
        return min((len(groups) for groups in self.prompts().values()), default=0)

    @property
    def width(self) -> int:
        return int(self.params.get("width", 1))

    @property
    def truncation(self) -> tuple[int, float]:
        """(top-k, top-p) of a sampled run; greedy decoding (T=0) picks the same tokens under any truncation."""
        return (self.top_k, self.top_p) if self.temperature > 0 else NO_TRUNCATION

    @property
    def sampling(self) -> str:
        return sampling_label(self.temperature, self.truncation)

    @property
    def block(self) -> Block:
        return Block(self.temperature, self.truncation, self.width)

    def matches(self, method: str, params: dict, temperature: float,
                truncation: tuple[int, float] = NO_TRUNCATION) -> bool:
        """Same method, temperature and truncation (ignored at T=0), and every listed parameter equal (width
        defaults to 1)."""
        own = {**self.params, "width": self.width}
        wanted = tuple(truncation) if temperature > 0 else NO_TRUNCATION
        return (self.method == method and self.temperature == temperature and self.truncation == wanted
                and all(own.get(k) == v for k, v in params.items()))

    # --- rates ------------------------------------------------------------------------------------------------
    @property
    def tokens_per_second(self) -> float | None:
        """Decode throughput: tokens produced after the prefill token over decode time."""
        decode = self.timing.get("decode", 0.0)
        return (self.new_tokens - self.samples) / decode if decode > 0 else None

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens committed per step; each sample's first token comes from the prefill, not from a step."""
        return (self.new_tokens - self.samples) / self.steps if self.steps else None

    @property
    def logic(self) -> int:
        """Checked samples that left greedy AR for a reason other than a numerics flip."""
        return self.checked - self.identical - self.flips

    @property
    def lossless_pct(self) -> float | None:
        return 100.0 * self.identical / self.checked if self.checked else None

    @property
    def acceptance(self) -> float | None:
        """Share of the drafts the target verified that it accepted, over the family's positions."""
        drafts = sum(self.position_drafts)
        return sum(self.position_accepts) / drafts if drafts else None

    @property
    def expected_acceptance(self) -> float | None:
        """Simulated runs: the verifier's expected acceptance, sum of min(p, q) per draft over the drafts."""
        drafts = sum(self.position_drafts)
        expected = (self.stats.expected_accepts or 0.0) if self.stats else 0.0
        return expected / drafts if drafts and self.simulated else None

    @property
    def position_acceptance(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.position_accepts, self.position_drafts)]

    # --- the family's figures ---------------------------------------------------------------------------------
    @property
    def family(self) -> type[Method] | None:
        return family(self.method)

    @property
    def reports(self) -> type[Reports]:
        """The family's figure hooks (methods/capabilities.py), or the defaults where it declares none."""
        return offered(self.family, Reports)

    def _figure(self, hook: str):
        return getattr(self.reports, hook)(self)

    @property
    def l_acc(self) -> float | None:
        return self._figure("l_acc")

    @property
    def theoretical_speedup(self) -> float | None:
        return self._figure("theoretical_speedup")

    @property
    def reference_theoretical(self) -> float | None:
        return self._figure("reference_speedup")

    @property
    def modeled_speedup(self) -> float | None:
        """The theoretical formula with measured component times (the family's; simulated runs have no times)."""
        return self._figure("modeled_speedup")

    @property
    def cycle_breakdown(self) -> dict[str, float | None] | None:
        return self._figure("cycle_breakdown")

    @property
    def distributed(self) -> bool:
        """Whether the family's served ranks ran in processes of their own (`--executor distributed`)."""
        return self.stats is not None and self.stats.executor_kind == "distributed"

    @property
    def wall_clock_ratios(self) -> list[float]:
        """Per sample: its decode tokens/s over AR's on the same prompt, AR timed beside it in the same run (samples
        that decoded nothing after the prefill token on either side have no ratio)."""
        ratios = []
        for row, _ in self.units:
            base, decode = row.get("baseline"), row["timing"].get("decode", 0.0)
            base_decode = base["timing"].get("decode", 0.0) if base else 0.0
            if decode > 0 and base_decode > 0 and row["new_tokens"] > 1 and base["new_tokens"] > 1:
                ratios.append(((row["new_tokens"] - 1) / decode) / ((base["new_tokens"] - 1) / base_decode))
        return ratios

    @property
    def wall_clock_median(self) -> float | None:
        """The median of the per-sample paired ratios (the unit of a wall-clock comparison: both timed on one prompt
        in one run, so the machine's drift between prompts cancels)."""
        if self.method == "autoregressive":
            return 1.0
        ratios = sorted(self.wall_clock_ratios)
        if not ratios:
            return None
        middle = len(ratios) // 2
        return ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2

    @property
    def wall_clock_speedup(self) -> float | None:
        if self.method == "autoregressive":
            return 1.0
        ours = self.tokens_per_second
        if ours is None or self.baseline_decode_s <= 0:
            return None
        return ours / ((self.baseline_tokens - self.samples) / self.baseline_decode_s)


def _vector_sum(a: list, b: list) -> list:
    size = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(size)]


def _group(row: dict, by_engine: bool) -> tuple:
    """A record's summary: its configuration and, where `by_engine`, the engine that timed it (a re-measurement on
    new kernels is a row of its own beside the earlier one, never pooled with it)."""
    engine = timed_on(row) if by_engine and not row.get("simulated") else ()
    return row["config_key"], row["method"], row["model"]["name"], row["temperature"], engine


def find(summaries: list[Summary], method: str, params: dict, temperature: float, dataset: str = OVERALL,
         model: str | None = None, simulated: bool | None = None,
         truncation: tuple[int, float] = NO_TRUNCATION, turns: str = "first") -> Summary | None:
    """The summary matching a configuration (see Summary.matches) on `model` (default: any) under the `turns`
    protocol (default: the paper's, the first turn), executed runs before simulated ones (`simulated`: only those
    of that kind), then the latest measured (a configuration re-measured on new kernels: the new engine's)."""
    found = [s for s in summaries if s.dataset == dataset and s.matches(method, params, temperature, truncation)
             and model in (None, s.model) and simulated in (None, s.simulated) and s.turns == turns]
    return max(found, key=lambda s: (not s.simulated, s.finished)) if found else None


def summarize(rows: list[dict], by_engine: bool = True) -> list[Summary]:
    """One Summary per (configuration, engine, dataset), per turn of a multi-turn set where a run decoded every turn,
    and one per configuration and engine over all its datasets (`by_engine` False: the engines pooled)."""
    table: dict[tuple, Summary] = {}
    for row in rows:
        for dataset in _datasets(row):
            key = (*_group(row, by_engine), dataset)
            if key not in table:
                table[key] = Summary(row["method"], row["params"], row["model"]["name"], row["temperature"], dataset,
                                     row["config_key"], row.get("top_k", 0), row.get("top_p", 1.0),
                                     row.get("max_new_tokens", 0), row.get("turns", "first"),
                                     simulated=bool(row.get("simulated")))
            table[key].add(row)
    order = {OVERALL: "~"}  # overall sorts after the datasets of its configuration
    return sorted(table.values(), key=lambda s: (s.model, s.method, str(sorted(s.params.items())), s.simulated,
                                                 s.temperature, s.truncation, s.engine,
                                                 order.get(s.dataset, s.dataset)))
