"""The run identity: one RunConfig names a run (method, parameters, model, sampling, lengths, seed, executor) from the
command line through the record; here it is validated, and its prompts, drafter and results file are found."""

from __future__ import annotations

import functools
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path

from tqdm import tqdm

import methods  # noqa: F401  (fills the registry)
from harness.bench.data import DATASETS, MULTI_TURN, TURNS, Sample, load_samples
from harness.runtime import checkpoints
from harness.runtime import distributed as launch
from harness.runtime.errors import HarnessError
from harness.runtime.kernels import chosen
from harness.runtime.models import DEFAULT_MODEL, LoadedModel, check_model_spec, pick_dtype
from methods.base import REGISTRY, parse_params, recorded_params
from methods.capabilities import Imports, Serves, Simulates, drafter_of
from methods.sampling import SamplingConfig

REFERENCE_METHOD = "autoregressive"


KEPT = object()  # an `omit` of no value: the entry is always in the key


def option(default=None, *, key: str | None = None, omit=KEPT, value=None, record: str | None = None,
           factory=None, help: str | None = None, choices: tuple = (), flag: str | None = None):
    """A run option: its default, and where it goes. `key`: its entry in the configuration key (None: not there);
    `omit`: a value whose entry is left out (options added after records were keyed keep earlier keys); `value`:
    (config, raw) -> what the key holds; `record`: its name in the record (None: not stored); `help`, `choices` and
    `flag` (default `--the-name`): its command-line option (harness/cli's `config_option`; no help: none)."""
    metadata = {"key": key, "omit": omit, "value": value, "record": record, "help": help, "choices": choices,
                "flag": flag}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def _executor(config: RunConfig, executor: str) -> dict | None:
    if executor != "distributed":
        return None
    return {"kind": "distributed", "world_size": len(config.stage_devices) + 1, "devices": config.stage_devices}


DTYPE_HELP = ("Default: float32 on CPU, bfloat16 on CUDA. auto: bfloat16 on a CPU where the row kernels serve (faster; "
              "every method still decodes its runtime's own greedy AR tokens, which in bf16 can part from HF's bf16 "
              "decoding at near-ties: --kernels torch for that comparison), else the default.")
COMPILE_HELP = ("Run the target's attention layers through torch.compile'd graphs (inductor; on a CPU a run of alike "
                "layers as one graph, on CUDA one layer a graph with static shapes replayed as CUDA graphs): on stops "
                "with the reason where it cannot compile, and auto falls back to eager saying why. Drafters' layers "
                "run the same way.")
TURNS_HELP = ("MT-Bench: decode each question's first user turn (the paper's protocol), or all its turns as one "
              "conversation (Spec-Bench's and EAGLE's), a record per turn; other sets have one turn.")


@dataclass
class RunConfig:
    """What names a run, from its command-line options (harness/cli's `config_option`: flag, type, default, help)
    through its configuration key (`key_entries`) to its records (`recorded`)."""

    method: str = option(REFERENCE_METHOD, key="method", record="method", help="Registered decoding method.")
    params: dict = option(key="params", record="params", factory=dict)  # the method's: its Params' own options
    model: str = option(DEFAULT_MODEL, help="Embedded model name, a local HF folder, or a hub id.")  # keyed by weights
    datasets: tuple[str, ...] = option(DATASETS, help="Comma-separated datasets.", flag="--dataset")
    temperature: float = option(0.0, key="temperature", record="temperature", help="0: greedy.")
    top_k: int = option(0, key="top_k", record="top_k", help="0 disables top-k.")
    top_p: float = option(1.0, key="top_p", record="top_p", help="1 disables top-p.")
    max_new_tokens: int = option(128, key="max_new_tokens", record="max_new_tokens", help="Tokens per answer at most.")
    limit: int | None = option(None, help="First N prompts per dataset.")
    seed: int = option(0, key="seed", record="seed", help="The sampler's seed (T>0).")
    device: str = option("cpu", help="cpu or cuda[:N].")  # keyed by its type (the runner adds it)
    dtype: str | None = option(None, key="dtype", value=lambda c, _: c.dtype_name, help=DTYPE_HELP,
                               choices=("float32", "bfloat16", "float16", "auto"))
    data_dir: str | None = option(None, help="Folder with <dataset>.jsonl files (or $SPD_BENCH_DATA).")
    out: Path | None = option(None, help="Results file (default results/<model>/<method>.jsonl).")
    checkpoint: str | None = option(None, help="Drafter checkpoint folder (methods that need one).")  # keyed by weights
    skip_missing: bool = option(False, help="Skip datasets that cannot be found instead of failing.")
    baseline: bool = option(True)  # time AR on every sample beside the method (wall-clock measured side by side)
    simulate: bool = option(False, key="simulated", omit=False, record="simulated",
                            help="Replay acceptance on the AR output from one teacher-forced pass instead of executing "
                                 "(exact at T=0; expected acceptance at T>0; no timings).")
    executor: str = option("local", key="executor", omit=None, value=_executor, choices=launch.EXECUTORS,
                           help="Run everything in this process, or give the method's served ranks processes of "
                                "their own (torch.distributed, started here or by torchrun).")
    devices: str | None = option(None, help="--executor distributed: one device per served rank, e.g. cuda:1,cuda:2 "
                                            "(default: the --device type).")
    timeout: float = option(300.0, help="--executor distributed: the run deadline, seconds a rank may wait for "
                                        "another once every rank has started, before the run fails.")
    join_timeout: float = option(900.0, help="--executor distributed: the start deadline, seconds the ranks may take "
                                             "to start and load what they serve (a spawned rank that exits meanwhile "
                                             "ends the wait at once).")
    compile: str = option("off", key="compile", omit="off", help=COMPILE_HELP, choices=("off", "on", "auto"))
    turns: str = option("first", key="turns", omit="first", record="turns", help=TURNS_HELP, choices=TURNS)
    kernels: str = option(key="kernels", omit="auto", factory=chosen)  # the CPU kernels (harness/runtime/kernels.py;
    # the command line's --kernels chooses them for the process and its ranks)

    @classmethod
    def field(cls, name: str):
        return next(f for f in fields(cls) if f.name == name)

    @classmethod
    def default(cls, name: str):
        """An option's default (the command line's)."""
        found = cls.field(name)
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
    if config.checkpoint and drafter_of(cls, params) is None:
        raise HarnessError(f"method {config.method} uses no drafter; drop --checkpoint")
    if config.simulate and not issubclass(cls, Simulates):
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
    if not issubclass(cls, Serves):
        distributed = sorted(name for name, c in REGISTRY.items() if issubclass(c, Serves))
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
    needed = drafter_of(cls, parse_params(cls, config.params))
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
    """`--checkpoint` naming a drafter published in a format the method's family reads (Imports.import_checkpoint):
    converted into the cache and used from there."""
    if not config.checkpoint:
        return
    path, cls = Path(config.checkpoint), REGISTRY[config.method]
    imported = None
    if issubclass(cls, Imports):
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
