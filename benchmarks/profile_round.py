"""Where a federated round's time goes: the steady rounds of one workload under cProfile.

    .venv/bin/python benchmarks/profile_round.py [WORKLOAD] [--rounds N] [--top N]

Runs the workload (default ``fedavg``) in a fresh process with one XLA host device per core,
exactly as ``fedbayes bench`` does, but with the steady rounds under ``cProfile``; prints the
functions with the most own time and their share of the profiled round time, then the start-up
breakdown. Time spent waiting for the compiled round shows up in the call that blocks on its
result; everything else is host-side Python (cohort sampling, gathering, dispatch).
"""

import argparse
import dataclasses
import sys

from fedbayes import bench as fb


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", default="fedavg", choices=[n for n, w in fb.WORKLOADS.items() if isinstance(w, fb.FederatedWorkload)])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--dataset", default=fb.FULL.dataset)
    args = parser.parse_args(argv)
    settings = dataclasses.replace(fb.FULL, rounds=args.rounds, dataset=args.dataset)
    fb.check_dataset(settings)
    raw = fb.run_federated_process(fb.WORKLOADS[args.workload], settings, profile_top=args.top)
    entry = fb.federated_entry(raw)
    total = sum(raw["round_s"])
    print(f"{args.workload}: {entry['rounds']} steady rounds under cProfile, {total:.3f} s, median round {entry['round_s']:.4f} s, {entry['examples_per_s']:,.0f} examples/s (profiler on)")
    print(f"{'own s':>8} {'share':>6} {'cum s':>8} {'calls':>7}  function")
    for r in raw["profile"]:
        print(f"{r['own_s']:8.3f} {100 * r['own_share']:5.1f}% {r['cum_s']:8.3f} {r['calls']:7d}  {r['function']}")
    parts = ", ".join(f"{k} {v:.2f}" for k, v in raw["startup_parts"].items())
    print(f"start-up {raw['startup_s']:.2f} s: {parts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
