"""``fedbayes config``, ``datasets`` and ``bench``: the config reference, the datasets present,
the machine's throughput."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Annotated, Optional

import typer

from fedbayes.cli.base import fail
from fedbayes.cli.progress import BenchProgress
from fedbayes.runs import report
from fedbayes.runs.report import terminal_width

__all__ = ["bench", "config_reference", "datasets"]


def config_reference(
    section: Annotated[Optional[str], typer.Argument(help="run, data, model, client, server, privacy, attack, algorithm or an algorithm's name")] = None,
):
    """Every config key with its type, default and meaning (from the config's own definitions)."""
    from fedbayes.config import reference as config_doc

    try:
        chosen = config_doc.select(section)
    except ValueError as exc:
        fail(f"error: {exc}")
    print(config_doc.render(chosen, terminal_width()), end="")


def datasets(data_dir: Annotated[Optional[Path], typer.Option(help="folder to look in as well")] = None):
    """List the datasets and whether each is present on this machine."""
    from fedbayes.data import dataset_status

    status = dataset_status(data_dir)
    name_width = max(len(name) for name, _, _ in status)
    width = terminal_width()
    lines = [f"{'dataset':<{name_width}}  present  where / how to get it"]
    for name, present, detail in status:
        head = f"{name:<{name_width}}  {'yes' if present else 'no':<7}  "
        if len(head) + len(detail) <= width:
            lines.append(head + detail)
        else:  # on lines of their own below the name, wrapped at spaces: a URL or a path is never cut
            lines.append(head.rstrip())
            lines += textwrap.wrap(detail, width, initial_indent="  ", subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    print("\n".join(lines))


def bench(
    suite: Annotated[
        Optional[str],
        typer.Argument(
            help="what to measure: nothing (round throughput), 'gpu' (the GPU record: vmap layout, device store, own limits) or 'posterior' (posterior quality against NUTS)"
        ),
    ] = None,
    json_: Annotated[bool, typer.Option("--json", help="print one JSON object keyed by workload instead of the table")] = False,
    quick: Annotated[
        bool, typer.Option("--quick", help="fewer rounds, one repeat: a smoke check of every workload (docs/results/bench.md has its times)")
    ] = False,
    workload: Annotated[
        Optional[list[str]], typer.Option("--workload", help="run only this workload (repeatable; an unknown name lists them); limit_b32 always runs")
    ] = None,
    repeats: Annotated[Optional[int], typer.Option(min=1, help="repeat every workload this many times and report medians")] = None,
    rounds: Annotated[Optional[int], typer.Option(min=1, help="steady-state rounds per federated workload")] = None,
    data_dir: Annotated[Optional[Path], typer.Option(help="folder holding the dataset")] = None,
    out: Annotated[Path, typer.Option(help="posterior: the folder for the results and the caches (NUTS, finished rows)")] = Path("runs/posterior"),
    dataset: Annotated[Optional[list[str]], typer.Option("--dataset", help="posterior: only this data set (repeatable): breast_cancer, digits_3v8")] = None,
    method: Annotated[Optional[list[str]], typer.Option("--method", help="posterior: only this method (repeatable), e.g. fedep_laplace, pvi")] = None,
    max_rounds: Annotated[Optional[int], typer.Option(min=1, help="posterior: rounds before a method counts as not reaching its family optimum")] = None,
    client: Annotated[
        Optional[str],
        typer.Option(help='posterior: [client] settings for every method as JSON, e.g. \'{"epochs": 3, "batch_size": 8}\' (default: the defaults)'),
    ] = None,
    keep_going: Annotated[
        bool, typer.Option("--keep-going", help="posterior: run every method all --max-rounds rounds, past the bar, to see whether it stays there")
    ] = False,
):
    """Round throughput, compile time and peak memory against this machine's compute limit; with
    ``posterior``, each Bayesian method's posterior against NUTS and its family's central optimum."""
    import dataclasses

    if suite == "posterior":
        _bench_posterior(out, quick, dataset, method, max_rounds, client, json_, keep_going)
        return
    if suite not in (None, "gpu"):
        fail(f"error: bench: unknown suite {suite!r}; allowed: posterior, gpu (or none for the throughput bench)")

    from fedbayes import bench as fb

    settings = fb.QUICK if quick else fb.GPU if suite == "gpu" else fb.FULL
    if suite == "gpu":
        workload = workload or list(fb.GPU_WORKLOADS)
        if quick:
            settings = dataclasses.replace(settings, own_limit_blocks=1, paired=False)
    changes = {k: v for k, v in (("repeats", repeats), ("rounds", rounds), ("data_dir", data_dir and str(data_dir))) if v is not None}
    settings = dataclasses.replace(settings, **changes)
    title = fb.describe_run(settings, quick, suite)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731  (stdout stays pure JSON)
    log(textwrap.fill(title, terminal_width(), break_long_words=False, break_on_hyphens=False))
    steps = BenchProgress(log)
    try:
        results = fb.run_bench(settings, workload, log=log, steps=steps)
    except fb.BenchError as exc:
        steps.close()
        fail(f"bench error: {exc}", code=3)
    steps.close()
    if json_:
        print(json.dumps(results))
    else:
        print(fb.text_tables(results, title=title), end="", flush=True)


def _bench_posterior(
    out: Path,
    quick: bool,
    datasets: list[str] | None,
    methods: list[str] | None,
    max_rounds: int | None,
    client: str | None,
    json_: bool,
    keep_going: bool = False,
) -> None:
    """``fedbayes bench posterior``: :func:`fedbayes.bench.posterior.run_posterior_bench`."""
    import dataclasses

    from fedbayes.bench import posterior

    settings = posterior.QUICK if quick else posterior.FULL
    if max_rounds is not None:
        settings = dataclasses.replace(settings, max_rounds=max_rounds)
    if keep_going:
        settings = dataclasses.replace(settings, stop_at_bar=False)
    if client is not None:
        try:
            parsed = json.loads(client)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            fail(f"error: bench posterior: --client must be a JSON object of [client] settings, got {client!r}")
        settings = dataclasses.replace(settings, client=parsed)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731  (stdout stays pure JSON)
    try:
        result = posterior.run_posterior_bench(out, settings, datasets, methods, log=log)
    except ValueError as exc:
        fail(f"error: bench posterior: {exc}")
    except ImportError as exc:
        fail(f"error: {exc}")
    if json_:
        print(json.dumps(result, default=float))
    else:
        print(report.markdown_as_text(posterior.markdown(result), full=str(out / "posterior_quality.md")), end="")
        log(f"written: {out / 'posterior_quality.md'} and {out / 'posterior_quality.json'}")
