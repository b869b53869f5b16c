"""`spd-bench report`, `export` and `check`: what the records say, in tables, other formats and a regression gate."""

from __future__ import annotations

from pathlib import Path

import click

from harness.cli import compile_option, data_option, device_option, kernels_option, main
from harness.reporting.export import formats, formats_help
from harness.runtime.errors import HarnessError


def _records(results: Path | tuple[Path, ...]) -> list[dict]:
    """One record per sample under `results` (several paths: shards' folders, merged), saying what each path held,
    when duplicates (e.g. two runs on one file) were dropped, which files were not results files, and what code the
    records come from."""
    from harness.runtime.files import kind_of
    from harness.runtime.provenance import code_identity
    from harness.runtime.results import code_notes, load_all

    loaded = load_all(results)
    if len(loaded.sources) > 1:
        for path, files, rows in loaded.sources:
            click.echo(f"note: read {rows} records from {files} results files under {path}", err=True)
    if loaded.duplicates:
        click.echo(f"note: {loaded.duplicates} duplicate records of the same samples were counted once", err=True)
    for path in loaded.foreign:
        why = kind_of(path)
        why = f"{why}, not a regular file" if why else "no record on its first line"
        click.echo(f"note: {path} is not a results file ({why}): skipped", err=True)
    for note in code_notes(loaded.rows, code_identity()):
        click.echo(f"note: {note}", err=True)
    return loaded.rows


results_option = click.option("--results", type=click.Path(path_type=Path), multiple=True, default=(Path("results"),),
                              show_default=True, help="Results file or folder; repeat to merge several (shards' "
                                                      "folders: duplicates of a sample count once).")


def _finite(ctx, param, value: float) -> float:
    if value != value:  # NaN passes every range check
        raise click.BadParameter("must be a number between 0 and 1, got nan")
    return value


replace_option = click.option("--replace", is_flag=True, help="Overwrite files that already exist (by default a "
                                                               "command writes only new files).")


