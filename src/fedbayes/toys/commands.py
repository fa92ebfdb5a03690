"""``fedbayes toy quadratic | least-squares | niw``: the toy problems on the command line.

No math lives here: each command calls :mod:`fedbayes.toys`, prints a rich table (or, with
``--json``, exactly one JSON object on stdout) and writes a plot into ``--out``
(default ``runs/toy_<name>/``). Registered on the main app by :mod:`fedbayes.cli`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

toy_app = typer.Typer(
    no_args_is_help=True,
    rich_markup_mode=None,  # plain help text: brackets stay (fedbayes.cli.base)
    help="Reproducible toy problems of the seed papers (docs/algorithms.md §15): quadratic, least-squares, niw.",
)
_console = Console()
if not _console.is_terminal:
    _console = Console(width=160)

JsonOpt = Annotated[bool, typer.Option("--json", help="print only one JSON object (method -> figures) on stdout")]
SeedOpt = Annotated[int, typer.Option(help="random seed (changes the problem draws, starting points and noise)")]


def _fail(message: str, code: int = 2):
    print(message, file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _fail(f"toy error: --{name} must be one of {', '.join(allowed)}; got {value!r}")


def _int_list(name: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        _fail(f"toy error: --{name} must be comma-separated integers, e.g. 10,100; got {text!r}")
    if not values or min(values) < 1:
        _fail(f"toy error: --{name} needs at least one integer >= 1; got {text!r}")
    return values


def _emit(json_: bool, figures: dict, table: Table, plot: Path) -> None:
    if json_:
        print(json.dumps(figures))
    else:
        _console.print(table)
        _console.print(f"plot: {plot}", highlight=False)


def _g(x: float) -> str:
    return f"{x:.4g}"


@toy_app.command("quadratic")
def quadratic(
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/toy_quadratic)")] = None,
    json_: JsonOpt = False,
    seed: SeedOpt = 0,
    problem: Annotated[str, typer.Option(help="gaussians (docs/algorithms.md §15.1) or random (FedPA code's random quadratics)")] = "gaussians",
    rounds: Annotated[int, typer.Option(min=1, help="server rounds")] = 50,
    inits: Annotated[int, typer.Option(min=1, help="runs from different starting points")] = 5,
    sampler: Annotated[str, typer.Option(help="FedPA samples: iasg (noisy SGD, averaged) or exact")] = "iasg",
    rho: Annotated[float, typer.Option(min=0.0, help="FedPA shrinkage rho")] = 1.0,
    fedavg_steps: Annotated[str, typer.Option(help="FedAvg local step counts")] = "10,100",
    fedpa_samples: Annotated[str, typer.Option(help="FedPA sample counts")] = "10,100",
    mbsgd_grads: Annotated[int, typer.Option(min=0, help="MB-SGD gradients per client and round (0: skip MB-SGD)")] = 100,
    lr: Annotated[Optional[float], typer.Option(min=0.0, help="client SGD / IASG lr (default 1 / max eigenvalue)")] = None,
    server_lr: Annotated[float, typer.Option(min=0.0, help="server SGD lr")] = 1.0,
    steps_per_sample: Annotated[int, typer.Option(min=1, help="IASG steps averaged per sample")] = 100,
    burn_in: Annotated[int, typer.Option(min=0, help="IASG burn-in steps")] = 200,
    ep_steps: Annotated[int, typer.Option(min=1, help="diagonal EP steps")] = 10,
    iso_steps: Annotated[int, typer.Option(min=1, help="scaled-identity EP steps")] = 100,
    tail: Annotated[int, typer.Option(min=1, help="final rounds averaged for the distance")] = 10,
):
    """Two 2-D quadratic clients: FedAvg, MB-SGD, FedPA and EP vs the optimum (Al-Shedivat et al. 2021 (FedPA) Fig. 1, Guo et al. 2023 (FedEP) Fig. 1)."""
    from fedbayes.toys import local, plots
    from fedbayes.toys.quadratic import PROBLEMS, run_quadratic

    _check_choice("problem", problem, PROBLEMS)
    _check_choice("sampler", sampler, local.SAMPLERS)
    if tail > rounds:
        _fail(f"toy error: --tail ({tail}) must be <= --rounds ({rounds})")
    result = run_quadratic(
        seed=seed,
        problem=problem,
        rounds=rounds,
        inits=inits,
        sampler=sampler,
        rho=rho,
        fedavg_steps=_int_list("fedavg-steps", fedavg_steps),
        fedpa_samples=_int_list("fedpa-samples", fedpa_samples),
        mbsgd_grads=mbsgd_grads,
        lr=lr,
        server_lr=server_lr,
        steps_per_sample=steps_per_sample,
        burn_in=burn_in,
        ep_steps=ep_steps,
        iso_steps=iso_steps,
        tail=tail,
    )
    plot = plots.plot_quadratic(result, (out or Path("runs/toy_quadratic")) / "toy_quadratic.png")
    figures = result.summary()
    for name, dist in result.curves.items():
        figures[name]["curve"] = [float(x) for x in dist.mean(axis=1)]
    for name, dist in result.ep_curves.items():
        figures[name]["curve"] = [float(x) for x in dist]
    opt = ", ".join(f"{x:.5f}" for x in result.optimum)
    s = result.settings
    table = Table(title=f"2-D quadratic toy: optimum ({opt}); {s['inits']} runs x {s['rounds']} rounds, lr {s['lr']:.3g}, tau {s['noise_tau']:g}")
    for col in ("method", "estimate", f"distance (last {s['tail']} rounds)", "fixed-point distance"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, f in figures.items():
        est = "(" + ", ".join(f"{x:.4f}" for x in f["estimate"]) + ")"
        dist = f"{f['mean']:.4g} ± {f['std']:.2g}" if f["std"] > 0 else _g(f["mean"])
        table.add_row(name, est, dist, _g(f["estimate_distance"]))
    _emit(json_, figures, table, plot)


@toy_app.command("least-squares")
def least_squares(
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/toy_least_squares)")] = None,
    json_: JsonOpt = False,
    seed: SeedOpt = 0,
    dims: Annotated[str, typer.Option(help="feature counts d, comma-separated (Al-Shedivat et al. 2021 (FedPA): 10,100,1000)")] = "10,100",
    problems: Annotated[int, typer.Option(min=1, help="random problems per dimension (Al-Shedivat et al. 2021 (FedPA): 10)")] = 3,
    inits: Annotated[int, typer.Option(min=1, help="starting points per problem (Al-Shedivat et al. 2021 (FedPA): 10)")] = 3,
    reps: Annotated[int, typer.Option(min=2, help="repetitions of each FedPA estimate (FedAvg: 10x)")] = 10,
    init_scale: Annotated[float, typer.Option(min=0.0, help="starting points theta = mu + init_scale N(0, I)")] = 10.0,
    fedavg_steps: Annotated[str, typer.Option(help="FedAvg local step counts")] = "1,2,5,10,20,50,100,200",
    fedpa_samples: Annotated[str, typer.Option(help="FedPA sample counts")] = "2,5,10,20,50,100",
    sampler: Annotated[str, typer.Option(help="FedPA samples: iasg or exact")] = "iasg",
    rho: Annotated[
        Optional[float], typer.Option(min=0.0, help="FedPA rho (default Al-Shedivat et al. 2021 (FedPA)'s 0.01 / 0.005 / 0.001 for d = 10 / 100 / 1000)")
    ] = None,
    lr: Annotated[Optional[float], typer.Option(min=0.0, help="client lr (default 0.5 / max eigenvalue per problem)")] = None,
    steps_per_sample: Annotated[int, typer.Option(min=1, help="IASG steps averaged per sample")] = 100,
    burn_in: Annotated[int, typer.Option(min=0, help="IASG burn-in steps")] = 200,
):
    """Bias and variance of FedAvg and FedPA client deltas on make_regression problems (Al-Shedivat et al. 2021 (FedPA) App. A, Fig. 3)."""
    from fedbayes.toys import local, plots
    from fedbayes.toys.least_squares import run_least_squares

    _check_choice("sampler", sampler, local.SAMPLERS)
    result = run_least_squares(
        dims=_int_list("dims", dims),
        seed=seed,
        problems=problems,
        inits=inits,
        reps=reps,
        init_scale=init_scale,
        fedavg_steps=_int_list("fedavg-steps", fedavg_steps),
        fedpa_samples=_int_list("fedpa-samples", fedpa_samples),
        sampler=sampler,
        rho=rho,
        lr=lr,
        steps_per_sample=steps_per_sample,
        burn_in=burn_in,
    )
    plot = plots.plot_least_squares(result, (out or Path("runs/toy_least_squares")) / "toy_least_squares.png")
    s = result.settings
    table = Table(title=f"least squares: {s['problems']} problems x {s['inits']} starts, {s['reps']} reps (FedAvg {s['fedavg_reps']}), {s['sampler']} samples")
    for col in ("d", "method", "setting", "bias", "variance", "note"):
        table.add_column(col, justify="left" if col in ("d", "method", "note") else "right")
    for dim, r in result.by_dim.items():
        for i, k in enumerate(r["fedavg"]["steps"]):
            table.add_row(
                str(dim),
                "fedavg",
                f"{k} steps",
                _g(r["fedavg"]["bias"][i]),
                _g(r["fedavg"]["variance"][i]),
                f"closed-form bias {_g(r['fedavg']['bias_exact'][i])}",
            )
        for i, k in enumerate(r["fedpa"]["samples"]):
            table.add_row(
                str(dim),
                "fedpa",
                f"{k} samples ({r['fedpa']['steps'][i]} steps)",
                _g(r["fedpa"]["bias"][i]),
                _g(r["fedpa"]["variance"][i]),
                f"rho {r['fedpa']['rho']:g}",
            )
        for i, v in enumerate(r["fedpa_rho"]["rho"]):
            table.add_row(
                str(dim), "fedpa_rho", f"rho {v:g}", _g(r["fedpa_rho"]["bias"][i]), _g(r["fedpa_rho"]["variance"][i]), f"{r['fedpa_rho']['samples']} samples"
            )
        table.add_row(str(dim), "exact", "||g*||", _g(r["exact"]["norm"]), "", "", end_section=True)
    _emit(json_, result.summary(), table, plot)


@toy_app.command("niw")
def niw(
    out: Annotated[Optional[Path], typer.Option("--out", help="output folder (default runs/toy_niw)")] = None,
    json_: JsonOpt = False,
    seed: SeedOpt = 0,
    trials: Annotated[int, typer.Option(min=1, help="random problems (Guo et al. 2023 (FedEP): 200)")] = 200,
    clients: Annotated[int, typer.Option(min=1, help="clients per problem (Guo et al. 2023 (FedEP): 2)")] = 2,
    dim: Annotated[int, typer.Option(min=1, help="dimension (Guo et al. 2023 (FedEP): 2)")] = 2,
    steps: Annotated[int, typer.Option(min=1, help="EP steps (Guo et al. 2023 (FedEP): 100; use ~1000 for dim > 2 or > 2 clients)")] = 100,
    iso_steps: Annotated[Optional[int], typer.Option(min=1, help="scaled-identity EP steps (default --steps)")] = None,
    damping: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="EP damping (default min(1, 2/clients))")] = None,
    nu: Annotated[Optional[float], typer.Option(help="inverse-Wishart dof (default 7, or dim + 5 for dim > 2)")] = None,
    float32: Annotated[bool, typer.Option("--float32", help="run EP in float32 (the paper's precision)")] = False,
):
    """Random normal-inverse-Wishart clients: FedAvg, FedPA and EP vs the exact global mean (Guo et al. 2023 (FedEP) Table 4, Fig. 4 left)."""
    import jax.numpy as jnp

    from fedbayes.toys import plots
    from fedbayes.toys.niw import run_niw

    if damping is not None and damping <= 0:
        _fail(f"toy error: --damping must be in (0, 1]; got {damping}")
    try:
        result = run_niw(
            trials=trials,
            num_clients=clients,
            dim=dim,
            steps=steps,
            iso_steps=iso_steps,
            damping=damping,
            seed=seed,
            nu=nu,
            dtype=jnp.float32 if float32 else jnp.float64,
        )
    except ValueError as exc:
        _fail(f"toy error: {exc}")
    plot = plots.plot_niw(result, (out or Path("runs/toy_niw")) / "toy_niw.png")
    figures = result.summary()
    for name, curve in result.curves.items():
        figures[name]["curve"] = [float(x) for x in curve]
    paper = {"fedavg": "0.54 ± 0.47", "fedpa": "0.26 ± 0.26", "fedep_diag": "1.1e-7 ± 9.8e-8", "fedep_iso": "—"}
    s = result.settings
    table = Table(
        title=f"NIW toy: {s['trials']} trials, {s['clients']} clients, dim {s['dim']}, nu {s['nu']:g}, {s['steps']} EP steps, damping {s['damping']:.3g}, {s['dtype']}"
    )
    for col in ("method", "mean distance", "std", "max", "Guo et al. 2023 (FedEP) Table 4"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for name, f in figures.items():
        table.add_row(name, _g(f["mean"]), _g(f["std"]), _g(f["max"]), paper[name] if (s["dim"], s["clients"]) == (2, 2) else "")
    _emit(json_, figures, table, plot)
