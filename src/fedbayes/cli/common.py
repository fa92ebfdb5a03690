"""What the commands share: reading configs, checking the output folder, running one run with its
errors mapped to exit codes, printing the table."""

from __future__ import annotations

import sys
from pathlib import Path

from fedbayes.cli import progress
from fedbayes.cli.base import CommandContext, fail
from fedbayes.config.schema import ConfigError, RunConfig, apply_overrides, read_toml, stored_meaning, validate
from fedbayes.runs import folder as run_folder
from fedbayes.runs import report

LOG_HELP = "also log to csv (metrics.csv), tensorboard or wandb (repeatable; the last two are optional extras)"
SEEDS_HELP = "run every variant with these seeds and report mean and std: a count N (seeds 0..N-1) or a list such as 0,3,7; default: the comparison file's `seeds`, else each config's own seed"


def number_in(option: str, low: float, high: float = float("inf")):
    """A typer callback that refuses a value of ``option`` outside ``[low, high]`` or NaN (one line, exit 2)."""
    import math

    def check(value):
        if value is not None and (math.isnan(value) or not low <= value <= high):
            upper = "" if math.isinf(high) else f" and <= {high:g}"
            fail(f"error: {option}: must be a number >= {low:g}{upper}; got {value}")
        return value

    return check


def check_out(out: Path, overwrite: bool, resume: bool = False, what: str = "run") -> None:
    """Refuses an output folder that another process is writing (exit 5, naming it), and an
    existing non-empty one unless told to overwrite or resume it (its lock file does not count)."""
    from fedbayes.runs import runlock

    if out.is_dir() and (out / runlock.LOCK_NAME).exists():
        with runlock.hold(out, what):  # held by another process: one line naming its pid
            pass
    if overwrite or resume or not out.exists():
        return
    if out.is_file():
        fail(f"error: --out {out} is a file; pass a folder")
    if any(p.name != runlock.LOCK_NAME for p in out.iterdir()):
        hint = f"`fedbayes resume {out}` to continue it" if what == "run" else "--resume to continue it"
        fail(f"error: {out} is not empty (an earlier {what}?); pass --overwrite to replace it, {hint}, or choose another --out")


DETERMINISTIC_GPU_FLAG = "--xla_gpu_deterministic_ops=true"


def gpu_repeatability_note(backend: str, xla_flags: str) -> str | None:
    """The line a run on a GPU prints once when XLA may sum in a different order from one run to
    the next (``backend`` as :func:`jax.default_backend` names it, ``xla_flags`` the environment's
    ``XLA_FLAGS``); ``None`` on a CPU, or with XLA's deterministic GPU kernels asked for."""
    name = DETERMINISTIC_GPU_FLAG.split("=")[0]
    given = [f.partition("=") for f in xla_flags.split() if f.partition("=")[0] == name]
    if backend != "gpu" or (given and given[-1][2].lower() in ("", "true", "1")):  # the last one counts, as for XLA
        return None
    return (
        "note: on a GPU two runs of one config, or a resumed run and an uninterrupted one, can end a little apart; "
        f"XLA_FLAGS={DETERMINISTIC_GPU_FLAG} makes them repeat bit for bit, at about 3/4 of the rounds per second (docs/gpu.md)"
    )


def _note_gpu_repeatability(ctx: CommandContext) -> None:
    import os

    import jax

    if "gpu_repeatability" not in ctx.noted and (line := gpu_repeatability_note(jax.default_backend(), os.environ.get("XLA_FLAGS", ""))) is not None:
        ctx.noted.add("gpu_repeatability")
        print(line, file=sys.stderr, flush=True)


def load(path: Path, overrides: list[str], stored: bool = False) -> RunConfig:
    """The validated config of a run file with ``--set`` overrides; a bad one exits 2 with one line.
    ``stored``: the file is a run folder's config.toml, read as it meant when written (:func:`stored_meaning`)."""
    try:
        raw = read_toml(path)
        return validate(apply_overrides(stored_meaning(raw) if stored else raw, overrides))
    except ConfigError as exc:
        fail(str(exc))


def run_one(
    ctx: CommandContext,
    config: RunConfig,
    out: Path,
    resume: bool = False,
    logs: list[str] | None = None,
    stderr: bool = False,
    accept_changes=(),
    *,
    diverged_ok: bool = False,
    reporter=None,
    warn=None,
) -> dict:
    """Runs (or resumes) one experiment into ``out`` and returns its summary; a diverged run is
    exit 3 (or, with ``diverged_ok``, a ``diverged:`` line and its summary); a missing dataset
    exit 3; a config error exit 2. ``reporter``: the progress display (default: bar or lines,
    with the loggers of ``logs``); ``warn``: where the run's warning lines go (default stderr).
    JAX's compilation during the run, which the run's ``seconds`` leave out, goes to
    ``ctx.compile_seconds`` (:func:`with_compile_seconds`)."""
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs import loop
    from fedbayes.runs.compile_clock import CompileClock
    from fedbayes.runs.health import Diverged

    ctx.folder = out
    _note_gpu_repeatability(ctx)
    try:
        # overwrite: the command has checked the folder already (check_out, or a comparison's own rule)
        with CompileClock() as compiling:
            summary = loop.run_experiment(
                config,
                out,
                resume=resume,
                overwrite=True,
                reporter=reporter or progress.reporter(out, logs, config, stderr),
                accept_changes=accept_changes,
                warn=warn,
            )
        ctx.compile_seconds[Path(out)] = compiling.seconds
        return summary
    except Diverged as exc:
        if not diverged_ok:
            raise  # one line and exit 3 (the top-level handler)
        print(f"diverged: {exc}", file=sys.stderr, flush=True)
        return run_folder.read_summary(out)
    except DatasetNotFoundError as exc:
        fail(f"data error: {exc}", code=3)
    except ConfigError as exc:
        fail(str(exc))
    except Exception as exc:
        from fedbayes.runs.limits import raise_if_too_large

        raise_if_too_large(config, exc)  # one line naming the config's sizes (exit 2)
        raise


def with_compile_seconds(summaries: dict[str, dict], folders: dict[str, Path], ctx: CommandContext) -> dict[str, dict]:
    """The summaries to print, each run this command ran with its ``compile_seconds`` (the
    tables' "compile s"); ``folders``: each summary's run folder."""
    seconds = {name: ctx.compile_seconds.get(Path(folder)) for name, folder in folders.items()}
    return {name: s if seconds.get(name) is None else {**s, "compile_seconds": seconds[name]} for name, s in summaries.items()}


def records(out: Path) -> list[dict]:
    """A run's metrics.jsonl records (for the table's curve summaries)."""
    return run_folder.read_metrics(out / run_folder.METRICS)


def print_table(
    summaries: dict[str, dict], threshold: float = 0.8, curves: dict[str, list[dict]] | None = None, title: str | None = None, full: str = "--json"
) -> None:
    """Prints the table to fit the terminal (:mod:`fedbayes.runs.report`).

    "rounds to" is the first evaluated round whose accuracy reaches ``threshold`` (as in
    "Federated Learning via Posterior Averaging", Al-Shedivat et al. 2021, Table 3). The "marg."
    columns are the marginalised predictions of the Bayesian methods, shown only when one has them.
    """
    print(report.render(summaries, threshold=threshold, curves=curves, title=title, full=full), end="", flush=True)
