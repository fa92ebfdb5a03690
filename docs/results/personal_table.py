"""The table of docs/results/personalisation.md from a comparison run with --personal.

    PYTHONPATH=src python docs/results/personal_table.py runs/personal_digits

Reads every VARIANT/seed_S/personal.json and prints, per method and predictive, the global and the
personalised model's accuracy, worst-10% accuracy, NLL and ECE on the clients' own test examples,
each the mean over seeds (± the standard deviation over seeds).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def cell(values: list[float], digits: int = 3) -> str:
    return f"{np.mean(values):.{digits}f} ± {np.std(values, ddof=1 if len(values) > 1 else 0):.{digits}f}"  # the sample std, as compare


def main(folder: Path) -> None:
    print(
        "| method | personalised by | predictive | acc global | acc personal | worst 10% global | worst 10% personal | NLL global | NLL personal | ECE global | ECE personal |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for variant in sorted(p for p in folder.iterdir() if p.is_dir()):
        bodies = [json.loads(f.read_text()) for f in sorted(variant.glob("seed_*/personal.json"))]
        if not bodies:
            continue
        how = bodies[0]["personalisation"]
        how = f"q_g t_k^{bodies[0]['weight']:g}" if how == "site" else f"fine-tuning, {bodies[0]['epochs']} epochs"
        for predictive in ("point", "marginal"):
            if predictive not in bodies[0]["predictives"]:
                continue
            if predictive == "marginal" and bodies[0]["personalisation"] != "site":
                continue  # a fine-tuned model is a point: its marginal score is its point score

            def get(which, metric, stat, _p=predictive):
                return [b["predictives"][_p][which][metric][stat] for b in bodies]

            row = [variant.name, how, predictive]
            row += [cell(get("global", "accuracy", "mean")), cell(get("personal", "accuracy", "mean"))]
            row += [cell(get("global", "accuracy", "worst10")), cell(get("personal", "accuracy", "worst10"))]
            row += [cell(get("global", "nll", "mean")), cell(get("personal", "nll", "mean"))]
            row += [cell(get("global", "ece", "mean")), cell(get("personal", "ece", "mean"))]
            print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
