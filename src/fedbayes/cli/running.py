"""``fedbayes run``, ``deploy`` and ``resume``: one run into its folder (or a comparison or sweep
resumed)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from fedbayes.cli.base import CommandContext, console, fail, handled
from fedbayes.cli.common import LOG_HELP, check_out, load, number_in, print_table, records, run_one, with_compile_seconds
from fedbayes.config.schema import parse_override
from fedbayes.flower import INSTALL as _FLOWER_INSTALL  # the package's __init__ imports no flwr
from fedbayes.runs import folder as run_folder
from fedbayes.runs.resume import finished

DEPLOYED = "flower"  # the folder `fedbayes deploy` adds to a run folder (fedbayes.flower.deploy.deploy_local)


@handled
def run(
    ctx: CommandContext,
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
    cfg = load(config, set_ or [])
    out = out or Path("runs") / cfg.name
    check_out(out, overwrite)
    summary = run_one(ctx, cfg, out, logs=log)
    print_table(with_compile_seconds({cfg.name: summary}, {cfg.name: out}, ctx), curves={cfg.name: records(out)}, full=f"{out / run_folder.SUMMARY}")
    conformal = ", conformal.json" if cfg.evaluation.conformal_alpha is not None else ""
    conformal += ", personal.json" if cfg.evaluation.personal_fraction > 0 else ""
    console.print(f"outputs in {out}/ (metrics.jsonl, summary.json{conformal}, model.npz, curves.png, checkpoints/)", highlight=False, soft_wrap=True)


@handled
def deploy(
    ctx: CommandContext,
    config: Annotated[Path, typer.Argument(help="experiment TOML file (as for `fedbayes run`)")],
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/<name>)")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="override a key, e.g. --set rounds=5")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace the run already in --out")] = False,
    resume_: Annotated[bool, typer.Option("--resume", help="continue the run in --out from its newest checkpoint")] = False,
    print_commands: Annotated[
        bool, typer.Option("--print-commands", help="print the commands that start this federation on real machines (TLS) instead")
    ] = False,
    tls: Annotated[bool, typer.Option("--tls", help="run the local federation over TLS with certificates made for it")] = False,
    reply_timeout: Annotated[
        float, typer.Option("--reply-timeout", help="seconds a round waits for its replies", callback=number_in("--reply-timeout", 0))
    ] = 120.0,
    node_timeout: Annotated[
        float, typer.Option("--node-timeout", help="seconds to wait for the nodes to join", callback=number_in("--node-timeout", 0))
    ] = 120.0,
    min_nodes: Annotated[int, typer.Option("--min-nodes", help="nodes to wait for before the first round (0: one per client)")] = 0,
    on_missing: Annotated[str, typer.Option("--on-missing", help="a missing reply: skip (aggregate the others) or fail")] = "skip",
    executor: Annotated[
        str, typer.Option("--executor", help="warm: one long-lived fedbayes executor per node; stock: Flower's fresh ClientApp process per message")
    ] = "warm",
):
    """Run an experiment on Flower: a SuperLink and one SuperNode per client on this machine (real
    processes on loopback), the same run folder as `fedbayes run`, every process ended at the end.

    Needs the flower extra in an environment of its own (flwr pins older typer, rich and protobuf):
    python -m venv .venv-flower && .venv-flower/bin/pip install -e '.[flower]', then
    .venv-flower/bin/fedbayes deploy ...; examples/flower/README.md walks through it."""
    cfg = load(config, set_ or [])
    out = out or Path("runs") / cfg.name
    try:
        from fedbayes.flower import deploy as flower_deploy
    except ImportError as exc:
        fail(f"error: fedbayes deploy needs Flower ({exc.name or exc} is missing); install it {_FLOWER_INSTALL}")
    if print_commands and set_:
        fail("error: --print-commands names CONFIG as written (the SuperLink reads it there); put the --set changes in the file")
    if print_commands:  # needs no Flower here: the commands run on the federation's machines
        print(flower_deploy.print_commands(config.resolve(), cfg, out.resolve()), end="")
        return
    check_out(out, overwrite, resume_)
    run_config = {"reply-timeout": reply_timeout, "node-timeout": node_timeout, "min-nodes": min_nodes, "on-missing": on_missing}
    _deploy(ctx, cfg, out, resume=resume_, tls=tls, run_config=run_config, executor=executor)


def _deploy(ctx: CommandContext, cfg, out: Path, *, resume: bool, tls: bool, run_config: dict | None = None, executor: str = "warm") -> None:
    """Runs (or resumes) ``cfg`` on a local Flower federation into ``out`` and prints its table."""
    try:
        import flwr  # noqa: F401

        from fedbayes.flower import deploy as flower_deploy
    except ImportError:
        fail(f"error: fedbayes deploy needs Flower (flwr is missing); install it {_FLOWER_INSTALL}")
    from fedbayes.runs.loggers import format_record

    ctx.folder = out  # an interrupt names `fedbayes resume OUT`, which resumes a deployed run on Flower
    echo = lambda r: console.print(format_record(r, cfg.rounds), highlight=False)  # noqa: E731
    summary = flower_deploy.deploy_local(cfg, out, resume=resume, tls=tls, run_config=run_config, progress=echo, executor=executor)
    print_table({cfg.name: summary}, curves={cfg.name: records(out)}, full=f"{out / run_folder.SUMMARY}")
    console.print(f"outputs in {out}/ (as fedbayes run; flower/ holds the processes' logs and the nodes' state)", highlight=False, soft_wrap=True)


@handled
def resume(
    ctx: CommandContext,
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
    from fedbayes.cli import comparing

    cfg_path = out / run_folder.CONFIG
    if not cfg_path.is_file() and (out / run_folder.SWEEP).is_file():
        comparing.resume_sweep(ctx, out)
        return
    if not cfg_path.is_file() and (out / run_folder.COMPARISON).is_file():
        comparing.resume_comparison(ctx, out, logs=log)
        return
    if not cfg_path.is_file():
        from fedbayes.runs import runlock

        if out.is_dir() and [p.name for p in out.iterdir()] == [runlock.LOCK_NAME]:  # a run's lock, nothing else
            fail(f"error: {out} holds nothing to resume (the run stopped before it wrote its config); start it again with fedbayes run CONFIG --out {out}")
        fail(f"error: {out} holds no {run_folder.CONFIG} or {run_folder.COMPARISON}; is it a fedbayes run folder?")
    cfg = load(cfg_path, set_ or [], stored=True)
    done = finished(cfg, out)
    if done is not None and not done.get("diverged"):
        console.print(f"{out}: finished earlier ({cfg.rounds} rounds, every file intact); nothing to resume", highlight=False, soft_wrap=True)
        return
    if (out / DEPLOYED).is_dir():  # a run deployed on Flower continues there (its nodes hold the client states)
        if set_:
            fail(f"error: {out} is a run deployed on Flower; resume it as it was (fedbayes deploy CONFIG --out {out} --resume takes --set)")
        _deploy(ctx, cfg, out, resume=True, tls=(out / DEPLOYED / "certs").is_dir())
        return
    accept = [".".join(parse_override(item)[0]) for item in set_ or []]
    summary = run_one(ctx, cfg, out, resume=True, logs=log, accept_changes=accept)
    print_table(with_compile_seconds({cfg.name: summary}, {cfg.name: out}, ctx), curves={cfg.name: records(out)}, full=f"{out / run_folder.SUMMARY}")
