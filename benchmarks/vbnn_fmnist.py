"""Ozer et al. 2022 (VBNN aggregation)'s aggregation rules on Fashion-MNIST at a reduced budget (docs/results/vbnn.md).

    PYTHONPATH=src .venv/bin/python benchmarks/vbnn_fmnist.py [--model mlp|cnn] [--rounds 10]
        [--epochs 1] [--clients 10] [--per-round M] [--partitions iid dirichlet] [--weightings examples uniform]
        [--rules fed eaa gaa aalv ppa cf] [--accumulation exact|reference_code] [--seed 0]
        [--out docs/results/vbnn_runs.jsonl]

Every run: ``--clients`` clients, all active every round (``--per-round M``: M sampled each round), the paper's client optimizer (SGD lr
0.01, momentum 0.9, weight decay 1e-5, batch 64) for ``--epochs`` local epochs, ``--rounds``
rounds; IID or Dirichlet(0.5) label skew with at least 10 examples per client; weighting
``examples`` (FVBWA / FEDAVG) or ``uniform`` (FVBA / FED). ``fed`` is the deterministic model
trained by FedAvg (server SGD lr 1). The variational runs are evaluated by the marginalised
predictive over 10 stochastic passes, the deterministic ones by their point prediction, both on
the 10,000 test images (accuracy, ECE-15, NLL), and the variational ones report the L2 norm of the
stored standard deviations (Table 4) and of the clamped ones. One JSON line per finished run is
appended to ``--out``; a run already there (same settings) is skipped, so the script resumes.
``--accumulation reference_code`` sums EAA's and GAA's variances as the paper's published code
does (``fedbayes.algorithms.vbnn``'s module docstring); its rows carry ``"accumulation"``. Every
variational run here is the published code (``vbnn(..., variant="paper")``), whose tables these
reproduce.

    PYTHONPATH=src .venv/bin/python benchmarks/vbnn_fmnist.py --analyse COMPARE_DIR [--plot PNG] [--data JSON]

reads a ``fedbayes compare`` folder instead (e.g. of ``examples/fmnist_vbnn_bayes.toml``) and prints
each run's final accuracy, NLL and ECE with its log-variances' quantiles at the start and the end;
``--plot`` draws their histograms.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fedbayes.sim import hostdevices  # noqa: E402

hostdevices.configure()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedbayes.algorithms.fedavg import fedavg  # noqa: E402
from fedbayes.algorithms.server_opt import make_server_optimizer  # noqa: E402
from fedbayes.algorithms.vbnn import vbnn  # noqa: E402
from fedbayes.data import load_dataset, partition  # noqa: E402
from fedbayes.data.federation import Federation  # noqa: E402
from fedbayes.evaluation.metrics import classification_metrics  # noqa: E402
from fedbayes.evaluation.variational import predictive_metrics  # noqa: E402
from fedbayes.inference import LocalTrainer  # noqa: E402
from fedbayes.models import init_params, loss_fn, make_model  # noqa: E402
from fedbayes.models.variational import apply_with_key, std_norm  # noqa: E402
from fedbayes.sim.simulator import Simulator  # noqa: E402


def _settings(args, part: str, weighting: str, rule: str) -> dict:
    extra = {"accumulation": args.accumulation} if args.accumulation != "exact" and rule not in ("fed", "aalv", "cf", "ppa") else {}
    if args.per_round not in (None, args.clients):
        extra["per_round"] = args.per_round
    return {
        **extra,
        "model": args.model,
        "rounds": args.rounds,
        "epochs": args.epochs,
        "clients": args.clients,
        "partition": part,
        "weighting": weighting,
        "rule": rule,
        "seed": args.seed,
    }


SETTING_KEYS = ("accumulation", "per_round", "model", "rounds", "epochs", "clients", "partition", "weighting", "rule", "seed")


def _settings_of(row: dict) -> dict:
    """A result row's settings, as :func:`_settings` writes them (its metrics dropped)."""
    return {k: row[k] for k in SETTING_KEYS if k in row}


