"""The ``fedbayes`` command line: run, compare, resume, config, datasets.

No math lives here: commands parse and validate configs, then call :mod:`fedbayes.runs.experiment`.
Bad configs exit with code 2 and one line naming the field and what is allowed, before any work.
Every failure is one line on stderr and a documented exit code (:mod:`fedbayes.errors`; the
handler is :func:`_handled` and :func:`main`).
"""

from __future__ import annotations

import os
import sys

from fedbayes.sim import hostdevices

# One XLA host device per core, set before JAX starts (docs/design.md, "Using every core"). A device
# count already in XLA_FLAGS is kept.
hostdevices.configure()

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Annotated, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from fedbayes import __version__  # noqa: E402
from fedbayes.config.schema import ConfigError, RunConfig, apply_overrides, deep_merge, parse_override, read_toml, same_config, validate  # noqa: E402
from fedbayes.errors import EXIT_INTERRUPTED, EXIT_UNEXPECTED, exit_code_for, one_line  # noqa: E402
from fedbayes.runs import report  # noqa: E402

CACHE_ENV = "FEDBAYES_CACHE"


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache for CLI runs; returns its folder or None.

    Compiled rounds, evaluators and initialisers are reused across processes, which cuts a
    repeated run's fixed start-up (about 7 s cold to under 3 s warm for FedAvg on Fashion-MNIST,
    docs/results/bench.md). Folder: ``$FEDBAYES_CACHE``, else ``$XDG_CACHE_HOME/fedbayes/xla``,
    else ``~/.cache/fedbayes/xla``; ``FEDBAYES_CACHE=off`` disables it. Capped at 2 GB (JAX
    evicts the least recently used entries).
    """
    import jax

    setting = os.environ.get(CACHE_ENV, "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    folder = setting or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fedbayes", "xla")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", 2 * 1024**3)
    return folder


def _progress_bar():
    """The rich progress bar of runs and sweeps: description, bar, done/total, status, time left."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console
    )


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning as Bayesian inference, in JAX.")
console = Console()
if not console.is_terminal:
    console = Console(width=report.terminal_width())  # logs and CI: $COLUMNS, else 160


def _version(value: bool):
    if value:
        print(f"fedbayes {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False,
):
    """Federated learning as Bayesian inference, in JAX."""


def _fail(message: str, code: int = 2):
    print(message, file=sys.stderr, flush=True)  # one unwrapped line, whatever the terminal width
    raise typer.Exit(code)


class RichReporter:
    """A rich progress bar (round, accuracy, ETA) for terminals."""

    def __init__(self):
        self.progress = _progress_bar()
        self.task = None

    def start(self, name, total, done):
        self.progress.start()
        self.task = self.progress.add_task(name, total=total, completed=done, status="")

    def update(self, round_idx, total, record):
        status = None
        if record is not None:
            status = f"acc {record['accuracy']:.4f}" if "accuracy" in record else f"mse {record['mse']:.5f}"
        self.progress.update(self.task, completed=round_idx, **({"status": status} if status else {}))

    def stop(self):
        self.progress.stop()


def _reporter(out: Path | None = None, logs: list[str] | None = None, config: RunConfig | None = None, stderr: bool = False):
    """The progress display (stderr when stdout is for JSON) plus the loggers of ``--log``."""
    from fedbayes.runs.experiment import PlainReporter
    from fedbayes.runs.loggers import LoggerUnavailable, Reporters, make_loggers

    if console.is_terminal and not stderr:
        progress = RichReporter()
    else:
        progress = PlainReporter(lambda s: print(s, file=sys.stderr if stderr else sys.stdout, flush=True))
    if not logs:
        return progress
    try:
        loggers = make_loggers(logs, out, config.model_dump(mode="json") if config is not None else None)
    except (ValueError, LoggerUnavailable) as exc:
        _fail(f"error: {exc}")
    return Reporters([progress, *loggers])


def _check_out(out: Path, overwrite: bool, resume: bool = False, what: str = "run") -> None:
    """Refuses an output folder that another process is writing (exit 5, naming it), and an
    existing non-empty one unless told to overwrite or resume it (its lock file does not count)."""
    from fedbayes.runs import runlock

    if out.is_dir() and (out / runlock.LOCK_NAME).exists():
        with runlock.hold(out, what):  # held by another process: one line naming its pid
            pass
    if overwrite or resume or not out.exists():
        return
    if out.is_file():
        _fail(f"error: --out {out} is a file; pass a folder")
    if any(p.name != runlock.LOCK_NAME for p in out.iterdir()):
        hint = f"`fedbayes resume {out}` to continue it" if what == "run" else "--resume to continue it"
        _fail(f"error: {out} is not empty (an earlier {what}?); pass --overwrite to replace it, {hint}, or choose another --out")


def _load(path: Path, overrides: list[str]) -> RunConfig:
    try:
        return validate(apply_overrides(read_toml(path), overrides))
    except ConfigError as exc:
        _fail(str(exc))


def _run(
    config: RunConfig, out: Path, resume: bool = False, logs: list[str] | None = None, stderr: bool = False, accept_changes=(), *, diverged_ok: bool = False
) -> dict:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs.experiment import Diverged, run_experiment

    _state["folder"] = out
    try:
        return run_experiment(config, out, resume=resume, reporter=_reporter(out, logs, config, stderr), accept_changes=accept_changes)
    except Diverged as exc:
        if not diverged_ok:
            raise  # one line and exit 3 (the top-level handler)
        print(f"diverged: {exc}", file=sys.stderr, flush=True)
        return json.loads((out / "summary.json").read_text())
    except DatasetNotFoundError as exc:
        _fail(f"data error: {exc}", code=3)
    except ConfigError as exc:
        _fail(str(exc))


