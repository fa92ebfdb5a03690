"""Table 1 of Swaroop et al. 2025 ("Connecting Federated ADMM to Bayes") beside ours.

Two steps, after the sweeps and comparisons of docs/results/fedlap_table1.md:

  winners SWEEP_DIR CONFIG OUT_TOML   write a comparison file: CONFIG's variants with the best cell
                                      of each (from SWEEP_DIR/sweep.json) and seeds = [0, 1, 2]
  table ROW=COMPARE_DIR[:SWEEP_DIR] ...   the table: accuracy at R = 10, 25, 50 (mean over rounds
                                      R-2..R, as the paper's Table 1), mean (std) over the seeds,
                                      beside the paper's; --json and --md write it to files

ROW is one of the keys of PAPER. Plain on purpose: it only reads run folders.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path

import tomli_w

from fedbayes.runs import summaries
from fedbayes.runs.folder import read_metrics

METHODS = ("fedavg", "fedprox", "feddyn", "fedlap", "fedlap_cov", "fedlap_func")
ROUNDS = (10, 25, 50)

# Table 1 of the paper: mean accuracy (%) over rounds R-2..R, mean (std) over 3 seeds.
PAPER = {
    "fmnist_het": {
        "title": "Fashion-MNIST (10%), heterogeneous, 10 clients",
        10: ("70.4(0.9)", "69.9(0.4)", "73.0(0.6)", "71.3(0.9)", "74.6(0.7)", "72.2(0.9)"),
        25: ("74.3(0.5)", "74.7(0.6)", "74.6(0.4)", "74.3(0.4)", "78.3(1.0)", "75.4(0.8)"),
        50: ("76.0(0.7)", "76.9(0.9)", "74.6(0.5)", "77.6(0.7)", "80.5(0.6)", "78.1(0.7)"),
    },
    "fmnist_homog": {
        "title": "Fashion-MNIST (10%), homogeneous, 10 clients",
        10: ("72.3(0.4)", "72.2(0.3)", "75.3(0.8)", "72.1(0.2)", "75.0(0.6)", "73.7(0.7)"),
        25: ("77.7(0.3)", "77.4(0.1)", "77.5(0.8)", "77.1(0.1)", "79.8(0.4)", "77.9(0.3)"),
        50: ("80.0(0.2)", "80.3(0.1)", "78.2(0.5)", "80.2(0.1)", "81.8(0.1)", "80.0(0.2)"),
    },
    "fmnist100_het": {
        "title": "Fashion-MNIST (full), heterogeneous, 100 clients",
        10: ("73.9(0.3)", "73.3(0.7)", "75.7(0.4)", "73.9(0.3)", "76.9(0.7)", "76.9(0.8)"),
        25: ("78.7(0.3)", "78.4(0.1)", "81.4(0.2)", "79.4(0.2)", "81.3(0.2)", "79.7(0.4)"),
        50: ("81.8(0.3)", "81.6(0.1)", "82.2(0.3)", "82.4(0.3)", "83.0(0.1)", "81.8(0.3)"),
    },
    "breast_cancer_het": {
        "title": "breast cancer, heterogeneous, 10 clients (ours) -- STAND-IN for the paper's UCI Credit (heterog)",
        10: ("77.0(1.3)", "73.6(2.2)", "73.5(1.0)", "77.1(2.3)", "80.4(0.4)", "77.1(1.1)"),
        25: ("76.3(3.5)", "75.0(4.1)", "79.9(2.6)", "80.7(1.4)", "84.2(2.0)", "83.6(2.7)"),
        50: ("78.6(3.3)", "79.3(0.9)", "83.5(2.2)", "83.5(1.8)", "85.2(1.6)", "85.8(2.0)"),
    },
}


def best_cells(sweep_dir: Path) -> dict[str, dict]:
    """variant -> the settings of its selected cell, from a sweep's sweep.json."""
    data = json.loads((sweep_dir / "sweep.json").read_text())
    rows = [r for r in data["cells"] if r.get("best")]
    if not rows:
        sys.exit(f"error: {sweep_dir}/sweep.json: no selected cell")
    return {r["variant"]: dict(r["settings"]) for r in rows}


