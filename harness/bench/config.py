"""The run identity: one RunConfig names a run (method, parameters, model, sampling, lengths, seed, executor) from the
command line through the record; here it is validated, and its prompts, drafter and results file are found."""

from __future__ import annotations

import functools
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from tqdm import tqdm

import methods  # noqa: F401  (fills the registry)
from harness.bench.data import MULTI_TURN, TURNS, Sample, load_samples
from harness.runtime import checkpoints
from harness.runtime import distributed as launch
from harness.runtime.errors import HarnessError
from harness.runtime.kernels import chosen
from harness.runtime.models import LoadedModel, check_model_spec, pick_dtype
from methods.base import REGISTRY, Method, parse_params, recorded_params
from methods.sampling import SamplingConfig

REFERENCE_METHOD = "autoregressive"


KEPT = object()  # an `omit` of no value: the entry is always in the key


def option(default=None, *, key: str | None = None, omit=KEPT, value=None, record: str | None = None,
           factory=None):
    """A run option: its default, and where it goes. `key`: its entry in the configuration key (None: not there);
    `omit`: a value whose entry is left out (options added after records were keyed keep earlier keys); `value`:
    (config, raw) -> what the key holds; `record`: its name in the record (None: not stored)."""
    metadata = {"key": key, "omit": omit, "value": value, "record": record}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _executor(config: RunConfig, executor: str) -> dict | None:
    if executor != "distributed":
        return None
    return {"kind": "distributed", "world_size": len(config.stage_devices) + 1, "devices": config.stage_devices}


@dataclass
class RunConfig:
    """What names a run, from the command line (`spd-bench run`'s options and their defaults) through its
    configuration key (`key_entries`) to its records (`recorded`)."""

    method: str = option("autoregressive", key="method", record="method")
    params: dict = option(key="params", record="params", factory=dict)
    model: str = option("smollm2-135m")  # keyed by its weights' identity (the runner adds it)
    datasets: tuple[str, ...] = option(("mt_bench", "gsm8k", "humaneval"))
    temperature: float = option(0.0, key="temperature", record="temperature")
    top_k: int = option(0, key="top_k", record="top_k")
    top_p: float = option(1.0, key="top_p", record="top_p")
    max_new_tokens: int = option(128, key="max_new_tokens", record="max_new_tokens")
    limit: int | None = option(None)
    seed: int = option(0, key="seed", record="seed")
    device: str = option("cpu")  # keyed by its type (the runner adds it)
    dtype: str | None = option(None, key="dtype", value=lambda c, _: c.dtype_name)
    data_dir: str | None = option(None)
    out: Path | None = option(None)
    checkpoint: str | None = option(None)  # keyed by the drafter's weights (the runner adds them)
    skip_missing: bool = option(False)
    baseline: bool = option(True)  # time AR on every sample beside the method (wall-clock measured side by side)
    simulate: bool = option(False, key="simulated", omit=False, record="simulated")  # replay on the AR output
    executor: str = option("local", key="executor", omit=None, value=_executor)  # distributed: served ranks apart
    devices: str | None = option(None)  # distributed: one device per served rank, comma list
    timeout: float = option(300.0)  # distributed: seconds any rank may wait for another once all started
    join_timeout: float = option(900.0)  # distributed: the start deadline (spawn, imports, loading a rank's share)
    compile: str = option("off", key="compile", omit="off")  # the layer step: eager (off), compiled (on) or auto
    turns: str = option("first", key="turns", omit="first", record="turns")  # first user turn, or all
    kernels: str = option(key="kernels", omit="auto", factory=chosen)  # the CPU kernels (harness/runtime/kernels.py)

    @classmethod
    def default(cls, name: str):
        """An option's default (the command line's)."""
        found = next(f for f in fields(cls) if f.name == name)
        return found.default_factory() if found.default is MISSING else found.default

    def key_entries(self) -> dict:
        """The options' entries in the configuration key."""
        entries = {}
        for f in fields(self):
            meta = f.metadata
            if meta["key"] is None:
                continue
            value = getattr(self, f.name) if meta["value"] is None else meta["value"](self, getattr(self, f.name))
            if meta["omit"] is KEPT or value != meta["omit"]:
                entries[meta["key"]] = value
        return entries

    def recorded(self) -> dict:
        """The options every record stores, under their record names."""
        return {f.metadata["record"]: getattr(self, f.name) for f in fields(self) if f.metadata["record"]}

    @property
    def stage_devices(self) -> list[str]:
        """One device per rank the method serves besides the driver."""
        count, why = REGISTRY[self.method].served(parse_params(REGISTRY[self.method], self.params))
        return launch.stage_devices(self.devices, self.device, count, why)

    @property
    def dtype_name(self) -> str:
        return pick_dtype(self.dtype, self.device)

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p)