LOG_HELP = "also log to csv (metrics.csv), tensorboard or wandb (repeatable; the last two are optional extras)"
SEEDS_HELP = "run every variant with these seeds and report mean and std: a count N (seeds 0..N-1) or a list such as 0,3,7; default: the comparison file's `seeds`, else each config's own seed"


# ----- the top-level handler: every failure one line and a documented exit code -----------------
_state: dict = {"folder": None, "stack": None}  # the run folder being written; locks held by the command


def _hold(folder: Path, what: str) -> None:
    """Holds ``folder``'s run lock until the command ends (see :mod:`fedbayes.runs.runlock`)."""
    from fedbayes.runs import runlock

    _state["stack"].enter_context(runlock.hold(folder, what))


def _log_traceback(exc: BaseException) -> Path | None:
    """Writes the traceback to ``<run folder>/error.log``, else a file under the user's cache."""
    import datetime
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "fedbayes" / "logs"
    candidates = [_state["folder"] / "error.log"] if _state["folder"] is not None else []
    candidates += [cache / f"error-{stamp}-{os.getpid()}.log", Path(tempfile.gettempdir()) / f"fedbayes-error-{stamp}-{os.getpid()}.log"]
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{stamp} fedbayes {' '.join(sys.argv[1:])}\n{text}\n")
            return path
        except OSError:
            continue
    return None


