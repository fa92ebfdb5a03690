"""``fedbayes compare`` and ``fedbayes sweep``: the commands, their progress and their output.
The orchestration is :mod:`fedbayes.runs.compare` and :mod:`fedbayes.runs.sweep`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedbayes.cli import progress
from fedbayes.cli.base import CommandContext, console, fail, handled
from fedbayes.cli.common import LOG_HELP, SEEDS_HELP, check_out, number_in, print_table, run_one, with_compile_seconds
from fedbayes.config.schema import ConfigError, RunConfig
from fedbayes.runs import folder as run_folder
from fedbayes.runs import report

__all__ = ["SWEEP_HELP", "compare", "resume_comparison", "resume_sweep", "sweep"]


def _or_fail(read: Callable[[], object]):
    """``read()``, a bad config or comparison file ending the command with its one line (exit 2)."""
    try:
        return read()
    except ConfigError as exc:
        fail(str(exc))


def _seeds_option(text: str) -> list[int]:
    from fedbayes.runs.sweep import parse_seeds

    return _or_fail(lambda: parse_seeds(text))


def _print_reference(summaries, curves, reference, full: str) -> None:
    if reference is None:
        return
    cols, rows = report.reference_table(summaries, curves, reference)
    print(report.render_rows(cols, rows, title=f"beside the paper: {reference.source}", full=full), end="", flush=True)


def _title(configs: list[Path], runs: dict[str, RunConfig]) -> str:
    """What was run, for the plots (:func:`fedbayes.runs.compare.describe`)."""
    from fedbayes.runs import compare as cmp

    return cmp.describe(configs[0].stem if len(configs) == 1 else "comparison", runs)


@handled
def compare(
    ctx: CommandContext,
    configs: Annotated[list[Path], typer.Argument(help="a comparison TOML ([base] + [variants.NAME]) or several run TOMLs")],
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("runs/compare"),
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key in every variant (key=value) or in one (VARIANT.key=value)")] = None,
    threshold: Annotated[float, typer.Option(help="accuracy threshold for the rounds-to column", callback=number_in("--threshold", 0, 1))] = 0.8,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the comparison already in --out")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue the comparison in --out: finished variants are not rerun")] = False,
    rerun: Annotated[
        Optional[list[str]],
        typer.Option(
            "--rerun",
            help="with --resume: run this variant again from its start, its runs replaced, the others kept (after --set VARIANT.key=value); repeatable",
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="print the summaries as one JSON object (progress goes to stderr)")] = False,
    log: Annotated[Optional[list[str]], typer.Option("--log", help=LOG_HELP)] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help=SEEDS_HELP)] = None,
    shift: Annotated[
        bool,
        typer.Option(
            "--shift",
            help="then evaluate every run under dataset shift (rotation, noise, blur, contrast; a [shift] table's kinds = [...] picks some): OUT/shift.md, shift.json, shift.png",
        ),
    ] = False,
    conformal: Annotated[
        Optional[float],
        typer.Option(
            "--conformal",
            help="ALPHA: conformal prediction sets at coverage 1 - ALPHA for every variant (evaluation.conformal_alpha; each run's conformal.json): coverage and set-size columns",
        ),
    ] = None,
    personal: Annotated[
        Optional[float],
        typer.Option(
            "--personal",
            help="FRACTION: every client keeps FRACTION of its examples as its own test set (evaluation.personal_fraction; each run's personal.json): "
            "global against personalised accuracy columns over clients",
        ),
    ] = None,
):
    """Run several methods or configs and print one table and one overlaid plot.

    With seeds (`seeds = [0, 1, 2]` in the comparison file, or --seeds 3) every variant runs once
    per seed, each run in its own folder OUT/VARIANT/seed_S/, and the table, compare.json and the
    plot show the mean and standard deviation over the seeds (the plot: the mean curve in a band
    of +-1 standard deviation).

    --conformal ALPHA sets evaluation.conformal_alpha for every variant: each client keeps
    evaluation.calibration_fraction of its training examples for calibration, and after the last
    round each run's conformal.json holds the sets' coverage and size on the test set; the table
    gets coverage and set-size columns.

    --personal FRACTION sets evaluation.personal_fraction for every variant: each client keeps
    FRACTION of its examples as its own test set, and after the last round each run's
    personal.json scores the global model and the client's personalised one there (a site
    method's q_g t_k^w, otherwise the global fine-tuned on the client's data); the table gets the
    mean accuracy over clients of both and the worst 10% of clients' personalised accuracy."""
    from fedbayes.runs import compare as cmp

    if overwrite and resume:
        fail("error: --overwrite and --resume exclude each other")
    if conformal is not None:
        if not 0 < conformal < 1:
            fail(f"error: --conformal: the miscoverage alpha must be in (0, 1), e.g. 0.1 for 90% sets; got {conformal}")
        set_ = [*(set_ or []), f"evaluation.conformal_alpha={conformal!r}"]
    if personal is not None:
        if not 0 < personal < 1:
            fail(f"error: --personal: the fraction of each client's examples kept as its own test set must be in (0, 1), e.g. 0.2; got {personal}")
        set_ = [*(set_ or []), f"evaluation.personal_fraction={personal!r}"]
    # a resumed comparison keeps each variant's earlier --set (comparison.toml), but for a variant run again
    remembered = {v: items for v, items in _or_fail(lambda: cmp.stored_overrides(out)).items() if v not in (rerun or ())} if resume else {}
    runs, overrides = _or_fail(lambda: cmp.load_comparison_with_overrides(configs, set_ or [], remembered))
    unknown = [v for v in rerun or [] if v not in runs]
    if unknown:
        fail(f"error: --rerun {unknown[0]}: not a variant of this comparison; allowed: {', '.join(runs)}")
    if rerun and not resume:
        fail("error: --rerun replaces variants of the comparison in --out: pass --resume with it")
    seed_list = _seeds_option(seeds) if seeds is not None else _or_fail(lambda: cmp.file_seeds(configs))
    check_out(out, overwrite, resume, what="comparison")
    title = _title(configs, runs)
    reference = _or_fail(lambda: cmp.file_reference(configs, list(runs)))
    kinds = _or_fail(lambda: cmp.file_shift(configs))
    if shift and kinds is None:
        from fedbayes.data.shift import SHIFTS

        kinds = SHIFTS
    _run_comparison(
        ctx,
        runs,
        out,
        resume=resume,
        logs=log,
        json_out=json_,
        title=title,
        threshold=threshold,
        seeds=seed_list,
        reference=reference,
        shift=kinds,
        rerun=tuple(rerun or ()),
        overrides=overrides,
        remembered=remembered,
    )