def validate(config: RunConfig) -> None:
    """Reject bad input before anything is loaded or written; fill the method's default parameters in."""
    check_model_spec(config.model)
    if config.method not in REGISTRY:
        raise HarnessError(f"unknown method {config.method!r}; choose from {', '.join(sorted(REGISTRY))}")
    cls = REGISTRY[config.method]
    try:
        params = parse_params(cls, config.params)
        config.params = recorded_params(params)
        config.sampling()
    except (ValueError, TypeError) as exc:
        raise HarnessError(f"{exc}; fix the option") from None
    if config.checkpoint and cls.drafter(params) is None:
        raise HarnessError(f"method {config.method} uses no drafter; drop --checkpoint")
    if config.simulate and cls.simulate is Method.simulate:
        raise HarnessError(f"method {config.method} has no acceptance simulation; drop --simulate")
    if config.simulate:
        try:
            cls.check_simulation(params, config.temperature)
        except ValueError as exc:
            raise HarnessError(str(exc)) from None
    if config.limit is not None and config.limit < 1:
        raise HarnessError(f"--limit must be a positive integer, got {config.limit}")
    if config.max_new_tokens < 1:
        raise HarnessError(f"--max-new-tokens must be a positive integer, got {config.max_new_tokens}")
    if config.turns not in TURNS:
        raise HarnessError(f"--turns must be one of {', '.join(TURNS)}, got {config.turns!r}")
    single_turn_sets(config)
    validate_executor(config, cls)


def single_turn_sets(config: RunConfig) -> None:
    """--turns all over sets whose questions have one turn each: they run that turn, said once here. A run of such
    sets alone is keyed and recorded as --turns first, the run it is."""
    single = [name for name in config.datasets if name not in MULTI_TURN]
    if config.turns != "all" or not single:
        return
    if len(single) == len(config.datasets):
        config.turns = "first"
        _say_once(f"--turns all: {', '.join(single)} have one turn per question; running it as --turns first")
    else:
        _say_once(f"--turns all: {', '.join(single)} have one turn per question; they run it")


@functools.cache
def _say_once(line: str) -> None:
    """A note a process prints once, however many configurations of a sweep are validated."""
    tqdm.write(line, file=sys.stderr)


def validate_executor(config: RunConfig, cls) -> None:
    """--executor, --devices and --timeout: distributed runs the families that serve ranks, one device each."""
    if config.executor not in launch.EXECUTORS:
        raise HarnessError(f"--executor must be one of {', '.join(launch.EXECUTORS)}, got {config.executor!r}")
    if config.executor == "local":
        if config.devices:
            raise HarnessError("--devices places the stages of --executor distributed; add it or drop --devices")
        return
    if cls.served(parse_params(cls, config.params)) is None:
        distributed = sorted(name for name, c in REGISTRY.items() if c.served(parse_params(c, {})) is not None)
        raise HarnessError(f"--executor distributed runs {', '.join(distributed)}, not {config.method}")
    if config.simulate:
        raise HarnessError("--simulate replays acceptance without running stages; drop --executor distributed")
    launch.check_deadline("--timeout", config.timeout)
    launch.check_deadline("--join-timeout", config.join_timeout, launch.SHORTEST_START_S)
    config.stage_devices  # noqa: B018 - validates --devices against n


def load_prompts(config: RunConfig) -> list[Sample]:
    samples = []
    for name in config.datasets:
        try:
            samples += load_samples(name, config.data_dir, config.limit)
        except HarnessError as exc:
            if not config.skip_missing or "not found" not in str(exc):
                raise
            tqdm.write(f"skipping {name}: {exc}")
    if not samples:
        raise HarnessError("no prompts to run: every requested dataset is missing; pass --data-dir")
    return samples


def drafter_folder(config: RunConfig, identity) -> tuple[Path, str] | None:
    """Where the configuration's trained drafter lives and the command that trains it; None: it needs none."""
    cls = REGISTRY[config.method]
    needed = cls.drafter(parse_params(cls, config.params))
    if needed is None:
        return None
    tag, command = needed
    folder = checkpoints.find(identity, cls.drafter_family(), tag, config.checkpoint)
    return folder, command


def drafter_fingerprint(config: RunConfig, identity) -> str | None:
    found = drafter_folder(config, identity)
    if found is None or not (found[0] / checkpoints.WEIGHTS).exists():
        return None
    return checkpoints.fingerprint(found[0])


def import_checkpoint(config: RunConfig, loaded: LoadedModel) -> None:
    """`--checkpoint` naming a drafter published in a format the method's family reads (Method.import_checkpoint):
    converted into the cache and used from there."""
    if not config.checkpoint:
        return
    path, cls = Path(config.checkpoint), REGISTRY[config.method]
    imported = cls.import_checkpoint(path, loaded, parse_params(cls, config.params))
    if imported is not None:
        folder, params = imported
        config.checkpoint = str(folder)
        config.params.update(params)
    elif path.is_file():
        raise HarnessError(f"{config.checkpoint} is a file that --method {config.method} does not read; pass a "
                           f"drafter folder")


def default_out(config: RunConfig, model_name: str, root: Path = Path("results")) -> Path:
    return root / model_name.replace("/", "--") / f"{config.method}.jsonl"