def describe_failure(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one line the user sees for ``exc`` (see :mod:`fedbayes.errors`)."""
    code = exit_code_for(exc)
    if code == EXIT_INTERRUPTED:
        folder = _state["folder"]
        if folder is None:
            return code, "interrupted"
        from fedbayes.runs.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(Path(folder) / "checkpoints")
        where = f"from its checkpoint {ckpt.name}" if ckpt is not None else "from the start (no checkpoint was written yet)"
        if _state.get("resume_target") is not None:  # a run of a sweep: resuming the sweep resumes it
            return code, f"interrupted; `fedbayes resume {_state['resume_target']}` continues it ({folder} {where})"
        return code, f"interrupted; `fedbayes resume {folder}` continues {where}"
    if code == EXIT_UNEXPECTED:
        log = _log_traceback(exc)
        where = f"; traceback in {log}" if log is not None else ""
        return code, f"internal error: {type(exc).__name__}: {one_line(exc)[:300]}{where} (please report it)"
    line = one_line(exc)
    if not line.startswith(("config error:", "data error:", "error:")):
        from fedbayes.errors import DivergedError

        kind = "diverged" if isinstance(exc, DivergedError) else {3: "data error", 4: "run folder error"}.get(code, "error")
        line = f"{kind}: {line}"
    return code, line


def _handled(command):
    """Runs a command under the top-level handler: a failure prints one line and exits with its
    code; the locks the command took are released."""
    import contextlib
    import functools

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            _state.update(folder=None, stack=stack, resume_target=None)
            try:
                return command(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, (SystemExit, typer.Exit, typer.Abort)) or type(exc).__module__.split(".")[0] in ("click", "typer"):
                    raise
                code, line = describe_failure(exc)
                print(line, file=sys.stderr, flush=True)
                raise typer.Exit(code) from None

    return wrapper


@app.command()
@_handled
def run(
    config: Annotated[Path, typer.Argument(help="experiment TOML file; every key: `fedbayes config`")],
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/<name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key, e.g. --set server.lr=0.5")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the run already in --out")] = False,
    log: Annotated[Optional[list[str]], typer.Option("--log", help=LOG_HELP)] = None,
):
    """Run one experiment: metrics.jsonl, summary.json, config.toml, model.npz, curves.png, checkpoints.

    Every config key, with its type, default and meaning: `fedbayes config`.

    Privacy: a [privacy] section (clip, noise_multiplier, delta, coordinates) clips every client's
    message to an L2 norm and adds Gaussian noise to the cohort's sum (needs server.weighting =
    "uniform"); metrics.jsonl then has each evaluation's epsilon at delta (dp-accounting, RDP).
    Robustness: server.aggregator = mean | median | trimmed_mean | norm_bound,
    server.max_precision_share, server.dropout, server.deadline; [attack] (fraction, kind) for
    measuring. `fedbayes config privacy` lists the keys.
    """
    cfg = _load(config, set_ or [])
    out = out or Path("runs") / cfg.name
    _check_out(out, overwrite)
    summary = _run(cfg, out, logs=log)
    _print_table({cfg.name: summary}, curves={cfg.name: _records(out)})
    console.print(f"outputs in {out}/ (metrics.jsonl, summary.json, model.npz, curves.png, checkpoints/)", highlight=False)


@app.command()
@_handled
def deploy(
    config: Annotated[Path, typer.Argument(help="experiment TOML file (as for `fedbayes run`)")],
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/<name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key, e.g. --set rounds=5")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the run already in --out")] = False,
    resume_: Annotated[bool, typer.Option("--resume", help="continue the run in --out from its newest checkpoint")] = False,
    print_commands: Annotated[
        bool, typer.Option("--print-commands", help="print the commands that start this federation on real machines (TLS) instead")
    ] = False,
    tls: Annotated[bool, typer.Option("--tls", help="run the local federation over TLS with certificates made for it")] = False,
    reply_timeout: Annotated[float, typer.Option("--reply-timeout", help="seconds a round waits for its replies")] = 120.0,
    node_timeout: Annotated[float, typer.Option("--node-timeout", help="seconds to wait for the nodes to join")] = 120.0,
    min_nodes: Annotated[int, typer.Option("--min-nodes", help="nodes to wait for before the first round (0: one per client)")] = 0,
    on_missing: Annotated[str, typer.Option("--on-missing", help="a missing reply: skip (aggregate the others) or fail")] = "skip",
):
    """Run an experiment on Flower: a SuperLink and one SuperNode per client on this machine (real
    processes on loopback), the same run folder as `fedbayes run`, every process ended at the end.

    Needs the flower extra (pip install -e '.[flower]'); examples/flower/README.md walks through it."""
    cfg = _load(config, set_ or [])
    out = out or Path("runs") / cfg.name
    try:
        from fedbayes.flower import deploy as flower_deploy
    except ImportError as exc:
        _fail(f"error: fedbayes deploy needs Flower ({exc.name or exc} is missing): pip install -e '.[flower]'")
    if print_commands and set_:
        _fail("error: --print-commands names CONFIG as written (the SuperLink reads it there); put the --set changes in the file")
    if print_commands:  # needs no Flower here: the commands run on the federation's machines
        print(flower_deploy.print_commands(config.resolve(), cfg, out.resolve()), end="")
        return
    try:
        import flwr  # noqa: F401
    except ImportError:
        _fail("error: fedbayes deploy needs Flower (flwr is missing): pip install -e '.[flower]'")
    _check_out(out, overwrite, resume_)
    from fedbayes.runs.experiment import format_record

    run_config = {"reply-timeout": reply_timeout, "node-timeout": node_timeout, "min-nodes": min_nodes, "on-missing": on_missing}
    echo = lambda r: console.print(format_record(r, cfg.rounds), highlight=False)  # noqa: E731
    summary = flower_deploy.deploy_local(cfg, out, resume=resume_, tls=tls, run_config=run_config, progress=echo)
    _print_table({cfg.name: summary}, curves={cfg.name: _records(out)})
    console.print(f"outputs in {out}/ (as fedbayes run; flower/ holds the processes' logs and the nodes' state)", highlight=False)


COMPARISON_FILE = "comparison.toml"


def _records(out: Path) -> list[dict]:
    """A run's metrics.jsonl records (for the table's curve summaries)."""
    from fedbayes.runs.experiment import read_metrics

    return read_metrics(out / "metrics.jsonl")


@app.command()
@_handled
def resume(
    out: Annotated[Path, typer.Argument(help="the folder of an interrupted run or comparison")],
    set_: Annotated[
        Optional[list[str]], typer.Option("--set", help="change a key of the run's config on purpose, e.g. --set rounds=50 (recorded in resume_changes.jsonl)")
    ] = None,
    log: Annotated[Optional[list[str]], typer.Option("--log", help=LOG_HELP)] = None,
):
    """Resume an interrupted run from its newest intact checkpoint (or a comparison: its unfinished
    variants; or a sweep: its unfinished runs, then its tables); ends as if it never stopped.

    The run's config.toml must match its checkpoint's config; a change is accepted only when given
    here with --set (and is then recorded in the folder)."""
    cfg_path = out / "config.toml"
    if not cfg_path.is_file() and (out / "sweep.toml").is_file():  # fedbayes.runs.sweep.SWEEP_FILE
        _resume_sweep(out)
        return
    if not cfg_path.is_file() and (out / COMPARISON_FILE).is_file():
        files = [out / COMPARISON_FILE]
        runs = _comparison(files, [])
        _run_comparison(runs, out, resume=True, logs=log, seeds=_file_seeds(files), reference=_file_reference(files, runs))
        return
    if not cfg_path.is_file():
        from fedbayes.runs import runlock

        if out.is_dir() and [p.name for p in out.iterdir()] == [runlock.LOCK_NAME]:  # a run's lock, nothing else
            _fail(f"error: {out} holds nothing to resume (the run stopped before it wrote its config); start it again with fedbayes run CONFIG --out {out}")
        _fail(f"error: {out} holds no config.toml or {COMPARISON_FILE}; is it a fedbayes run folder?")
    cfg = _load(cfg_path, set_ or [])
    accept = [".".join(parse_override(item)[0]) for item in set_ or []]
    summary = _run(cfg, out, resume=True, logs=log, accept_changes=accept)
    _print_table({cfg.name: summary}, curves={cfg.name: _records(out)})


def _split_overrides(overrides: list[str], variants) -> tuple[list[str], dict[str, list[str]]]:
    """``--set`` items for every variant, and those of the form ``VARIANT.key=value`` by variant."""
    common: list[str] = []
    targeted: dict[str, list[str]] = {}
    for item in overrides:
        head, _, rest = item.partition(".")
        if head in variants and rest and "=" in rest and "=" not in head:
            targeted.setdefault(head, []).append(rest)
        else:
            common.append(item)
    return common, targeted


def _comparison(files: list[Path], overrides: list[str]) -> dict[str, RunConfig]:
    """Variant name -> config, from one comparison file ([base] + [variants.*]) or several run files.

    ``--set key=value`` applies to every variant; ``--set VARIANT.key=value`` to that one only.
    """
    runs: dict[str, RunConfig] = {}
    all_overrides = overrides
    for path in files:
        try:
            raw = read_toml(path)
        except ConfigError as exc:
            _fail(str(exc))
        if "variants" in raw or "base" in raw:
            unknown = set(raw) - {"base", "variants", "seeds", "reference"}
            if unknown:
                _fail(f"config error: {path}: unknown top-level key(s) {sorted(unknown)} in a comparison file; allowed: base, variants, seeds, reference")
            variants = raw.get("variants") or {}
            if not variants:
                _fail(f"config error: {path}: variants: a comparison needs at least one [variants.NAME] table")
            overrides, targeted = _split_overrides(all_overrides, variants)
            for name, update in variants.items():
                merged = deep_merge(raw.get("base", {}), update)
                merged.setdefault("name", name)
                merged["name"] = name
                try:
                    runs[name] = validate(apply_overrides(merged, overrides + targeted.get(name, [])))
                except ConfigError as exc:
                    _fail(f"{exc} (variant {name!r})")
        else:
            cfg = _load(path, all_overrides)
            runs[cfg.name if cfg.name not in runs else f"{cfg.name}_{len(runs)}"] = cfg
    return runs


def _print_table(summaries: dict[str, dict], threshold: float = 0.8, curves: dict[str, list[dict]] | None = None) -> str:
    """Prints the table to fit the terminal (:mod:`fedbayes.runs.report`) and returns it as Markdown.

    "rounds to" is the first evaluated round whose accuracy reaches ``threshold`` (as in
    "Federated Learning via Posterior Averaging", Al-Shedivat et al. 2021, Table 3). The "marg."
    columns are the marginalised predictions of the Bayesian methods, shown only when one has them.
    """
    title = "fedbayes comparison" if len(summaries) > 1 else None
    print(report.render(summaries, threshold=threshold, curves=curves, title=title), end="", flush=True)
    return report.markdown(summaries, threshold=threshold, curves=curves)


@app.command()
@_handled
def compare(
    configs: Annotated[list[Path], typer.Argument(help="a comparison TOML (\\[base] + \\[variants.NAME]) or several run TOMLs")],
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("runs/compare"),
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key in every variant (key=value) or in one (VARIANT.key=value)")] = None,
    threshold: Annotated[float, typer.Option(help="accuracy threshold for the rounds-to column")] = 0.8,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the comparison already in --out")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue the comparison in --out: finished variants are not rerun")] = False,
    json_: Annotated[bool, typer.Option("--json", help="print the summaries as one JSON object (progress goes to stderr)")] = False,
    log: Annotated[Optional[list[str]], typer.Option("--log", help=LOG_HELP)] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help=SEEDS_HELP)] = None,
):
    """Run several methods or configs and print one table and one overlaid plot.

    With seeds (`seeds = [0, 1, 2]` in the comparison file, or --seeds 3) every variant runs once
    per seed, each run in its own folder OUT/VARIANT/seed_S/, and the table, compare.json and the
    plot show the mean and standard deviation over the seeds (the plot: the mean curve in a band
    of +-1 standard deviation)."""
    if overwrite and resume:
        _fail("error: --overwrite and --resume exclude each other")
    runs = _comparison(configs, set_ or [])
    seed_list = _seeds_option(seeds) if seeds is not None else _file_seeds(configs)
    _check_out(out, overwrite, resume, what="comparison")
    datasets = sorted({c.data.dataset for c in runs.values()})
    title = f"{configs[0].stem if len(configs) == 1 else 'comparison'} ({', '.join(datasets)})"
    reference = _file_reference(configs, runs)
    _run_comparison(runs, out, resume=resume, logs=log, json_out=json_, title=title, threshold=threshold, seeds=seed_list, reference=reference)


def _finished(cfg: RunConfig, folder: Path) -> dict | None:
    """The summary of a variant already finished in ``folder`` with this very config, else None."""
    try:
        if same_config(folder / "config.toml", cfg):
            return json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        pass
    return None


def _run_comparison(
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
) -> None:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs.experiment import prepare_data, read_metrics
    from fedbayes.runs.plotting import plot_curves

    if seeds is not None:  # every (variant, seed) its own run; mean and std over seeds
        return _run_seeded_comparison(runs, out, seeds, resume=resume, logs=logs, json_out=json_out, title=title, threshold=threshold, reference=reference)
    say = (lambda s: print(s, file=sys.stderr, flush=True)) if json_out else (lambda s: console.print(s, highlight=False, markup=False))
    if resume:  # a variant whose folder holds another config must not be mixed in silently
        for name, cfg in runs.items():
            stored = out / name / "config.toml"
            if stored.is_file() and not same_config(stored, cfg):
                _fail(f"error: {out / name} holds a run of a different config; pass --overwrite to replace it, or another --out")
    _hold(out, "compare")
    todo = {name: cfg for name, cfg in runs.items() if not (resume and _finished(cfg, out / name))}
    for name, cfg in todo.items():  # every variant's data and model are checked before any trains
        try:
            prepare_data(cfg)
        except DatasetNotFoundError as exc:
            _fail(f"data error: {exc}", code=3)
        except ConfigError as exc:
            _fail(f"{exc} (variant {name!r})")
    out.mkdir(parents=True, exist_ok=True)
    comparison = {"variants": {name: cfg.model_dump(mode="json", exclude_none=True) for name, cfg in runs.items()}}
    if reference is not None:
        comparison["reference"] = reference.model_dump(mode="json")
    (out / COMPARISON_FILE).write_text("# written by `fedbayes compare`; `fedbayes resume` continues it\n" + _toml(comparison))
    summaries = {}
    for name, cfg in runs.items():
        if name not in todo:
            say(f"== {name}: finished earlier, not rerun")
            summaries[name] = _finished(cfg, out / name)
            continue
        say(f"== {name} ({cfg.algorithm.name}, server {cfg.server.optimizer})")
        folder = out / name
        has_ckpt = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("round_*.npz"))
        summaries[name] = _run(cfg, folder, resume=resume and has_ckpt, logs=logs, stderr=json_out, diverged_ok=True)
    curves = {name: read_metrics(out / name / "metrics.jsonl") for name in runs}
    task = "regression" if any(c.data.dataset == "least_squares" for c in runs.values()) else "classification"
    plot = plot_curves(out / "compare.png", curves, title=title, task=task)
    md = report.markdown(summaries, threshold=threshold, curves=curves) + _reference_markdown(summaries, curves, reference)
    (out / "compare.md").write_text(md)
    from fedbayes.runs.strictjson import dumps_record

    (out / "compare.json").write_text(dumps_record({n: _without_numbers(s) for n, s in summaries.items()}, indent=2) + "\n")
    diverged = [n for n, s in summaries.items() if s.get("diverged")]
    if json_out:
        print(dumps_record({n: _without_numbers(s) for n, s in summaries.items()}), flush=True)
    else:
        _print_table(summaries, threshold, curves)
        _print_reference(summaries, curves, reference)
        console.print(f"table: {out / 'compare.md'}  plot: {plot}", highlight=False)
    if diverged:
        _fail(f"error: diverged: {', '.join(diverged)} (see their rows; each kept its last good checkpoint for fedbayes resume DIR --set ...)", code=3)


def _file_reference(files: list[Path], runs: dict[str, RunConfig]):
    """The ``[reference]`` table of the comparison file (a paper's numbers), else None."""
    from fedbayes.config.schema import read_reference

    found = None
    for path in files:
        try:
            raw = read_toml(path)
            if "reference" in raw and ("variants" in raw or "base" in raw):
                if found is not None:
                    _fail(f"config error: {path}: reference: only one comparison file may hold a [reference] table")
                found = read_reference(raw["reference"], path, list(runs))
        except ConfigError as exc:
            _fail(str(exc))
    return found


def _reference_markdown(summaries, curves, reference) -> str:
    if reference is None:
        return ""
    cols, rows = report.reference_table(summaries, curves, reference)
    return f"\n**Beside the paper** ({reference.source}):\n\n" + report.markdown_rows(cols, rows)


def _print_reference(summaries, curves, reference) -> None:
    if reference is None:
        return
    cols, rows = report.reference_table(summaries, curves, reference)
    print(report.render_rows(cols, rows, title=f"beside the paper: {reference.source}"), end="", flush=True)


def _without_numbers(summary: dict) -> dict:
    """A diverged variant's summary keeps its name, settings and where it diverged, not its metrics."""
    if "runs" in summary:  # over seeds: each diverged seed's run loses its numbers too
        summary = {**summary, "runs": {k: _without_numbers(v) for k, v in summary["runs"].items()}}
    if not summary.get("diverged"):
        return summary
    return {k: summary[k] for k in ("name", "algorithm", "server_optimizer", "rounds", "seeds", "diverged_seeds", "diverged", "runs") if k in summary}


def _toml(data: dict) -> str:
    import tomli_w

    return tomli_w.dumps(data)


# ----- seeds: a comparison's runs over several seeds --------------------------------------------


def _seeds_option(text: str) -> list[int]:
    from fedbayes.runs.sweep import parse_seeds

    try:
        return parse_seeds(text)
    except ConfigError as exc:
        _fail(str(exc))


def _file_seeds(files: list[Path]) -> list[int] | None:
    """The ``seeds = [...]`` of the comparison files (one list for all), else None."""
    from fedbayes.runs.sweep import check_seeds

    found: list[int] | None = None
    for path in files:
        try:
            raw = read_toml(path)
        except ConfigError as exc:
            _fail(str(exc))
        if "seeds" not in raw or not ("variants" in raw or "base" in raw):
            continue
        try:
            seeds = check_seeds(raw["seeds"], f"{path}: seeds")
        except ConfigError as exc:
            _fail(str(exc))
        if found is not None and seeds != found:
            _fail(f"config error: {path}: seeds: {seeds} differs from another file's {found}; give one list (or --seeds)")
        found = seeds
    return found


def _check_data(configs, label) -> None:
    """Loads and partitions the data of every config (each distinct data setting once) before
    any run trains: a bad data setting fails at once, naming the field."""
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs.experiment import prepare_split

    seen = set()
    for key, cfg in configs:
        ident = (cfg.seed, json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True), json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True))
        if ident in seen:
            continue
        seen.add(ident)
        try:
            prepare_split(cfg)
        except DatasetNotFoundError as exc:
            _fail(f"data error: {exc}", code=3)
        except ConfigError as exc:
            _fail(f"{exc} ({label(key)})")


