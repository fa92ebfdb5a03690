"""FedLap-Cov's low-rank structure against NUTS over its rank: the posterior benchmark's problems.

For each rank, FedLap-Cov with ``covariance = "low_rank"`` and that ``rank`` (every other setting
at its default) runs as a row of ``fedbayes bench posterior`` (the same data, split, prior match,
stopping rule and NUTS reference, cached under ``--out``), beside the diagonal and full rows.
Prints one line per problem and rank: the median [min, max] marginal variance ratio to NUTS,
``KL(NUTS-diag || q)``, the mean's distance to NUTS, and the message's numbers
(``2 D + r^2 + D r``). docs/results/low_rank.md.

    PYTHONPATH=src python benchmarks/low_rank_sweep.py --out runs/posterior_lr --ranks 1,2,5,10,20,40
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedbayes.bench.posterior import FULL, METHODS, PROBLEMS, Method, run_problem
from fedbayes.runs.folder import write_atomic


def methods(ranks: list[int]) -> list[Method]:
    by_key = {m.key: m for m in METHODS}
    rows = [by_key["fedlap_cov"], by_key["fedlap_cov_full"]]
    for r in ranks:
        rows.append(
            Method(
                f"fedlap_cov_low_rank_r{r}",
                f"FedLap-Cov (covariance low_rank, rank {r})",
                {"name": "fedlap_cov", "covariance": "low_rank", "rank": r},
                "low_rank_laplace",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/posterior_lr"))
    parser.add_argument("--ranks", default="1,2,5,10,20,40")
    parser.add_argument("--dataset", action="append", default=[], help=f"of {', '.join(PROBLEMS)} (repeatable; default: all)")
    args = parser.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",") if r]
    except ValueError:
        print(f"--ranks: comma-separated integers; got {args.ranks!r}", file=sys.stderr)
        return 2
    if not ranks or min(ranks) < 1:
        print(f"--ranks: at least one rank, each >= 1; got {args.ranks!r}", file=sys.stderr)
        return 2
    names = args.dataset or list(PROBLEMS)
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown:
        print(f"--dataset: unknown {unknown}; allowed: {', '.join(PROBLEMS)}", file=sys.stderr)
        return 2
    summary = {}
    for name in names:
        result = run_problem(PROBLEMS[name], args.out, FULL, methods(ranks), log=lambda s: print(s, flush=True))
        d = result["num_params"]
        lines = []
        for row in result["rows"]:
            key = row.get("key", "")
            if not key.startswith("fedlap_cov"):
                continue
            rank = row["config"]["algorithm"].get("rank") if row["config"]["algorithm"].get("covariance") == "low_rank" else None
            structure = row["config"]["algorithm"].get("covariance", "diagonal")
            numbers = {"diagonal": 2 * d, "full": d + d * d}.get(structure, 2 * d + (rank or 0) ** 2 + d * (rank or 0))
            lines.append(
                {
                    "structure": structure,
                    "rank": rank,
                    "var_ratio_vs_nuts": row["vs_nuts"]["var_ratio"],
                    "kl_nuts_q": row["kl_nuts_q"],
                    "mean_rel_l2_vs_nuts": row["vs_nuts"]["mean_rel_l2"],
                    "message_numbers": numbers,
                    "reached_round": row.get("reached_round"),
                }
            )
        summary[name] = {"num_params": d, "rows": lines}
        for line in lines:
            v = line["var_ratio_vs_nuts"]
            print(
                f"{name} {line['structure']:>9} rank {line['rank'] or '-':>3}: variance vs NUTS {v[0]:.3f} [{v[1]:.2f}, {v[2]:.2f}], "
                f"KL {line['kl_nuts_q']:.2f}, mean {line['mean_rel_l2_vs_nuts']:.3f}, {line['message_numbers']} numbers a message"
            )
    write_atomic(args.out / "low_rank_sweep.json", json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
