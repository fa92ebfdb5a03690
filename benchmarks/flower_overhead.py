"""What a deployed round costs, in one run on this machine: fedbayes's warm executors, Flower's
stock per-message path (fedbayes's app, and Flower's own FedAvg on the same processes), and the
simulator's round of the same config, blocked until its result is ready.

    PYTHONPATH=src:benchmarks python benchmarks/flower_overhead.py --config examples/flower/breast_cancer_fedavg.toml --out runs/flower_overhead

Steps (in this order, one federation of a SuperLink and K SuperNodes on loopback at a time):

1. the simulator: ``exp.simulator.run_round`` plus ``jax.block_until_ready``, ``--sim-rounds``
   rounds, for the config and for the heavy MLP (``--heavy``: the config on scikit-learn's
   digits with an MLP of 2 hidden layers of 512, 10 local epochs);
2. warm federation (``executor = "warm"``): fedbayes's run of the config and of the heavy MLP,
   ``--rounds`` rounds each;
3. stock federation (``executor = "stock"``: a fresh ClientApp process per message): fedbayes's
   run of the config, then Flower's FedAvg (benchmarks/flower_fedavg_baseline.py), ``--stock-rounds``
   rounds each, on the same processes.

A fedbayes round's time is its exchange (``flower_times.jsonl``'s ``seconds``: from the
server's first push to its last reply); Flower's FedAvg round is ``strategy.start``'s time over
the rounds. Steady: rounds after the first (which builds and compiles). Prints one JSON line per
measurement and the load average around each, and writes ``summary.json``; with it the CPU seconds
per round of each long-lived process during the warm heavy run (:func:`cpu_seconds`), and with
``--count-requests`` the SuperLink's requests per steady round of that run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import jax

from fedbayes.config.schema import load_config, to_toml
from fedbayes.flower.deploy import LocalFederation
from fedbayes.flower.node import write_client_file
from fedbayes.runs.build import build_experiment

HERE = Path(__file__).resolve().parent


def baseline_app(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [
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
    (folder / "pyproject.toml").write_text("\n".join(lines) + "\n")
    return folder


def heavy(config):
    """The config on digits with an MLP [512, 512] and 10 local epochs."""
    return config.model_copy(
        update={
            "name": config.name + "_heavy_mlp",
            "data": config.data.model_copy(update={"dataset": "digits"}),
            "model": config.model.model_copy(update={"name": "mlp", "hidden": (512, 512)}),
            "client": config.client.model_copy(update={"epochs": 10}),
        }
    )


def load() -> float:
    return round(os.getloadavg()[0], 1)


def steady(values: list[float]) -> dict:
    v = values[1:]
    return {"median": statistics.median(v), "min": min(v), "max": max(v), "first": values[0], "n": len(v)}


def simulator_rounds(config, rounds: int) -> list[float]:
    exp = build_experiment(config)
    sim = exp.simulator
    state = sim.init(exp.params)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        state, _ = sim.run_round(state)
        jax.block_until_ready(state.server_state)
        out.append(time.perf_counter() - t0)
    return out


def federation(work: Path, exp, executor: str, count_requests: Path | None = None) -> LocalFederation:
    path = [str(HERE), os.environ.get("PYTHONPATH")]
    env = {}
    if count_requests is not None:  # the SuperLink logs its requests (benchmarks/flower_requests)
        path.insert(0, str(HERE / "flower_requests"))
        env["FEDBAYES_COUNT_REQUESTS"] = str(count_requests)
    fed = LocalFederation(work, exp.federation.num_clients, executor=executor, env={**env, "PYTHONPATH": os.pathsep.join(filter(None, path))})
    for n in fed.nodes:
        n.data = {"data-file": str(write_client_file(exp, n.partition, n.state_dir.parent / "data.npz"))}
    return fed


def cpu_seconds(fed: LocalFederation) -> dict[str, float]:
    """CPU seconds (user + system) so far of the federation's long-lived processes: the SuperLink
    (the ServerApp runs in a process of its own, started per run, and is not counted), each
    SuperNode and each warm executor."""
    import psutil

    procs = {"superlink": fed.superlink}
    for i, n in enumerate(fed.nodes):
        procs[f"node{i}"], procs[f"executor{i}"] = n.process, n.executor
    out = {}
    for name, p in procs.items():
        if p is not None and p.poll() is None:
            t = psutil.Process(p.pid).cpu_times()
            out[name] = t.user + t.system
    return out


def fedbayes_rounds(fed: LocalFederation, config, out: Path) -> list[float]:
    cfg_file = out.with_suffix(".toml")
    cfg_file.write_text(to_toml(config))
    status = fed.run({"config": str(cfg_file), "out": str(out)}, timeout=3600)
    assert status.get("ok"), status
    return [json.loads(line)["seconds"] for line in (out / "flower_times.jsonl").read_text().splitlines()]


def requests_per_round(log: Path, rounds: int) -> dict:
    """The SuperLink's requests per steady round of the last run in ``log`` (its
    ``/v1/runtime/push-messages``, one a round, mark the rounds; rounds 1 to ``rounds - 2``): the
    count by path, the total, and the SuperLink's CPU seconds per round and per request."""
    rows = [line.split() for line in log.read_text().splitlines()]
    pushes = [float(r[0]) for r in rows if r[3] == "/v1/runtime/push-messages"]
    lo, hi, n = pushes[-(rounds - 1)], pushes[-1], rounds - 2
    window = [r for r in rows if lo <= float(r[0]) < hi]
    by_path: dict[str, float] = {}
    for r in window:
        by_path[r[3]] = by_path.get(r[3], 0) + 1 / n
    cpu = float(window[-1][2]) - float(window[0][2])
    return {
        "rounds": n,
        "total": len(window) / n,
        "by_path": dict(sorted(((k, round(v, 1)) for k, v in by_path.items()), key=lambda kv: -kv[1])),
        "superlink_cpu_s_per_round": cpu / n,
        "superlink_cpu_ms_per_request": 1000 * cpu / len(window),
    }