def _run_seeded_comparison(runs: dict[str, RunConfig], out: Path, seeds: list[int], *, resume, logs, json_out, title, threshold, reference=None) -> None:
    """A comparison over seeds: run folders OUT/VARIANT/seed_S; tables and plot of means and
    standard deviations (:mod:`fedbayes.runs.summaries`)."""
    from fedbayes.runs import summaries as sm
    from fedbayes.runs.experiment import read_metrics
    from fedbayes.runs.plotting import plot_curves
    from fedbayes.runs.strictjson import dumps_record
    from fedbayes.runs.sweep import finished

    say = (lambda s: print(s, file=sys.stderr, flush=True)) if json_out else (lambda s: console.print(s, highlight=False, markup=False))
    jobs = {(name, seed): (cfg.model_copy(update={"seed": seed}), out / name / f"seed_{seed}") for name, cfg in runs.items() for seed in seeds}
    if resume:  # a run folder holding another config is never overwritten
        for cfg, folder in jobs.values():
            if (folder / "config.toml").is_file() and not same_config(folder / "config.toml", cfg):
                _fail(f"error: {folder} holds a run of a different config; pass --overwrite to replace it, or another --out")
    _hold(out, "compare")
    _state["resume_target"] = out  # an interrupted run: `fedbayes resume OUT` continues the comparison
    todo = {key: job for key, job in jobs.items() if not (resume and finished(*job))}
    _check_data([(key, cfg) for key, (cfg, _) in todo.items()], lambda key: f"variant {key[0]!r}, seed {key[1]}")
    out.mkdir(parents=True, exist_ok=True)
    comparison = {"seeds": seeds, "variants": {name: cfg.model_dump(mode="json", exclude_none=True) for name, cfg in runs.items()}}
    if reference is not None:
        comparison["reference"] = reference.model_dump(mode="json")
    (out / COMPARISON_FILE).write_text("# written by `fedbayes compare`; `fedbayes resume` continues it\n" + _toml(comparison))
    results: dict[str, dict[int, dict]] = {}
    for (name, seed), (cfg, folder) in jobs.items():
        if (name, seed) not in todo:
            say(f"== {name} seed {seed}: finished earlier, not rerun")
            results.setdefault(name, {})[seed] = finished(cfg, folder)
            continue
        say(f"== {name} seed {seed} ({cfg.algorithm.name}, server {cfg.server.optimizer})")
        has_ckpt = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("round_*.npz"))
        results.setdefault(name, {})[seed] = _run(cfg, folder, resume=resume and has_ckpt, logs=logs, stderr=json_out, diverged_ok=True)
    curves = {name: {seed: read_metrics(out / name / f"seed_{seed}" / "metrics.jsonl") for seed in seeds} for name in runs}
    summaries = {name: sm.aggregate(name, results[name], curves[name], threshold) for name in runs}
    means = {name: sm.mean_curves([curves[name][s] for s in seeds if not results[name][s].get("diverged")]) for name in runs}
    task = "regression" if any(c.data.dataset == "least_squares" for c in runs.values()) else "classification"
    plot = plot_curves(
        out / "compare.png",
        {n: m for n, (m, _) in means.items()},
        title=f"{title}, mean ± std over seeds {seeds}",
        task=task,
        bands={n: sd for n, (_, sd) in means.items()},
    )
    mean_records = {n: m for n, (m, _) in means.items()}
    note = f"\nMean±std over seeds {seeds} (sample standard deviation); curve summaries as Swaroop et al. 2025 (ADMM and Bayes) report them.\n"
    (out / "compare.md").write_text(
        report.markdown(summaries, threshold=threshold, curves=mean_records) + note + _reference_markdown(summaries, mean_records, reference)
    )
    body = {n: _without_numbers(s) for n, s in summaries.items()}
    (out / "compare.json").write_text(dumps_record(body, indent=2) + "\n")
    if json_out:
        print(dumps_record(body), flush=True)
    else:
        print(report.render(summaries, threshold=threshold, curves=mean_records, title=f"fedbayes comparison, mean±std over seeds {seeds}"), end="", flush=True)
        _print_reference(summaries, mean_records, reference)
        console.print(f"table: {out / 'compare.md'}  plot: {plot}", highlight=False)
    diverged = [f"{n} (seed {s})" for n in runs for s in seeds if results[n][s].get("diverged")]
    if diverged:
        _fail(f"error: diverged: {', '.join(diverged)} (see their rows; each kept its last good checkpoint for fedbayes resume DIR --set ...)", code=3)


