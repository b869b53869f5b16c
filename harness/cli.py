"""`spd-bench` command line: parses options and calls the harness; every bad input exits 2 with one line."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from harness.data import DATASETS
from harness.errors import HarnessError
from harness.models import DEFAULT_MODEL


class _Group(click.Group):
    """Turns usage errors and HarnessError into `error: <one line>` on stderr and exit code 2."""

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
    try:
        return [kind(v.strip()) for v in text.split(",") if v.strip()]
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


@click.group(cls=_Group)
def main():
    """Benchmark and reproduction harness for lossless speculative decoding."""
    _quiet_libraries()


model_option = click.option("--model", default=DEFAULT_MODEL, show_default=True,
                            help="Embedded model name, a local HF folder, or a hub id.")
device_option = click.option("--device", default="cpu", show_default=True, help="cpu or cuda[:N].")
dtype_option = click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                            help="Default: float32 on CPU, bfloat16 on CUDA.")
data_option = click.option("--data-dir", default=None, help="Folder with <dataset>.jsonl files (or $SPD_BENCH_DATA).")
simulate_option = click.option(
    "--simulate", is_flag=True, help="Replay acceptance on the AR output from one teacher-forced pass instead of "
                                     "executing (exact at T=0; expected acceptance at T>0; no timings).")


def prompt_options(command):
    """The prompts, lengths, seed and device options that `run` and `sweep` share."""
    options = [
        model_option,
        click.option("--dataset", "datasets", default=",".join(DATASETS), show_default=True,
                     callback=lambda c, p, v: _datasets(v), help="Comma-separated datasets."),
        click.option("--max-new-tokens", type=int, default=128, show_default=True),
        click.option("--limit", type=int, default=None, help="First N prompts per dataset."),
        click.option("--seed", type=int, default=0, show_default=True),
        device_option, dtype_option, data_option, simulate_option,
    ]
    for option in reversed(options):
        command = option(command)
    return command


@main.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--method", default="autoregressive", show_default=True, help="Registered decoding method.")
@click.option("--param", "param_pairs", multiple=True,
              help="Method parameter name=value (repeatable); `--name value` works too for any parameter the method "
                   "declares (e.g. --fan-out 3 for ssd).")
@click.option("--n", type=int, default=None, help="Pipeline stages (pipeline methods).")
@click.option("--ls", type=int, default=None, help="Drafter decoder layers (pipeline methods).")
@click.option("--schedule", type=click.Choice(["input", "output"]), default=None, help="Drafter schedule (spd).")
@click.option("--width", type=int, default=None, help="Draft width (1 = chain).")
@click.option("--m", type=int, default=None, help="Draft depth per round (eagle3).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True, help="0 disables top-k.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@prompt_options
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Results file (default results/<model>/<method>.jsonl).")
@click.option("--checkpoint", default=None, help="Drafter checkpoint folder (methods that need one).")
@click.option("--skip-missing", is_flag=True, help="Skip datasets that cannot be found instead of failing.")
@click.option("--executor", type=click.Choice(["local", "distributed"]), default="local", show_default=True,
              help="Pipeline methods: run every stage in this process, or one process per stage (torch.distributed; "
                   "started here, or by torchrun).")
@click.option("--devices", default=None,
              help="--executor distributed: one device per stage, e.g. cuda:1,cuda:2 (default: the --device type).")
@click.option("--timeout", type=float, default=300.0, show_default=True,
              help="--executor distributed: seconds a rank may wait for another before the run fails.")
@click.pass_context
def run(ctx, method, param_pairs, n, ls, schedule, width, m, model, datasets, temperature, top_k, top_p, max_new_tokens,
        limit, seed, device, dtype, data_dir, out, checkpoint, skip_missing, simulate, executor, devices, timeout):
    """Decode benchmark prompts, check losslessness, append one record per sample."""
    from harness.runner import RunConfig
    from harness.runner import run as run_config

    named = {"n": n, "ls": ls, "schedule": schedule, "width": width, "m": m}
    params = {**_params(param_pairs), **_method_options(ctx.args),
              **{k: v for k, v in named.items() if v is not None}}
    config = RunConfig(
        method=method, params=params, model=model, datasets=datasets, temperature=temperature,
        top_k=top_k, top_p=top_p, max_new_tokens=max_new_tokens, limit=limit, seed=seed, device=device, dtype=dtype,
        data_dir=data_dir, out=out, checkpoint=checkpoint, skip_missing=skip_missing, simulate=simulate,
        executor=executor, devices=devices, timeout=timeout,
    )
    path = run_config(config)
    if path is not None:  # a torchrun stage rank writes nothing
        click.echo(f"results: {path}")


@main.command()
@click.option("--method", default="spd", show_default=True, type=click.Choice(["spd", "ppsd"]))
@click.option("--n", type=int, default=None, help="Pipeline stages.")
@click.option("--ls", type=int, default=None, help="Drafter decoder layers.")
@click.option("--schedule", type=click.Choice(["input", "output"]), default=None, help="Drafter schedule.")
@prompt_options
@click.option("--checkpoint", default=None, help="Drafter checkpoint folder (default: the cache).")
def parity(method, n, ls, schedule, model, datasets, max_new_tokens, limit, seed, device, dtype, data_dir, simulate,
           checkpoint):
    """Train/decode parity of a pipeline drafter: its top-1 per (position, fill level) on the greedy AR output, through
    the training layout, the decoding engine and the replay; exits 1 on any disagreement beyond near-ties."""
    from harness.parity import check as parity_check
    from harness.parity import table
    from harness.runner import RunConfig

    if simulate:
        raise click.UsageError("parity always compares the engine with the training layout; drop --simulate")
    named = {"n": n, "ls": ls, "schedule": schedule}
    config = RunConfig(method=method, params={k: v for k, v in named.items() if v is not None}, model=model,
                       datasets=datasets, max_new_tokens=max_new_tokens, limit=limit, seed=seed, device=device,
                       dtype=dtype, data_dir=data_dir, checkpoint=checkpoint)
    found = parity_check(config)
    click.echo(table(found))
    if found.disagree:
        raise SystemExit(1)


@main.command()
@click.option("--preset", type=click.Choice(["paper"]), default=None,
              help="paper: EAGLE-3 m 3/7/15, PPSD n 4/8/16, SPD n 4/8/16 x Ls 1-4 (+ output ablation), T 0/1, width 1/4.")
@click.option("--method", "methods", default=None, help="Comma list of methods (instead of --preset).")
@click.option("--n", "n_values", default=None, help="Comma list of pipeline stages.")
@click.option("--ls", "ls_values", default=None, help="Comma list of drafter layers.")
@click.option("--schedule", "schedules", default=None, help="Comma list: input, output.")
@click.option("--m", "m_values", default=None, help="Comma list of EAGLE-3 draft depths.")
@click.option("--ttt", "ttt_values", default=None, help="EAGLE-3 head(s) by training-time-test depth (default 7).")
@click.option("--width", "widths", default="1", show_default=True, help="Comma list of draft widths.")
@click.option("--temperature", "temperatures", default="0", show_default=True, help="Comma list of temperatures.")
@prompt_options
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Results root (default results/): records go to <root>/<model>/<method>.jsonl.")
def sweep(preset, methods, n_values, ls_values, schedules, m_values, ttt_values, widths, temperatures, model, datasets,
          max_new_tokens, limit, seed, device, dtype, data_dir, results, simulate):
    """Run a grid of configurations, resumable, with one progress bar; trains nothing (missing drafters are listed)."""
    from harness.paper import paper_grid
    from harness.runner import RunConfig
    from harness.sweep import grid
    from harness.sweep import sweep as run_sweep

    if (preset is None) == (methods is None):
        raise click.UsageError("pass either --preset paper or --method LIST")
    if preset:
        points = paper_grid()
    else:
        values = {"n": _values(n_values), "ls": _values(ls_values), "schedule": _values(schedules, str),
                  "m": _values(m_values), "ttt": _values(ttt_values)}
        points = grid(_values(methods, str), values, _values(temperatures, float), _values(widths))
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


def _records(results: Path) -> list[dict]:
    """One record per sample under `results`, saying when duplicates (e.g. two runs on one file) were dropped."""
    from harness.results import load_all

    rows, dropped = load_all(results)
    if dropped:
        click.echo(f"note: {dropped} duplicate records of the same samples under {results} were counted once", err=True)
    return rows


@main.command()
@click.option("--results", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
              help="Results file or folder.")
@click.option("--format", "fmt", type=click.Choice(["markdown", "latex", "csv"]), default="markdown", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the report here instead of stdout.")
@click.option("--summary", is_flag=True, help="Only the table of acceptance and speedups per configuration (markdown).")
def report(results, fmt, out, summary):
    """Pooled metrics per configuration and dataset; with --out (markdown) also figures under <out dir>/figures."""
    from harness.metrics import summarize
    from harness.report import RENDERERS, markdown_summary, render_figures
    from harness.results import load_training

    rows = _records(results)
    if not rows:
        raise HarnessError(f"no result records under {results}; run `spd-bench run` first")
    summaries = summarize(rows)
    if summary:
        text = markdown_summary(summaries)
    elif fmt == "markdown" and out is not None:  # figures go beside the report and are embedded in it
        figures = render_figures(summaries, rows, out.parent / "figures", relative_to=out.parent,
                                 train_rows=load_training(results))
        text = RENDERERS[fmt](summaries, figures)
    else:
        text = RENDERERS[fmt](summaries)
    if out is None:
        click.echo(text, nl=False)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    click.echo(f"report: {out}")


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
    from harness.interop import import_eagle3, import_spd
    from harness.models import load_model
    from harness.target import TargetRuntime

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
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The EAGLE-3 folder to write.")
def export_head(model, ttt, checkpoint, out):
    """An EAGLE-3 head trained with --eagle-layout eagle3, in the EAGLE-3 folder format (SGLang, the EAGLE code)."""
    from transformers import AutoConfig

    from harness import checkpoints
    from harness.interop import export_eagle3
    from harness.models import load_identity, resolve_model_dir
    from methods.eagle3 import EagleParams

    tag = EagleParams(ttt=ttt, layout="eagle3").tag
    folder, _ = checkpoints.locate(load_identity(model), "eagle3", tag,
                                   f"spd-bench train --method eagle3 --ttt {ttt} --eagle-layout eagle3", checkpoint)
    text = AutoConfig.from_pretrained(resolve_model_dir(model)[1]).get_text_config()
    click.echo(f"EAGLE-3 head: {export_eagle3(folder, out, text)}")


@main.command()
@click.option("--device", default="cuda", show_default=True, help="cpu or cuda[:k].")
@click.option("--shapes", type=click.Choice(["real", "tiny"]), default="real", show_default=True,
              help="real: Qwen3.5-4B- and Qwen3-4B-shaped random models; tiny: small ones (a CPU).")
@click.option("--dtype", default=None, help="Default: bfloat16 on CUDA, float32 on CPU.")
@click.option("--prompts", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=32, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/selfcheck.jsonl"),
              show_default=True)
def selfcheck(device, shapes, dtype, prompts, max_new_tokens, out):
    """Every method lossless against AR on random models of real shapes, and AR against HF generate (no downloads)."""
    from harness import selfcheck as check
    from harness.models import default_dtype, resolve_device, resolve_dtype
    from harness.results import ResultStore

    resolve_device(device)  # a missing CUDA device fails here, in one line
    checks = check.selfcheck(device, shapes, prompts, max_new_tokens, resolve_dtype(dtype or default_dtype(device)))
    store = ResultStore(out)
    for row in check.record(checks, device):
        store.append(row)
    click.echo(check.table(checks))
    click.echo(f"records: {out}")
    if not all(c.ok for c in checks):
        raise SystemExit(1)


@main.command()
@click.option("--format", "fmt", type=click.Choice(["spec-bench", "reference"]), required=True,
              help="spec-bench: Spec-Bench answer files; reference: the reference code's per-sample JSONL (pipeline).")
@click.option("--results", type=click.Path(path_type=Path), default=Path("results"), show_default=True,
              help="Results file or folder.")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for one JSONL per configuration.")
def export(fmt, results, out):
    """Our records in another tool's format, one file per configuration."""
    from harness.export import export as write

    written, skipped = write(_records(results), fmt, out)
    click.echo(f"{len(written)} files in {out}" + (f" ({skipped} records have no {fmt} form)" if skipped else ""))


