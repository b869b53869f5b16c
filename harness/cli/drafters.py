"""`spd-bench train`, `ship`, `import` and `export-head`: drafters in and out of the cache and the repository."""

from __future__ import annotations

import math
from pathlib import Path

import click

from harness.cli import _params, _values, device_option, dtype_option, list_values, main, model_option, param_options
from harness.reporting.paper import FLAGSHIP
from harness.runtime.errors import HarnessError


def _drafter_specs(methods: str | None, values: dict[str, list]) -> list:
    """Every drafter a train command asks for (`methods`: comma list, None: every trainable method); each family turns
    the listed values of its training parameters into its drafters."""
    from methods.base import REGISTRY, offers, parse_params
    from methods.capabilities import Trains

    trainable = sorted(name for name, cls in REGISTRY.items() if issubclass(cls, Trains))
    specs = []
    for method in _values(methods, str) if methods is not None else trainable:
        if method not in trainable:
            raise click.BadParameter(f"--method must list {', '.join(trainable)}, got {method!r}")
        cls = REGISTRY[method]
        try:
            for name in cls.training_params:  # each value as the method's parameter takes it (its own checks)
                for value in values.get(name, []):
                    if offers(cls, {name: value}):
                        parse_params(cls, {name: value})
            specs += cls.training_specs(values)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    if not specs:
        raise click.BadParameter("--method lists no drafter")
    return specs


def _learning_rate(value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise click.BadParameter(f"must be a finite number above 0, got {value:g}", param_hint="--lr")
    return value


def _corpus(value: str) -> str:
    """A --corpus spec, checked before any model loads (files exist, forms known)."""
    from harness.training.sources import parse

    try:
        parse(value)
    except HarnessError as exc:
        raise click.BadParameter(str(exc).removeprefix(f"--corpus {value}: "), param_hint="--corpus") from None
    return value


@main.command()
@click.option("--method", "methods", default=FLAGSHIP, show_default=True,
              help="Drafter kinds, comma list of the trainable methods (all share the teacher passes).")
@param_options(lists=True, training=True)
@click.option("--tokens", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Target tokens to train on (shared by every drafter of this run).")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Passes over --tokens; the teacher runs once per chunk, later passes read its outputs from disk.")
@click.option("--feature-cache/--no-feature-cache", default=True, show_default=True,
              help="Keep the teacher's outputs in the cache (features/), reused by later epochs and runs.")
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True,
              help="Chunks per rank and step (under torchrun the global batch is this times the ranks).")
@click.option("--global-batch", type=click.IntRange(min=1), default=None,
              help="Chunks per step over all ranks instead (it must divide over them); a resumed run keeps its "
                   "own, so it continues to the same schedule on any number of ranks.")
@click.option("--timeout", type=float, default=1800.0, show_default=True,
              help="Under torchrun: seconds a rank may wait for another (a killed or stuck rank ends every rank "
                   "within it, in one line); rank 0 validates meanwhile, so it must exceed a validation.")
@click.option("--lr", type=float, default=1e-4, show_default=True, callback=lambda ctx, param, value: _learning_rate(value),
              help="Peak learning rate (AdamW), a finite number above 0.")
@click.option("--warmup", type=click.FloatRange(0, 1), default=0.05, show_default=True,
              help="Share of the steps over which the learning rate rises linearly (then it decays to zero).")
@click.option("--draft-vocab", type=click.IntRange(min=0), default=8192, show_default=True,
              help="Draft vocabulary size by corpus frequency (0: full vocabulary).")
@click.option("--draft-vocab-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Take the draft vocabulary from a file instead: the reference's draft_vocab/*.json (its "
                   "token_ids) or a JSON list of target ids.")
@click.option("--save-every", type=click.IntRange(min=1), default=50, show_default=True, help="Steps between checkpoints.")
@click.option("--val-prompts", type=click.IntRange(min=0), default=8, show_default=True,
              help="Held-out prompts decoded greedily once; validation replays decoding on them (0: text top-1 only).")
@click.option("--corpus", default="sharegpt", show_default=True, callback=lambda ctx, param, value: _corpus(value),
              help="What to train on, a comma list mixed a conversation at a time: sharegpt (the shipped ShareGPT "
                   "replies), self (the target's own greedy replies to ShareGPT first turns, generated once, "
                   "cached), a .jsonl/.json/.parquet file or a folder of them, a datasets save_to_disk folder, or "
                   "a datasets NAME:SPLIT; records in ShareGPT (conversations: from/value) or OpenAI (messages: "
                   "role/content) form.")
