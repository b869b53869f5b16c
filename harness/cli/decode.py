"""`spd-bench run`, `parity` and `sweep`: decoding benchmark prompts."""

from __future__ import annotations

from pathlib import Path

import click

from harness.bench.parity import parity_methods
from harness.cli import _method_options, _params, _values, list_values, main, param_options, prompt_options
from harness.reporting.paper import FLAGSHIP, GRID
from methods.base import REGISTRY


def _served() -> str:
    return ", ".join(f"{cls.serves} ({cls.name})" for cls in REGISTRY.values() if cls.serves)


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--method", default="autoregressive", show_default=True, help="Registered decoding method.")
@click.option("--param", "param_pairs", multiple=True,
              help="Method parameter name=value (repeatable); each parameter also has its own option below.")
@param_options()
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@prompt_options
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Results file (default results/<model>/<method>.jsonl).")
@click.option("--checkpoint", default=None, help="Drafter checkpoint folder (methods that need one).")
@click.option("--skip-missing", is_flag=True, help="Skip datasets that cannot be found instead of failing.")
@click.option("--executor", type=click.Choice(["local", "distributed"]), default="local", show_default=True,
              help="Run everything in this process, or give the method's served ranks processes of their own "
                   f"(torch.distributed, started here or by torchrun): {_served()}.")
@click.option("--devices", default=None,
              help="--executor distributed: one device per served rank, e.g. cuda:1,cuda:2 (default: the --device "
                   "type).")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="--executor distributed: the run deadline, seconds a rank may wait for another once every rank "
                   "has started, before the run fails.")
@click.option("--join-timeout", type=float, default=900.0, show_default=True,
              help="--executor distributed: the start deadline, seconds the ranks may take to start and load what "
                   "they serve (a spawned rank that exits meanwhile ends the wait at once).")
@click.pass_context
def run(ctx, method, param_pairs, model, datasets, temperature, top_k, top_p, max_new_tokens, limit, seed, device,
        dtype, data_dir, out, checkpoint, skip_missing, simulate, executor, devices, timeout, join_timeout, **named):
    """Decode benchmark prompts, check losslessness, append one record per sample."""
    from harness.bench.config import RunConfig
    from harness.bench.runner import run as run_config

    params = {**_params(param_pairs), **_method_options(ctx.args),
              **{k: v for k, v in named.items() if v is not None}}
    config = RunConfig(
        method=method, params=params, model=model, datasets=datasets, temperature=temperature,
        top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, limit=limit, seed=seed, device=device, dtype=dtype,
        data_dir=data_dir, out=out, checkpoint=checkpoint, skip_missing=skip_missing, simulate=simulate,
        executor=executor, devices=devices, timeout=timeout, join_timeout=join_timeout,
    )
    path = run_config(config)
    if path is not None:  # a torchrun stage rank writes nothing
        click.echo(f"results: {path}")


@main.command()
@click.option("--method", default=FLAGSHIP, show_default=True,
              type=click.Choice(parity_methods()))
@param_options(only=tuple(p for name in parity_methods() for p in REGISTRY[name].training_params))
@prompt_options
@click.option("--checkpoint", default=None, help="Drafter checkpoint folder (default: the cache).")
def parity(method, model, datasets, max_new_tokens, limit, seed, device, dtype, data_dir, simulate, checkpoint,
           **named):
    """Train/decode parity of a drafter: its predictions on the greedy AR output through the training layout and
    through decoding, as its family compares them; exits 1 on any disagreement beyond near-ties."""
    from harness.bench.config import RunConfig
    from harness.bench.parity import check as parity_check

    if simulate:
        raise click.UsageError("parity always compares the engine with the training layout; drop --simulate")
    config = RunConfig(method=method, params={k: v for k, v in named.items() if v is not None}, model=model,
                       datasets=datasets, max_new_tokens=max_new_tokens, limit=limit, seed=seed, device=device,
                       dtype=dtype, data_dir=data_dir, checkpoint=checkpoint)
    found = parity_check(config)
    click.echo(found.table())
    if found.disagree:
        raise SystemExit(1)


@main.command()
@click.option("--preset", type=click.Choice(["paper"]), default=None,
              help=f"paper: {GRID}.")
@click.option("--method", "methods", default=None, help="Comma list of methods (instead of --preset).")
@param_options(lists=True, skip=("width",))
@click.option("--width", "widths", default="1", show_default=True, help="Comma list of draft widths.")
@click.option("--temperature", "temperatures", default="0", show_default=True, help="Comma list of temperatures.")
@click.option("--top-k", type=int, default=0, show_default=True,
              help="Top-k of the T>0 points (0: off; the paper samples with 50).")
@click.option("--top-p", type=float, default=1.0, show_default=True,
              help="Top-p of the T>0 points (the paper samples with 0.95).")
@prompt_options
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Results root (default results/): records go to <root>/<model>/<method>.jsonl.")
def sweep(preset, methods, widths, temperatures, top_k, top_p, model, datasets, max_new_tokens, limit, seed, device,
          dtype, data_dir, results, simulate, **param_values):
    """Run a grid of configurations, resumable, with one progress bar; trains nothing (missing drafters are listed)."""
    from harness.bench.config import RunConfig
    from harness.bench.sweep import grid
    from harness.bench.sweep import sweep as run_sweep
    from harness.reporting.paper import paper_grid

    if (preset is None) == (methods is None):
        raise click.UsageError("pass either --preset paper or --method LIST")
    if preset:
        points = paper_grid()
    else:
        values = list_values(param_values)
        points = grid(_values(methods, str), values, _values(temperatures, float), _values(widths), (top_k, top_p))
    base = RunConfig(model=model, datasets=datasets, max_new_tokens=max_new_tokens, limit=limit, seed=seed,
                     device=device, dtype=dtype, data_dir=data_dir, simulate=simulate)
    outcome = run_sweep(points, base, results)
    ran = sum(1 for count in outcome.ran.values() if count)
    click.echo(f"{len(outcome.ran)} of {len(points)} configurations complete ({ran} ran now); "
               f"results: {', '.join(str(f) for f in sorted(outcome.files)) or 'none'}")
    reasons: dict[str, list[str]] = {}
    for skip in outcome.skipped:
        reasons.setdefault(skip.reason, []).append(skip.point.label())
    for reason, labels in reasons.items():
        click.echo(f"skipped {len(labels)}: {reason}\n  " + "\n  ".join(labels))
    if outcome.skipped:
        raise SystemExit(1)
