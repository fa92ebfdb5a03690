"""Stateful FedEP at 500 clients of a ~1M-parameter model: round time and peak memory against
stateless FedSEP.

    .venv/bin/python benchmarks/fedep_scale.py [--clients 500] [--hidden 1024,256] [--rounds 10] [--modes fedsep,fedep-disk,fedep-memory] [--dir DIR] [--json]

Fashion-MNIST split IID over ``--clients`` clients, the MLP ``--hidden`` (1024, 256: 1,068,810
parameters), batch 32, ``--epochs`` local epochs, ``--cohort`` clients per round, the
scaled-identity client method ("identity"), built as ``fedbayes bench`` builds FedEP
(``fedbayes.bench.build_algorithm``, the registry's defaults: TiltedSettings defaults, damping 1/M, no burn-in). Each mode runs
in its own fresh process with one XLA host device per core:

* ``fedsep``: stateless FedSEP (no client store);
* ``fedep-disk``: stateful FedEP, every client's site (2 float32 copies of the parameters) in the
  on-disk store (``Simulator(store="disk")``: one file per leaf, preadv/pwrite of the cohort's
  rows, undo log and fsync every round);
* ``fedep-memory``: the same sites in the memory store (stacked ``[K, ...]`` host arrays,
  updated in place with ``run_round(state, donate=True)``): ``K`` x 8.6 MB, 4.3 GB at 500 clients.

Every mode runs ``run_round(state, donate=True)`` as ``run_experiment`` does. Reported per mode:
``init_s`` (``Simulator.init``: server state and, for FedEP, the store), ``first_round_s``
(compile and first round), ``round_s`` (median steady round) with ``store_s`` (its median time
in the store's gather and scatter), ``peak_rss_mb`` (``ru_maxrss`` of the process: interpreter,
JAX, the training set on the host and on each device, the store, the round) and
``store_disk_mb`` (the disk store's files after the run). ``peak_ratio_to_fedsep`` is each
mode's peak over FedSEP's in the same invocation: the done-when asks at most 2 for
``fedep-disk``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from fedbayes import bench as fb
from fedbayes.sim.hostdevices import num_cores, xla_flags

MODES = ("fedsep", "fedep-disk", "fedep-memory")


def run_mode(mode: str, args: argparse.Namespace, folder: str) -> dict:
    import dataclasses

    import jax
    import numpy as np

    from fedbayes.data import partition
    from fedbayes.data.federation import Federation
    from fedbayes.sim.simulator import Simulator
    from fedbayes.tree import num_params

    t0 = time.perf_counter()
    settings = dataclasses.replace(fb.FULL, hidden=tuple(args.hidden))
    dataset = fb.load_data(settings)
    parts = partition("iid", dataset.y_train, args.clients, np.random.default_rng([settings.seed, 2]))
    params, trainer, apply_fn = fb.model_and_trainer(settings, dataset, settings.batch_size, args.epochs)
    federation = Federation(dataset.x_train, dataset.y_train, tuple(parts))
    # preset "paper": the scaled-identity method these measurements were taken with (docs/results/fedep_scale.md)
    algorithm = fb.build_algorithm(
        "fedsep" if mode == "fedsep" else "fedep", trainer, federation.sizes, args.cohort, apply_fn, dataset.task, hparams=(("preset", "paper"),)
    )
    store = "disk" if mode == "fedep-disk" else "memory"
    sim = Simulator(algorithm, federation, clients_per_round=args.cohort, seed=settings.seed, store=store, store_dir=folder if store == "disk" else None)
    built_s = time.perf_counter() - t0
    rss_built = fb.peak_rss_mb()

    t0 = time.perf_counter()
    state = sim.init(params)
    init_s = time.perf_counter() - t0

    store_time = [0.0]
    # The store's share of a round: the cohort's states onto the devices and back, transfers included.
    for meth in ("_put_states", "_write_back"):

        def timed(*a, _fn=getattr(sim, meth), **k):
            s = time.perf_counter()
            try:
                return jax.block_until_ready(_fn(*a, **k))
            finally:
                store_time[0] += time.perf_counter() - s

        setattr(sim, meth, timed)

    t0 = time.perf_counter()
    state, _ = sim.run_round(state, donate=True)
    jax.block_until_ready(state.server_state)
    first_s = time.perf_counter() - t0
    rounds, stores = [], []
    for _ in range(args.rounds):
        store_time[0] = 0.0
        t0 = time.perf_counter()
        state, info = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        rounds.append(time.perf_counter() - t0)
        stores.append(store_time[0])
    disk_mb = 0.0
    if store == "disk":
        disk_mb = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / 2**20
    row_mb = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(algorithm.client_init(params))) / 2**20
    return {
        "mode": mode,
        "num_clients": args.clients,
        "clients_per_round": args.cohort,
        "epochs": args.epochs,
        "hidden": list(args.hidden),
        "num_params": int(num_params(params)),
        "client_state_mb": round(row_mb, 2),
        "store_mb": round(row_mb * args.clients, 1) if mode != "fedsep" else 0.0,
        "build_s": round(built_s, 2),
        "init_s": round(init_s, 2),
        "first_round_s": round(first_s, 2),
        "round_s": round(statistics.median(rounds), 3),
        "round_range_s": [round(min(rounds), 3), round(max(rounds), 3)],
        "store_s": round(statistics.median(stores), 3),
        "rounds": len(rounds),
        "peak_rss_mb_before_init": round(rss_built, 1),
        "peak_rss_mb": round(fb.peak_rss_mb(), 1),
        "store_disk_mb": round(disk_mb, 1),
        "bytes_up_per_round": int(info.bytes_up),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--hidden", type=lambda s: [int(h) for h in s.split(",")], default=[1024, 256], help="MLP widths, e.g. 1024,256")
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10, help="steady rounds after the first")
    ap.add_argument("--modes", default="fedsep,fedep-disk", help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--dir", default=None, help="where the disk store goes (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="one JSON object per mode on stdout")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(run_mode(args.worker, args, args.dir)))
        return 0
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    fb.check_dataset(fb.FULL)
    root = tempfile.mkdtemp(prefix="fedbayes-fedep-scale-", dir=args.dir)
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    results = []
    try:
        for mode in modes:
            folder = os.path.join(root, mode)
            cmd = [sys.executable, __file__, "--worker", mode, "--dir", folder, "--clients", str(args.clients), "--hidden", ",".join(map(str, args.hidden))]
            cmd += ["--cohort", str(args.cohort), "--epochs", str(args.epochs), "--rounds", str(args.rounds)]
            res = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=flags))
            if res.returncode != 0:
                print(res.stderr[-4000:], file=sys.stderr)
                return res.returncode
            results.append(json.loads(res.stdout.strip().splitlines()[-1]))
            shutil.rmtree(folder, ignore_errors=True)
            if not args.json:
                r = results[-1]
                print(
                    f"{mode:>13}: round {r['round_s']:.3f} s (store {r['store_s']:.3f} s)  first {r['first_round_s']:.1f} s  init {r['init_s']:.1f} s  "
                    f"peak RSS {r['peak_rss_mb']:,.0f} MB  store {r['store_mb']:,.0f} MB ({r['client_state_mb']} MB/client)",
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = next((r["peak_rss_mb"] for r in results if r["mode"] == "fedsep"), None)
    for r in results:
        if base:
            r["peak_ratio_to_fedsep"] = round(r["peak_rss_mb"] / base, 3)
    if args.json:
        for r in results:
            print(json.dumps(r))
    elif base:
        print("peak RSS / FedSEP's: " + ", ".join(f"{r['mode']} {r['peak_ratio_to_fedsep']:.2f}" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
