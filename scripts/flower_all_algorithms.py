"""Every registered algorithm through `fedbayes deploy` (real Flower processes on loopback) and
through `fedbayes run` (the simulator), same config and seed; one JSON line per algorithm with
the largest difference of the final server states and the deployed run's seconds per round.

    PYTHONPATH=src python scripts/flower_all_algorithms.py --out runs/flower_all [--rounds 2]

Resumable: algorithms already in OUT/results.jsonl are skipped. Needs the flower extra.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import tomli_w

from fedbayes.algorithms import registry
from fedbayes.runs.checkpoint import latest_checkpoint, read_checkpoint


def config_for(name: str, rounds: int) -> dict:
    raw = {
        "name": f"flower_{name}",
        "seed": 0,
        "rounds": rounds,
        "data": {"dataset": "breast_cancer", "num_clients": 3, "partition": "dirichlet", "alpha": 1.0},
        "model": {"name": "logreg"},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"clients_per_round": 3},
        "algorithm": {"name": name},
    }
    if name == "fedpa":  # one sample per epoch after the first (algorithm.skip_epochs = 1)
        raw["client"]["epochs"] = 3
    if name == "vbnn":  # variational clients train a variational model
        raw["model"] = {"name": "mlp", "hidden": [16], "variational": True}
    return raw


def max_diff(a_dir: Path, b_dir: Path) -> float:
    a, _ = read_checkpoint(latest_checkpoint(a_dir / "checkpoints"))
    b, _ = read_checkpoint(latest_checkpoint(b_dir / "checkpoints"))
    keys = [k for k in a if k.startswith("server")]
    if set(keys) != {k for k in b if k.startswith("server")}:
        return float("inf")
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) if a[k].size else 0.0 for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/flower_all"))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()] if results.is_file() else []
    done = {r["algorithm"] for r in rows if "error" not in r}  # a failed algorithm is tried again
    fedbayes = [sys.executable, "-m", "fedbayes.cli"]
    for name in args.only or registry.names():
        if name in done:
            continue
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        cfg = folder / "config.toml"
        cfg.write_text(tomli_w.dumps(config_for(name, args.rounds)))
        t0 = time.perf_counter()
        sim = subprocess.run([*fedbayes, "run", str(cfg), "--out", str(folder / "sim"), "--overwrite"], capture_output=True, text=True)
        t1 = time.perf_counter()
        dep = subprocess.run([*fedbayes, "deploy", str(cfg), "--out", str(folder / "flower"), "--overwrite"], capture_output=True, text=True)
        t2 = time.perf_counter()
        row = {
            "algorithm": name,
            "rounds": args.rounds,
            "sim_exit": sim.returncode,
            "deploy_exit": dep.returncode,
            "sim_wall_s": round(t1 - t0, 1),
            "deploy_wall_s": round(t2 - t1, 1),
        }
        if sim.returncode == 0 and dep.returncode == 0:
            records = [json.loads(x) for x in (folder / "flower" / "metrics.jsonl").read_text().splitlines()]
            last = records[-1]
            row.update(
                max_abs_diff=max_diff(folder / "sim", folder / "flower"),
                seconds_per_round=round(last["seconds"] / args.rounds, 2),
                rejected=last["rejected"],
                dropped=last["dropped"],
                accuracy=round(last["accuracy"], 4),
            )
        else:
            row["error"] = " ".join((dep.stderr or sim.stderr).split())[-300:]
        print(json.dumps(row), flush=True)
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
