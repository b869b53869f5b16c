"""`spd-bench sweep`: a grid of run configurations (methods x parameters x T x width) over the datasets, with one
model load, one overall progress bar and the run's resume rule per configuration. It trains nothing: a point whose
drafter is missing, or that this model or mode cannot run, is skipped and listed with the command that fixes it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from pathlib import Path

from tqdm import tqdm

from harness.bench.config import RunConfig, default_out, drafter_folder, load_prompts, validate
from harness.bench.runner import Runner, sample_keys
from harness.runtime import checkpoints
from harness.runtime.errors import HarnessError
from harness.runtime.models import load_model
from harness.runtime.results import ResultStore, SampleKey, load_all, row_key
from methods.base import REGISTRY, check_fit, offers, parse_params
from methods.sampling import NO_TRUNCATION


@dataclass(frozen=True)
class GridPoint:
    """One run configuration of a sweep: a method, its parameters and a temperature."""

    method: str
    params: tuple[tuple[str, object], ...]  # sorted (name, value) pairs, hashable
    temperature: float
    top_k: int = 0  # 0: off
    top_p: float = 1.0

    @classmethod
    def of(cls, method: str, temperature: float, **params) -> GridPoint:
        return cls(method, tuple(sorted(params.items())), float(temperature))

    @property
    def param_dict(self) -> dict:
        return dict(self.params)

    @property
    def truncation(self) -> tuple[int, float]:
        return self.top_k, self.top_p

    def label(self) -> str:
        params = " ".join(f"{k}={v}" for k, v in self.params)
        return f"{self.method} {params} T={self.temperature:g}{self._truncation(' top-k={} top-p={}')}".replace("  ", " ")

    def run_command(self) -> str:
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.params)
        return (f"spd-bench run --method {self.method} {flags} --temperature {self.temperature:g}"
                + self._truncation(" --top-k {} --top-p {}"))

    def _truncation(self, form: str) -> str:
        return form.format(self.top_k, f"{self.top_p:g}") if (self.top_k, self.top_p) != (0, 1.0) else ""


@dataclass
class Skipped:
    label: str  # the configuration (a work item: on which dataset)
    reason: str


@dataclass
class SweepOutcome:
    ran: dict[str, int]  # samples run now per configuration label (0: already finished)
    skipped: list[Skipped]
    files: set[Path]


def grid(methods: list[str], values: dict[str, list], temperatures: list[float], widths: list[int],
         truncation: tuple[int, float] = NO_TRUNCATION) -> list[GridPoint]:
    """Every combination of the listed values of each method's own parameters (others are ignored); points at T>0
    sample with `truncation` (top-k, top-p)."""
    points = []
    for method in methods:
        if method not in REGISTRY:
            raise HarnessError(f"unknown method {method!r}; choose from {', '.join(sorted(REGISTRY))}")
        known = {f for f in REGISTRY[method].Params.__dataclass_fields__} - {"width"}
        names = [name for name in values if name in known and values[name]]
        has_width = "width" in REGISTRY[method].Params.__dataclass_fields__
        for t, w, combo in product(temperatures, widths if has_width else [None], product(*(values[k] for k in names))):
            params = dict(zip(names, combo)) | ({} if w is None else {"width": w})
            if _valid(method, params):
                point = GridPoint.of(method, t, **params)
                points.append(replace(point, top_k=truncation[0], top_p=truncation[1]) if t > 0 else point)
    return points


def _valid(method: str, params: dict) -> bool:
    """False for a value the method does not take (a parameter's `choices`); other bad values are errors."""
    if not offers(REGISTRY[method], params):
        return False
    try:
        parse_params(REGISTRY[method], params)
        return True
    except ValueError as exc:
        raise HarnessError(f"{method} {params}: {exc}; fix the sweep's values") from None


def missing_drafter(config: RunConfig, identity) -> str | None:
    """The train command for a configuration whose drafter is not in the cache, else None."""
    found = drafter_folder(config, identity)
    if found is None or (found[0] / checkpoints.CONFIG).exists():
        return None
    return found[1]


def configs(points: list[GridPoint], base: RunConfig) -> dict[str, RunConfig]:
    """Each point's run configuration by label (records to the default file of its method)."""
    return {point.label(): replace(base, method=point.method, params=point.param_dict, temperature=point.temperature,
                                   top_k=point.top_k, top_p=point.top_p)
            for point in points}


def sweep(jobs: dict[str, RunConfig], base: RunConfig, results: Path | None) -> SweepOutcome:
    """Run each job (a label and its configuration: its datasets and, if set, its own results file) with one model
    load and one progress bar, resuming: a sample already recorded anywhere under the results root is not run again."""
    root = results or Path("results")
    for config in jobs.values():
        validate(config)  # bad input fails before the model loads
    prompts = {sets: load_prompts(replace(base, datasets=sets)) for sets in {c.datasets for c in jobs.values()}}
    loaded = load_model(base.model, base.device, base.dtype)
    recorded = recorded_samples(root)
    skipped, runners = [], {}
    for config in jobs.values():
        check_fit(config.method, config.params, len(loaded.model.model.layers))
    for label, config in jobs.items():
        command = missing_drafter(config, loaded.identity)
        if command is not None:
            skipped.append(Skipped(label, f"no drafter; train it with: {command}"))
            continue
        store = ResultStore(config.out or default_out(config, loaded.identity.name, root))
        store.load()
        runner = Runner(config, loaded)
        own = store.finished()  # recorded in its own file: the run resumes them (and says so)
        samples = [s for s in prompts[config.datasets]
                   if any(k not in recorded or k in own for k in sample_keys(runner.key, s, config.turns))]
        runners[label] = (runner, store, samples)
    todo = {label: runner.todo(samples, store) for label, (runner, store, samples) in runners.items()}
    outcome = SweepOutcome({}, skipped, {store.path for _, store, _ in runners.values()})
    with tqdm(total=sum(len(t) for t in todo.values()), desc="sweep", unit="sample", dynamic_ncols=True) as bar:
        for label, (runner, store, samples) in runners.items():
            bar.set_description(label)
            try:
                outcome.ran[label] = runner.run(samples, store, bar)
            except HarnessError as exc:  # this model or mode cannot run the point (e.g. trees on linear attention)
                bar.total -= len(runner.todo(samples, store))
                bar.refresh()
                outcome.skipped.append(Skipped(label, str(exc)))
    return outcome


def recorded_samples(root: Path) -> set[SampleKey]:
    """Every sample recorded under the results root, in any file (another shard's, a one-process sweep's)."""
    if not root.exists():
        return set()
    return {row_key(r) for r in load_all(root).rows}
