"""Regenerates the main job's committed results at the current commit (`make results`).

Runs, each into a fresh folder under runs/results/:

1. the main job, `fedbayes compare examples/fmnist_compare.toml` (ten methods, 50 rounds, one seed);
2. its short version, the same comparison with SHORT (a few rounds, past the sampling methods'
   burn-in), whose table tests/runs/test_main_job_table.py reruns and compares with the committed
   one: when the code changes what the job prints, that test fails until this script is run again.

Then writes, between the `<!-- generated:begin -->` and `<!-- generated:end -->` markers of
docs/results/fmnist_compare.md, the provenance (date, commit, machine, versions of the numeric stack) and the table as compare.md
writes it; copies the plot to docs/results/fmnist_compare.png; and writes
docs/results/fmnist_compare_check.md (the short job's table, its command and the same provenance).
Needs Fashion-MNIST (Debian's dataset-fashion-mnist). From the repository's root:

    .venv/bin/python scripts/fmnist_results.py
    .venv/bin/python scripts/fmnist_results.py --full-from runs/demo   # reuse a finished main job of this commit

`--full-from DIR` takes the main job's table from DIR (a finished `fedbayes compare` of the same
config at this commit, e.g. `make demo`'s runs/demo) instead of running it again, and redraws its
plot from DIR's metrics with this commit's plotting.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/fmnist_compare.toml"
SHORT = ["rounds=6", "checkpoint_every=0"]  # FedPA/FedEP/FedSEP leave their 5 burn-in rounds
FULL_OUT, SHORT_OUT = "runs/results/fmnist_compare", "runs/results/fmnist_compare_check"
PAGE, CHECK, PLOT = ROOT / "docs/results/fmnist_compare.md", ROOT / "docs/results/fmnist_compare_check.md", ROOT / "docs/results/fmnist_compare.png"
BEGIN, END = "<!-- generated:begin -->", "<!-- generated:end -->"
STACK = ("jax", "jaxlib", "numpy", "flax", "optax")  # what decides the last digits; pinned in constraints.txt


def short_command(out: str = SHORT_OUT) -> list[str]:
    """The short job's `fedbayes` arguments."""
    return ["compare", CONFIG, *(a for s in SHORT for a in ("--set", s)), "--out", out, "--overwrite"]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def provenance() -> str:
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = " with uncommitted changes to src/ (commit them and run this again)" if _git("status", "--porcelain", "src") else ""
    date = datetime.date.today().isoformat()
    stack = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in STACK)
    return (
        f"> Provenance: measured on {date} at commit {commit}{dirty} by `make results` (scripts/fmnist_results.py), one seed (0), "
        f"on a {os.cpu_count()}-core machine, with {stack} (constraints.txt). "
        "The runs are deterministic: the same commit, seed, machine and versions give the same numbers; "
        "`train s` depends on the machine and its load. tests/runs/test_main_job_table.py reruns the short version "
        "(fmnist_compare_check.md) and fails when the code no longer prints these numbers."
    )


def _fedbayes(args: list[str]) -> None:
    print("+ fedbayes " + " ".join(args), flush=True)
    subprocess.run([str(Path(sys.executable).parent / "fedbayes"), *args], cwd=ROOT, check=True)


def _redraw(out: Path) -> None:
    """compare.png of the finished comparison in ``out``, drawn again by this commit's plotting."""
    from fedbayes.algorithms import registry
    from fedbayes.runs.folder import read_metrics
    from fedbayes.runs.plotting import plot_curves

    body = json.loads((out / "compare.json").read_text())
    bayesian = {v for v, summary in body.items() if registry.get(summary["algorithm"]).bayesian}
    curves = {v: read_metrics(out / v / "metrics.jsonl") for v in body}
    plot_curves(out / "compare.png", curves, title="fmnist_compare (fashion_mnist)", bayesian=bayesian)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-from", type=Path, help="a finished main job of this commit to take the table from (instead of running it)")
    args = parser.parse_args()
    if (
        "fashion_mnist"
        not in subprocess.run(
            [sys.executable, "-c", "from fedbayes.data import dataset_status; print([n for n, p, _ in dataset_status() if p])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    ):
        sys.exit("Fashion-MNIST is not on this machine (sudo apt-get install dataset-fashion-mnist): the committed results are on it")
    line = provenance()
    full = ROOT / FULL_OUT
    if args.full_from is None:
        _fedbayes(["compare", CONFIG, "--out", FULL_OUT, "--overwrite"])
    else:
        full = args.full_from.resolve()
        _redraw(full)
    _fedbayes(short_command())
    table = (full / "compare.md").read_text().rstrip()
    command = f"`.venv/bin/fedbayes compare {CONFIG} --out {FULL_OUT} --overwrite`"
    generated = f"{BEGIN}\n{line}\n\nCommand: {command}\n\n## Table (as `compare.md` writes it)\n\n{table}\n\n![accuracy, NLL and ECE per round](fmnist_compare.png)\n{END}"
    page = PAGE.read_text()
    PAGE.write_text(page[: page.index(BEGIN)] + generated + page[page.index(END) + len(END) :])
    shutil.copyfile(full / "compare.png", PLOT)
    short_table = (ROOT / SHORT_OUT / "compare.md").read_text().rstrip()
    CHECK.write_text(
        "# The main job's short version: the check of the committed table\n\n"
        f"{line}\n\nCommand: `.venv/bin/fedbayes {' '.join(short_command())}`\n\n{short_table}\n"
    )
    print(f"written: {PAGE.relative_to(ROOT)}, {PLOT.relative_to(ROOT)}, {CHECK.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