@click.option("--autocast/--no-autocast", default=True, show_default=True,
              help="Train the drafters under bf16 autocast on a bf16 copy of their weights (fp32 master weights; "
                   "the teacher stays in its dtype).")
@click.option("--teacher", type=click.Choice(["online", "offline"]), default="online", show_default=True,
              help="online: the target runs on every rank, once per chunk (later epochs read the cache); offline: "
                   "training reads only the feature cache that --prepare-features wrote, and ranks other than 0 "
                   "load only the target's embedding, norm, head and first layer.")
@click.option("--prepare-features", is_flag=True,
              help="Compute the target's outputs for every chunk of the run into the feature cache, shared out over "
                   "the ranks, and train nothing (then train with --teacher offline).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint of each drafter.")
@model_option
@device_option
@dtype_option
def train(methods, tokens, epochs, feature_cache, seq_len, batch_size, global_batch, timeout, lr, warmup,
          draft_vocab, save_every, val_prompts, corpus, autocast, teacher, prepare_features, resume, model, device,
          dtype, draft_vocab_file, **named_values):
    """Distil drafters from the frozen target; one teacher pass feeds every drafter listed. Runs unchanged under
    torchrun, data-parallel: every rank takes its share of each global batch.

    \b
    Examples:
      spd-bench train --method spd --n 8 --ls 4 --tokens 300000 --corpus self
      torchrun --nproc-per-node 8 -m harness.cli train --method eagle3 --ttt 7 --corpus train.parquet --device cuda
    """
    from harness.training.train import TrainConfig
    from harness.training.offline import prepare_features as run_prepare
    from harness.training.train import train as run_training

    specs = _drafter_specs(methods, list_values(named_values, training=True))
    shape = " ".join(f"--{key.removesuffix('_values').replace('_', '-')} {text}"
                     for key, text in named_values.items() if text is not None)
    config = TrainConfig(drafters=specs, model=model, tokens=tokens, epochs=epochs, feature_cache=feature_cache,
                         seq_len=seq_len, batch_size=batch_size, global_batch=global_batch or 0,
                         timeout=timeout, lr=lr, warmup=warmup,
                         draft_vocab=draft_vocab, draft_vocab_file=draft_vocab_file, save_every=save_every,
                         val_prompts=val_prompts, corpus=corpus,
                         autocast=autocast, teacher=teacher, device=device, dtype=dtype, resume=resume,
                         command=(f"spd-bench train --method {methods} {shape} "
                                  f"--tokens {tokens} --epochs {epochs} --seq-len {seq_len} --batch-size {batch_size} "
                                  + (f"--global-batch {global_batch} " if global_batch else "") +
                                  f"--lr {lr} --warmup {warmup} "
                                  f"--draft-vocab {draft_vocab} --val-prompts {val_prompts} --corpus {corpus} "
                                  + (f"--draft-vocab-file {draft_vocab_file} " if draft_vocab_file else "") +
                                  f"--{'' if autocast else 'no-'}autocast --teacher {teacher} --model {model} --device {device}"
                                  + (f" --dtype {dtype}" if dtype else "")))
    if prepare_features:
        prepared = run_prepare(config)
        if prepared is not None:  # rank 0 reports
            click.echo(f"features: {prepared.chunks} chunks ({prepared.computed} computed now) in {prepared.folder}: "
                       f"{prepared.bytes / 2**20:.1f} MiB, {prepared.bytes_per_token:.0f} bytes per token")
        return
    for folder in run_training(config):
        click.echo(f"checkpoint: {folder}")


