"""A method's client step against FedAvg's, paired in one process: the cost of its arithmetic.

    PYTHONPATH=src .venv/bin/python benchmarks/step_cost.py [WORKLOAD ...] [--reps N] [--one-core] [--square-std] [--natural-kl] [--per-leaf] [--json]

Each workload (default ``fedavg_e3_100 pvi_100 pvi_local_100``; any federated key of
``fedbayes.bench.WORKLOADS``; the first is the reference) is built as ``fedbayes bench`` builds it,
in this one process with one XLA host device per core, and its round's own limit is timed
(:mod:`fedbayes.bench.own_limit`: the cohort's ``client_update`` calls as a plain jitted loop, and
its server step): round indices 1, 2, ... in turn for every workload, ``--reps`` passes
interleaved. The workloads share the cohort and the number of local steps, so the ratio of round
times is the ratio of step times (the server steps of these methods are a few element-wise
operations). ``--per-leaf`` adds ``pvi_100`` with its weight noise drawn one generator call per
leaf, as before 2026-11-27, as the row ``pvi_100_per_leaf``; ``--natural-kl`` adds ``pvi_100`` and
``pvi_local_100`` with their KL penalty through the natural parameters, as before 2026-11-27
(``gaussian.kl(to_gaussian(q), cavity)``), as the rows ``*_natural_kl``; ``--square-std`` adds
``pvi_local_100`` with its variances computed as ``square(exp(raw_std))``, as before 2026-11-28,
as the row ``pvi_local_100_square_std`` (the weight-draw estimator still computes them so).

``--one-core`` runs everything on one single-threaded XLA host device in a process pinned to one
core: every client of a round then runs in turn on that core, so the round ratio is the ratio of
the clients' step loops as a plain process runs them, without the second device (whose threads
share the cores in the default layout).

Prints, per workload, the median round time and the median and range over the passes of its
ratio to the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from fedbayes.sim import hostdevices

if "--one-core" in sys.argv[1:]:  # before JAX is imported (main imports it)
    os.environ["XLA_FLAGS"] = hostdevices.xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=1, single_thread=True)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
else:
    hostdevices.configure(os.environ)


def _per_leaf_draw(key, vp, parameterisation):
    """The weight draw as it was before 2026-11-27: one generator call per leaf."""
    import jax
    import optax

    from fedbayes.inference import vi

    keys = optax.tree.split_key_like(key, vp.mean)
    return jax.tree.map(lambda k, m, r: m + vi._std(r, parameterisation) * jax.random.normal(k, m.shape, m.dtype), keys, vp.mean, vp.raw_std)


def _natural_kl(cavity, parameterisation, **_):
    """The KL penalty as it was before 2026-11-27: through ``q``'s natural parameters."""
    from fedbayes import gaussian
    from fedbayes.inference import vi

    return lambda vp: gaussian.kl(vi.to_gaussian(vp, parameterisation), cavity)


def _square_std(raw, parameterisation):
    """The variances as they were before 2026-11-28: ``square(std)``, i.e. ``exp(raw)^2``."""
    import jax.numpy as jnp

    from fedbayes.inference import vi

    return jnp.square(vi._std(raw, parameterisation))


OLD = {
    "_per_leaf": ("draw_weights", _per_leaf_draw),
    "_natural_kl": ("kl_to_cavity", _natural_kl),
    "_square_std": ("_var", _square_std),
}  # suffix: (vi's function, its old form)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["fedavg_e3_100", "pvi_100", "pvi_local_100"])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--per-leaf", action="store_true")
    parser.add_argument("--natural-kl", action="store_true")
    parser.add_argument("--square-std", action="store_true")
    parser.add_argument("--one-core", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    from fedbayes import bench as fb
    from fedbayes.bench.own_limit import first_device_state
    from fedbayes.inference import vi

    settings = fb.FULL
    data = fb.load_data(settings)
    extra = (["pvi_100_per_leaf"] if args.per_leaf else []) + (["pvi_100_natural_kl", "pvi_local_100_natural_kl"] if args.natural_kl else [])
    extra += ["pvi_local_100_square_std"] if args.square_std else []
    if len(args.workloads + extra) > 8:  # own_limit keeps 8 workloads' programs and data
        parser.error(f"at most 8 workloads in one process (own_limit's cache); got {len(args.workloads + extra)}")
    runs = {}
    for name in args.workloads + extra:
        suffix = next((x for x in OLD if name.endswith(x)), "")
        workload = fb.WORKLOADS[name.removesuffix(suffix)] if suffix else fb.WORKLOADS[name]
        if suffix:  # read when the loss is traced, below
            attr, old_form = OLD[suffix]
            original = getattr(vi, attr)
            setattr(vi, attr, old_form)
        sim, state = fb.build_simulator(workload, settings, data)
        server = fb.plain_round(sim, first_device_state(sim, state.server_state), fb.prepare_plain_round(sim, state, 0))  # compiles
        if suffix:
            setattr(vi, attr, original)
        runs[name] = (sim, state, server)
    times = {n: [] for n in runs}
    for rep in range(args.reps):
        for name, (sim, state, server) in runs.items():
            inputs = fb.prepare_plain_round(sim, state, rep + 1)
            t0 = time.perf_counter()
            fb.plain_round(sim, server, inputs)
            times[name].append(time.perf_counter() - t0)
    ref = args.workloads[0]
    out = {}
    for name, ts in times.items():
        ratios = [t / r for t, r in zip(ts, times[ref])]
        out[name] = {"round_s": statistics.median(ts), "ratio": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'workload':<20} {'round (s)':>10} {'vs ' + ref:>22}")
    for name, e in out.items():
        print(f"{name:<20} {e['round_s']:>10.3f} {e['ratio']:>8.2f} ({e['range'][0]:.2f}-{e['range'][1]:.2f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