def _stored_params(sim, state):
    """The server's stored variational parameters (``VBNNState.params``, before the paper
    variant's clamp that ``server_params`` applies)."""
    return state.server_state.params


def run_one(args, data, part: str, weighting: str, rule: str) -> dict:
    rng = np.random.default_rng([args.seed, 2])
    params_kw = {"alpha": 0.5} if part == "dirichlet" else {}
    parts = partition(part, data.y_train, args.clients, rng, **params_kw)
    federation = Federation(data.x_train, data.y_train, tuple(parts))
    optimizer = optax.chain(optax.add_decayed_weights(1e-5), optax.sgd(0.01, momentum=0.9))
    variational = rule != "fed"
    model = make_model(args.model, data.num_classes, variational=variational)
    params = init_params(model, jax.random.fold_in(jax.random.key(args.seed), 3), data.feature_shape)
    if variational:
        apply = apply_with_key(model)
        # the published code (variant "paper"): the paper's tables are of it
        algo = vbnn(LocalTrainer(None, optimizer, args.epochs, 64), apply, aggregation=rule, accumulation=args.accumulation, variant="paper")
    else:
        algo = fedavg(LocalTrainer(loss_fn(model, "classification"), optimizer, args.epochs, 64), make_server_optimizer("sgd", 1.0))
    sim = Simulator(algo, federation, clients_per_round=args.per_round or args.clients, seed=args.seed, weighting=weighting)
    state = sim.init(params)
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        state, info = sim.run_round(state)
    train_s = time.perf_counter() - t0
    final = sim.server_params(state)  # the paper variant's: clamped to [-8, 8], as its forward pass
    if variational:
        metrics = predictive_metrics(apply, final, jax.random.key(1000 + args.seed), data.x_test, data.y_test, num_samples=10)
        metrics["std_norm"] = float(std_norm(_stored_params(sim, state)))  # Table 4: the stored log-variances
    else:
        logits = jnp.concatenate([model.apply({"params": final}, jnp.asarray(data.x_test[i : i + 2000])) for i in range(0, len(data.x_test), 2000)])
        metrics = {k: float(v) for k, v in classification_metrics(logits, jnp.asarray(data.y_test)).items()}
    return {**_settings(args, part, weighting, rule), **metrics, "train_s": train_s, "rejected_last_round": len(info.rejected)}