@main.command()
@click.option("--baseline", type=click.Path(path_type=Path), required=True, help="Baseline JSON (spd-bench check --write).")
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Results file or folder to check (default results/); with --rerun, the folder the rerun writes to "
                   "(default: a fresh temporary folder).")
@click.option("--tolerance", type=click.FloatRange(0, 1), default=0.1, show_default=True,
              help="Largest allowed relative drop of pooled tokens/step and acceptance rate.")
@click.option("--write", is_flag=True, help="Write the baseline from the results instead of checking.")
@click.option("--rerun", is_flag=True, help="Run the baseline's configurations again (same prompts, sampling, lengths, "
                                            "seed, dtype; drafters from the cache) and check those records.")
@click.option("--model", default=None, help="With --rerun: target to load instead of the baseline's model name.")
@device_option
@data_option
def check(baseline, results, tolerance, write, rerun, model, device, data_dir):
    """Exit 1 when acceptance fell beyond the tolerance, a sample lost losslessness, or a configuration is missing."""
    import tempfile

    from harness import check as regression
    from harness.metrics import summarize

    if write and rerun:
        raise click.UsageError("--write takes recorded results; drop --rerun")
    expected = None if write else regression.read_baseline(baseline)
    if rerun:
        results = results or Path(tempfile.mkdtemp(prefix="spd-bench-check-"))
        results.mkdir(parents=True, exist_ok=True)
        for problem in regression.rerun(expected, results, model, device, data_dir):
            click.echo(f"not rerun: {problem}")
        click.echo(f"rerun records: {results}")
    results = results or Path("results")
    rows = _records(results)
    if not rows and not rerun:
        raise HarnessError(f"no result records under {results}; run `spd-bench run` first")
    if write:
        regression.write_baseline(baseline, summarize(rows), rows)
        click.echo(f"baseline: {baseline}")
        return
    outcomes = regression.compare(expected, summarize(rows), tolerance)
    click.echo(regression.table(outcomes), nl=False)
    failed = [o for o in outcomes if not o.ok]
    click.echo(f"{len(failed)} of {len(outcomes)} configurations failed" if failed else "all configurations pass")
    if failed:
        raise SystemExit(1)