# ----- sweeps -----------------------------------------------------------------------------------

SWEEP_HELP = r"""Run a grid of settings, several seeds each; tables of every cell and of the best cell per method.

CONFIG is a run TOML or a comparison TOML (\[base] + \[variants.NAME]); the grid applies to every
variant. Every combination of --grid values is a cell; every (variant, cell, seed) is its own run
folder OUT/VARIANT/CELL/seed_S/.

  fedbayes sweep CONFIG --grid algorithm.delta=0.1,1,10 --grid client.epochs=1,2,5 --seeds 3

--grid KEY=V1,V2,...   any config key (`fedbayes config` lists them); values read as TOML
                       (strings may be bare; brackets keep commas: model.hidden=[100],[200,100]);
                       VARIANT.KEY=... sweeps a key in one variant only (e.g. feddyn.algorithm.alpha=...).
                       A key that is not a setting of some variant it applies to is an error.
--seeds N | S1,S2,...  N seeds (0..N-1) or these seeds; default the comparison file's `seeds`,
                       else each config's own seed. Cells are compared on their mean over seeds.
--select-on validation (default) chooses each method's best cell on a validation split held out
                       from every client's training data (data.validation_fraction; when the
                       config holds out nothing, --validation-fraction, default 0.1); the test
                       metrics are reported beside it. The split is taken per client after
                       partitioning, seeded, so the federation is the one a run without it gets.
--select-on test       chooses on the test set, as the papers do; the output says so.

A cell's score: its mean accuracy over rounds R-2..R (Swaroop et al. 2025, Table 1), averaged
over seeds (regression: the lowest MSE); a cell with a diverged seed is never chosen. The tables
also give the max accuracy over R-2..R and the rounds to --threshold (mean±std over seeds, the
sample standard deviation). They are printed and written to OUT/sweep.md and OUT/sweep.json.

Nothing is overwritten: a non-empty OUT needs --resume (or `fedbayes resume OUT`), which runs
only what is missing (finished runs are not rerun, an interrupted run continues from its
checkpoint; new grid values or seeds are added), or --overwrite. Bad input (an unknown key, a
value the key does not allow, an empty grid) is one line naming it, exit code 2, before any run.
"""


