"""The conformal table of docs/results/conformal.md from a comparison run with --conformal (and --shift).

    .venv/bin/python docs/results/conformal_table.py runs/conformal_digits

One row per method and predictive (the point one; ``marg.`` the marginalised one of a method with a
posterior; a variational model's only one): each seed's coverage, their mean, the finite-sample
bound [1 - alpha, 1 - alpha + 1/(N + 1)] (N the calibration examples; the bound is on the expected
coverage, and one seed's test set of n examples measures it within about sqrt(0.09 / n)), the mean
set size, the share of empty sets, each client's coverage (min and median over clients, mean over
seeds) and, from shift.json, the coverage averaged over each shift's levels.
"""

import json
import sys
from pathlib import Path

import numpy as np


def main(out: Path) -> None:
    order = list(json.loads((out / "compare.json").read_text()))
    shift = json.loads((out / "shift.json").read_text()) if (out / "shift.json").is_file() else None
    kinds = list(shift["shifts"]) if shift else []
    cols = ["method", "coverage per seed", "mean", "bound", "set size", "empty sets", "client min", "client median"] + [f"under {k}" for k in kinds]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name in order:
        bodies = [json.loads(p.read_text()) for p in sorted((out / name).glob("seed_*/conformal.json"))]
        for predictive, suffix in (("point", ""), ("marginal", "_marg")):
            records = [b["predictives"][predictive] for b in bodies if predictive in b["predictives"]]
            if not records:
                continue
            cov = [r["coverage"] for r in records]
            lo, hi = np.mean([b["bound"] for b in bodies], axis=0)
            label = name if predictive == "point" else f"{name} marg."
            cells = [
                label,
                ", ".join(f"{c:.3f}" for c in cov),
                f"{np.mean(cov):.3f}",
                f"[{lo:.3f}, {hi:.3f}]",
                f"{np.mean([r['set_size'] for r in records]):.2f}",
                f"{100 * np.mean([r['empty_sets'] for r in records]):.1f}%",
                f"{np.mean([r['client_coverage']['min'] for r in records]):.3f}",
                f"{np.mean([r['client_coverage']['median'] for r in records]):.3f}",
            ]
            for kind in kinds:
                recs = shift["methods"][name]["records"]
                values = [r[f"coverage{suffix}"] for r in recs if r["shift"] == kind and r["level"] > 0 and f"coverage{suffix}" in r]
                sizes = [r[f"set_size{suffix}"] for r in recs if r["shift"] == kind and r["level"] > 0 and f"set_size{suffix}" in r]
                cells.append(f"{np.mean(values):.3f} ({np.mean(sizes):.2f})" if values else "—")
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