def winners(sweep_dir: Path, config: Path, out: Path, seeds: list[int]) -> None:
    raw = tomllib.loads(config.read_text())
    best = best_cells(sweep_dir)
    for name, variant in raw["variants"].items():
        if name not in best:
            sys.exit(f"error: {sweep_dir}: variant {name!r} has no selected cell")
        for key, value in best[name].items():
            *path, last = key.split(".")
            node = variant
            for part in path:
                node = node.setdefault(part, {})
            node[last] = value
    raw = {"seeds": seeds, **raw}
    head = f"# Written by scripts/fedlap_table1.py from {config} and the cells selected in {sweep_dir}\n# (best on the sweep's selection split); do not edit by hand, rerun the script.\n"
    out.write_text(head + tomli_w.dumps(raw))
    print(f"wrote {out}")


def accuracy_at(compare_dir: Path, variant: str, rnd: int) -> dict:
    """mean (std) over the finished seed runs (those with a summary.json; an interrupted run
    counts nowhere) of the mean test accuracy over rounds rnd-2..rnd."""
    values = []
    for folder in sorted((compare_dir / variant).glob("seed_*")):
        if not (folder / "summary.json").is_file():
            continue
        records = read_metrics(folder / "metrics.jsonl")
        last = max((int(r["round"]) for r in records if "accuracy" in r), default=0)
        s = summaries.curve_summary(records, final_round=rnd) if last >= rnd else None
        values.append(None if s is None else 100.0 * s["mean_last"])
    return summaries.mean_std(values)


def fmt(stat: dict) -> str:
    if stat["mean"] is None:
        return "—"
    text = f"{stat['mean']:.1f}" + (f"({stat['std']:.1f})" if stat["std"] is not None else "")
    return text + (f" [{stat['n']} seed{'s' if stat['n'] != 1 else ''}]" if stat["n"] != 3 else "")


def paper_mean(text: str) -> float:
    return float(text.split("(")[0])


def table(rows: list[str], json_out: Path | None, md_out: Path | None) -> None:
    result, parts = {}, []
    for item in rows:
        name, _, dirs = item.partition("=")
        compare_dir, _, sweep_dir = dirs.partition(":")
        if name not in PAPER:
            sys.exit(f"error: row {name!r}: allowed: {', '.join(PAPER)}")
        paper = PAPER[name]
        chosen = best_cells(Path(sweep_dir)) if sweep_dir else {}
        result[name] = {"title": paper["title"], "runs": compare_dir, "sweep": sweep_dir or None, "methods": {}}
        same_data = name != "breast_cancer_het"
        head = (
            "| method | "
            + " | ".join(f"R={r} ours | R={r} paper" for r in ROUNDS)
            + (" | R=50 ours - paper" if same_data else "")
            + " | selected (sweep: 1 seed, validation) |"
        )
        lines = [f"**{paper['title']}** (`{compare_dir}`)", "", head, "|---" * (2 + 2 * len(ROUNDS) + same_data) + "|"]
        for i, m in enumerate(METHODS):
            if not (Path(compare_dir) / m).is_dir():
                continue
            entry = result[name]["methods"][m] = {"selected": chosen.get(m), "rounds": {}}
            cols = [m]
            for rnd in ROUNDS:
                stat = accuracy_at(Path(compare_dir), m, rnd)
                cols += [fmt(stat), paper[rnd][i]]
                entry["rounds"][str(rnd)] = {"ours": stat, "paper": paper[rnd][i]}
            if same_data:
                ours = entry["rounds"][str(ROUNDS[-1])]["ours"]["mean"]
                cols.append("—" if ours is None else f"{ours - paper_mean(paper[ROUNDS[-1]][i]):+.1f}")
            cols.append(", ".join(f"{k.split('.')[-1]}={v}" for k, v in (chosen.get(m) or {}).items()))
            lines.append("| " + " | ".join(cols) + " |")
        parts.append("\n".join(lines))
    text = "\n\n".join(parts) + "\n"
    print(text)
    if md_out:
        md_out.write_text(text)
    if json_out:
        json_out.write_text(json.dumps(result, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("winners")
    w.add_argument("sweep_dir", type=Path)
    w.add_argument("config", type=Path)
    w.add_argument("out", type=Path)
    w.add_argument("--seeds", default="0,1,2")
    t = sub.add_parser("table")
    t.add_argument("rows", nargs="+", help="ROW=COMPARE_DIR[:SWEEP_DIR], ROW one of " + ", ".join(PAPER))
    t.add_argument("--json", type=Path)
    t.add_argument("--md", type=Path)
    a = p.parse_args()
    if a.cmd == "winners":
        winners(a.sweep_dir, a.config, a.out, [int(s) for s in a.seeds.split(",")])
    else:
        table(a.rows, a.json, a.md)


if __name__ == "__main__":
    main()
