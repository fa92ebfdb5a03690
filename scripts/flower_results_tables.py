"""Markdown tables of docs/results/flower.md from runs/flower_all/results.jsonl and
runs/flower_overhead/summary.json (or the rows printed so far in runs/flower_overhead.log).

    python scripts/flower_results_tables.py
"""

from __future__ import annotations

import json
import statistics
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


def overhead(folder: Path = Path("runs/flower_overhead"), log: Path = Path("runs/flower_overhead.log")) -> str:
    rows = [json.loads(x) for x in log.read_text().splitlines() if x.startswith('{"rep"')] if log.is_file() else []
    lines = [
        "| pair | fedbayes s / round | fedbayes s / round, rounds 2+ | Flower FedAvg s / round | ratio | fedbayes run wall s | Flower run wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios = []
    for rep in sorted({r["rep"] for r in rows}):
        pair = {r["kind"]: r for r in rows if r["rep"] == rep}
        if len(pair) < 2:
            continue
        a, b = pair["fedbayes"], pair["flower"]
        ratios.append(a["seconds_per_round"] / b["seconds_per_round"])
        recs = [json.loads(x) for x in (folder / f"fedbayes_{rep}" / "metrics.jsonl").read_text().splitlines()]
        later = (recs[-1]["seconds"] - recs[1]["seconds"]) / (len(recs) - 2) if len(recs) > 2 else float("nan")
        lines.append(
            f"| {folder.name} {rep} | {a['seconds_per_round']:.1f} | {later:.1f} | {b['seconds_per_round']:.1f} | {ratios[-1]:.2f} | {a['run_wall_s']:.0f} | {b['run_wall_s']:.0f} |"
        )
    if ratios:
        lines.append(
            f"\nRatio fedbayes / Flower per round: median {statistics.median(ratios):.2f}, range {min(ratios):.2f} to {max(ratios):.2f} ({len(ratios)} pairs)."
        )
    return "\n".join(lines)


if __name__ == "__main__":
    for name in ("flower_overhead", "flower_overhead2"):
        print(overhead(Path("runs") / name, Path("runs") / f"{name}.log"))
        print()
    print()
    print(algorithms())
