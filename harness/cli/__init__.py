"""`spd-bench` command line: parses options and calls the harness; every bad input exits 2 with one line.

This module holds the command group, its error handling and the options commands share; the commands live by
kind in decode.py (run, parity, sweep), drafters.py (train, ship, import, export-head), results.py (report, export,
check) and bench.py (bench ar/train/stage, selfcheck).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

# Before torch loads: c10d logs every connection retry and timeout itself, with C++ frames, while the harness turns
# each failure into one line that says what failed (set the variable to see them).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import click  # noqa: E402

from harness.bench.config import RunConfig  # noqa: E402
from harness.bench.data import DATASETS  # noqa: E402
from harness.runtime.errors import HarnessError  # noqa: E402


# The sections a command's --help groups its options into, by parameter name; a method's own parameters (every
# Params field is an option) go under METHOD, anything else under the last.
METHOD = "Method and its parameters"
SECTIONS = {
    METHOD: ("method", "methods", "preset", "param_pairs", "params", "checkpoint", "widths", "configurations"),
    "Prompts and lengths": ("datasets", "dataset", "data_dir", "limit", "prompts", "max_new_tokens", "turns",
                            "seq_len", "batch_size", "tokens", "epochs", "steps"),
    "Sampling": ("temperature", "temperatures", "top_k", "top_p", "seed"),
    "Model and device": ("model", "device", "dtype", "kernels", "compile_mode", "executor", "devices", "timeout",
                         "join_timeout", "simulate", "shape", "shapes", "layers"),
    "Output": ("out", "results", "fmt", "replace", "summary", "show_plan", "as_json", "per_dataset", "shard",
               "missing", "skip_missing"),
    "The gate": ("baseline", "margin", "write", "rerun"),
}
OTHER = "Other options"


class _Sectioned(click.Command):
    """A command whose --help lists its options in sections (SECTIONS) instead of one long list."""

    def format_options(self, ctx, formatter):
        declared = _declared_params(training=True).keys() | _declared_params().keys()
        sections: dict[str, list] = {title: [] for title in (*SECTIONS, OTHER)}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            name = (param.name or "").removesuffix("_values")
            title = next((t for t, names in SECTIONS.items() if param.name in names), None)
            sections[title or (METHOD if name in declared else OTHER)].append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class _Group(click.Group):
    """Turns usage errors and HarnessError into `error: <one line>` on stderr and exit code 2; its commands list
    their options in sections."""

    command_class = _Sectioned
    group_class = type  # subgroups (bench) are of this class too

    def main(self, *args, **kwargs):
        try:
            return super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        except click.ClickException as exc:
            click.echo(f"error: {exc.format_message()}", err=True)
            sys.exit(2)
        except HarnessError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(2)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _datasets(value: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    unknown = [n for n in names if n not in DATASETS]
    if unknown or not names:
        raise click.BadParameter(f"unknown dataset(s) {', '.join(unknown) or value!r}; choose from {', '.join(DATASETS)}")
    return names


def _values(text: str | None, kind=int) -> list:
    """A comma-separated option as a list of `kind` values (None: empty)."""
    if text is None:
        return []
    entries = [v.strip() for v in text.split(",")]
    if not all(entries):
        raise click.BadParameter(f"{text!r} has an empty entry; list values separated by single commas, e.g. 4,8")
    try:
        return [kind(v) for v in entries]
    except ValueError:
        raise click.BadParameter(f"expected a comma-separated list, got {text!r}") from None


def _params(pairs: tuple[str, ...]) -> dict:
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"--param {pair!r} must look like name=value")
        params[name] = int(value) if value.lstrip("-").isdigit() else value
    return params


def _method_options(args: list[str]) -> dict:
    """`--some-name value` pairs left over by `run`'s own options: the method's parameters (checked by the method)."""
    pairs = []
    for i in range(0, len(args), 2):
        name, value = args[i], args[i + 1] if i + 1 < len(args) else None
        if not name.startswith("--") or value is None or value.startswith("--"):
            raise click.UsageError(f"unexpected argument {name!r}: method parameters go as --name value")
        pairs.append(f"{name[2:].replace('-', '_')}={value}")
    return _params(tuple(pairs))


@dataclass
class Declared:
    """A method parameter as the command line offers it."""

    kind: type
    help: str
    users: list[str] = field(default_factory=list)  # each declaring method, with its default where it has one
    flags: tuple[str, ...] = ()  # further names its option answers to (names from before it was generated)
    defaults: bool = True  # users name their defaults (a training-only option has none)


def _declared_params(training: bool = False) -> dict[str, Declared]:
    """Every parameter a registered method declares (its Params); with `training`, the ones the trainable families
    train over (their `training_params`) and their training-only options (`training_options`)."""
    import methods  # noqa: F401  (fills the registry)
    from methods.base import REGISTRY
    from methods.capabilities import Trains

    declared: dict[str, Declared] = {}
    for cls in REGISTRY.values():
        if training and not issubclass(cls, Trains):
            continue
        for f in fields(cls.Params):
            if training and f.name not in cls.training_params:
                continue
            kind = {"int": int, "float": float, "str": str}[getattr(f.type, "__name__", str(f.type))]
            entry = declared.setdefault(f.name, Declared(kind, f.metadata.get("help", ""),
                                                         flags=f.metadata.get("flags", ())))
            entry.users.append(f"{cls.name} {f.default!r}")
        for name, (kind, text) in (cls.training_options.items() if training else ()):
            declared.setdefault(name, Declared(kind, text, defaults=False)).users.append(cls.name)
    return declared


def param_options(lists: bool = False, skip: tuple[str, ...] = (), training: bool = False,
                  only: tuple[str, ...] | None = None):
    """A `--name` option per method parameter, from the methods' Params (type, help); default None: the method's own
    default (each method's is listed in the help). With `lists`, each takes a comma list and arrives as
    `<name>_values` (sweeps, training); `training`: the parameters `spd-bench train` takes (see _declared_params)."""

    def decorate(command):
        for name, entry in sorted(_declared_params(training).items(), reverse=True):
            if name in skip or (only is not None and name not in only):
                continue
            flags = (f"--{name.replace('_', '-')}", *entry.flags)
            about = f"{entry.help} [{'default' if entry.defaults else 'methods'}: {', '.join(entry.users)}]"
            if lists:
                command = click.option(*flags, f"{name}_values", default=None, help=f"Comma list. {about}")(command)
            else:
                command = click.option(*flags, name, type=entry.kind, default=None, help=about)(command)
        return command

    return decorate


def list_values(named: dict[str, str | None], training: bool = False) -> dict[str, list]:
    """`<name>_values` comma lists (param_options(lists=True)) as {name: [typed values]} for the ones given."""
    declared = _declared_params(training)
    return {name: _values(text, declared[name].kind) for key, text in named.items()
            if text is not None and (name := key.removesuffix("_values")) in declared}


@click.group(cls=_Group, context_settings={"max_content_width": 120})
def main():
    """Benchmark and reproduction harness for lossless speculative decoding: decode, report, check.

    \b
    Examples:
      spd-bench run --method spd --n 8 --ls 4 --limit 10
      spd-bench report --results results
    Each command's --help shows its options and an example; docs/ has the guides.
    """
    _quiet_libraries()


_KINDS = {"int": int, "float": float, "Path": click.Path(path_type=Path)}


def config_option(name: str, dest: str | None = None, **overrides):
    """The command-line option of RunConfig's field `name`: flag, type, choices, default and help all from the field
    (`dest`: the command's parameter name where it is not the field's; `overrides`: what a command says otherwise,
    e.g. sweep's comma lists)."""
    found = RunConfig.field(name)
    meta, default = found.metadata, RunConfig.default(name)
    settings = {"default": ",".join(default) if isinstance(default, tuple) else default, "help": meta["help"]}
    if isinstance(default, bool):
        settings["is_flag"] = True
    else:
        settings["show_default"] = default is not None
        kind = _KINDS.get(str(found.type).split(" |")[0])
        settings["type"] = click.Choice(meta["choices"]) if meta["choices"] else kind
    if isinstance(default, tuple):
        settings["callback"] = lambda ctx, param, value: _datasets(value)
    return click.option(meta["flag"] or "--" + name.replace("_", "-"), dest or name, **{**settings, **overrides})


model_option = config_option("model")
device_option = config_option("device")
dtype_option = config_option("dtype")


def _choose_kernels(ctx, param, value):
    from harness.runtime.kernels import choose

    choose(value)  # before any model loads; served ranks inherit it
    return value


def kernels_option(expose: bool = True):
    """--kernels: which CPU kernels serve the target's Linears and attention, for this process and its ranks."""
    return click.option(
        "--kernels", type=click.Choice(["auto", "rows", "torch"]), default="auto", show_default=True,
        callback=_choose_kernels, expose_value=expose, envvar="SPD_BENCH_KERNELS",
        help="CPU kernels of the target's Linears and attention: auto takes the project's row kernels where they "
             "build (a row's result independent of the rows beside it, so verified drafts equal steps bit for bit), "
             "rows insists on them, torch keeps torch's (oneDNN/MKL and sdpa, as HF's own decoding runs).")
compile_option = config_option("compile", "compile_mode")
turns_option = config_option("turns")
data_option = config_option("data_dir")
simulate_option = config_option("simulate")


def prompt_options(command):
    """The prompts, lengths, seed and device options that `run` and `sweep` share."""
    options = [
        model_option,
        config_option("datasets"), config_option("max_new_tokens"), config_option("limit"), config_option("seed"),
        device_option, dtype_option, data_option, simulate_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


from harness.cli import bench, decode, drafters, results  # noqa: F401  (registers their commands on main)
