"""A results table (Markdown) from finished run folders of ``fedbayes run`` / ``compare``.

    .venv/bin/python docs/results/make_table.py runs/fmnist_bayes --thresholds 0.80,0.85

Arguments are run folders (each with ``summary.json``) or comparison folders (each variant a
subfolder); columns: final accuracy, NLL, ECE-15, their marginalised versions (Bayesian methods),
best accuracy, rounds to each threshold (first round reaching it; and with the 10-round running
mean of Guo et al. 2023 (FedEP) and Al-Shedivat et al. 2021 (FedPA)), and training seconds.
"""

import argparse
import json
from pathlib import Path

from fedbayes.evaluation.metrics import rounds_to_threshold
from fedbayes.runs.folder import read_metrics


def _runs(paths):
    """(name, summary, accuracy curve) of every finished run under ``paths``."""
    for p in map(Path, paths):
        runs = [p] if (p / "summary.json").is_file() else sorted(q for q in p.iterdir() if (q / "summary.json").is_file())
        if (p / "compare.json").is_file():  # a comparison keeps its variants' order
            order = list(json.loads((p / "compare.json").read_text()))
            runs = [p / name for name in order]
        for run in runs:
            recs = read_metrics(run / "metrics.jsonl")
            yield run.name, json.loads((run / "summary.json").read_text()), [r["round"] for r in recs], [r.get("accuracy") for r in recs]


def _f(v, pct=False):
    return "—" if v is None else (f"{100 * v:.2f}" if pct else f"{v:.4f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--thresholds", default="0.80,0.85")
    args = ap.parse_args()
    thr = args.thresholds.split(",")
    cols = ["method", "accuracy", "NLL", "ECE-15 (%)", "acc marg.", "NLL marg.", "ECE marg. (%)", "best acc"]
    cols += [f"rounds to {float(t):.0%}" for t in thr] + [f"rounds to {float(t):.0%} (rm10)" for t in thr] + ["rejected", "train s"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name, s, rounds, acc in _runs(args.paths):
        f = s["final"]
        row = [name, _f(f["accuracy"]), _f(f["nll"]), _f(f["ece"], True), _f(f.get("accuracy_marg")), _f(f.get("nll_marg")), _f(f.get("ece_marg"), True)]
        row += [_f(s.get("best_accuracy"))]
        for window in (1, 10):
            row += [str(rounds_to_threshold(rounds, acc, float(t), window=window) or "—") for t in thr]
        row += [str(f.get("rejected", 0)), f"{f['seconds']:.0f}"]
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