@main.command()
@click.option("--method", required=True, help="Method whose drafter to ship (spd, ppsd, eagle3).")
@click.option("--param", "param_pairs", multiple=True, help="Method parameter name=value (repeatable).")
@click.option("--n", type=int, default=None, help="Pipeline stages.")
@click.option("--ls", type=int, default=None, help="Drafter decoder layers.")
@click.option("--schedule", type=click.Choice(["input", "output"]), default=None)
@model_option
def ship(method, param_pairs, n, ls, schedule, model):
    """Copy a trained drafter from the cache into drafters/<model>/ as bf16 safetensors + config (at most 40 MiB),
    where `run` finds it when the cache has none."""
    from harness import checkpoints
    from harness.models import load_identity
    from methods.base import REGISTRY, parse_params

    if method not in REGISTRY or REGISTRY[method].drafter(parse_params(REGISTRY[method], {})) is None:
        raise click.BadParameter(f"--method must name a method with a trained drafter, got {method!r}")
    named = {"n": n, "ls": ls, "schedule": schedule}
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


@main.group()
def bench():
    """Speed benchmarks (figures go to results/bench/)."""


@bench.command("ar")
@model_option
@click.option("--dataset", default="mt_bench", show_default=True, type=click.Choice(DATASETS))
@click.option("--prompts", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@device_option
@dtype_option
@data_option
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/ar.jsonl"), show_default=True)
def bench_ar_command(model, dataset, prompts, max_new_tokens, repeats, device, dtype, data_dir, out):
    """Harness AR decode vs HF generate, alternating runs; prints the median time ratio (HF / ours)."""
    from harness.bench import bench_ar, save

    result = bench_ar(model, dataset, prompts, max_new_tokens, repeats, device, dtype, data_dir)
    save(result, out)
    click.echo(f"outputs identical to HF generate: {result.identical}")
    click.echo(f"median speed ratio (HF generate time / harness AR time) over {len(result.ratios)} pairs: "
               f"{result.median_ratio:.3f}")
    click.echo(f"record: {out}")


@bench.command("train")
@click.option("--method", "methods", default="spd,ppsd,eagle3", show_default=True, help="Comma list of drafter kinds.")
@click.option("--n", "n_values", default="8", show_default=True, help="Pipeline stages (comma list).")
@click.option("--ls", "ls_values", default=None, help="Drafter decoder layers (default: spd 4, ppsd 1).")
@click.option("--ttt", "ttt_values", default="7", show_default=True, help="EAGLE-3 training-time-test steps.")
@click.option("--seq-len", type=click.IntRange(min=8), default=256, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="Timed batches (after one warm-up).")
@model_option
@device_option
@dtype_option
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/bench/train.jsonl"), show_default=True)
def bench_train_command(methods, n_values, ls_values, ttt_values, seq_len, batch_size, steps, model, device, dtype, out):
    """Training throughput per drafter kind: teacher and drafter target tokens/s on corpus batches."""
    from harness import bench_train
    from harness.train import TrainConfig

    specs = _drafter_specs(methods, n_values, ls_values, None, ttt_values)
    config = TrainConfig(drafters=specs, model=model, seq_len=seq_len, batch_size=batch_size, device=device,
                         dtype=dtype, val_prompts=0)
    results = bench_train.bench_train(config, steps)
    bench_train.record(results, out)
    click.echo(bench_train.table(results))
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
    """One pipeline stage call on W draft branches against one: time per stage and memory per branch."""
    import torch

    from harness import bench_stage
    from harness.models import load_model
    from harness.selfcheck import build_model
    from harness.target import TargetRuntime

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
              help="Train the drafters under bf16 autocast (fp32 master weights; the teacher stays in its dtype).")
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint of each drafter.")
@model_option
@device_option
@dtype_option
def train(methods, n_values, ls_values, schedules, ttt_values, eagle_layout, aggr_bounds, tokens, epochs,
          feature_cache, seq_len, batch_size, lr, draft_vocab, save_every, val_prompts, corpus, init, autocast, resume,
          model, device, dtype):
    """Distil drafters from the frozen target on ShareGPT; one teacher pass feeds every drafter listed."""
    from harness.train import TrainConfig
    from harness.train import train as run_training

    specs = _drafter_specs(methods, n_values, ls_values, schedules, ttt_values, eagle_layout, aggr_bounds)
    shape = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in (
        ("n", n_values), ("ls", ls_values), ("schedule", schedules), ("ttt", ttt_values),
        ("aggr_bounds", aggr_bounds)) if v is not None)
    shape += "" if eagle_layout == "harness" else f" --eagle-layout {eagle_layout}"
    config = TrainConfig(drafters=specs, model=model, tokens=tokens, epochs=epochs, feature_cache=feature_cache,
                         seq_len=seq_len, batch_size=batch_size, lr=lr,
                         draft_vocab=draft_vocab, save_every=save_every, val_prompts=val_prompts, corpus=corpus,
                         init=init, autocast=autocast, device=device, dtype=dtype, resume=resume,
                         command=(f"spd-bench train --method {methods} {shape} "
                                  f"--tokens {tokens} --epochs {epochs} --seq-len {seq_len} --batch-size {batch_size} "
                                  f"--lr {lr} "
                                  f"--draft-vocab {draft_vocab} --val-prompts {val_prompts} --corpus {corpus} "
                                  f"--init {init} "
                                  f"--{'' if autocast else 'no-'}autocast --model {model} --device {device}"
                                  + (f" --dtype {dtype}" if dtype else "")))
    for folder in run_training(config):
        click.echo(f"checkpoint: {folder}")


if __name__ == "__main__":  # `torchrun ... -m harness.cli -- run ...` starts every rank this way ("--" keeps
    main()                  # torchrun from taking --n or --model for abbreviations of its own options)
