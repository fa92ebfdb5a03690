"""The adapter's overhead: fedbayes-on-Flower's FedAvg against Flower's own FedAvg
(benchmarks/flower_fedavg_baseline.py) on the same model, data and processes (one federation: a
SuperLink and K SuperNodes on loopback), runs interleaved (fedbayes, Flower, fedbayes, ...).

    PYTHONPATH=src python benchmarks/flower_overhead.py --config examples/flower/breast_cancer_fedavg.toml --reps 3 --out runs/flower_overhead

Per run: seconds per round (fedbayes: metrics.jsonl's training seconds, evaluation excluded;
Flower: around ``strategy.start``, which does no evaluation here) and the whole run's wall time
(``flwr run`` to the end, the ServerApp's start included). Prints one JSON line per run, then the
medians and ranges and the paired ratio fedbayes / Flower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from fedbayes.config.schema import load_config, to_toml
from fedbayes.flower.deploy import LocalFederation
from fedbayes.flower.node import prepare_data
from fedbayes.runs.build import build_experiment

HERE = Path(__file__).resolve().parent


def baseline_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(
        "\n".join(
            [
                "[build-system]",
                'requires = ["hatchling"]',
                'build-backend = "hatchling.build"',
                "[project]",
                'name = "flower-fedavg-baseline"',
                'version = "1.0.0"',
                'description = "Flower FedAvg on a fedbayes config"',
                'license = "Apache-2.0"',
                "dependencies = []",
                "[tool.hatch.build.targets.wheel]",
                'packages = ["."]',
                "[tool.flwr.app]",
                'publisher = "fedbayes"',
                "[tool.flwr.app.components]",
                'serverapp = "flower_fedavg_baseline:serverapp"',
                'clientapp = "flower_fedavg_baseline:clientapp"',
                "[tool.flwr.app.config]",
                'config = ""',
                'out = ""',
            ]
        )
        + "\n"
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("runs/flower_overhead"))
    args = parser.parse_args()
    config = load_config(args.config)
    if config.algorithm.name != "fedavg":
        raise SystemExit("the baseline is Flower's FedAvg: give a fedavg config")
    args.out.mkdir(parents=True, exist_ok=True)
    cfg_file = args.out / "config.toml"
    cfg_file.write_text(to_toml(config))
    fed = LocalFederation(args.out / "federation", config.data.num_clients, env={"PYTHONPATH": str(HERE)})
    prepare_data(build_experiment(config), {n.partition: n.state_dir for n in fed.nodes})
    ours_app, theirs_app = fed.app_dir, baseline_app(args.out / "baseline_app")
    rows = []
    try:
        fed.start()
        for rep in range(args.reps):
            for kind in ("fedbayes", "flower"):
                out = args.out / f"{kind}_{rep}"
                t0 = time.perf_counter()
                if kind == "fedbayes":
                    fed.app_dir = ours_app
                    status = fed.run({"config": str(cfg_file), "out": str(out)}, timeout=1800)
                    assert status.get("ok"), status
                    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
                    per_round = last["seconds"] / config.rounds
                else:
                    fed.app_dir = theirs_app
                    result = out.with_suffix(".json")
                    run_id = fed.submit({"config": str(cfg_file), "out": str(result)})
                    end = time.monotonic() + 1800
                    while not result.is_file():
                        assert time.monotonic() < end, "the baseline did not finish"
                        time.sleep(0.2)
                    fed._wait_finished(run_id)
                    per_round = json.loads(result.read_text())["seconds"] / config.rounds
                row = {"rep": rep, "kind": kind, "seconds_per_round": round(per_round, 3), "run_wall_s": round(time.perf_counter() - t0, 2)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        fed.app_dir = ours_app
        fed.stop()
    summary = {}
    for kind in ("fedbayes", "flower"):
        v = [r["seconds_per_round"] for r in rows if r["kind"] == kind]
        w = [r["run_wall_s"] for r in rows if r["kind"] == kind]
        summary[kind] = {"per_round_median": statistics.median(v), "per_round_range": [min(v), max(v)], "run_wall_median": statistics.median(w)}
    ratios = [a["seconds_per_round"] / b["seconds_per_round"] for a, b in zip(rows[0::2], rows[1::2])]
    summary["ratio_per_round_fedbayes_over_flower"] = {"median": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    print(json.dumps(summary), flush=True)
    (args.out / "summary.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
