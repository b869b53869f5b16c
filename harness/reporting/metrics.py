"""Pooled metrics over result records: sums per dataset and overall, never means of per-sample ratios.

Definitions (one for every method): tokens/step (the prefill token excluded) is tau for draft-then-verify methods
(tokens per target forward, bonus included) and alpha for pipeline methods; L'acc = alpha * L / largest stage;
the theoretical and modeled multi-device speedups are each family's own formulas (its method class: SPD/PPSD in
methods/pipeline/spd.py, EAGLE-3 in methods/eagle3/method.py), the reference's definition for pipeline runs (n * N / S per sample,
averaged) is reported beside them; wall-clock speedup is decode tokens/s over AR's, timed beside the method on the
same prompts.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from methods.sampling import NO_TRUNCATION

OVERALL = "overall"


def sampling_label(temperature: float, truncation: tuple[int, float]) -> str:
    """The temperature, with the truncation where one applied: "1 (top-k 50, top-p 0.95)"."""
    k, p = truncation
    return f"{temperature:g}" + (f" (top-k {k}, top-p {p:g})" if truncation != NO_TRUNCATION else "")


def _add(totals: dict, values: dict) -> None:
    for key, value in values.items():
        totals[key] += value


@dataclass(frozen=True, order=True)
class Block:
    """Runs shown side by side in a table or a figure panel: one temperature with its truncation, one draft width."""

    temperature: float
    truncation: tuple[int, float]
    width: int

    @property
    def title(self) -> str:
        return f"T={sampling_label(self.temperature, self.truncation)}, width {self.width}"


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
    samples: int = 0
    new_tokens: int = 0
    steps: int = 0
    checked: int = 0
    identical: int = 0
    divergences: list = field(default_factory=list)
    timing: dict = field(default_factory=lambda: defaultdict(float))
    counts: dict = field(default_factory=lambda: defaultdict(int))
    fill_drafts: list = field(default_factory=list)
    fill_accepts: list = field(default_factory=list)
    baseline_tokens: int = 0
    baseline_decode_s: float = 0.0
    pipeline: dict | None = None  # pipeline methods: layers, stages, Ls, schedule, width
    draft: dict | None = None  # draft-then-verify methods: layers, Ls, m, width
    simulated: bool = False  # acceptance replayed on the AR output, not executed
    expected_accepts: float = 0.0  # simulated runs: summed acceptance probabilities of the verified drafts
    executor: str = "local"  # pipeline methods: where the stages ran ("distributed": one process per stage)
    stage_forward: list = field(default_factory=list)  # distributed: each stage rank's summed forward seconds
    reference_ratios: float = 0.0  # pipeline: summed per-sample n * N / S, the reference's theoretical speedup

    def add(self, row: dict) -> None:
        self.samples += 1
        self.new_tokens += row["new_tokens"]
        self.steps += row["steps"]
        self.checked += bool(row["lossless"].get("checked"))
        self.identical += bool(row["lossless"].get("identical"))
        if row["lossless"].get("checked") and not row["lossless"].get("identical"):
            self.divergences.append((row["question_id"], row["lossless"].get("first_divergence")))
        _add(self.timing, row["timing"])
        stats = row.get("stats", {})
        _add(self.counts, {k: v for k, v in stats.items() if type(v) is int})  # every family's counters
        self.expected_accepts += stats.get("expected_accepts", 0.0)
        self.pipeline = stats.get("pipeline", self.pipeline)
        if "pipeline" in stats and row["steps"]:
            self.reference_ratios += stats["pipeline"]["n"] * row["new_tokens"] / row["steps"]
        self.draft = stats.get("draft", self.draft)
        executor = stats.get("executor") or {}
        self.executor = executor.get("kind", self.executor)
        self.stage_forward = _vector_sum(self.stage_forward, executor.get("stage_forward_s", []))
        accepts = row.get("position_accepts", [])
        self.fill_drafts = _vector_sum(self.fill_drafts, stats.get("fill_drafts") or [row["steps"]] * len(accepts))
        self.fill_accepts = _vector_sum(self.fill_accepts, accepts)
        if row.get("baseline"):
            self.baseline_tokens += row["baseline"]["new_tokens"]
            self.baseline_decode_s += row["baseline"]["timing"].get("decode", 0.0)

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
    def lossless_pct(self) -> float | None:
        return 100.0 * self.identical / self.checked if self.checked else None

    @property
    def acceptance(self) -> float | None:
        """Share of verified drafts the target accepted (pipeline), or of draft positions offered (EAGLE-3)."""
        drafts = sum(self.fill_drafts)
        return sum(self.fill_accepts) / drafts if drafts else None

    @property
    def expected_acceptance(self) -> float | None:
        """Simulated runs: the verifier's expected acceptance, sum of min(p, q) per draft over the drafts."""
        drafts = sum(self.fill_drafts)
        return self.expected_accepts / drafts if drafts and self.simulated else None

    @property
    def fill_acceptance(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.fill_accepts, self.fill_drafts)]

    # --- speedups ---------------------------------------------------------------------------------------------
    @property
    def l_acc(self) -> float | None:
        if self.pipeline is None or self.tokens_per_step is None:
            return None
        return self.tokens_per_step * self.pipeline["num_layers"] / self.pipeline["largest_stage"]

    @property
    def family(self):
        """The method's class: it owns its speedup formulas (methods/*.py); None for a method not installed here."""
        from methods.base import REGISTRY

        return REGISTRY.get(self.method)

    @property
    def theoretical_speedup(self) -> float | None:
        return None if self.family is None else self.family.theoretical_speedup(self)

    @property
    def reference_theoretical(self) -> float | None:
        """The reference code's theoretical speedup of a pipeline run: n * N / S per sample (N counts the prefill
        token, S the decode cycles), averaged over samples, so a row compares with its published tables directly."""
        return self.reference_ratios / self.samples if self.pipeline is not None and self.samples else None

    @property
    def modeled_speedup(self) -> float | None:
        """The theoretical formula with measured component times (the family's; simulated runs have no times)."""
        return None if self.family is None else self.family.modeled_speedup(self)

    @property
    def stage_seconds(self) -> float:
        """Pipeline runs: seconds of stage compute; distributed runs time it on the ranks, where the driver's
        "stages" is its wait, transfers included."""
        return sum(self.stage_forward) if self.executor == "distributed" else self.timing.get("stages", 0.0)

    @property
    def cycle_breakdown(self) -> dict[str, float] | None:
        """Executed pipeline runs: the driver's serial phases in ms per cycle (they add up to the cycle's wall time)
        and, distributed, the slowest stage rank's forward time per cycle."""
        if self.pipeline is None or self.simulated or not self.steps or not self.timing.get("decode"):
            return None
        ms = {phase: 1000 * self.timing.get(key, 0.0) / self.steps
              for phase, key in (("draft", "drafter"), ("stages", "stages"), ("verify", "verify_head"))}
        ms["other"] = 1000 * self.timing["decode"] / self.steps - sum(ms.values())
        ms["cycle"] = 1000 * self.timing["decode"] / self.steps
        if self.stage_forward:
            ms["slowest stage"] = 1000 * max(self.stage_forward) / self.steps
        return ms

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


