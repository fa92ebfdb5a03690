"""Markdown tables of docs/results/flower.md from runs/flower_overhead/summary.json
(benchmarks/flower_overhead.py) and runs/flower_all/results.jsonl (scripts/flower_all_algorithms.py).

    python scripts/flower_results_tables.py [SUMMARY_JSON [RESULTS_JSONL]]
"""

from __future__ import annotations

import json
from pathlib import Path


def algorithms(path: Path = Path("runs/flower_all/results.jsonl")) -> str:
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    best = {}
    for r in rows:  # the last attempt per algorithm
        best[r["algorithm"]] = r
    lines = [
        "| algorithm | fedbayes deploy | max abs difference of the final server state vs fedbayes run | s / round (deployed) | rejected | missing | accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in best.items():
        if "error" in r:
            lines.append(f"| {name} | exit {r['deploy_exit']} | {r['error']} | | | | |")
            continue
        lines.append(f"| {name} | exit 0 | {r['max_abs_diff']:.1e} | {r['seconds_per_round']:.1f} | {r['rejected']} | {r['dropped']} | {r['accuracy']:.4f} |")
    return "\n".join(lines)


NAMES = {
    "simulator_logreg": "simulator, logreg (blocked round)",
    "simulator_heavy_mlp": "simulator, heavy MLP (blocked round)",
    "warm_logreg": "fedbayes deploy, warm executors, logreg",
    "warm_heavy_mlp": "fedbayes deploy, warm executors, heavy MLP",
    "stock_logreg": "fedbayes deploy, Flower's stock path, logreg",
    "flower_fedavg_logreg": "Flower's own FedAvg, stock path, logreg (same processes)",
}


def overhead(summary: Path = Path("runs/flower_overhead/summary.json")) -> str:
    """The table of benchmarks/flower_overhead.py's summary.json."""
    data = json.loads(summary.read_text())
    lines = ["| measurement | steady round, median (min to max) | first round | rounds | load average before / after |", "|---|---|---|---|---|"]
    for key, name in NAMES.items():
        r = data[key]
        v, (a, b) = r["value"], r["load"]
        if isinstance(v, dict):
            lines.append(f"| {name} | {_s(v['median'])} ({_s(v['min'])} to {_s(v['max'])}) | {_s(v['first'])} | {v['n']} + 1 | {a} / {b} |")
        else:
            lines.append(f"| {name} | {_s(v)} (all rounds' mean) | | | {a} / {b} |")
    lines.append(
        f"\nWarm heavy MLP / simulator's blocked round: {data['ratio_warm_heavy_over_simulator']:.2f}; warm logreg / Flower's FedAvg: "
        f"{data['ratio_warm_logreg_over_flower_fedavg']:.3f} (flwr {data['flwr']})."
    )
    return "\n".join(lines)


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


if __name__ == "__main__":
    import sys

    print(overhead(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("runs/flower_overhead/summary.json")))
    print()
    print(algorithms(Path(sys.argv[2]) if len(sys.argv) > 2 else Path("runs/flower_all/results.jsonl")))
