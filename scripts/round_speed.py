"""Rounds per second of each method of one or more ``fedbayes compare`` folders, side by side.

    .venv/bin/python scripts/round_speed.py cpu=runs/demo gpu=runs/demo_gpu > speed.md

(any Python that imports fedbayes: it reads the files with :func:`fedbayes.runs.folder.read_metrics`).

Each ``LABEL=FOLDER`` is a comparison's output folder: its ``compare.json`` is keyed by the methods,
and each method's ``metrics.jsonl`` holds the cumulative training seconds at every evaluated round.
A comparison over seeds gives one row per method and seed (``METHOD/seed_S``); a folder without
``compare.json`` (an unfinished comparison) gives every subfolder with a ``metrics.jsonl``, up to
the round it reached. A round's time is the growth of ``seconds`` between two evaluations divided
by the rounds between them: wall time from a round's start to its outputs, with evaluation,
checkpoints and compilation left out (``fedbayes.runs.loop``). Per method and folder the table gives
the rounds run, the final accuracy, NLL and ECE, the training seconds in all, the median round with
its range, and rounds per second (rounds over training seconds). With two folders or more, the last
columns divide each folder's rounds per second by the first folder's.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from fedbayes.runs.folder import read_metrics


def method_speed(run: Path) -> dict:
    """Final metrics and round times of one run folder."""
    records = [r for r in read_metrics(run / "metrics.jsonl") if r["round"] > 0]  # a line torn by a kill ends the records
    if not records:
        raise SystemExit(f"{run / 'metrics.jsonl'}: no round was recorded")
    seconds = [r["seconds"] for r in records]
    done = [r["round"] for r in records]
    rounds = [(b - a) / (rb - ra) for a, b, ra, rb in zip([0.0, *seconds[:-1]], seconds, [0, *done[:-1]], done)]  # per round between evaluations
    last = records[-1]
    total = seconds[-1]
    return {
        "rounds": last["round"],
        "accuracy": last.get("accuracy"),
        "nll": last.get("nll"),
        "ece": last.get("ece"),
        "train_s": total,
        "median_s": statistics.median(rounds),
        "min_s": min(rounds),
        "max_s": max(rounds),
        "rounds_per_s": last["round"] / total if total > 0 else float("inf"),
    }


def folder_speeds(folder: Path) -> dict[str, dict]:
    """``{method: method_speed}`` for every run of a comparison folder, in its order."""
    compare = folder / "compare.json"
    if compare.is_file():
        out = {}
        for name in json.loads(compare.read_text()):
            seeds = sorted((folder / name).glob("seed_*/metrics.jsonl"))
            for run in [p.parent for p in seeds] or [folder / name]:
                out[name if run == folder / name else f"{name}/{run.name}"] = method_speed(run)
        return out
    runs = sorted(p.parent for p in folder.glob("*/metrics.jsonl"))
    if not runs:
        raise SystemExit(f"{folder}: neither a compare.json nor a run folder with a metrics.jsonl")
    return {run.name: method_speed(run) for run in runs}  # an unfinished comparison: the rounds it reached


def _fmt(x: float | None, digits: int) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def table(speeds: dict[str, dict[str, dict]]) -> str:
    """The Markdown table of :func:`folder_speeds` for each label."""
    labels = list(speeds)
    methods = list(dict.fromkeys(m for per in speeds.values() for m in per))
    head = ["method"]
    for label in labels:
        head += [
            f"{label} rounds",
            f"{label} accuracy",
            f"{label} NLL",
            f"{label} ECE (%)",
            f"{label} train s",
            f"{label} s / round (median, range)",
            f"{label} rounds / s",
        ]
    head += [f"rounds / s, {label} / {labels[0]}" for label in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in methods:
        row = [m]
        for label in labels:
            s = speeds[label].get(m)
            if s is None:
                row += ["—"] * 7
                continue
            ece = None if s["ece"] is None else 100 * s["ece"]
            row += [
                str(s["rounds"]),
                _fmt(s["accuracy"], 4),
                _fmt(s["nll"], 4),
                _fmt(ece, 2),
                _fmt(s["train_s"], 2),
                f"{s['median_s'] * 1e3:.1f} ms ({s['min_s'] * 1e3:.1f}-{s['max_s'] * 1e3:.1f})",
                _fmt(s["rounds_per_s"], 1),
            ]
        first = speeds[labels[0]].get(m)
        for label in labels[1:]:
            s = speeds[label].get(m)
            row.append("—" if s is None or first is None else f"{s['rounds_per_s'] / first['rounds_per_s']:.2f}x")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if not argv or any("=" not in a for a in argv):
        print("usage: .venv/bin/python scripts/round_speed.py LABEL=COMPARE_FOLDER [LABEL=COMPARE_FOLDER ...]", file=sys.stderr)
        return 2
    speeds = {}
    for a in argv:
        label, path = a.split("=", 1)
        speeds[label] = folder_speeds(Path(path))
    sys.stdout.write(table(speeds))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