class _SweepProgress:
    """One rich progress display for a sweep: the whole sweep and the run in progress; plain
    lines (one per run) when the output is not a terminal."""

    def __init__(self, total: int):

        self.total, self.count = total, 0
        self.progress = None
        if console.is_terminal:
            self.progress = _progress_bar()
            self.progress.start()
            self.overall = self.progress.add_task("sweep (runs)", total=total, status="")

    def skip(self, label: str) -> None:
        self.count += 1
        if self.progress is None:
            console.print(f"[{self.count}/{self.total}] {label}: finished earlier, not rerun", highlight=False, markup=False)
        else:
            self.progress.advance(self.overall)

    def reporter(self, label: str):
        return _SweepRunReporter(self, label)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class _SweepRunReporter:
    """The reporter of one run of a sweep (``run_experiment``'s start/update/stop)."""

    def __init__(self, parent: _SweepProgress, label: str):
        self.parent, self.label, self.task, self.last, self.total = parent, label, None, None, 0

    def start(self, name, total, done):
        p = self.parent
        self.total = total
        if p.progress is not None:
            self.task = p.progress.add_task(self.label, total=total, completed=done, status="")
        else:
            console.print(
                f"[{p.count + 1}/{p.total}] {self.label} (from round {done})" if done else f"[{p.count + 1}/{p.total}] {self.label}",
                highlight=False,
                markup=False,
            )

    def update(self, round_idx, total, record):
        if record is not None:
            self.last = record
        if self.task is not None:
            status = "" if record is None else (f"acc {record['accuracy']:.4f}" if "accuracy" in record else f"mse {record.get('mse', float('nan')):.5f}")
            self.parent.progress.update(self.task, completed=round_idx, **({"status": status} if status else {}))

    def stop(self):
        p = self.parent
        p.count += 1
        if p.progress is not None:
            if self.task is not None:
                p.progress.remove_task(self.task)
            p.progress.advance(p.overall)
        elif self.last is not None:
            from fedbayes.runs.experiment import format_record

            console.print(f"    {format_record(self.last, self.total)}", highlight=False, markup=False)


