"""The ``fedbayes`` command line: run, compare, resume, datasets.

No math lives here: commands parse and validate configs, then call :mod:`fedbayes.experiment`.
Bad configs exit with code 2 and one line naming the field and what is allowed, before any work.
"""

from __future__ import annotations

import os
import sys

from fedbayes import hostdevices

# One XLA host device per core, set before JAX starts (DESIGN.md, "Using every core"). A device
# count already in XLA_FLAGS is kept.
hostdevices.configure()

import json  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Annotated, Optional  # noqa: E402

import typer  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from fedbayes.config import ConfigError, RunConfig, apply_overrides, deep_merge, read_toml, validate  # noqa: E402

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


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Federated learning as Bayesian inference, in JAX.")
console = Console()
if not console.is_terminal:
    console = Console(width=160)  # logs and CI: do not squeeze tables into 80 columns


def _fail(message: str, code: int = 2):
    print(message, file=sys.stderr, flush=True)  # one unwrapped line, whatever the terminal width
    raise typer.Exit(code)


class RichReporter:
    """A rich progress bar (round, accuracy, ETA) for terminals."""

    def __init__(self):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
            console=console,
        )
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


def _reporter():
    from fedbayes.experiment import PlainReporter

    return RichReporter() if console.is_terminal else PlainReporter(lambda s: print(s, flush=True))


def _load(path: Path, overrides: list[str]) -> RunConfig:
    try:
        return validate(apply_overrides(read_toml(path), overrides))
    except ConfigError as exc:
        _fail(str(exc))


def _run(config: RunConfig, out: Path, resume: bool = False, *, diverged_ok: bool = False) -> dict:
    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.experiment import Diverged, run_experiment

    try:
        return run_experiment(config, out, resume=resume, reporter=_reporter())
    except Diverged as exc:
        if not diverged_ok:
            _fail(f"error: {exc}", code=3)
        console.print(f"error: {exc}", style="red", highlight=False)
        return json.loads((out / "summary.json").read_text())
    except DatasetNotFoundError as exc:
        _fail(f"data error: {exc}", code=3)
    except ConfigError as exc:
        _fail(str(exc))


@app.command()
def run(
    config: Annotated[Path, typer.Argument(help="experiment TOML file")],
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/<name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key, e.g. --set server.lr=0.5")] = None,
):
    """Run one experiment: metrics.jsonl, summary.json, config.toml, curves.png, checkpoints."""
    cfg = _load(config, set_ or [])
    out = out or Path("runs") / cfg.name
    summary = _run(cfg, out)
    _print_table({cfg.name: summary})
    console.print(f"outputs in {out}/ (metrics.jsonl, summary.json, curves.png, checkpoints/)", highlight=False)


@app.command()
def resume(
    out: Annotated[Path, typer.Argument(help="the folder of an interrupted run")],
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="change a key before continuing, e.g. --set client.lr=0.01 (after a divergence)")] = None,
):
    """Resume an interrupted (or diverged) run from its newest checkpoint; with no --set it ends as
    if it never stopped."""
    cfg_path = out / "config.toml"
    if not cfg_path.is_file():
        _fail(f"error: {out} holds no config.toml; is it a fedbayes run folder?")
    cfg = _load(cfg_path, set_ or [])
    summary = _run(cfg, out, resume=True)
    _print_table({cfg.name: summary})


def _comparison(files: list[Path], overrides: list[str]) -> dict[str, RunConfig]:
    """Variant name -> config, from one comparison file ([base] + [variants.*]) or several run files."""
    runs: dict[str, RunConfig] = {}
    for path in files:
        try:
            raw = read_toml(path)
        except ConfigError as exc:
            _fail(str(exc))
        if "variants" in raw or "base" in raw:
            unknown = set(raw) - {"base", "variants"}
            if unknown:
                _fail(f"config error: {path}: unknown top-level key(s) {sorted(unknown)} in a comparison file; allowed: base, variants")
            variants = raw.get("variants") or {}
            if not variants:
                _fail(f"config error: {path}: variants: a comparison needs at least one [variants.NAME] table")
            for name, update in variants.items():
                merged = deep_merge(raw.get("base", {}), update)
                merged.setdefault("name", name)
                merged["name"] = name
                try:
                    runs[name] = validate(apply_overrides(merged, overrides))
                except ConfigError as exc:
                    _fail(f"{exc} (variant {name!r})")
        else:
            cfg = _load(path, overrides)
            runs[cfg.name if cfg.name not in runs else f"{cfg.name}_{len(runs)}"] = cfg
    return runs


def _fmt(v, pct=False, digits=4):
    if v is None:
        return "—"
    return f"{100 * v:.2f}" if pct else f"{v:.{digits}f}"


