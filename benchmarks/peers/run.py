"""fedbayes against pfl-research (``pfl``) and Flower's simulation on the same FedAvg workloads,
side by side in one run, each framework in its documented best configurations.

    PYTHONPATH=src .venv/bin/python benchmarks/peers/run.py --pfl-python PY --flower-python PY \\
        [--repeats 3] [--rounds-100 16] [--rounds-10 4] [--out FILE.json] [--markdown]

Workloads (both): Fashion-MNIST, the MLP (200, 100) with ReLU, batch 32, one local epoch of plain
SGD (lr 0.05), server = the plain weighted mean of the clients' models; ``fedavg_100``: 100 IID
clients, 10 per round; ``fedavg``: 10 IID clients, all 10 per round. Every framework trains on
fedbayes' own IID partition of the workload (written once by this process for the peers).

Configurations (each a fresh process per repeat; repeats interleaved: in each repeat every
configuration runs once, fedbayes first):

* fedbayes: the simulator as ``fedbayes bench`` runs it, one process with one XLA host device per core;
* pfl (PyTorch backend): one process with ``torch.set_num_threads`` 1 and 2, and pfl's multi-process
  mode (``torch.distributed.run --nproc_per_node=<cores>``, one thread per process);
* Flower (``run_simulation``, Ray backend): ``client_resources.num_cpus`` 1 and <cores>
  (one Ray actor per core, each one torch thread; or one actor with all cores' threads).

The two configurations with several torch threads in one process (pfl's and Flower's) ran 7 to 30
times slower than their one-thread ones on the shared 2-core machine (OpenMP's threads wait
for each other at every operation while other processes hold the cores): they run on the
10-of-100 workload only, for ``--slow-rounds`` rounds.

Reported per configuration and workload: examples per second (examples trained over the steady
rounds, the first round excluded, divided by their time) as median [min, max] over repeats, the
median steady round time, and test accuracy after the same number of rounds (evaluated outside
the clock); and fedbayes' throughput over each peer's best configuration (the highest median),
paired by repeat: median [min, max] of the per-repeat ratios.

The peers are not dependencies of fedbayes: install them in an environment of their own, e.g.

    python3 -m venv .venv-peers && .venv-peers/bin/pip install torch==2.13.0 pfl==0.6.0 "flwr[simulation]==1.42.*"

and pass its interpreter to ``--pfl-python`` and ``--flower-python``. When either is missing or
cannot import its framework, the script says so in one line and exits 0, measuring nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
RESULT = "PEERS_RESULT "  # common.RESULT (common is not imported here: the tests load this file alone)
WORKLOADS = {"fedavg_100": "10 of 100 IID clients", "fedavg": "10 of 10 IID clients"}
FRAMEWORKS = ("fedbayes", "pfl", "flower")
PEER_IMPORTS = {"pfl": "import torch, pfl.model.pytorch", "flower": "import torch, flwr.simulation, ray"}


def configurations(cores: int) -> list[dict]:
    """Every configuration measured, in the order each repeat runs them."""
    return [
        {"framework": "fedbayes", "config": f"1 process, {cores} XLA host devices", "key": "fedbayes"},
        {"framework": "pfl", "config": "1 process, 1 torch thread", "key": "pfl_t1", "threads": 1, "processes": 1},
        {"framework": "flower", "config": f"num_cpus=1 per client ({cores} Ray actors x 1 thread)", "key": "flower_c1", "num_cpus": 1},
        {"framework": "pfl", "config": f"1 process, {cores} torch threads", "key": "pfl_t2", "threads": cores, "processes": 1, "slow": True},
        {"framework": "flower", "config": f"num_cpus={cores} per client (1 Ray actor x {cores} threads)", "key": "flower_c2", "num_cpus": cores, "slow": True},
        {"framework": "pfl", "config": f"torchrun, {cores} processes x 1 thread", "key": "pfl_mp", "threads": 1, "processes": cores},
    ]


# ----- the table and the ratios (pure; tested) ---------------------------------------------------
def throughput(result: dict) -> float:
    """Examples per second of one process: its steady rounds' examples over their time."""
    return sum(result["examples"]) / sum(result["round_s"])


