"""Where a federated round's time goes: phases of the steady rounds, or cProfile's top functions.

    .venv/bin/python benchmarks/profile_round.py [WORKLOAD ...] [--rounds N] [--mode phases|cprofile] [--top N] [--json]

Runs each workload (default ``fedavg``; any federated key of ``fedbayes.bench.WORKLOADS``, e.g.
``fedpa``, ``fedep``, ``fedavg_e3_100``) in a fresh process with one XLA host device per core,
built exactly as ``fedbayes bench`` builds it (``run_round(state, donate=True)``).

``--mode phases`` (default) wraps the simulator's steps with timers and splits the median steady
round into:

* ``cohort``: sampling the cohort and assigning it to devices (``sample_cohort``, ``layout_cohort``);
* ``host_layout``: drawing the clients' shuffles and laying out the order buffer (``gather``);
* ``store``: the cohort's client states from the store onto the devices and back into the store,
  transfers included (``Simulator._put_states`` and ``_write_back``;
  0 for stateless methods);
* ``device_put``: moving the round's host arrays to the devices;
* ``program``: the compiled round (``jit`` of broadcast, every client's update, validation and
  the server update), from the call until its outputs are ready;
* ``to_host``: reading the acceptance flags and the new client states back;
* ``python``: the rest of ``run_round`` (its own Python, dispatch, the ``RoundInfo``).

It then times the compiled program again on its own, the same inputs called back to back
(``program_alone``): if that equals ``program``, the host adds nothing but the other phases.

``--mode cprofile`` is the older view: the steady rounds under cProfile, functions with the most
own time (``fedbayes.bench.measure_federated(profile_top=...)``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from fedbayes import bench as fb
from fedbayes.hostdevices import num_cores, xla_flags

PHASES = ("cohort", "host_layout", "store", "device_put", "program", "to_host", "python")


class _Proxy:
    """A module with a few attributes replaced."""

    def __init__(self, module, **replaced):
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._module, name)


def measure_phases(workload: fb.FederatedWorkload, settings: fb.BenchSettings, *, store: str = "memory", store_dir: str | None = None) -> dict:
    """Builds the workload as ``fedbayes bench`` does and times the phases of its steady rounds."""
    import jax
    import numpy as np

    from fedbayes import simulate

    dataset = fb.load_data(settings)
    epochs = fb.workload_epochs(workload, settings)
    sim, state = fb.build_simulator(workload, settings, dataset, store=store, store_dir=store_dir)
    federation = sim.federation
    state, _ = sim.run_round(state, donate=True)  # compile
    jax.block_until_ready(state.server_state)

    acc = dict.fromkeys(PHASES, 0.0)

    depth = [0]

    def timed(phase, fn, block=False):
        # Only the outermost timed call counts (the store's transfers call device_put/asarray).
        def wrapper(*a, **k):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                out = fn(*a, **k)
                if block:
                    jax.block_until_ready(out)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                acc[phase] += time.perf_counter() - t0
            return out

        return wrapper

    last_args = {}

    def program(*a):
        last_args["a"] = a
        return jax.block_until_ready(round_fn(*a))

    round_fn = sim._round_fn
    sim.sample_cohort = timed("cohort", sim.sample_cohort)
    sim.layout_cohort = timed("cohort", sim.layout_cohort)
    sim.gather = timed("host_layout", sim.gather)
    sim._round_fn = timed("program", program)
    # The cohort's states: gathered onto the devices, and written back (transfers included).
    sim._put_states = timed("store", sim._put_states, block=True)
    sim._write_back = timed("store", sim._write_back)
    # simulate's own module references only: jax and numpy stay untouched for everyone else.
    simulate.jax = _Proxy(jax, device_put=timed("device_put", jax.device_put))
    simulate.np = _Proxy(np, asarray=timed("to_host", np.asarray))
    per_round = []
    totals = []
    try:
        for _ in range(fb.steady_rounds(workload, settings)):
            for k in acc:
                acc[k] = 0.0
            t0 = time.perf_counter()
            state, _ = sim.run_round(state, donate=True)
            jax.block_until_ready(state.server_state)
            total = time.perf_counter() - t0
            # Transfers made inside the store's phase count as store, not device_put or to_host.
            acc["python"] = total - sum(v for k, v in acc.items() if k != "python")
            per_round.append(dict(acc))
            totals.append(total)
    finally:
        simulate.jax, simulate.np = jax, np
    alone = []
    for _ in range(max(3, len(totals) // 2)):
        t0 = time.perf_counter()
        jax.block_until_ready(round_fn(*last_args["a"]))
        alone.append(time.perf_counter() - t0)
    round_s = statistics.median(totals)
    phases = {k: statistics.median([r[k] for r in per_round]) for k in PHASES}
    examples = int(sum(federation.sizes[c] for c in sim.sample_cohort(1))) * epochs
    return {
        "workload": workload.name,
        "store": store,
        "rounds": len(totals),
        "round_s": round_s,
        "examples_per_s": examples / round_s,
        "phases_s": phases,
        "phases_share": {k: v / round_s for k, v in phases.items()},
        "program_alone_s": statistics.median(alone),
        "peak_rss_mb": fb.peak_rss_mb(),
    }


def _spawn_phases(name: str, settings: fb.BenchSettings) -> dict:
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    spec = json.dumps({"workload": name, "settings": fb.settings_to_dict(settings)})
    res = subprocess.run([sys.executable, __file__, "--worker", spec], capture_output=True, text=True, env=dict(os.environ, XLA_FLAGS=flags))
    if res.returncode != 0:
        raise fb.BenchError(f"profile worker {name} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def print_phases(r: dict) -> None:
    ms = lambda s: f"{1000 * s:8.1f}"  # noqa: E731
    print(f"{r['workload']}: median of {r['rounds']} steady rounds {1000 * r['round_s']:.1f} ms ({r['examples_per_s']:,.0f} examples/s); "
          f"program alone {1000 * r['program_alone_s']:.1f} ms; peak RSS {r['peak_rss_mb']:,.0f} MB")  # fmt: skip
    for k in PHASES:
        print(f"  {k:<12}{ms(r['phases_s'][k])} ms {100 * r['phases_share'][k]:6.1f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    federated = [n for n, w in fb.WORKLOADS.items() if isinstance(w, fb.FederatedWorkload)]
    parser.add_argument("workloads", nargs="*", metavar="WORKLOAD", help=f"default: fedavg; one of {', '.join(federated)}")
    parser.add_argument("--mode", choices=("phases", "cprofile"), default="phases")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds (scaled by the workload's rounds_scale)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dataset", default=fb.FULL.dataset)
    parser.add_argument("--json", action="store_true", help="phases: one JSON object per workload")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(measure_phases(fb.WORKLOADS[spec["workload"]], fb.settings_from_dict(spec["settings"]))))
        return 0
    unknown = [n for n in args.workloads if n not in federated]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(federated)}")
    settings = dataclasses.replace(fb.FULL, rounds=args.rounds, dataset=args.dataset)
    fb.check_dataset(settings)
    for name in args.workloads or ["fedavg"]:
        if args.mode == "phases":
            r = _spawn_phases(name, settings)
            print(json.dumps(r)) if args.json else print_phases(r)
            continue
        raw = fb.run_federated_process(fb.WORKLOADS[name], settings, profile_top=args.top)
        entry = fb.federated_entry(raw)
        total = sum(raw["round_s"])
        print(
            f"{name}: {entry['rounds']} steady rounds under cProfile, {total:.3f} s, median round {entry['round_s']:.4f} s, {entry['examples_per_s']:,.0f} examples/s (profiler on)"
        )
        print(f"{'own s':>8} {'share':>6} {'cum s':>8} {'calls':>7}  function")
        for r in raw["profile"]:
            print(f"{r['own_s']:8.3f} {100 * r['own_share']:5.1f}% {r['cum_s']:8.3f} {r['calls']:7d}  {r['function']}")
        parts = ", ".join(f"{k} {v:.2f}" for k, v in raw["startup_parts"].items())
        print(f"start-up {raw['startup_s']:.2f} s: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
