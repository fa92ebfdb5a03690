"""Where a federated round's time goes: phases of the steady rounds, or cProfile's top functions.

    .venv/bin/python benchmarks/profile_round.py [WORKLOAD ...] [--rounds N] [--mode phases|ops|cprofile] [--top N] [--json]

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

``--mode ops`` traces the steady rounds with the JAX profiler and reports the device threads' time
per XLA operation (:mod:`fedbayes.bench.trace`): per thread its ``loop`` operations (a training
step's, a curvature batch's, a server step's), the ``once`` operations (per client or per round),
``control`` (loops and dispatch) and ``sync`` (collectives, i.e. waiting for the other device), then
the operations with the most time. The profiler slows the round (by 10-30% on the development
machine), so read shares, not absolute times; when it drops events (a long trace of many small
operations) the output says how much of the round the recorded operations explain. A workload
with fused rounds (``fedavg_100_fused``) is traced as ``fedbayes bench`` runs it, whole blocks of
its ``fuse`` rounds a program (the traced rounds rounded up to whole blocks); the other modes run
one round a program.

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
from fedbayes.sim.hostdevices import num_cores, xla_flags

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

    from fedbayes.sim import simulator as simulate

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


def measure_ops(workload: fb.FederatedWorkload, settings: fb.BenchSettings, *, top: int = 12) -> dict:
    """Builds the workload as ``fedbayes bench`` does and traces its steady rounds (``--mode ops``)."""
    import tempfile

    import jax

    from fedbayes.bench import trace

    dataset = fb.load_data(settings)
    sim, state = fb.build_simulator(workload, settings, dataset)
    rounds = fb.steady_rounds(workload, settings)
    if sim.fuse > 1:  # fused rounds, as `fedbayes bench` runs them: whole blocks of sim.fuse rounds
        rounds = -(-rounds // sim.fuse) * sim.fuse

        def run(state, n):
            for state, _ in sim.rounds(state, state.round + n, donate=True):
                pass
            return state
    else:

        def run(state, n):
            for _ in range(n):
                state, _ = sim.run_round(state, donate=True)
            return state

    state = run(state, max(2, sim.fuse))  # compile, then steady rounds before the trace
    jax.block_until_ready(state.server_state)
    with tempfile.TemporaryDirectory(prefix="fedbayes-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            t0 = time.perf_counter()
            state = run(state, rounds)
            jax.block_until_ready(state.server_state)
            wall = time.perf_counter() - t0
        events, names = trace.load_events(trace.find_trace(tmp))
    out = trace.op_breakdown(events, names, rounds=rounds, top=top)
    round_ms = 1000 * wall / rounds
    # The profiler keeps a bounded number of events: with many small operations a long trace loses
    # some, and the threads look idle. Coverage says how much of the round the busiest thread's
    # recorded operations explain.
    coverage = max((t["busy_ms"] for t in out["threads"]), default=0.0) / round_ms
    return {"workload": workload.name, "rounds": rounds, "round_ms": round_ms, "coverage": coverage, **out}


def print_ops(r: dict) -> None:
    print(f"{r['workload']}: {r['rounds']} traced rounds, {r['round_ms']:.1f} ms a round (profiler on); device threads, ms a round:")
    if r["coverage"] < 0.8:
        print(f"  note: the recorded operations explain {100 * r['coverage']:.0f}% of the round: the profiler dropped events; trace fewer rounds (--rounds 1)")
    for t in r["threads"]:
        print(
            f"  {t['thread'][:28]:<28} busy {t['busy_ms']:7.1f}: loop {t['loop_ms']:7.1f}  once {t['once_ms']:6.1f}  control {t['control_ms']:5.1f}  sync {t['sync_ms']:6.1f}"
        )
    print(f"  {'operation':<44} {'class':<8} {'ms/round':>9} {'calls/round':>12}")
    for o in r["ops"]:
        print(f"  {o['name'][:44]:<44} {o['class']:<8} {o['ms']:9.2f} {o['calls']:12.1f}")


def _spawn_phases(name: str, settings: fb.BenchSettings, mode: str = "phases", top: int = 12) -> dict:
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    spec = json.dumps({"workload": name, "settings": fb.settings_to_dict(settings), "mode": mode, "top": top})
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
    parser.add_argument("--mode", choices=("phases", "ops", "cprofile"), default="phases")
    parser.add_argument("--rounds", type=int, default=10, help="steady rounds (scaled by the workload's rounds_scale)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dataset", default=fb.FULL.dataset)
    parser.add_argument("--json", action="store_true", help="phases, ops: one JSON object per workload")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        workload, settings = fb.WORKLOADS[spec["workload"]], fb.settings_from_dict(spec["settings"])
        if spec.get("mode") == "ops":
            print(json.dumps(measure_ops(workload, settings, top=spec.get("top", 12))))
        else:
            print(json.dumps(measure_phases(workload, settings)))
        return 0
    unknown = [n for n in args.workloads if n not in federated]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; known: {', '.join(federated)}")
    settings = dataclasses.replace(fb.FULL, rounds=args.rounds, dataset=args.dataset)
    fb.check_dataset(settings)
    for name in args.workloads or ["fedavg"]:
        if args.mode in ("phases", "ops"):
            r = _spawn_phases(name, settings, args.mode, args.top)
            if args.json:
                print(json.dumps(r))
            else:
                (print_phases if args.mode == "phases" else print_ops)(r)
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
