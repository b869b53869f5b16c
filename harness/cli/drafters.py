"""`spd-bench train`, `ship`, `import` and `export-head`: drafters in and out of the cache and the repository."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli import _params, _values, device_option, dtype_option, main, model_option, param_options
from harness.runtime.errors import HarnessError


def _drafter_specs(methods: str, n_values: str, ls_values: str | None, schedules: str | None, ttt_values: str,
                   eagle_layout: str = "harness", aggr_bounds: str | None = None) -> list:
    """Every drafter a train command asks for; each family turns the listed values into its drafters."""
    from methods.base import REGISTRY

    trainable = sorted(name for name, cls in REGISTRY.items() if cls.trainable)
    values = {"n": _values(n_values), "ls": _values(ls_values), "schedule": _values(schedules, str),
              "ttt": _values(ttt_values), "layout": [eagle_layout], "aggr_bounds": _values(aggr_bounds)}
    if any(v < 1 for key in ("n", "ls", "ttt") for v in values[key]):
        raise click.BadParameter("--n, --ls and --ttt must be positive")
    specs = []
    for method in _values(methods, str):
        if method not in trainable:
            raise click.BadParameter(f"--method must list {', '.join(trainable)}, got {method!r}")
        try:
            specs += REGISTRY[method].training_specs(values)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    if not specs:
        raise click.BadParameter("--method lists no drafter")
    return specs


@main.command()
@click.option("--method", "methods", default="spd", show_default=True,
              help="Drafter kinds, comma list of spd, ppsd, eagle3 (all share the teacher passes).")
@click.option("--n", "n_values", default="8", show_default=True, help="Pipeline stages (comma list trains several).")
@click.option("--ls", "ls_values", default=None, help="Drafter decoder layers, comma list (default: spd 4, ppsd 1).")
@click.option("--schedule", "schedules", default=None,
              help="input, output or both, comma list (default: spd input, ppsd output).")
@click.option("--ttt", "ttt_values", default="7", show_default=True,
              help="EAGLE-3 training-time-test steps (comma list trains several heads; run them with --param ttt=N).")
@click.option("--eagle-layout", type=click.Choice(["harness", "eagle3"]), default="harness", show_default=True,
              help="EAGLE-3 heads: the harness's layer, or the EAGLE-3 authors' (exportable with export-head).")
@click.option("--aggr-bounds", default=None,
              help="SPD drafters: hidden-state indices 0 < b1 < ... whose cumulative features the projections read, "
                   "shared between depths as in the reference (default: one projection per depth).")
@click.option("--tokens", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Target tokens to train on (shared by every drafter of this run).")
@click.option("--epochs", type=click.IntRange(min=1), default=1, show_default=True,
              help="Passes over --tokens; the teacher runs once per chunk, later passes read its outputs from disk.")
@click.option("--feature-cache/--no-feature-cache", default=True, show_default=True,
              help="Keep the teacher's outputs in the cache (features/), reused by later epochs and runs.")
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--lr", type=float, default=1e-4, show_default=True)
@click.option("--warmup", type=click.FloatRange(0, 1), default=0.05, show_default=True,
              help="Share of the steps over which the learning rate rises linearly (then it decays to zero).")
@click.option("--draft-vocab", type=click.IntRange(min=0), default=8192, show_default=True,
              help="Draft vocabulary size by corpus frequency (0: full vocabulary).")
@click.option("--save-every", type=click.IntRange(min=1), default=50, show_default=True, help="Steps between checkpoints.")
@click.option("--val-prompts", type=click.IntRange(min=0), default=8, show_default=True,
              help="Held-out prompts decoded greedily once; validation replays decoding on them (0: text top-1 only).")
@click.option("--corpus", type=click.Choice(["sharegpt", "self"]), default="sharegpt", show_default=True,
              help="Train on ShareGPT's replies, or on the target's own greedy replies to ShareGPT first turns "
                   "(generated once, cached).")
@click.option("--init", type=click.Choice(["identity", "target"]), default="target", show_default=True,
              help="Pipeline drafter layers start as copies of the target's last layers or as identity (residual "
                   "branches zero).")
@click.option("--autocast/--no-autocast", default=True, show_default=True,
              help="Train the drafters under bf16 autocast on a bf16 copy of their weights (fp32 master weights; "
                   "the teacher stays in its dtype).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint of each drafter.")
@model_option
@device_option
@dtype_option
def train(methods, n_values, ls_values, schedules, ttt_values, eagle_layout, aggr_bounds, tokens, epochs,
          feature_cache, seq_len, batch_size, lr, warmup, draft_vocab, save_every, val_prompts, corpus, init, autocast,
          resume, model, device, dtype):
    """Distil drafters from the frozen target on ShareGPT; one teacher pass feeds every drafter listed."""
    from harness.training.train import TrainConfig
    from harness.training.train import train as run_training

    specs = _drafter_specs(methods, n_values, ls_values, schedules, ttt_values, eagle_layout, aggr_bounds)
    shape = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (
        ("n", n_values), ("ls", ls_values), ("schedule", schedules), ("ttt", ttt_values),
        ("aggr_bounds", aggr_bounds)) if v is not None)
    shape += "" if eagle_layout == "harness" else f" --eagle-layout {eagle_layout}"
    config = TrainConfig(drafters=specs, model=model, tokens=tokens, epochs=epochs, feature_cache=feature_cache,
                         seq_len=seq_len, batch_size=batch_size, lr=lr, warmup=warmup,
                         draft_vocab=draft_vocab, save_every=save_every, val_prompts=val_prompts, corpus=corpus,
                         init=init, autocast=autocast, device=device, dtype=dtype, resume=resume,
                         command=(f"spd-bench train --method {methods} {shape} "
                                  f"--tokens {tokens} --epochs {epochs} --seq-len {seq_len} --batch-size {batch_size} "
                                  f"--lr {lr} --warmup {warmup} "
                                  f"--draft-vocab {draft_vocab} --val-prompts {val_prompts} --corpus {corpus} "
                                  f"--init {init} "
                                  f"--{'' if autocast else 'no-'}autocast --model {model} --device {device}"
                                  + (f" --dtype {dtype}" if dtype else "")))
    for folder in run_training(config):
        click.echo(f"checkpoint: {folder}")


@main.command()
@click.option("--method", required=True, help="Method whose drafter to ship (spd, ppsd, eagle3).")
@click.option("--param", "param_pairs", multiple=True, help="Method parameter name=value (repeatable).")
@param_options()
@model_option
def ship(method, param_pairs, model, **named):
    """Copy a trained drafter from the cache into drafters/<model>/ as bf16 safetensors + config (at most 40 MB),
    where `run` finds it when the cache has none."""
    from harness.runtime import checkpoints
    from harness.runtime.models import load_identity
    from methods.base import REGISTRY, parse_params

    if method not in REGISTRY or REGISTRY[method].drafter(parse_params(REGISTRY[method], {})) is None:
        raise click.BadParameter(f"--method must name a method with a trained drafter, got {method!r}")
    params = {**_params(param_pairs), **{k: v for k, v in named.items() if v is not None}}
    try:
        tag, command = REGISTRY[method].drafter(parse_params(REGISTRY[method], params))
    except (ValueError, TypeError) as exc:
        raise click.BadParameter(str(exc)) from None
    identity = load_identity(model)
    folder = checkpoints.drafter_dir(identity, method, tag)
    if not (folder / checkpoints.CONFIG).exists():
        raise HarnessError(f"no {method} drafter with {tag} in the cache; train one with: {command}")
    dest = checkpoints.ship(folder, checkpoints.shipped_dir(identity, method, tag))
    click.echo(f"shipped: {dest} ({(dest / checkpoints.WEIGHTS).stat().st_size / 2**20:.1f} MiB)")


@main.command(name="import")
@click.option("--spd", "spd_file", type=click.Path(path_type=Path), default=None,
              help="A reference speculation head (v11 .pt, e.g. Qwen3.5-4B_s8_l4.pt).")
@click.option("--eagle3", "eagle_dir", type=click.Path(path_type=Path), default=None,
              help="An EAGLE-3 head folder (config.json + model.safetensors or pytorch_model.bin).")
@click.option("--ttt", type=click.IntRange(min=1), default=7, show_default=True,
              help="--eagle3: the tag it is filed under (run it with --param ttt=N --param layout=eagle3).")
@click.option("--force", is_flag=True, help="Replace a drafter already in the cache under the same tag.")
@model_option
@device_option
@dtype_option
def import_command(spd_file, eagle_dir, ttt, force, model, device, dtype):
    """Convert a published SPD or EAGLE-3 head for --model into the drafter cache (checked against the target)."""
    from harness.runtime.models import load_model
    from harness.runtime.target import TargetRuntime
    from methods.eagle3.interop import import_eagle3
    from methods.pipeline.interop import import_spd

    if (spd_file is None) == (eagle_dir is None):
        raise click.UsageError("pass one of --spd FILE.pt or --eagle3 DIR")
    loaded = load_model(model, device, dtype)
    target = TargetRuntime(loaded.model, max_len=8, identity=loaded.identity)
    folder = (import_spd(spd_file, target, force=force) if spd_file
              else import_eagle3(eagle_dir, target, ttt=ttt, force=force))
    click.echo(f"drafter: {folder}")


@main.command(name="export-head")
@model_option
@click.option("--ttt", type=click.IntRange(min=1), default=7, show_default=True, help="Which trained head.")
@click.option("--checkpoint", default=None, help="The head's folder (default: the cache's eagle3-layout head).")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="The EAGLE-3 folder to write: new or empty.")
@click.option("--replace", is_flag=True, help="Overwrite the config.json and model.safetensors of a non-empty --out "
                                              "(nothing else in it is touched).")
def export_head(model, ttt, checkpoint, out, replace):
    """An EAGLE-3 head trained with --eagle-layout eagle3, in the EAGLE-3 folder format (SGLang, the EAGLE code)."""
    from transformers import AutoConfig

    from harness.runtime import checkpoints
    from harness.runtime.models import load_identity, resolve_model_dir
    from methods.eagle3.head import head_tag
    from methods.eagle3.interop import check_export_target, export_eagle3

    check_export_target(out, replace)  # before anything loads
    tag = head_tag(ttt, "eagle3")
    folder, _ = checkpoints.locate(load_identity(model), "eagle3", tag,
                                   f"spd-bench train --method eagle3 --ttt {ttt} --eagle-layout eagle3", checkpoint)
    text = AutoConfig.from_pretrained(resolve_model_dir(model)[1]).get_text_config()
    click.echo(f"EAGLE-3 head: {export_eagle3(folder, out, text, replace)}")