def flower_fedavg_round(fed: LocalFederation, config, out: Path) -> float:
    cfg_file = out.with_suffix(".toml")
    cfg_file.write_text(to_toml(config))
    own = fed.app_dir
    fed.app_dir = baseline_app(out.parent / "baseline_app")
    try:
        result = out.with_suffix(".json")
        run_id = fed.submit({"config": str(cfg_file), "out": str(result)})
        end = time.monotonic() + 3600
        while not result.is_file():
            assert time.monotonic() < end, "the baseline did not finish"
            time.sleep(0.2)
        fed._wait_finished(run_id)
    finally:
        fed.app_dir = own
    return json.loads(result.read_text())["seconds"] / config.rounds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=10, help="warm rounds per config")
    parser.add_argument("--stock-rounds", type=int, default=3, help="stock rounds (fedbayes's app and Flower's FedAvg)")
    parser.add_argument("--sim-rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("runs/flower_overhead"))
    parser.add_argument("--skip-stock", action="store_true", help="skip step 3 (the stock per-message path): a GPU record's time is short")
    parser.add_argument("--count-requests", action="store_true", help="log the warm SuperLink's requests; summary: the heavy run's per steady round")
    args = parser.parse_args()
    config = load_config(args.config)
    if config.algorithm.name != "fedavg":
        raise SystemExit("the baseline is Flower's FedAvg: give a fedavg config")
    args.out.mkdir(parents=True, exist_ok=True)
    configs = {"logreg": config, "heavy_mlp": heavy(config)}
    results: dict = {}

    def record(name: str, value, before: float) -> None:
        results[name] = {"value": value, "load": [before, load()]}
        print(json.dumps({name: results[name]}), flush=True)

    for name, cfg in configs.items():
        before = load()
        record(f"simulator_{name}", steady(simulator_rounds(cfg.model_copy(update={"rounds": args.sim_rounds}), args.sim_rounds)), before)

    counted = (args.out / "superlink_requests.log").resolve() if args.count_requests else None
    fed = federation(args.out / "warm", build_experiment(config), "warm", counted)
    heavy_files = build_experiment(configs["heavy_mlp"])
    try:
        fed.start()
        before = load()
        record("warm_logreg", steady(fedbayes_rounds(fed, config.model_copy(update={"rounds": args.rounds}), args.out / "warm_logreg")), before)
        for n in fed.nodes:  # the heavy config's examples (digits) in the same files: the nodes read them per run
            write_client_file(heavy_files, n.partition, Path(n.data["data-file"]))
        before, cpu0 = load(), cpu_seconds(fed)
        record("warm_heavy_mlp", steady(fedbayes_rounds(fed, configs["heavy_mlp"].model_copy(update={"rounds": args.rounds}), args.out / "warm_heavy")), before)
        cpu1 = cpu_seconds(fed)  # per round of the heavy run, its first round (compiles) included
        results["cpu_s_per_round_heavy_mlp"] = {k: (cpu1[k] - cpu0[k]) / args.rounds for k in cpu1 if k in cpu0}
        print(json.dumps({"cpu_s_per_round_heavy_mlp": results["cpu_s_per_round_heavy_mlp"]}), flush=True)
        if counted is not None:
            time.sleep(1.0)  # the last requests' lines
            results["superlink_requests_heavy_mlp"] = requests_per_round(counted, args.rounds)
            print(json.dumps({"superlink_requests_heavy_mlp": results["superlink_requests_heavy_mlp"]}), flush=True)
    finally:
        fed.stop()

    if not args.skip_stock:
        fed = federation(args.out / "stock", build_experiment(config), "stock")
        try:
            fed.start()
            stock = config.model_copy(update={"rounds": args.stock_rounds})
            before = load()
            record("stock_logreg", steady(fedbayes_rounds(fed, stock, args.out / "stock_logreg")), before)
            before = load()
            record("flower_fedavg_logreg", flower_fedavg_round(fed, stock, args.out / "flower_fedavg"), before)
        finally:
            fed.stop()

    sim, warm = results["simulator_heavy_mlp"]["value"]["median"], results["warm_heavy_mlp"]["value"]["median"]
    results["ratio_warm_heavy_over_simulator"] = warm / sim
    if "flower_fedavg_logreg" in results:
        results["ratio_warm_logreg_over_flower_fedavg"] = results["warm_logreg"]["value"]["median"] / results["flower_fedavg_logreg"]["value"]
    import flwr

    results["flwr"] = flwr.__version__
    # the device the simulator ran on; the nodes inherit JAX_PLATFORMS, so a GPU record sets it
    results["device"] = {
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", ""),
    }
    keys = ("ratio_warm_heavy_over_simulator", "ratio_warm_logreg_over_flower_fedavg", "flwr", "device")
    print(json.dumps({k: results[k] for k in keys if k in results}), flush=True)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