@app.command(help=SWEEP_HELP)
@_handled
def sweep(
    config: Annotated[Path, typer.Argument(help="a run TOML or a comparison TOML (\\[base] + \\[variants.NAME])")],
    grid: Annotated[Optional[list[str]], typer.Option("--grid", help="KEY=V1,V2,... (repeatable; VARIANT.KEY=... for one variant)")] = None,
    seeds: Annotated[Optional[str], typer.Option("--seeds", help="N (seeds 0..N-1) or S1,S2,...; default the file's `seeds`, else the config's seed")] = None,
    select_on: Annotated[
        str, typer.Option("--select-on", help="validation (default: a split held out from the training data) or test (as the papers)")
    ] = "validation",
    validation_fraction: Annotated[
        Optional[float],
        typer.Option("--validation-fraction", help="data.validation_fraction for every variant (default: the config's, else 0.1 when selecting on validation)"),
    ] = None,
    threshold: Annotated[float, typer.Option(help="accuracy threshold for the rounds-to column")] = 0.8,
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/sweep_<config name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key in every variant (key=value) or in one (VARIANT.key=value)")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the sweep already in --out")] = False,
    resume: Annotated[bool, typer.Option("--resume", help="continue the sweep in --out: finished runs are not rerun")] = False,
):
    from fedbayes.runs import sweep as sw

    if overwrite and resume:
        _fail("error: --overwrite and --resume exclude each other")
    if select_on not in sw.SELECT_ON:
        _fail(f"error: --select-on {select_on!r}: allowed: {', '.join(sw.SELECT_ON)}")
    runs = _comparison([config], set_ or [])
    seed_list = _seeds_option(seeds) if seeds is not None else _file_seeds([config])
    if validation_fraction is not None or select_on == "validation":
        for name, cfg in runs.items():
            fraction = validation_fraction if validation_fraction is not None else (cfg.data.validation_fraction or sw.DEFAULT_VALIDATION_FRACTION)
            try:
                runs[name] = validate(
                    {
                        **cfg.model_dump(mode="json", exclude_none=True),
                        "data": {**cfg.data.model_dump(mode="json", exclude_none=True), "validation_fraction": fraction},
                    }
                )
            except ConfigError as exc:
                _fail(f"{exc} (--validation-fraction)")
    out = out or Path("runs") / f"sweep_{config.stem}"
    spec = {"grid": list(grid or []), "select_on": select_on, "threshold": threshold, "title": config.stem}
    if seed_list is not None:
        spec["seeds"] = seed_list
    _sweep(runs, spec, out, overwrite=overwrite, resume=resume)


def _resume_sweep(out: Path) -> None:
    """Continues the sweep in ``out`` from its sweep.toml."""
    from fedbayes.runs.sweep import SWEEP_FILE

    try:
        raw = read_toml(out / SWEEP_FILE)
        runs = {name: validate(cfg) for name, cfg in (raw.get("variants") or {}).items()}
    except ConfigError as exc:
        _fail(f"{exc} ({out / SWEEP_FILE})")
    _sweep(runs, raw.get("sweep") or {}, out, resume=True)


