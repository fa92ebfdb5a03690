"""Pipelined rounds against one round at a time, and the device store against the host store,
paired in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/pipeline.py [--workload fedavg_100 ...] [--blocks 12]
        [--block 5] [--json]

One process, one XLA host device per core (``fedbayes.sim.hostdevices``), Fashion-MNIST (the bench's
workloads, :data:`fedbayes.bench.WORKLOADS`). For each workload it builds

* ``loop``: ``Simulator.run_round(state, donate=True)`` then ``block_until_ready``, round after
  round (how rounds ran before ``Simulator.rounds``);
* ``pipelined``: ``Simulator.rounds`` (round r + 1 prepared and launched while round r runs);
* for a stateful workload, ``pipelined_host`` / ``pipelined_device``: the pipelined rounds with
  the client states in the host memory store and in device memory.

Each variant compiles and warms up (two rounds), then ``--blocks`` passes run ``--block`` rounds of
every variant in turn (rotating the order each pass). Reported per variant: median seconds per
round, and, per pass, the throughput ratio to ``loop`` (median and range over passes). The
variants' results are bitwise equal (tests/sim/test_pipeline.py); only their timing differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from fedbayes.sim import hostdevices  # noqa: E402  (no JAX import)

hostdevices.configure()

import jax  # noqa: E402

from fedbayes import bench as fb  # noqa: E402


def _loop(sim, state, n):
    for _ in range(n):
        state, _ = sim.run_round(state, donate=True)
    jax.block_until_ready(state.server_state)
    return state


def _pipelined(sim, state, n):
    for state, _ in sim.rounds(state, state.round + n, donate=True):
        pass
    jax.block_until_ready(state.server_state)
    return state


def measure(name: str, settings: fb.BenchSettings, dataset, blocks: int, block: int) -> dict:
    w = fb.WORKLOADS[name]
    variants = {"loop": (w.store, _loop), "pipelined": (w.store, _pipelined)}
    _, first = fb.build_simulator(w, settings, dataset)
    if jax.tree.leaves(first.client_states):  # stateful: both stores
        variants.update({"pipelined_host": ("memory", _pipelined), "pipelined_device": ("device", _pipelined)})
    runs = {}
    for label, (store, fn) in variants.items():
        sim, state = fb.build_simulator(w, settings, dataset, store=store)
        runs[label] = [sim, fn(sim, state, 2), fn]
    times: dict[str, list[float]] = {k: [] for k in runs}
    labels = list(runs)
    for p in range(blocks):
        for label in labels[p % len(labels) :] + labels[: p % len(labels)]:
            sim, state, fn = runs[label]
            t0 = time.perf_counter()
            runs[label][1] = fn(sim, state, block)
            times[label].append((time.perf_counter() - t0) / block)
    out = {"workload": name, "round_s": {k: statistics.median(v) for k, v in times.items()}, "speedup_vs_loop": {}}
    for label, ts in times.items():
        if label != "loop":
            ratios = [a / b for a, b in zip(times["loop"], ts)]
            out["speedup_vs_loop"][label] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", action="append", help="bench workload (repeatable; default fedavg, fedavg_100, fedep_100)")
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--block", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    settings = fb.FULL
    fb.check_dataset(settings)
    dataset = fb.load_data(settings)
    results = [measure(n, settings, dataset, args.blocks, args.block) for n in (args.workload or ["fedavg", "fedavg_100", "fedep_100"])]
    if args.json:
        print(json.dumps(results))
        return
    print("| workload | variant | s / round | throughput vs loop, median (range) |")
    print("|---|---|---|---|")
    for r in results:
        for label, t in r["round_s"].items():
            s = r["speedup_vs_loop"].get(label)
            vs = f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})" if s else "1"
            print(f"| {r['workload']} | {label} | {t:.4f} | {vs} |")


if __name__ == "__main__":
    main()