def _span(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(records: list[dict]) -> list[dict]:
    """One row per (workload, configuration) from the per-process ``records`` (each with
    ``workload``, ``framework``, ``config``, ``key``, ``repeat`` and a worker's ``result``), in
    the order first seen."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for rec in records:
        groups.setdefault((rec["workload"], rec["key"]), []).append(rec)
    rows = []
    for (workload, key), recs in groups.items():
        eps = [throughput(r["result"]) for r in recs]
        rows.append(
            {
                "workload": workload, "key": key, "framework": recs[0]["framework"], "config": recs[0]["config"],
                "examples_per_s": _span(eps), "per_repeat": {r["repeat"]: e for r, e in zip(recs, eps, strict=True)},
                "round_s": statistics.median(statistics.median(r["result"]["round_s"]) for r in recs),
                "first_round_s": statistics.median(r["result"]["first_round_s"] for r in recs),
                "accuracy": statistics.median(r["result"]["accuracy"] for r in recs),
                "rounds": recs[0]["result"]["rounds"], "repeats": len(recs),
            }
        )  # fmt: skip
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """fedbayes' throughput over each peer's best configuration (highest median) per workload:
    the per-repeat ratios (paired by repeat) as median [min, max], and the ratio of medians."""
    out = []
    for workload in dict.fromkeys(r["workload"] for r in rows):
        ours = next((r for r in rows if r["workload"] == workload and r["framework"] == "fedbayes"), None)
        if ours is None:
            continue
        for peer in FRAMEWORKS[1:]:
            theirs = [r for r in rows if r["workload"] == workload and r["framework"] == peer]
            if not theirs:
                continue
            best = max(theirs, key=lambda r: r["examples_per_s"]["median"])
            paired = [e / best["per_repeat"][k] for k, e in ours["per_repeat"].items() if k in best["per_repeat"]]
            out.append(
                {
                    "workload": workload, "peer": peer, "best": best["config"], **_span(paired),
                    "of_medians": ours["examples_per_s"]["median"] / best["examples_per_s"]["median"],
                }
            )  # fmt: skip
    return out


def markdown(rows: list[dict], ratio_rows: list[dict]) -> str:
    """The table and the ratios as Markdown."""
    lines = [
        "| framework | configuration | workload | examples/s median [min, max] | round s | accuracy after N rounds |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["examples_per_s"]
        lines.append(
            f"| {r['framework']} | {r['config']} | {WORKLOADS.get(r['workload'], r['workload'])} | "
            f"{e['median']:,.0f} [{e['min']:,.0f}, {e['max']:,.0f}] | {r['round_s']:.3f} | {r['accuracy']:.4f} (N = {r['rounds']}) |"
        )
    lines += [
        "",
        "| workload | fedbayes / peer's best | peer's best configuration | ratio, median [min, max] over repeats | ratio of medians |",
        "|---|---|---|---|---|",
    ]
    for q in ratio_rows:
        lines.append(
            f"| {WORKLOADS.get(q['workload'], q['workload'])} | fedbayes / {q['peer']} | {q['best']} | {q['median']:.2f} [{q['min']:.2f}, {q['max']:.2f}] | {q['of_medians']:.2f} |"
        )
    return "\n".join(lines)


def missing_peers(pythons: dict[str, str | None]) -> list[str]:
    """The peers whose interpreter is not given, not there, or cannot import the framework."""
    missing = []
    for peer, python in pythons.items():
        ok = bool(python) and os.path.exists(python)
        ok = ok and subprocess.run([python, "-c", PEER_IMPORTS[peer]], capture_output=True).returncode == 0
        if not ok:
            missing.append(f"{peer} ({python or 'no --' + peer + '-python'})")
    return missing


# ----- running the workers -----------------------------------------------------------------------
def _worker_command(cfg: dict, pythons: dict[str, str], spec: dict, cores: int) -> tuple[list[str], dict]:
    env = dict(os.environ, PEERS_SPAWN_TIME=repr(time.time()))
    env.pop("XLA_FLAGS", None)
    if cfg["framework"] == "fedbayes":
        from fedbayes.sim.hostdevices import xla_flags

        env.update(PYTHONPATH=str(SRC), XLA_FLAGS=xla_flags("", device_count=cores))
        return [sys.executable, str(HERE / "fedbayes_side.py"), json.dumps(spec)], env
    env["PYTHONPATH"] = str(HERE)
    if cfg["framework"] == "pfl":
        spec = dict(spec, threads=cfg["threads"])
        if cfg["processes"] > 1:
            launcher = ["-m", "torch.distributed.run", "--standalone", "--nnodes=1", f"--nproc_per_node={cfg['processes']}"]
            return [pythons["pfl"], *launcher, str(HERE / "pfl_side.py"), json.dumps(spec)], env
        return [pythons["pfl"], str(HERE / "pfl_side.py"), json.dumps(spec)], env
    spec = dict(spec, num_cpus=cfg["num_cpus"], ray_cpus=cores)
    return [pythons["flower"], str(HERE / "flower_side.py"), json.dumps(spec)], env


def run_worker(cfg: dict, pythons: dict[str, str], spec: dict, cores: int, timeout: float) -> dict:
    cmd, env = _worker_command(cfg, pythons, spec, cores)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith(RESULT)), None)
    if res.returncode != 0 or line is None:
        print(res.stdout[-1500:], res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"peers: {cfg['key']} on {spec['workload']} failed (exit code {res.returncode})")
    return json.loads(line[len(RESULT) :])


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pfl-python", default=None, help="interpreter with torch and pfl")
    ap.add_argument("--flower-python", default=None, help="interpreter with torch and flwr[simulation]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds-100", type=int, default=16, help="rounds of the 10-of-100 workload (the first excluded from timing)")
    ap.add_argument("--rounds-10", type=int, default=4, help="rounds of the 10-of-10 workload (the first excluded from timing)")
    ap.add_argument("--slow-rounds", type=int, default=4, help="rounds of the multi-threaded torch configurations (10-of-100 workload only)")
    ap.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist", help="the four Fashion-MNIST IDX files")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--only", default=None, help="comma-separated configuration keys (default: all)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per worker process")
    ap.add_argument("--out", default=None, help="write every process's result and the summary here (JSON)")
    args = ap.parse_args(argv)

    pythons = {"pfl": args.pfl_python, "flower": args.flower_python}
    missing = missing_peers(pythons)
    if missing:
        print(f"peers: no usable interpreter for {', '.join(missing)}; nothing measured (pass --pfl-python and --flower-python, see this script's docstring).")
        return 0

    import numpy as np

    from fedbayes import bench as fb
    from fedbayes.sim.hostdevices import num_cores

    cores = num_cores()
    configs = [c for c in configurations(cores) if args.only is None or c["key"] in args.only.split(",")]
    settings = fb.BenchSettings(data_dir=args.data_dir, lr=args.lr)
    fb.check_dataset(settings)
    dataset = fb.load_data(settings)
    meta = {"uptime_start": _uptime(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cores": cores, "argv": sys.argv[1:]}
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        specs = {}
        for name, rounds in (("fedavg_100", args.rounds_100), ("fedavg", args.rounds_10)):
            workload = fb.WORKLOADS[name]
            parts = fb.workload_partition(workload, settings, dataset)
            path = os.path.join(tmp, f"{name}.npz")
            np.savez(path, **{f"c{i}": np.asarray(p) for i, p in enumerate(parts)})
            specs[name] = {
                "workload": name, "data_dir": args.data_dir, "parts": path, "hidden": list(settings.hidden), "rounds": rounds,
                "num_clients": workload.num_clients, "clients_per_round": workload.clients_per_round, "lr": args.lr,
                "epochs": settings.epochs, "batch_size": settings.batch_size, "seed": settings.seed, "out": os.path.join(tmp, "flower.json"),
            }  # fmt: skip
        for repeat in range(args.repeats):
            for name, spec in specs.items():
                for cfg in configs:
                    if cfg.get("slow") and name != "fedavg_100":  # see the docstring: 40x slower on a shared machine
                        continue
                    wspec = dict(spec, rounds=min(spec["rounds"], args.slow_rounds)) if cfg.get("slow") else spec
                    t0 = time.time()
                    result = run_worker(cfg, pythons, wspec, cores, args.timeout)
                    records.append(
                        {"workload": name, "framework": cfg["framework"], "config": cfg["config"], "key": cfg["key"], "repeat": repeat, "result": result}
                    )
                    print(
                        f"repeat {repeat} {name:>10} {cfg['key']:>9}: {throughput(result):>8,.0f} examples/s  accuracy {result['accuracy']:.4f}  ({time.time() - t0:.0f} s)",
                        flush=True,
                    )
    meta["uptime_end"] = _uptime()
    versions: dict[str, str] = {}
    for rec in records:
        versions.update(rec["result"].get("versions", {}))
    rows, ratio_rows = summarize(records), ratios(summarize(records))
    print(f"\nload at start: {meta['uptime_start']}\nload at end:   {meta['uptime_end']}\nversions: {versions}\n")
    print(markdown(rows, ratio_rows))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": {**meta, "versions": versions}, "records": records, "rows": rows, "ratios": ratio_rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