# Ozer et al. 2022, Fashion-MNIST: (accuracy %, ECE %, NLL), means over 5 seeds. Table 1: 10 clients,
# all active, 50 rounds; Table 3: 100 clients, 10 a round, 500 rounds; both the CNN, 10 local epochs.
# "fed" is FED under uniform weights and FEDAVG under example weights.
PAPER = {
    10: {
        ("iid", "uniform"): {
            "fed": (89.62, 7.99, 0.64),
            "eaa": (90.10, 3.04, 0.30),
            "gaa": (89.82, 6.38, 0.46),
            "aalv": (89.85, 6.44, 0.47),
            "ppa": (89.78, 2.16, 0.29),
            "cf": (89.90, 6.35, 0.47),
        },
        ("iid", "examples"): {
            "fed": (89.58, 7.97, 0.63),
            "eaa": (90.09, 3.07, 0.30),
            "gaa": (89.85, 6.37, 0.47),
            "aalv": (89.85, 6.37, 0.46),
            "ppa": (89.68, 2.17, 0.29),
            "cf": (89.84, 6.37, 0.46),
        },
        ("dirichlet", "uniform"): {
            "fed": (88.11, 8.73, 0.65),
            "eaa": (88.57, 3.45, 0.34),
            "gaa": (88.62, 6.47, 0.47),
            "aalv": (88.47, 6.64, 0.47),
            "ppa": (88.14, 2.41, 0.34),
            "cf": (88.75, 6.44, 0.47),
        },
        ("dirichlet", "examples"): {
            "fed": (87.99, 8.90, 0.66),
            "eaa": (88.30, 3.47, 0.35),
            "gaa": (88.39, 6.73, 0.48),
            "aalv": (88.46, 6.78, 0.49),
            "ppa": (87.72, 2.47, 0.35),
            "cf": (88.33, 6.90, 0.49),
        },
    },
    100: {
        ("iid", "uniform"): {
            "fed": (88.55, 8.30, 0.63),
            "eaa": (85.77, 3.02, 0.42),
            "gaa": (89.49, 4.97, 0.35),
            "aalv": (89.31, 5.03, 0.35),
            "ppa": (85.05, 3.24, 0.45),
            "cf": (89.40, 4.96, 0.35),
        },
        ("iid", "examples"): {
            "fed": (88.38, 8.48, 0.64),
            "eaa": (85.88, 2.58, 0.42),
            "gaa": (89.56, 4.81, 0.35),
            "aalv": (89.48, 4.92, 0.35),
            "ppa": (85.00, 3.14, 0.45),
            "cf": (89.53, 4.87, 0.35),
        },
        ("dirichlet", "uniform"): {
            "fed": (87.16, 8.39, 0.58),
            "eaa": (82.18, 4.32, 0.54),
            "gaa": (87.73, 4.72, 0.38),
            "aalv": (87.49, 4.94, 0.38),
            "ppa": (72.87, 7.97, 0.83),
            "cf": (87.63, 4.75, 0.38),
        },
        ("dirichlet", "examples"): {
            "fed": (86.77, 8.56, 0.59),
            "eaa": (79.61, 4.74, 0.61),
            "gaa": (87.40, 4.92, 0.39),
            "aalv": (87.42, 5.07, 0.39),
            "ppa": (76.38, 5.59, 0.70),
            "cf": (87.16, 5.12, 0.40),
        },
    },
}
# Table 4: the L2 norm of the final model's standard deviations, non-IID, FVBWA.
PAPER_STD = {10: {"eaa": 15.48, "gaa": 3.93, "aalv": 2.81, "ppa": 18.40, "cf": 1.40}, 100: {"eaa": 79.19, "gaa": 3.94, "aalv": 2.80, "ppa": 64.70, "cf": 1.42}}
RULES = ("fed", "eaa", "gaa", "aalv", "ppa", "cf", "merging")


def _label(rule: str, weighting: str) -> str:
    if rule == "fed":
        return "FED" if weighting == "uniform" else "FEDAVG"
    return ("FVBA " if weighting == "uniform" else "FVBWA ") + rule.upper()


