"""FedSEP against stochastic EP's own fixed point (docs/results/posterior_defaults.md, "FedSEP's
plateau: SEP's fixed point, measured").

FedSEP's rows in the posterior benchmark stop 0.05-0.12 from EP's family optimum. This script
separates the two possible causes, the federated algorithm and SEP's approximation, by computing
SEP's fixed point on each problem's split centrally (:func:`fedbayes.evaluation.reference.sep_fixed_point`)
and running FedSEP, with Laplace and NGVI clients, twice against it and against EP's optimum:

* ``defaults``: only the method's name set (the benchmark's first table);
* ``exact_local``: the clients run to their tilted optimum (``client.max_steps`` 600,
  ``max_epochs`` 300, ``tol`` 0.003), so that the federated run's fixed point is SEP's.

Every run is 300 rounds, all clients every round, checked every 25 rounds, on the posterior
benchmark's two problems and the two of ``benchmarks/posterior_unseen.py``. The central SEP fixed
points get rows of their own against NUTS. Rows are cached per run (``--out``): an interrupted run
redoes only what had not finished.

    PYTHONPATH=src python benchmarks/sep_fixed_point.py --out runs/sep_fixed_point --json docs/results/posterior_sep.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from posterior_unseen import PROBLEMS as UNSEEN

from fedbayes.bench.posterior import FULL, PROBLEMS, Method, run_problem
from fedbayes.runs.folder import write_atomic

EXACT_LOCAL = {"max_steps": 600, "max_epochs": 300, "tol": 0.003}
CLIENTS = {"defaults": {}, "exact_local": EXACT_LOCAL}
EP_FAMILY = {"laplace": "diag_laplace", "ngvi": "ngvi"}


def methods() -> list[Method]:
    """FedSEP with each client method, measured against EP's optimum and against SEP's."""
    rows = []
    for tilted, family in EP_FAMILY.items():
        algorithm = {"name": "fedsep", "method": tilted}
        rows.append(Method(f"fedsep_{tilted}", f"FedSEP ({tilted}) vs EP's optimum", algorithm, family))
        rows.append(Method(f"fedsep_{tilted}_vs_sep", f"FedSEP ({tilted}) vs SEP's fixed point", algorithm, f"sep_{tilted}"))
    return rows


def _summary(problem: dict) -> dict:
    """The numbers the results page quotes: each row's distances at round 300 and its predictive."""
    out = {"problem": problem["problem"], "client_sizes": problem["client_sizes"], "rows": {}}
    for row in problem["rows"]:
        if "error" in row:
            out["rows"][row["key"]] = {"error": row["error"]}
            continue
        keep = {"label": row["label"], "vs_nuts": row["vs_nuts"], "kl_nuts_q": row.get("kl_nuts_q"), "predictive": row.get("predictive")}
        for field in ("vs_family", "vs_ep_family"):
            if row.get(field) is not None:
                keep[field] = row[field]
        if "trajectory" in row:
            keep.update(family=row["family"], steps_per_client_round=row["steps_per_client_round"], trajectory=row["trajectory"])
        out["rows"][row["key"]] = keep
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="runs/sep_fixed_point")
    ap.add_argument("--json", default=None, help="also write the summary here")
    ap.add_argument("--problem", action="append", default=None, choices=[*PROBLEMS, *UNSEEN])
    ap.add_argument("--max-rounds", type=int, default=300)
    args = ap.parse_args()
    problems = {**PROBLEMS, **UNSEEN}
    result: dict = {"command": "PYTHONPATH=src python benchmarks/sep_fixed_point.py", "clients": CLIENTS, "max_rounds": args.max_rounds, "runs": {}}
    for name, client in CLIENTS.items():
        settings = dataclasses.replace(FULL, max_rounds=args.max_rounds, check_every=25, client=client, stop_at_bar=False)
        result["runs"][name] = [
            _summary(run_problem(problems[p], Path(args.out) / name, settings, methods(), log=print)) for p in args.problem or list(problems)
        ]
    text = json.dumps(result, indent=1, default=float) + "\n"
    write_atomic(Path(args.out) / "sep_fixed_point.json", text)
    if args.json:
        write_atomic(Path(args.json), text)


if __name__ == "__main__":
    main()