def _print_table(summaries: dict[str, dict], threshold: float = 0.8, curves: dict[str, list[dict]] | None = None) -> str:
    """Prints the comparison table and returns it as Markdown.

    "rounds to" is the first evaluated round whose accuracy reaches ``threshold`` (seed 001,
    Table 3), computed from the curves when given (any threshold), else from the summary. The
    "marg." columns are the marginalised prediction of Bayesian methods (seed 000 Table 5); "—"
    for point estimates.
    """
    from fedbayes.metrics import rounds_to_threshold
    table = Table(title="fedbayes comparison" if len(summaries) > 1 else None)
    cols = ["method", "algorithm", "server opt", "accuracy", "NLL", "ECE (%)", "acc marg.", "NLL marg.", "ECE marg. (%)"]
    cols += ["best acc", f"rounds to {threshold:.0%}", "time (s)", "MB up"]
    for c in cols:
        table.add_column(c, justify="left" if c in ("method", "algorithm", "server opt") else "right")
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, s in summaries.items():
        f = s.get("final", {})
        if s.get("diverged"):
            d = s["diverged"]
            row = [name, s["algorithm"], s["server_optimizer"], f"diverged (round {d['round']}: {d['metric']})"] + [""] * (len(cols) - 4)
        elif "accuracy" in f:
            if curves and curves.get(name):
                recs = curves[name]
                rt = rounds_to_threshold([r["round"] for r in recs], [r["accuracy"] for r in recs], threshold, window=1)
            else:
                rt = s.get("rounds_to", {}).get(f"{threshold:.2f}")
            row = [name, s["algorithm"], s["server_optimizer"], _fmt(f["accuracy"]), _fmt(f["nll"]), _fmt(f["ece"], pct=True)]
            row += [_fmt(f.get("accuracy_marg")), _fmt(f.get("nll_marg")), _fmt(f.get("ece_marg"), pct=True)]
            row += [_fmt(s.get("best_accuracy")), "—" if rt is None else str(rt)]
        else:
            row = [name, s["algorithm"], s["server_optimizer"], f"mse {_fmt(f.get('mse'), digits=5)}", "", "", "", "", "", "", ""]
        if not s.get("diverged"):
            row += [f"{f.get('seconds', 0):.1f}", f"{f.get('bytes_up', 0) / 1e6:.1f}"]
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    return "\n".join(md) + "\n"


@app.command()
def compare(
    configs: Annotated[list[Path], typer.Argument(help="a comparison TOML ([base] + [variants.NAME]) or several run TOMLs")],
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("runs/compare"),
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key in every run")] = None,
    threshold: Annotated[float, typer.Option(help="accuracy threshold for the rounds-to column")] = 0.8,
):
    """Run several methods or configs and print one table and one overlaid plot."""
    from fedbayes.experiment import read_metrics
    from fedbayes.plotting import plot_curves

    from fedbayes.data.dataset import DatasetNotFoundError
    from fedbayes.experiment import prepare_data

    runs = _comparison(configs, set_ or [])
    for name, cfg in runs.items():  # every variant's data and model are checked before any trains
        try:
            prepare_data(cfg)
        except DatasetNotFoundError as exc:
            _fail(f"data error: {exc}", code=3)
        except ConfigError as exc:
            _fail(f"{exc} (variant {name!r})")
    summaries = {}
    for name, cfg in runs.items():
        console.print(f"[bold]== {name}[/bold] ({cfg.algorithm.name}, server {cfg.server.optimizer})")
        summaries[name] = _run(cfg, out / name, diverged_ok=True)
    curves = {name: read_metrics(out / name / "metrics.jsonl") for name in runs}
    md = _print_table(summaries, threshold, curves)
    task = "regression" if any(c.data.dataset == "least_squares" for c in runs.values()) else "classification"
    plot = plot_curves(out / "compare.png", curves, title="comparison", task=task)
    (out / "compare.md").write_text(md)
    (out / "compare.json").write_text(json.dumps({n: _without_numbers(s) for n, s in summaries.items()}, indent=2) + "\n")
    console.print(f"table: {out / 'compare.md'}  plot: {plot}", highlight=False)
    diverged = [n for n, s in summaries.items() if s.get("diverged")]
    if diverged:
        _fail(f"error: diverged: {', '.join(diverged)} (see their rows; each kept its last good checkpoint for fedbayes resume DIR --set ...)", code=3)


def _without_numbers(summary: dict) -> dict:
    """A diverged variant's summary keeps its name, settings and where it diverged, not its metrics."""
    if not summary.get("diverged"):
        return summary
    return {k: summary[k] for k in ("name", "algorithm", "server_optimizer", "rounds", "diverged") if k in summary}


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
    quick: Annotated[bool, typer.Option("--quick", help="fewer rounds, one repeat (under two minutes on 2 cores)")] = False,
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


def main():
    enable_compilation_cache()
    app()


if __name__ == "__main__":
    sys.exit(main())