def tables(rows: list[dict]) -> str:
    """Markdown tables of ``rows`` (the JSON lines), one per budget and accumulation, beside the
    paper's Table 1 (10 clients) or Table 3 (100 clients) and Table 4's standard-deviation norms."""
    out = []
    budgets = sorted(
        {(r["model"], r["clients"], r.get("per_round") or r["clients"], r["rounds"], r["epochs"], r.get("accumulation", "exact"), r["seed"]) for r in rows}
    )
    for model, clients, per_round, rounds, epochs, acc, seed in budgets:
        group = [
            r
            for r in rows
            if (r["model"], r["clients"], r.get("per_round") or r["clients"], r["rounds"], r["epochs"], r.get("accumulation", "exact"), r["seed"])
            == (model, clients, per_round, rounds, epochs, acc, seed)
        ]
        paper = PAPER.get(clients, {})
        table_no = {10: "Table 1", 100: "Table 3"}.get(clients, "no table")
        out.append(
            f"**{model.upper()}, {clients} clients ({per_round} a round), {rounds} rounds x {epochs} local epoch(s), seed {seed}, accumulation {acc}** (paper: {table_no}, the CNN at its full budget)\n"
        )
        out.append("| partition | model | accuracy | ECE (%) | NLL | std norm | paper accuracy | paper ECE (%) | paper NLL | paper std norm |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for part in ("iid", "dirichlet"):
            for weighting in ("uniform", "examples"):
                for rule in RULES:
                    hit = [r for r in group if (r["partition"], r["weighting"], r["rule"]) == (part, weighting, rule)]
                    if not hit:
                        continue
                    r = hit[-1]
                    ref = paper.get((part, weighting), {}).get(rule)
                    std = r.get("std_norm")
                    ref_std = PAPER_STD.get(clients, {}).get(rule) if (part, weighting) == ("dirichlet", "examples") else None
                    cells = [
                        "IID" if part == "iid" else "non-IID", _label(rule, weighting), f"{100 * r['accuracy']:.2f}", f"{100 * r['ece']:.2f}",
                        f"{r['nll']:.3f}", "-" if std is None else f"{std:.2f}",
                        *(("-",) * 3 if ref is None else (f"{ref[0]:.2f}", f"{ref[1]:.2f}", f"{ref[2]:.2f}")), "-" if ref_std is None else f"{ref_std:.2f}",
                    ]  # fmt: skip
                    out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


QUANTILES = (0.0, 0.05, 0.5, 0.95, 1.0)


def _initial_params(config):
    """The run's initial variational parameters as its server holds them after ``server_init``
    (``fedbayes.runs.build``'s model and key; the paper variant redraws its log-variances)."""
    from fedbayes import protocol
    from fedbayes.models.variational import paper_init

    data = load_dataset(config.data.dataset)
    model = make_model(config.model.name, data.num_classes, variational=True, hidden=tuple(config.model.hidden), activation=config.model.activation)
    params = init_params(model, protocol.params_key(config.seed), data.feature_shape)
    if getattr(config.algorithm, "variant", "bayes") == "paper":
        params = paper_init(protocol.server_init_key(config.seed), params)
    if getattr(config.algorithm, "method", "bbb") == "ivon":  # the server's IVON start, h = h_0
        from fedbayes.algorithms.vbnn import ivon_init, ivon_settings_for
        from fedbayes.config.schema import validate_algorithm
        from fedbayes.runs.build import prepare_split

        # a stored [algorithm] holds the keys the run set; the settings give the defaults of the rest
        algorithm = validate_algorithm(config.algorithm.model_dump())
        hess_init = ivon_settings_for(algorithm, "client").hess_init  # a network's IVON client takes minibatches
        total = sum(len(p) for p in prepare_split(config)[1])
        params = ivon_init(params, hess_init, total / algorithm.kl_weight, algorithm.prior_variance)
    return params


def analyse(compare_dir: str, plot: str | None, data_out: str | None) -> str:
    """The log-variances at the start and the end of every finished run under ``compare_dir`` (a
    ``fedbayes compare --out`` folder): min / 5% / median / 95% / max over all variational weights,
    the final round's accuracy, NLL and ECE (the marginalised predictive for variational runs),
    and a histogram per run (``plot``). The end is ``model.npz``: the parameters the model predicts
    with (for the paper variant clamped to [-8, 8], where the forward pass sees them)."""
    from pathlib import Path

    from fedbayes.models.variational import logvar_quantiles, split_variational
    from fedbayes.runs.export import load_run

    rows, hists = [], {}
    for run in sorted(p for p in Path(compare_dir).iterdir() if (p / "model.npz").is_file()):
        config, params, metrics = load_run(run)
        last = [m for m in metrics if "accuracy" in m][-1]
        row = {"run": run.name, "algorithm": config.algorithm.name, "round": last.get("round"), **{k: last[k] for k in ("accuracy", "nll", "ece")}}
        if config.model.variational:
            row["variant"] = config.algorithm.variant
            row["aggregation"] = config.algorithm.aggregation
            start = _initial_params(config)
            row["logvar_start"] = logvar_quantiles(start, QUANTILES)
            row["logvar_end"] = logvar_quantiles(params, QUANTILES)
            row["logvar_start_per_layer"] = {
                "/".join(k): [float(x) for x in np.quantile(np.asarray(v), QUANTILES)] for k, v in split_variational(start)[1].items()
            }
            row["logvar_end_per_layer"] = {
                "/".join(k): [float(x) for x in np.quantile(np.asarray(v), QUANTILES)] for k, v in split_variational(params)[1].items()
            }
            flat = lambda p: np.concatenate([np.ravel(np.asarray(v)) for v in split_variational(p)[1].values()])  # noqa: E731
            hists[run.name] = (flat(start), flat(params))
        rows.append(row)
    lines = [
        "| run | rule (variant) | accuracy | NLL | ECE (%) | log-variance at the start: min / 5% / median / 95% / max | at the end |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        fmt = lambda q: " / ".join(f"{x:.2f}" for x in q)  # noqa: E731
        rule = f"{r['aggregation'].upper()} ({r['variant']})" if "variant" in r else r["algorithm"]
        lv = (fmt(r["logvar_start"]), fmt(r["logvar_end"])) if "variant" in r else ("-", "-")
        lines.append(f"| {r['run']} | {rule} | {r['accuracy']:.4f} | {r['nll']:.4f} | {100 * r['ece']:.2f} | {lv[0]} | {lv[1]} |")
    lines += ["", "| run | layer | start: min / 5% / median / 95% / max | end |", "| --- | --- | --- | --- |"]
    for r in rows:
        for layer, end in r.get("logvar_end_per_layer", {}).items():
            fmt = lambda q: " / ".join(f"{x:.2f}" for x in q)  # noqa: E731
            lines.append(f"| {r['run']} | {layer} | {fmt(r['logvar_start_per_layer'][layer])} | {fmt(end)} |")
    if data_out:
        with open(data_out, "w") as f:
            json.dump(rows, f, indent=1)
    if plot and hists:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ncols = min(4, len(hists))
        nrows = -(-len(hists) // ncols)
        fig, axes = plt.subplots(nrows, ncols, figsize=(3.2 * ncols, 2.6 * nrows), sharey=True, squeeze=False)
        for ax in axes.ravel()[len(hists) :]:
            ax.axis("off")
        lo = min(min(a.min(), b.min()) for a, b in hists.values())
        hi = max(max(a.max(), b.max()) for a, b in hists.values())
        bins = np.linspace(np.floor(lo), np.ceil(hi), 80)
        for ax, (name, (a, b)) in zip(axes.ravel(), hists.items()):
            ax.hist(a, bins=bins, alpha=0.6, label="start")
            ax.hist(b, bins=bins, alpha=0.6, label="end")
            ax.set_yscale("log")
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("log sigma^2")
        for row in axes:
            row[0].set_ylabel("weights")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="mlp", choices=("mlp", "cnn"))
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--per-round", type=int, default=None, help="clients per round (default: all)")
    ap.add_argument("--partitions", nargs="+", default=["iid", "dirichlet"], choices=("iid", "dirichlet"))
    ap.add_argument("--weightings", nargs="+", default=["examples"], choices=("examples", "uniform"))
    ap.add_argument("--rules", nargs="+", default=["fed", "eaa", "gaa", "aalv", "ppa", "cf"], choices=("fed", "eaa", "gaa", "aalv", "ppa", "cf", "merging"))
    ap.add_argument("--accumulation", default="exact", choices=("exact", "reference_code"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="docs/results/vbnn_runs.jsonl")
    ap.add_argument("--table", action="store_true", help="print the tables of the finished runs in --out beside the paper's, and stop")
    ap.add_argument("--analyse", metavar="COMPARE_DIR", help="print the log-variance table of a fedbayes compare folder, and stop")
    ap.add_argument("--plot", help="with --analyse: the histograms' PNG")
    ap.add_argument("--data", help="with --analyse: the rows as JSON")
    args = ap.parse_args(argv)
    if args.analyse:
        print(analyse(args.analyse, args.plot, args.data))
        return

    done = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = [json.loads(line) for line in f if line.strip()]
    if args.table:
        print(tables(done))
        return
    data = load_dataset("fashion_mnist")
    for part in args.partitions:
        for weighting in args.weightings:
            for rule in args.rules:
                key = _settings(args, part, weighting, rule)
                if any(_settings_of(row) == key for row in done):
                    continue
                row = run_one(args, data, part, weighting, rule)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
