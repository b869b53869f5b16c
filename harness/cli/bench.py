"""`spd-bench bench ar|peer|dispatch|train|stage` and `selfcheck`: speed benchmarks and the self-check on random real-shape models."""

from __future__ import annotations

from pathlib import Path

import click

from harness.bench.data import DATASETS
from harness.cli import (
    _datasets,
    _values,
    compile_option,
    data_option,
    device_option,
    dtype_option,
    kernels_option,
    list_values,
    main,
    model_option,
    param_options,
)
from harness.cli.drafters import _drafter_specs


def _writable(out: Path) -> None:
    """The records file a benchmark appends to, checked before it measures (a folder or a device is refused in one
    line, not after the measurement)."""
    from harness.runtime.results import ResultStore

    ResultStore(out).load()


@main.group()
def bench():
    """Speed and engine benchmarks (figures go to results/bench/).

    \b
    Example:
      spd-bench bench ar --prompts 3
    """


@bench.command("ar")
@model_option
@click.option("--dataset", default="mt_bench", show_default=True, type=click.Choice(DATASETS))
@click.option("--prompts", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@device_option
@dtype_option
@data_option
@compile_option
@kernels_option(expose=False)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/ar.jsonl"), show_default=True)
def bench_ar_command(model, dataset, prompts, max_new_tokens, repeats, device, dtype, data_dir, compile_mode, out):
    """Harness AR against HF generate, alternating runs, and the machine's bandwidth floor.

    \b
    Example:
      spd-bench bench ar --dataset gsm8k --prompts 3 --max-new-tokens 48 --repeats 2
    """
    from harness.bench.speed_ar import bench_ar, save

    _writable(out)
    result = bench_ar(model, dataset, prompts, max_new_tokens, repeats, device, dtype, data_dir, compile_mode)
    save(result, out)
    click.echo(f"outputs identical to HF generate: {result.identical}")
    click.echo(f"median speed ratio (HF generate time / harness AR time) over {len(result.ratios)} pairs: "
               f"{result.median_ratio:.3f}")
    click.echo(f"floor: {result.weights_bytes / 1e6:.0f} MB of weights per token at a measured {result.read_gb_s:.1f} "
               f"GB/s read = {result.floor_tok_s:.1f} tok/s; harness AR {result.ours_tok_s:.1f} tok/s "
               f"({result.ours_tok_s / result.floor_tok_s:.0%} of the floor), HF generate {result.hf_tok_s:.1f} "
               f"({result.hf_tok_s / result.floor_tok_s:.0%})")
    if result.engine.get("compile"):
        click.echo(f"compiled step: {result.engine['compile']}")
    click.echo(f"record: {out}")


@bench.command("peer")
@click.option("--method", required=True, help="A method HF generate also implements (its hf_peer hook).")
@model_option
@click.option("--dataset", "datasets", default=",".join(DATASETS), show_default=True,
              callback=lambda c, p, v: _datasets(v), help="Comma-separated datasets.")
@click.option("--prompts", type=click.IntRange(min=1), default=10, show_default=True, help="Prompts per dataset.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE",
              help="A parameter of the harness's method (repeatable); HF generate runs it with the same ones.")
@device_option
@dtype_option
@data_option
@compile_option
@kernels_option(expose=False)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/peer.jsonl"), show_default=True)
def bench_peer_command(method, model, datasets, prompts, max_new_tokens, params, device, dtype, data_dir, compile_mode,
                       out):
    """A method, the harness's and HF generate's, beside both greedy decodes on the same prompts, paired.

    Prints each side's tokens/s and wall-clock ratios with 95% intervals.

    \b
    Example:
      spd-bench bench peer --method lookup --prompts 10 --param length=cost
    """
    from dataclasses import asdict

    from harness.bench import peer
    from harness.bench.dispatch import parse_configuration
    from harness.reporting.peers import table

    _, values = parse_configuration(method + ":" + ",".join(params))
    _writable(out)
    result = peer.bench_peer(method, model, list(datasets), prompts, max_new_tokens, values, device, dtype, data_dir,
                             compile_mode)
    peer.save(result, out)
    click.echo(table(asdict(result)), nl=False)
    click.echo(f"record: {out}")


@bench.command("dispatch")
@click.option("--method", "configurations", multiple=True,
              help="A configuration to count, method[:key=value,...], e.g. eagle3:m=3,width=4 (repeatable; default: "
                   "every method at its defaults, and at width 4 where it drafts trees; those without a drafter for the model are "
                   "left out).")
@model_option
@click.option("--dataset", default="gsm8k", show_default=True, type=click.Choice(DATASETS))
@click.option("--prompts", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@device_option
@dtype_option
@data_option
@kernels_option(expose=False)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/dispatch.jsonl"),
              show_default=True)
def bench_dispatch_command(configurations, model, dataset, prompts, max_new_tokens, device, dtype, data_dir, out):
    """aten ops and host syncs per token and per step for each configuration, beside HF generate.

    Exact counts from a dispatch mode: the same on every machine.

    \b
    Example:
      spd-bench bench dispatch --method eagle3:m=3,width=4
    """
    from harness.bench import dispatch

    _writable(out)
    results = dispatch.bench_dispatch(list(configurations) or dispatch.default_configurations(), model, dataset,
                                      prompts, max_new_tokens, device, dtype, data_dir, skip_missing=not configurations)
    dispatch.record(results, out)
    click.echo(dispatch.table(results), nl=False)
    click.echo(f"records: {out}")


@bench.command("train")
@click.option("--method", "methods", default=None, help="Comma list of drafter kinds (default: every trainable method).")
@param_options(lists=True, training=True)
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed batches (after one warm-up).")
@model_option
@device_option
@dtype_option
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/train.jsonl"), show_default=True)
def bench_train_command(methods, seq_len, batch_size, steps, model, device, dtype, out, **named_values):
    """Training throughput per drafter kind: teacher and drafter target tokens/s on corpus batches; under torchrun
    per rank and in total, with the scaling over a one-process record of the same global batch in --out.

    \b
    Examples:
      spd-bench bench train --method spd --n 8 --ls 4 --steps 3
      torchrun --nproc-per-node 2 -m harness.cli bench train --method spd --n 8 --ls 4 --batch-size 2
    """
    from harness.runtime.results import ResultStore
    from harness.training import speed as bench_train
    from harness.training.train import TrainConfig

    specs = _drafter_specs(methods, list_values(named_values, training=True))
    config = TrainConfig(drafters=specs, model=model, seq_len=seq_len, batch_size=batch_size, device=device,
                         dtype=dtype, val_prompts=0)
    results = bench_train.bench_train(config, steps)
    if not results:  # a rank other than 0 under torchrun: rank 0 records and reports
        return
    earlier = ResultStore(out).load() if out.exists() else []
    bench_train.record(results, out)
    click.echo(bench_train.table(results, earlier))
    click.echo(f"records: {out}")


@bench.command("stage")
@model_option
@click.option("--random", "shape", type=click.Choice(["tiny-qwen3.5", "qwen3.5-4b"]), default=None,
              help="Instead of --model: a randomly initialised Qwen3.5 of these shapes (nothing downloaded).")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="With --random: keep only this many layers (one stage of a 4B split fits in CPU memory).")