@main.command()
@results_option
@click.option("--format", "fmt", type=click.Choice(["markdown", "latex", "csv"]), default="markdown", show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Write the report here instead of stdout.")
@click.option("--summary", is_flag=True, help="Only the table of acceptance and speedups per configuration (markdown).")
@replace_option
def report(results, fmt, out, summary, replace):
    """Pooled metrics with intervals per configuration and dataset; --out also draws the figures.

    \b
    Example:
      spd-bench report --results results --out reports/results.md --replace
    """
    from harness.reporting.metrics import summarize
    from harness.reporting.render import RENDERERS, markdown_summary, render_figures
    from harness.runtime.files import Outputs
    from harness.runtime.results import load_training

    outputs = Outputs(replace)
    if out is not None:
        outputs.claim(out)  # before the records are read
    rows = _records(results)
    if not rows:
        raise HarnessError(f"no result records under {', '.join(map(str, results))}; run `spd-bench run` first")
    summaries = summarize(rows)
    if out is None:
        click.echo(markdown_summary(summaries) if summary else RENDERERS[fmt](summaries), nl=False)
        return
    # The report and its figures are rendered into a staging folder beside it and moved in together.
    with outputs.staged(out.parent) as staging:
        if summary:
            text = markdown_summary(summaries)
        elif fmt == "markdown":  # figures go beside the report and are embedded in it
            figures = render_figures(summaries, rows, staging / "figures", relative_to=staging,
                                     train_rows=load_training(results))
            text = RENDERERS[fmt](summaries, figures)
        else:
            text = RENDERERS[fmt](summaries)
        (staging / out.name).write_text(text)
    click.echo(f"report: {out}")


@main.command()
@click.option("--format", "fmt", type=click.Choice(list(formats())), required=True, help=formats_help())
@results_option
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Folder for one JSONL per configuration.")
@replace_option
def export(fmt, results, out, replace):
    """Write the records in another tool's format, one file per configuration.

    \b
    Example:
      spd-bench export --format spec-bench --out answers
    """
    from harness.reporting.export import export as write
    from harness.runtime.files import Outputs
    from harness.runtime.paths import check_out_path

    check_out_path(out, folder=True)  # before the records are read
    written, skipped = write(_records(results), fmt, out, Outputs(replace))
    click.echo(f"{len(written)} files in {out}" + (f" ({skipped} records have no {fmt} form)" if skipped else ""))


@main.command()
@click.option("--baseline", type=click.Path(path_type=Path), required=True, help="Baseline JSON (spd-bench check --write).")
@click.option("--results", type=click.Path(path_type=Path), default=None,
              help="Results file or folder to check (default results/); with --rerun, the folder the rerun writes to "
                   "(default: a fresh temporary folder).")
@click.option("--margin", type=click.FloatRange(0, 1), default=0.05, show_default=True, callback=_finite,
              help="The relative drop a figure may show: at T=0 its change, at T>0 its whole paired 95% "
                   "interval.")
@click.option("--flip-rate", type=click.FloatRange(0, 1), default=0.0, show_default=True, callback=_finite,
              help="The share of a configuration's checked samples that may end in a numerics flip (a near-tie its "
                   "verify forward and AR's one-token step round apart; a logic divergence always fails): 0 for "
                   "the committed baseline's row kernels, which keep every verify row equal to AR's step.")
@click.option("--write", is_flag=True, help="Write the baseline from the results instead of checking (runs of one "
                                            "configuration at several seeds become one entry: use 3 or more at T>0).")
@click.option("--rerun", is_flag=True, help="Run the baseline's configurations again (same prompts, sampling, lengths, "
                                            "dtype; drafters from the cache) and check those records.")
@click.option("--seed", type=int, default=None, help="With --rerun: decode with this seed instead of the baseline's "
                                                     "first (at T>0 a reseeded rerun must pass).")
@click.option("--model", default=None, help="With --rerun: target to load instead of the baseline's model name.")
@click.option("--turns", type=click.Choice(["first", "all"]), default=None,
              help="Only the configurations of this MT-Bench protocol (the first user turn, or every turn as a "
                   "conversation): with --write the records written, else the baseline entries checked and rerun "
                   "(default: every one, each rerun as its baseline says).")
@replace_option
@device_option
@data_option
@compile_option
@kernels_option(expose=False)
def check(baseline, results, margin, flip_rate, write, rerun, seed, model, device, data_dir, turns, compile_mode,
          replace):
    """The regression gate against a committed baseline; exit 1 on a drop beyond noise or a lost output.

    \b
    Example:
      spd-bench check --baseline tests/baselines/regression.json --rerun
    """
    import tempfile

    from harness.reporting import check as regression
    from harness.runtime.files import Outputs, make_folder

    if write and rerun:
        raise click.UsageError("--write takes recorded results; drop --rerun")
    if (seed is not None or compile_mode != "off") and not rerun:
        raise click.UsageError("--seed and --compile shape the rerun; add --rerun")
    outputs = Outputs(replace, what="--baseline")
    if write:
        outputs.claim(baseline)  # before the records are read
    expected = None if write else regression.of_turns(regression.read_baseline(baseline), turns, baseline)
    if rerun:
        # The rerun decodes into a folder of its own and is judged on those records alone: never on records made
        # before it (which a resumed run would keep instead of decoding) or with another drafter.
        parent = make_folder(results, "--results") if results else None
        results = Path(tempfile.mkdtemp(prefix="rerun-" if parent else "spd-bench-check-", dir=parent))
        for problem in regression.rerun(expected, results, model, device, data_dir, seed, compile_mode):
            click.echo(f"not rerun: {problem}")
        click.echo(f"rerun records: {results}")
    results = results or Path("results")
    rows = _records(results)
    if not rows and not rerun:
        raise HarnessError(f"no result records under {results}; run `spd-bench run` first")
    if write:
        rows = [row for row in rows if turns in (None, row.get("turns", "first"))]
        if not rows:
            raise HarnessError(f"no records of --turns {turns} under {results}; run with --turns {turns} first")
        for warning in regression.write_baseline(baseline, rows, outputs):
            click.echo(f"warning: {warning}", err=True)
        click.echo(f"baseline: {baseline}")
        return
    for warning in regression.seed_warnings(expected):
        click.echo(f"note: {warning}", err=True)
    outcomes = regression.compare(expected, rows, margin, flip_rate)
    click.echo(regression.table(outcomes), nl=False)
    failed = [o for o in outcomes if not o.ok]
    click.echo(f"{len(failed)} of {len(outcomes)} configurations failed" if failed else "all configurations pass")
    if failed and not rerun and all(o.verdict == "missing" for o in outcomes):
        click.echo(f"hint: no records under {results} are of the baseline's configurations (its drafters, lengths or "
                   f"prompts differ); add --rerun to decode them now", err=True)
    if failed:
        raise SystemExit(1)