def _group(row: dict) -> tuple:
    return row["config_key"], row["method"], row["model"]["name"], row["temperature"]


def find(summaries: list[Summary], method: str, params: dict, temperature: float, dataset: str = OVERALL,
         model: str | None = None, simulated: bool | None = None,
         truncation: tuple[int, float] = NO_TRUNCATION) -> Summary | None:
    """The summary matching a configuration (see Summary.matches) on `model` (default: any), executed runs before
    simulated ones (`simulated`: only those of that kind)."""
    found = [s for s in summaries if s.dataset == dataset and s.matches(method, params, temperature, truncation)
             and model in (None, s.model) and simulated in (None, s.simulated)]
    return min(found, key=lambda s: s.simulated) if found else None


def summarize(rows: list[dict]) -> list[Summary]:
    """One Summary per (configuration, dataset) and one per configuration over all its datasets."""
    table: dict[tuple, Summary] = {}
    for row in rows:
        for dataset in (row["dataset"], OVERALL):
            key = (*_group(row), dataset)
            if key not in table:
                table[key] = Summary(row["method"], row["params"], row["model"]["name"], row["temperature"], dataset,
                                     row["config_key"], row.get("top_k", 0), row.get("top_p", 1.0),
                                     row.get("max_new_tokens", 0), simulated=bool(row.get("simulated")))
            table[key].add(row)
    order = {OVERALL: "~"}  # overall sorts after the datasets of its configuration
    return sorted(table.values(), key=lambda s: (s.model, s.method, str(sorted(s.params.items())), s.simulated,
                                                 s.temperature, s.truncation, order.get(s.dataset, s.dataset)))