@click.option("--n", type=click.IntRange(min=1), default=4, show_default=True, help="Pipeline stages.")
@click.option("--width", "widths", default="1,4", show_default=True, help="Branches per level (comma list).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=20, show_default=True)
@device_option
@dtype_option
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/stage.jsonl"), show_default=True)
def bench_stage_command(model, shape, layers, n, widths, prompt_len, repeats, device, dtype, out):
    """One pipeline stage call on W draft branches against one: time per stage and memory per branch.

    \b
    Example:
      spd-bench bench stage --random tiny-qwen3.5 --width 1,4
    """
    import torch

    from harness.bench import speed_stage as bench_stage
    from harness.bench.selfcheck import build_model
    from harness.runtime.models import load_model
    from harness.runtime.target import TargetRuntime

    if layers is not None and shape is None:
        raise click.UsageError("--layers trims a --random model; drop it or add --random")
    widths = _values(widths)
    if 1 not in widths or min(widths) < 1:
        raise click.BadParameter("--width must list 1 (the baseline) and positive widths")
    if shape is None:
        loaded = load_model(model, device, dtype)
        net, name = loaded.model, loaded.identity.name
    else:
        torch_dtype = getattr(torch, dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
        net = build_model("qwen3_5", "tiny" if shape == "tiny-qwen3.5" else "4b", device, torch_dtype, layers=layers)
        name = f"random-{shape}" + (f"-{layers}-layers" if layers else "")
    target = TargetRuntime(net, max_len=prompt_len + max(widths) + 8)
    if n > target.num_layers:
        raise click.BadParameter(f"--n {n} exceeds the model's {target.num_layers} layers")
    results = bench_stage.bench_stages(target, name, n, widths, prompt_len, repeats)
    bench_stage.record(results, out)
    click.echo(bench_stage.table(results))
    click.echo(f"records: {out}")


@main.command()
@click.option("--device", default="cuda", show_default=True, help="cpu or cuda[:k].")
@click.option("--shapes", type=click.Choice(["real", "tiny"]), default="real", show_default=True,
              help="real: Qwen3.5-4B- and Qwen3-4B-shaped random models; tiny: small ones (a CPU).")
@click.option("--dtype", default=None, help="Default: bfloat16 on CUDA, float32 on CPU.")
@click.option("--prompts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--compile", "compile_mode", type=click.Choice(["off", "on", "auto"]), default="off", show_default=True,
              help="Also run every method through the compiled step (on CUDA: static shapes as CUDA graphs), "
                   "checked against the eager AR.")
@kernels_option(expose=False)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/selfcheck.jsonl"),
              show_default=True)
def selfcheck(device, shapes, dtype, prompts, max_new_tokens, compile_mode, out):
    """Every method against AR on random real-shape models, and AR against HF generate (no downloads).

    \b
    Example:
      spd-bench selfcheck --device cuda
    """
    from harness.bench import selfcheck as check
    from harness.runtime.models import pick_dtype, resolve_device, resolve_dtype
    from harness.runtime.results import ResultStore

    device = str(resolve_device(device))  # indexed ("cuda" -> "cuda:0"); a missing CUDA device fails here
    _writable(out)
    store, checks, torch_dtype = ResultStore(out), [], resolve_dtype(pick_dtype(dtype, device))
    for found in check.selfcheck(device, shapes, prompts, max_new_tokens, torch_dtype, compile_mode):
        store.append(check.record(found, device, torch_dtype))  # each written as it finishes: a later crash loses none
        click.echo(check.line(found))
        checks.append(found)
    click.echo(check.table(checks))
    click.echo(check.summary(checks, device, torch_dtype, compile_mode))
    click.echo(f"records: {out}")
    if not all(c.ok for c in checks):
        raise SystemExit(1)