def resume_comparison(ctx: CommandContext, out: Path, logs=None) -> None:
    """Continues the comparison in ``out`` from its comparison.toml."""
    from fedbayes.runs import compare as cmp

    files = [out / run_folder.COMPARISON]
    runs, overrides = _or_fail(lambda: cmp.load_comparison_with_overrides(files, []))
    seeds = _or_fail(lambda: cmp.file_seeds(files))
    reference = _or_fail(lambda: cmp.file_reference(files, list(runs)))
    kinds = _or_fail(lambda: cmp.file_shift(files))
    _run_comparison(ctx, runs, out, resume=True, logs=logs, seeds=seeds, reference=reference, shift=kinds, overrides=overrides)


def _run_comparison(
    ctx: CommandContext,
    runs: dict[str, RunConfig],
    out: Path,
    *,
    resume: bool = False,
    logs=None,
    json_out: bool = False,
    title: str = "comparison",
    threshold: float = 0.8,
    seeds: list[int] | None = None,
    reference=None,
    shift=None,
    rerun: tuple[str, ...] = (),
    overrides=None,
    remembered=None,
) -> None:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs import compare as cmp
    from fedbayes.runs.strictjson import dumps_record

    say = (lambda s: print(s, file=sys.stderr, flush=True)) if json_out else (lambda s: console.print(s, highlight=False, soft_wrap=True, markup=False))
    reference, note = cmp.applicable_reference(reference, runs)
    if note:
        say(note)
    for variant, items in (remembered or {}).items():
        if items and variant in runs:
            say(f"{variant}: runs with its earlier --set {' '.join(items)} (kept in {out / run_folder.COMPARISON}; --rerun {variant} runs it as the file says)")
    if resume:  # a run folder holding another config is never overwritten (nor mixed in silently), unless named by --rerun
        planned = cmp.jobs(runs, out, seeds)
        for job in planned:
            if job.variant in rerun and job.folder.exists():
                shutil.rmtree(job.folder)
        bad = cmp.conflicts(planned)
        if bad:
            variant = next(j.variant for j in planned if j.folder == bad[0])
            fail(
                f"error: {bad[0]} holds a run of a different config; pass --rerun {variant} to run that variant again "
                "(the other variants are kept), or choose another --out"
            )
    ctx.hold(out, "compare")
    ctx.resume_target = out  # an interrupted run: `fedbayes resume OUT` continues the comparison

    warned: list[str] = []  # the runs' warning lines, said after the table (a run that ended before its fixed point: in the table instead)

    def one(cfg: RunConfig, folder: Path, resume_run: bool) -> dict:
        shown = progress.reporter(folder, logs, cfg, json_out, per_round=False)  # a bar per run, or one line at its end
        return run_one(ctx, cfg, folder, resume=resume_run, logs=logs, stderr=json_out, diverged_ok=True, warn=warned.append, reporter=shown)

    shifting = progress.StepsBar("shift (evaluations)", stderr=json_out)
    try:
        result = cmp.run_comparison(
            runs, out, one, seeds=seeds, resume=resume, reference=reference, threshold=threshold, title=title, say=say, shift=shift, overrides=overrides,
            shift_progress=shifting.update,
        )  # fmt: skip
    except DatasetNotFoundError as exc:
        fail(f"data error: {exc}", code=3)
    except ConfigError as exc:
        fail(str(exc))
    finally:
        shifting.close()
    if json_out:
        print(dumps_record(result.body), flush=True)
    else:
        changed = result.overrides
        shown = result.summaries if seeds else with_compile_seconds(result.summaries, {v: out / v for v in result.summaries}, ctx)
        print_table(cmp.marked(shown, changed), threshold, cmp.marked(result.curves, changed), title=result.title, full=f"{result.markdown} and --json")
        if changed:
            console.print(cmp.overrides_note(changed, list(shown)), highlight=False, soft_wrap=True, markup=False)
        _print_reference(result.summaries, result.curves, reference, full=f"{result.markdown}")
        console.print(f"table: {result.markdown}  plot: {result.plot}", highlight=False, soft_wrap=True)
    from fedbayes.runs.health import comparison_warnings

    for line in comparison_warnings(warned):  # on stderr, as a single run's; not a run ending before its fixed point (the table says)
        print(line, file=sys.stderr, flush=True)
    if result.shift is not None:
        say(f"shift table: {result.shift.markdown}  {result.shift.json}  plot: {result.shift.plot}")
    if result.diverged:
        fail(f"error: diverged: {', '.join(result.diverged)} (see their rows; each kept its last good checkpoint for fedbayes resume DIR --set ...)", code=3)