def _sweep(runs: dict[str, RunConfig], spec: dict, out: Path, *, overwrite: bool = False, resume: bool = False) -> None:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.runs import sweep as sw
    from fedbayes.runs.experiment import Diverged, run_experiment

    try:
        axes = sw.parse_grid(spec.get("grid") or [], list(runs))
        cells = sw.plan(runs, axes)
        sw.select_key(spec.get("select_on", "validation"))
    except ConfigError as exc:
        _fail(str(exc))
    seeds = spec.get("seeds")
    seeds_of = (lambda cell: seeds) if seeds is not None else (lambda cell: [cell.config.seed])
    _check_out(out, overwrite, resume, what="sweep")
    if resume:
        bad = sw.conflicts(cells, seeds_of, out)
        if bad:
            _fail(f"error: {bad[0]} holds a run of a different config (the sweep's settings changed?); pass --overwrite to replace the sweep, or another --out")
    _hold(out, "sweep")
    if overwrite and out.is_dir():  # replace the sweep: every run of it, not only this grid's
        import shutil

        from fedbayes.runs.runlock import LOCK_NAME

        for child in out.iterdir():
            if child.name != LOCK_NAME:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    todo = [(cell, s) for cell in cells for s in seeds_of(cell) if sw.finished(cell.config_for(s), cell.folder(out, s)) is None]
    _check_data([((cell.variant, cell.name, s), cell.config_for(s)) for cell, s in todo], lambda key: f"variant {key[0]!r}, cell {key[1]}, seed {key[2]}")
    out.mkdir(parents=True, exist_ok=True)
    record = {"sweep": spec, "variants": {name: cfg.model_dump(mode="json", exclude_none=True) for name, cfg in runs.items()}}
    (out / sw.SWEEP_FILE).write_text("# written by `fedbayes sweep`; `fedbayes resume` continues it\n" + _toml(record))
    total = sum(len(seeds_of(c)) for c in cells)
    axes_text = " x ".join(f"{a.label} ({len(a.values)})" for a in axes)
    console.print(
        f"sweep: {len(runs)} variant(s), grid {axes_text}: {len(cells)} cell(s), {total} run(s), {total - len(todo)} finished earlier",
        highlight=False,
        markup=False,
    )
    progress = _SweepProgress(total)
    _state["resume_target"] = out

    def label(cell, seed):
        settings = " ".join(f"{k}={v}" for k, v in cell.settings)
        return f"{cell.variant} {settings} seed {seed}"

    def run_one(cfg, folder, resume_run):
        _state["folder"] = folder
        cell = next(c for c in cells if c.folder(out, cfg.seed) == folder)
        try:
            return run_experiment(cfg, folder, resume=resume_run, reporter=progress.reporter(label(cell, cfg.seed)))
        except Diverged as exc:
            print(f"diverged: {exc}", file=sys.stderr, flush=True)
            return json.loads((folder / "summary.json").read_text())
        except DatasetNotFoundError as exc:
            _fail(f"data error: {exc}", code=3)
        except ConfigError as exc:
            _fail(str(exc))

    try:
        results = sw.run(cells, seeds_of, out, run_one, on_skip=lambda cell, seed: progress.skip(label(cell, seed)))
    finally:
        progress.close()
    _state["resume_target"] = None
    threshold = spec.get("threshold", 0.8)
    agg = sw.cell_summaries(cells, results, out, threshold)
    tables = sw.tables(cells, agg, select_on=spec.get("select_on", "validation"), threshold=threshold, seeds=seeds, axes=axes)
    md, js = sw.write_tables(tables, out, f"sweep {spec.get('title', out.name)}")
    print(tables.render(), end="", flush=True)
    console.print(f"tables: {md}  {js}", highlight=False)


@app.command("config")
def config_reference(
    section: Annotated[Optional[str], typer.Argument(help="run, data, model, client, server, privacy, attack, algorithm or an algorithm's name")] = None,
):
    """Every config key with its type, default and meaning (from the config's own definitions)."""
    from fedbayes.config import reference as config_doc

    try:
        chosen = config_doc.select(section)
    except ValueError as exc:
        _fail(f"error: {exc}")
    print(config_doc.render(chosen), end="")


@app.command()
def datasets(data_dir: Annotated[Optional[Path], typer.Option(help="folder to look in as well")] = None):
    """List the datasets and whether each is present on this machine."""
    from fedbayes.data import dataset_status

    table = Table()
    table.add_column("dataset")
    table.add_column("present")
    table.add_column("where / how to get it")
    for name, present, detail in dataset_status(data_dir):
        table.add_row(name, "yes" if present else "no", detail)
    console.print(table)


@app.command()
def bench(
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object keyed by workload instead of the table")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="fewer rounds, one repeat: a smoke check of every workload (about 7 minutes on 2 cores)")] = False,
    workload: Annotated[Optional[list[str]], typer.Option("--workload", help="run only this workload (repeatable); limit_b32 always runs")] = None,
    repeats: Annotated[Optional[int], typer.Option(min=1, help="repeat every workload this many times and report medians")] = None,
    rounds: Annotated[Optional[int], typer.Option(min=1, help="steady-state rounds per federated workload")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="folder holding the dataset")] = None,
):
    """Round throughput, compile time and peak memory against this machine's compute limit."""
    import dataclasses

    from fedbayes import bench as fb

    settings = fb.QUICK if quick else fb.FULL
    changes = {k: v for k, v in (("repeats", repeats), ("rounds", rounds), ("data_dir", data_dir and str(data_dir))) if v is not None}
    settings = dataclasses.replace(settings, **changes)
    title = fb.describe_run(settings, quick)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731  (stdout stays pure JSON)
    log(title)
    try:
        results = fb.run_bench(settings, workload, log=log)
    except fb.BenchError as exc:
        _fail(f"bench error: {exc}", code=3)
    if json_:
        print(json.dumps(results))
    else:
        console.print(fb.rich_table(results, title=title))


from fedbayes.toys.commands import toy_app  # noqa: E402  (toy quadratic | least-squares | niw)

app.add_typer(toy_app, name="toy")


def _in_gc_callback(frame) -> bool:
    for _ in range(32):
        if frame is None:
            return False
        if "gc_callback" in frame.f_code.co_name:
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame):
    """SIGINT and SIGTERM end a run with one line saying how to resume (exit 130).

    An exception raised while the garbage collector runs a callback (JAX registers one) is
    printed as "Exception ignored" with a traceback and then dropped; such a signal is re-raised
    50 ms later instead."""
    import signal

    if _in_gc_callback(frame):
        signal.signal(signal.SIGALRM, _interrupt)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        return
    raise KeyboardInterrupt


def main() -> int:
    """The ``fedbayes`` entry point: a failure outside the run commands is one line too."""
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    app.pretty_exceptions_enable = False
    try:
        enable_compilation_cache()
        app()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        code, line = describe_failure(exc)
        print(line, file=sys.stderr, flush=True)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
