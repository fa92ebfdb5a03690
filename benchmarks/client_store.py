"""Client-state stores at scale: time and peak memory per round.

``K`` clients, each with ``--leaves`` float32 arrays of ``--params`` values (the first leaf zeros,
the others non-zero, like ADMM's dual and contribution), cohorts of ``--cohort`` clients drawn
without replacement each round. One round = gather the cohort's rows + scatter new rows (the
store's host work in ``Simulator.run_round``; no training). Each mode runs in a fresh process:

* ``disk``: :class:`fedbayes.sim.store.DiskStore` (pread/pwrite, undo log per round, fsync at every
  commit point); also times a rollback over all rounds run.
* ``disk-nosync``: the same with ``durable=False`` (enough to survive a killed process).
* ``memmap``: the alternative the store avoids: one ``np.memmap`` per leaf kept mapped, rows
  read and written by fancy indexing, ``flush()`` per round, no undo log.
* ``memory`` / ``memory-donate``: :class:`fedbayes.sim.store.MemoryStore`, pure (copies ``K`` rows
  per leaf each round) or in place.

``peak_rss_growth_mb`` is the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs`` after imports and after building the rows a round scatters) minus its
resident set at that moment: what the store adds to a round on top of the cohort's own rows.
``init_s`` is building the store (for disk modes: preallocating and writing every client's
initial rows in chunks); ``gather_s``/``scatter_s``/``round_s`` are medians over rounds.

    .venv/bin/python benchmarks/client_store.py --clients 500 --params 1000000 --rounds 10 [--json]
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

MODES = ("disk", "disk-nosync", "memmap", "memory", "memory-donate")


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak() -> int:
    """Resets ``VmHWM`` to the current resident set (Linux >= 4.0); returns that baseline."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status()["VmHWM"]


def run_mode(mode: str, num_clients: int, params: int, leaves: int, cohort: int, rounds: int, folder: str) -> dict:
    import numpy as np

    from fedbayes.sim.store import DiskStore, MemoryStore

    rng = np.random.default_rng(0)
    template = {f"leaf{i}": (np.zeros if i == 0 else np.ones)(params, np.float32) for i in range(leaves)}
    new_rows = {k: np.full((cohort, params), 0.5, np.float32) for k in template}  # the cohort's output
    cohorts = [np.sort(rng.choice(num_clients, cohort, replace=False)) for _ in range(rounds)]
    base = _reset_peak()
    t0 = time.perf_counter()
    if mode.startswith("disk") or mode == "memmap":
        store = DiskStore.create(folder, template, num_clients, durable=mode != "disk-nosync")
    else:
        store = MemoryStore.create(template, num_clients)
    init_s = time.perf_counter() - t0
    init_growth = _status()["VmHWM"] - base
    maps = None
    if mode == "memmap":
        maps = {k: np.memmap(os.path.join(folder, f"leaf_{i:05d}.bin"), np.float32, "r+", shape=(num_clients, params)) for i, k in enumerate(template)}
    base = _reset_peak()
    gather_s, scatter_s = [], []
    for r, ids in enumerate(cohorts):
        t0 = time.perf_counter()
        if maps is not None:
            rows = {k: m[ids] for k, m in maps.items()}
        else:
            rows = store.gather(ids, r)
        t1 = time.perf_counter()
        del rows
        if maps is not None:
            for k, m in maps.items():
                m[ids] = new_rows[k]
                m.flush()
        else:
            store = store.scatter(ids, new_rows, r, donate=mode == "memory-donate")
        scatter_s.append(time.perf_counter() - t1)
        gather_s.append(t1 - t0)
    growth = _status()["VmHWM"] - base
    out = {
        "mode": mode,
        "num_clients": num_clients,
        "params": params,
        "leaves": leaves,
        "cohort": cohort,
        "rounds": rounds,
        "store_mb": round(num_clients * params * 4 * leaves / 2**20, 1),
        "cohort_mb": round(cohort * params * 4 * leaves / 2**20, 1),
        "init_s": round(init_s, 3),
        "init_peak_rss_growth_mb": round(init_growth / 2**20, 1),
        "gather_s": round(statistics.median(gather_s), 4),
        "scatter_s": round(statistics.median(scatter_s), 4),
        "round_s": round(statistics.median([g + s for g, s in zip(gather_s, scatter_s)]), 4),
        "peak_rss_growth_mb": round(growth / 2**20, 1),
    }
    if mode.startswith("disk"):
        t0 = time.perf_counter()
        store.rollback(0)
        out["rollback_s"] = round(time.perf_counter() - t0, 3)
        out["rollback_rounds"] = rounds
        got = store.gather(cohorts[-1][:1], 0)
        out["rollback_ok"] = all(np.array_equal(got[k][0], template[k]) for k in template)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=500)
    ap.add_argument("--params", type=int, default=1_000_000, help="float32 values per leaf per client")
    ap.add_argument("--leaves", type=int, default=2)
    ap.add_argument("--cohort", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    ap.add_argument("--dir", default=None, help="where the disk stores go (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="one JSON object per mode on stdout")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one mode, in this fresh process
        print(json.dumps(run_mode(args.worker, args.clients, args.params, args.leaves, args.cohort, args.rounds, args.dir)))
        return 0
    root = tempfile.mkdtemp(prefix="fedbayes-store-", dir=args.dir)
    results = []
    try:
        for mode in args.modes.split(","):
            folder = os.path.join(root, mode)
            cmd = [sys.executable, __file__, "--worker", mode, "--dir", folder]
            cmd += ["--clients", str(args.clients), "--params", str(args.params), "--leaves", str(args.leaves)]
            cmd += ["--cohort", str(args.cohort), "--rounds", str(args.rounds)]
            env = dict(os.environ, JAX_PLATFORMS="cpu")
            res = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return res.returncode
            results.append(json.loads(res.stdout.strip().splitlines()[-1]))
            shutil.rmtree(folder, ignore_errors=True)
            if not args.json:
                r = results[-1]
                print(
                    f"{mode:>13}: init {r['init_s']:7.2f} s  gather {r['gather_s']:.4f} s  scatter {r['scatter_s']:.4f} s  "
                    f"peak RSS growth {r['peak_rss_growth_mb']:8.1f} MB (store {r['store_mb']} MB, cohort {r['cohort_mb']} MB)"
                    + (f"  rollback of {r['rollback_rounds']} rounds {r['rollback_s']:.2f} s" if "rollback_s" in r else ""),
                    flush=True,
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        for r in results:
            print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