# ----- sweeps -----------------------------------------------------------------------------------

SWEEP_HELP = r"""Run a grid of settings, several seeds each; tables of every cell and of the best cell per method.

CONFIG is a run TOML or a comparison TOML ([base] + [variants.NAME]); the grid applies to every
variant. Every combination of --grid values is a cell; every (variant, cell, seed) is its own run
folder OUT/VARIANT/CELL/seed_S/. For example: `fedbayes sweep CONFIG --grid algorithm.delta=0.1,1,10
--grid client.epochs=1,2,5 --seeds 3`.

--grid KEY=V1,V2,...: any config key (`fedbayes config` lists them); values read as TOML (strings
may be bare; brackets keep commas: model.hidden=[100],[200,100]); VARIANT.KEY=... sweeps a key in
one variant only (e.g. feddyn.algorithm.alpha=...). A key that is not a setting of some variant it
applies to is an error.

--seeds N | S1,S2,...: N seeds (0..N-1) or these seeds; default the comparison file's `seeds`,
else each config's own seed. Cells are compared on their mean over seeds.

--select-on validation (the default) chooses each method's best cell on a validation split held
out from every client's training data (data.validation_fraction; when the config holds out
nothing, --validation-fraction, default 0.1); the test metrics are reported beside it. The split
is taken per client after partitioning, seeded, so the federation is the one a run without it
gets. --select-on test chooses on the test set, as the papers do; the output says so.

A cell's score: its mean accuracy over rounds R-2..R (Swaroop et al. 2025, Table 1), averaged
over seeds (regression: the lowest MSE); a cell with a diverged seed is never chosen. The tables
also give the max accuracy over R-2..R and the rounds to --threshold (mean±std over seeds, the
sample standard deviation). They are printed and written to OUT/sweep.md and OUT/sweep.json.

Nothing is overwritten: a non-empty OUT needs --resume (or `fedbayes resume OUT`), which runs
only what is missing (finished runs are not rerun, an interrupted run continues from its
checkpoint; new grid values or seeds are added), or --overwrite. Bad input (an unknown key, a
value the key does not allow, an empty grid) is one line naming it, exit code 2, before any run.
"""


