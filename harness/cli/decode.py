"""`spd-bench run`, `parity` and `sweep`: decoding benchmark prompts."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import click

from harness.bench.config import RunConfig
from harness.bench.parity import parity_methods
from harness.cli import (_method_options, _params, _values, compile_option, config_option, kernels_option,
                         list_values, main, param_options, prompt_options, turns_option)
from harness.reporting.paper import FLAGSHIP, GRID
from methods.base import REGISTRY
from methods.capabilities import Serves


def _served() -> str:
    return ", ".join(f"{cls.serves} ({cls.name})" for cls in REGISTRY.values() if issubclass(cls, Serves))


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@config_option("method")
@click.option("--param", "param_pairs", multiple=True,
              help="Method parameter name=value (repeatable); each parameter also has its own option below.")
@param_options()
@config_option("temperature")
@config_option("top_k")
@config_option("top_p")
@prompt_options
@turns_option
@compile_option
@kernels_option()
@config_option("out")
@config_option("checkpoint")
@config_option("skip_missing")
@config_option("executor", help=f"{RunConfig.field('executor').metadata['help'].rstrip('.')}: {_served()}.")
@config_option("devices")
@config_option("timeout")
@config_option("join_timeout")
@click.pass_context
def run(ctx, param_pairs, compile_mode, **options):
    """Decode prompts with one method, check each output against greedy AR, record each sample.

    \b
    Example:
      spd-bench run --method spd --n 8 --ls 4 --limit 10
    """
    from harness.bench.runner import run as run_config

    names = {f.name for f in fields(RunConfig)}  # the run's own options; the rest are the method's parameters
    named = {k: v for k, v in options.items() if k not in names and v is not None}
    config = RunConfig(**{k: v for k, v in options.items() if k in names}, compile=compile_mode,
                       params={**_params(param_pairs), **_method_options(ctx.args), **named})
    path = run_config(config)
    if path is not None:  # a torchrun stage rank writes nothing
        click.echo(f"results: {path}")


@main.command()
@click.option("--method", default=FLAGSHIP, show_default=True,
              type=click.Choice(parity_methods()))
@param_options(only=tuple(p for name in parity_methods() for p in REGISTRY[name].training_params))
@prompt_options
@config_option("checkpoint")
def parity(method, model, datasets, max_new_tokens, limit, seed, device, dtype, data_dir, simulate, checkpoint,
           **named):
    """Check a drafter predicts alike in training and in decoding; exit 1 on a disagreement.

    Its predictions on the greedy AR output, through the training layout and through decoding, as its family compares
    them.

    \b
    Example:
      spd-bench parity --method spd --n 4 --ls 1 --limit 3
    """
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
@config_option("top_k", help="Top-k of the T>0 points (0: off; the paper samples with 50).")
@config_option("top_p", help="Top-p of the T>0 points (the paper samples with 0.95).")
@prompt_options
@turns_option
@compile_option
@kernels_option()
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Results root (default results/): records go to <root>/<model>/<method>.jsonl, or with --shard, "
                   "--per-dataset and in --plan's commands to <root>/<model>/<method>/<work item>.jsonl.")
@click.option("--plan", "show_plan", is_flag=True,
              help="Print the work items' `spd-bench run` commands, one per line, largest first; run nothing.")
@click.option("--json", "as_json", is_flag=True,
              help="With --plan: a JSON list (index, name, shard, cost, out, command).")
@click.option("--per-dataset", is_flag=True,
              help="One work item per configuration and dataset (not per configuration).")
@click.option("--shard", default=None, help="I/N: only the work items of shard I of N (balanced by cost; N jobs with "
                                            "the same options cover the grid once).")
@click.option("--missing", is_flag=True, help="With --plan: only the items whose records under --results are "
                                              "incomplete (a second wave reruns just those).")
def sweep(preset, methods, widths, temperatures, top_k, top_p, model, datasets, max_new_tokens, limit, seed, device,
          dtype, data_dir, turns, compile_mode, kernels, results, simulate, show_plan, as_json, per_dataset, shard,
          missing, **param_values):
    """Run a grid of configurations, resumable, with one progress bar; trains nothing.

    With --plan, print its work items for a cluster scheduler; with --shard I/N, run one shard of them.

    \b
    Example:
      spd-bench sweep --preset paper --simulate --limit 10
    """
    from harness.bench.config import RunConfig, single_turn_sets, validate
    from harness.bench.plan import incomplete, parse_shard, plan
    from harness.bench.plan import shard as shard_of
    from harness.bench.sweep import configs, grid
    from harness.bench.sweep import sweep as run_sweep
    from harness.reporting.paper import paper_grid

    if (preset is None) == (methods is None):
        raise click.UsageError("pass either --preset paper or --method LIST")
    if (missing or as_json) and not show_plan:
        raise click.UsageError("--missing and --json shape the printed plan; add --plan")
    if preset:
        points = paper_grid()
    else:
        values = list_values(param_values)
        points = grid(_values(methods, str), values, _values(temperatures, float), _values(widths), (top_k, top_p))
    base = RunConfig(model=model, datasets=datasets, max_new_tokens=max_new_tokens, limit=limit, seed=seed,
                     device=device, dtype=dtype, data_dir=data_dir, simulate=simulate, compile=compile_mode,
                     turns=turns, kernels=kernels)
    single_turn_sets(base)
    root = results or Path("results")
    index, count = parse_shard(shard) if shard is not None else (1, 1)
    items = plan(points, base, per_dataset)
    for item in items:  # a plan of items that could never run is bad input, before anything is printed or run
        validate(item.config(base, root))
    mine = shard_of(items, index, count)
    if show_plan:
        _print_plan(incomplete(mine, base, root) if missing else mine, items, base, root, count, as_json)
        return
    if shard is not None or per_dataset:
        jobs = {item.label(): item.config(base, root) for item in mine}
        click.echo(f"shard {index}/{count}: {len(mine)} of {len(items)} work items")
        if not jobs:
            return
    else:
        jobs = configs(points, base)
    outcome = run_sweep(jobs, base, results)
    ran = sum(1 for done in outcome.ran.values() if done)
    click.echo(f"{len(outcome.ran)} of {len(jobs)} configurations complete ({ran} ran now); "
               f"results: {', '.join(str(f) for f in sorted(outcome.files)) or 'none'}")
    reasons: dict[str, list[str]] = {}
    for skip in outcome.skipped:
        reasons.setdefault(skip.reason, []).append(skip.label)
    for reason, labels in reasons.items():
        click.echo(f"skipped {len(labels)}: {reason}\n  " + "\n  ".join(labels))
    if outcome.skipped:
        raise SystemExit(1)


def _print_plan(shown, items, base, root, count, as_json):
    """The plan's items (`shown`: a shard's, or its incomplete ones) with their index in the whole plan and shard."""
    import json

    from harness.bench.plan import assign

    where = {item: (index, owner) for index, (item, owner) in enumerate(zip(items, assign(items, count)), 1)}
    entries = [{"index": where[item][0], "name": item.name, "label": item.label(), "shard": where[item][1],
                "cost": round(item.cost), "out": str(item.out(base, root)), "command": item.command(base, root)}
               for item in shown]
    if as_json:
        click.echo(json.dumps(entries, indent=1))
    else:
        for entry in entries:
            click.echo(entry["command"])
