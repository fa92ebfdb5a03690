"""The linear VBNN of the posterior benchmark (``fedbayes bench posterior --method vbnn``) with the
IVON client (``algorithm.method = "ivon"``; on this linear model its batch is by default the
client's whole data, ``ivon_batch = "whole"``) against the VBNN's own mean-field optimum (the bias a
point without a prior: the family ``mfvi_point_bias``), on both problems, 300 rounds at most
(docs/results/vbnn_ivon.md).

    PYTHONPATH=src python benchmarks/vbnn_ivon_linear.py --out runs/vbnn_ivon [--set ivon_lr=0.1 ...]
    PYTHONPATH=src python benchmarks/vbnn_ivon_linear.py --out runs/vbnn_ivon --set ivon_batch='"client"'   # minibatches

``--clients-per-round M`` samples ``M`` of the 10 clients a round; ``--seed`` changes the run's seed
(the split and NUTS stay the problem's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from fedbayes.bench.posterior import LINEAR_VARIATIONAL, PROBLEMS, Method, PosteriorBenchSettings, run_problem
from fedbayes.bench.truth import NUTSSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/vbnn_ivon")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--check-every", type=int, default=10)
    ap.add_argument("--set", action="append", default=[], help="algorithm key=value (JSON value)")
    ap.add_argument("--client", default="{}", help="[client] settings as JSON")
    ap.add_argument("--problem", action="append", default=None)
    ap.add_argument("--key", default="vbnn_ivon")
    ap.add_argument("--one-client", action="store_true", help="all the data on one client (no client drift): IVON's own noise floor")
    ap.add_argument("--no-stop", action="store_true", help="run all the rounds after meeting the bar (the row's after_bar: whether it stays)")
    ap.add_argument("--clients-per-round", type=int, default=None, help="sample this many clients a round (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="the run's seed")
    args = ap.parse_args()
    algorithm = {"name": "vbnn", "method": "ivon"}
    for item in args.set:
        k, v = item.split("=", 1)
        algorithm[k] = json.loads(v)
    method = Method(args.key, f"VBNN ({algorithm}) linear, kernel only", algorithm, "mfvi_point_bias", model=dict(LINEAR_VARIATIONAL), kernel_only=True)
    settings = PosteriorBenchSettings(
        max_rounds=args.rounds,
        check_every=args.check_every,
        nuts=NUTSSettings(chains=4, warmup=300, draws=500),
        client=json.loads(args.client),
        stop_at_bar=not args.no_stop,
        clients_per_round=args.clients_per_round,
        seed=args.seed,
    )
    for name in args.problem or list(PROBLEMS):
        problem = PROBLEMS[name]
        if args.one_client:
            problem = dataclasses.replace(problem, split={"num_clients": 1, "partition": "iid"})
        result = run_problem(problem, Path(args.out) / ("one_client" if args.one_client else "."), settings, methods=[method], log=print)
        row = next(r for r in result["rows"] if r.get("key") == args.key)
        print(name, json.dumps({k: row.get(k) for k in ("vs_family", "reached_round", "after_bar", "rounds", "seconds", "error")}))
        print(name, "trajectory", json.dumps([(t["round"], round(t["mean_rel_l2"], 3), round(t["var_ratio"][0], 3)) for t in row.get("trajectory", [])]))


if __name__ == "__main__":
    main()