@handled
def sweep(
    ctx: CommandContext,
    config: Annotated[Path, typer.Argument(help="a run TOML or a comparison TOML ([base] + [variants.NAME])")],
    grid: Annotated[Optional[list[str]], typer.Option("--grid", help="KEY=V1,V2,... (repeatable; VARIANT.KEY=... for one variant)")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="N (seeds 0..N-1) or S1,S2,...; default the file's `seeds`, else the config's seed")] = None,
    select_on: Annotated[
        str, typer.Option("--select-on", help="validation (default: a split held out from the training data) or test (as the papers)")
    ] = "validation",
    validation_fraction: Annotated[
        Optional[float],
        typer.Option("--validation-fraction", help="data.validation_fraction for every variant (default: the config's, else 0.1 when selecting on validation)"),
    ] = None,
    threshold: Annotated[float, typer.Option(help="accuracy threshold for the rounds-to column", callback=number_in("--threshold", 0, 1))] = 0.8,
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/sweep_<config name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key in every variant (key=value) or in one (VARIANT.key=value)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the sweep already in --out")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue the sweep in --out: finished runs are not rerun")] = False,
):
    from fedbayes.runs import compare as cmp
    from fedbayes.runs import sweep as sw

    if overwrite and resume:
        fail("error: --overwrite and --resume exclude each other")
    if select_on not in sw.SELECT_ON:
        fail(f"error: --select-on {select_on!r}: allowed: {', '.join(sw.SELECT_ON)}")
    runs = _or_fail(lambda: cmp.load_comparison([config], set_ or []))
    seed_list = _seeds_option(seeds) if seeds is not None else _or_fail(lambda: cmp.file_seeds([config]))
    runs = _or_fail(lambda: sw.with_validation_fraction(runs, select_on, validation_fraction))
    out = out or Path("runs") / f"sweep_{config.stem}"
    spec = {"grid": list(grid or []), "select_on": select_on, "threshold": threshold, "title": config.stem}
    if seed_list is not None:
        spec["seeds"] = seed_list
    _sweep(ctx, runs, spec, out, overwrite=overwrite, resume=resume)


def resume_sweep(ctx: CommandContext, out: Path) -> None:
    """Continues the sweep in ``out`` from its sweep.toml."""
    from fedbayes.runs import sweep as sw

    runs, spec = _or_fail(lambda: sw.load_sweep(out))
    _sweep(ctx, runs, spec, out, resume=True)


def _sweep(ctx: CommandContext, runs: dict[str, RunConfig], spec: dict, out: Path, *, overwrite: bool = False, resume: bool = False) -> None:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs import sweep as sw

    plan = _or_fail(lambda: sw.prepare(runs, spec))
    check_out(out, overwrite, resume, what="sweep")
    if resume:
        bad = sw.conflicts(plan.cells, plan.seeds_of, out)
        if bad:
            fail(f"error: {bad[0]} holds a run of a different config (the sweep's settings changed?); pass --overwrite to replace the sweep, or another --out")
    ctx.hold(out, "sweep")
    if overwrite and out.is_dir():
        sw.clear(out)
    shown: list[progress.SweepProgress] = []

    def start(total: int, finished_before: int) -> None:
        axes_text = " x ".join(f"{a.label} ({len(a.values)})" for a in plan.axes)
        console.print(
            f"sweep: {len(runs)} variant(s), grid {axes_text}: {len(plan.cells)} cell(s), {total} run(s), {finished_before} finished earlier",
            highlight=False,
            markup=False,
        )
        shown.append(progress.SweepProgress(total))
        ctx.resume_target = out

    def one(cfg: RunConfig, folder: Path, resume_run: bool) -> dict:
        cell = next(c for c in plan.cells if c.folder(out, cfg.seed) == folder)
        return run_one(ctx, cfg, folder, resume=resume_run, diverged_ok=True, reporter=shown[0].reporter(plan.label(cell, cfg.seed)))

    try:
        result = sw.run_sweep(plan, out, one, on_start=start, on_skip=lambda cell, seed: shown[0].skip(plan.label(cell, seed)))
    except DatasetNotFoundError as exc:
        fail(f"data error: {exc}", code=3)
    except ConfigError as exc:
        fail(str(exc))
    finally:
        for display in shown:
            display.close()
    ctx.resume_target = None
    print(result.tables.render(full=str(result.markdown)), end="", flush=True)
    console.print(f"tables: {result.markdown}  {result.json}", highlight=False, soft_wrap=True)