@main.command()
@click.option("--method", required=True, help="Method whose drafter to ship (one with a trained drafter).")
@click.option("--param", "param_pairs", multiple=True, help="Method parameter name=value (repeatable).")
@param_options()
@model_option
def ship(method, param_pairs, model, **named):
    """Copy a trained drafter from the cache into drafters/<model>/ (bf16 safetensors, at most 40 MB).

    `run` finds it there when the cache has none.

    \b
    Example:
      spd-bench ship --method spd --n 8 --ls 4
    """
    from harness.runtime import checkpoints
    from harness.runtime.models import load_identity
    from methods.base import REGISTRY, parse_params
    from methods.capabilities import drafter_of

    if method not in REGISTRY or drafter_of(REGISTRY[method], parse_params(REGISTRY[method], {})) is None:
        raise click.BadParameter(f"--method must name a method with a trained drafter, got {method!r}")
    params = {**_params(param_pairs), **{k: v for k, v in named.items() if v is not None}}
    try:
        tag, command = REGISTRY[method].drafter(parse_params(REGISTRY[method], params))
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from None
    identity, family = load_identity(model), REGISTRY[method].drafter_family()
    folder = checkpoints.drafter_dir(identity, family, tag)
    if not (folder / checkpoints.CONFIG).exists():
        raise HarnessError(f"no {family} drafter with {tag} in the cache; train one with: {command}")
    dest = checkpoints.ship(folder, checkpoints.shipped_dir(identity, family, tag))
    click.echo(f"shipped: {dest} ({(dest / checkpoints.WEIGHTS).stat().st_size / 2**20:.1f} MiB)")


def _formats() -> dict:
    """Every foreign drafter format a family imports (`Imports.imports`), by option name, with its family."""
    from methods.base import REGISTRY
    from methods.capabilities import Imports

    return {name: (cls, fmt) for cls in REGISTRY.values() if issubclass(cls, Imports)
            for name, fmt in cls.imports.items()}


def _format_options(command):
    for name, (_, fmt) in sorted(_formats().items(), reverse=True):
        command = click.option(f"--{name}", f"{name}_path", type=click.Path(path_type=Path), default=None,
                               help=fmt.about)(command)
    return command


def _named_params(cls, named: dict, wanted: tuple[str, ...]):
    """The family's Params from the options it reads (`wanted`), the rest at their defaults."""
    from methods.base import parse_params

    try:
        return parse_params(cls, {k: v for k, v in named.items() if k in wanted and v is not None})
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@main.command(name="import")
@_format_options
@param_options(only=tuple(p for _, fmt in _formats().values() for p in fmt.params))
@click.option("--force", is_flag=True, help="Replace a drafter already in the cache under the same tag.")
@model_option
@device_option
@dtype_option
def import_command(force, model, device, dtype, **options):
    """Convert a published drafter for --model into the drafter cache, checked against the target.

    \b
    Example:
      spd-bench import --eagle3 heads/EAGLE3-Qwen3-4B --ttt 7 --model Qwen/Qwen3-4B
    """
    from harness.runtime.models import load_model
    from harness.runtime.target import TargetRuntime

    given = {name: options.pop(f"{name}_path") for name in _formats()}
    given = {name: path for name, path in given.items() if path is not None}
    if len(given) != 1:
        raise click.UsageError("pass one of " + " or ".join(f"--{name} PATH" for name in _formats()))
    (name, path), = given.items()
    cls, fmt = _formats()[name]
    params = _named_params(cls, options, fmt.params)
    loaded = load_model(model, device, dtype)
    target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
    click.echo(f"drafter: {fmt.convert(path, target, params, force)}")


def _exporter():
    """The one family with a head export (`Imports.head_export`)."""
    from methods.base import REGISTRY
    from methods.capabilities import Imports

    (cls,) = [cls for cls in REGISTRY.values() if issubclass(cls, Imports) and cls.head_export is not None]
    return cls


@main.command(name="export-head", help=f"{_exporter().head_export.about}\n\n\b\nExample:\n  spd-bench export-head "
                                       f"--model smollm2-135m --ttt 7 --out heads/eagle3-ttt7")
@model_option
@param_options(only=_exporter().head_export.params)
@click.option("--checkpoint", default=None, help="The head's folder (default: the cache's).")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The folder to write: new or empty.")
@click.option("--replace", is_flag=True, help="Overwrite the config.json and model.safetensors of a non-empty --out "
                                              "(nothing else in it is touched).")
def export_head(model, checkpoint, out, replace, **options):
    cls = _exporter()
    export = cls.head_export
    export.check(out, replace)  # before anything loads
    params = _named_params(cls, options, export.params)
    click.echo(f"{cls.name} head: {export.write(model, params, checkpoint, out, replace)}")
