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
does (``fedbayes.algorithms.vbnn``'s module docstring); its rows carry ``"accumulation"``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fedbayes import hostdevices  # noqa: E402

hostdevices.configure()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fedbayes.algorithms import fedavg, make_server_optimizer  # noqa: E402
from fedbayes.algorithms.vbnn import predictive_metrics, vbnn  # noqa: E402
from fedbayes.data import load_dataset, partition  # noqa: E402
from fedbayes.inference import LocalTrainer  # noqa: E402
from fedbayes.metrics import classification_metrics  # noqa: E402
from fedbayes.models import init_params, loss_fn, make_model  # noqa: E402
from fedbayes.models.variational import apply_with_key  # noqa: E402
from fedbayes.simulate import Federation, Simulator  # noqa: E402


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
        algo = vbnn(LocalTrainer(None, optimizer, args.epochs, 64), apply, aggregation=rule, accumulation=args.accumulation)
    else:
        algo = fedavg(LocalTrainer(loss_fn(model, "classification"), optimizer, args.epochs, 64), make_server_optimizer("sgd", 1.0))
    sim = Simulator(algo, federation, clients_per_round=args.per_round or args.clients, seed=args.seed, weighting=weighting)
    state = sim.init(params)
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        state, info = sim.run_round(state)
    train_s = time.perf_counter() - t0
    final = sim.server_params(state)
    if variational:
        metrics = predictive_metrics(apply, final, jax.random.key(1000 + args.seed), data.x_test, data.y_test, num_samples=10)
    else:
        logits = jnp.concatenate([model.apply({"params": final}, jnp.asarray(data.x_test[i : i + 2000])) for i in range(0, len(data.x_test), 2000)])
        metrics = {k: float(v) for k, v in classification_metrics(logits, jnp.asarray(data.y_test)).items()}
    return {**_settings(args, part, weighting, rule), **metrics, "train_s": train_s, "rejected_last_round": len(info.rejected)}


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
    args = ap.parse_args(argv)

    done = []
    if os.path.exists(args.out):
        with open(args.out) as f:
            done = [json.loads(line) for line in f if line.strip()]
    data = load_dataset("fashion_mnist")
    for part in args.partitions:
        for weighting in args.weightings:
            for rule in args.rules:
                key = _settings(args, part, weighting, rule)
                if any(all(row.get(k) == v for k, v in key.items()) for row in done):
                    continue
                row = run_one(args, data, part, weighting, rule)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
