"""A round's own limit in pieces beside the simulator's round, in one process.

    PYTHONPATH=src .venv/bin/python benchmarks/round_pieces.py [WORKLOAD] [--rounds N] [--json]

Builds ``WORKLOAD`` (default ``fedlap_func_100``; any federated key of ``fedbayes.bench.WORKLOADS``)
as ``fedbayes bench`` builds it, with one XLA host device per core, then for rounds 1..N in turn
times (medians over the rounds, each blocked until its result is ready):

* ``simulator``: the simulator's round (``run_round``) and its process CPU seconds
  (``--server-in-round``: with a ``server_on_one_device`` method's server step split over the
  devices inside the round's program, as before 2026-11-28);
* ``plain``: the round's own limit (:func:`fedbayes.bench.own_limit.plain_round`: the cohort's
  ``client_update`` calls as a plain jitted loop over the devices, then the server step on the
  first device);
* ``plain_clients`` and ``plain_server``: the same two pieces timed apart, the server's CPU
  seconds beside its wall time (above 1 core: XLA's intra-op threads).

This is how FedLap-Func's server step split over the devices was found to cost far more than the
same step on one device (docs/results/bench.md, 2026-11-28).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from fedbayes.sim import hostdevices

hostdevices.configure(os.environ)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", default="fedlap_func_100")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument(
        "--server-in-round", action="store_true", help="the server step split over the devices inside the round's program, as before 2026-11-28"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import jax

    from fedbayes import bench as fb
    from fedbayes.bench.own_limit import _programs, first_device_state, plain_round, prepare_plain_round

    settings = fb.FULL
    sim, state = fb.build_simulator(fb.WORKLOADS[args.workload], settings, fb.load_data(settings))
    if args.server_in_round:
        sim.server_apart = False  # read when the round is traced and launched: nothing compiled yet
    client, broadcast, server = _programs(sim)
    start = first_device_state(sim, state.server_state)
    plain_round(sim, start, prepare_plain_round(sim, state, 0))  # compiles
    jax.block_until_ready(sim.run_round(state)[0].server_state)
    times: dict[str, list[float]] = {k: [] for k in ("simulator", "simulator_cpu", "plain", "plain_clients", "plain_server", "plain_server_cpu")}
    for r in range(1, args.rounds + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        jax.block_until_ready(sim.run_round(state)[0].server_state)
        times["simulator"].append(time.perf_counter() - t0)
        times["simulator_cpu"].append(time.process_time() - c0)
        inputs = prepare_plain_round(sim, state, r)
        t0 = time.perf_counter()
        plain_round(sim, start, inputs)
        times["plain"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        message = broadcast(start)
        on = {d: jax.device_put(message, d) for d in set(inputs.devices)}
        messages = [client(k, on[d], s, data)[0] for d, k, s, data in zip(inputs.devices, inputs.keys, inputs.states, inputs.data)]
        messages = jax.block_until_ready(jax.device_put(messages, inputs.devices[0]))
        t1, c1 = time.perf_counter(), time.process_time()
        jax.block_until_ready(server(inputs.server_key, start, messages, inputs.weights))
        times["plain_clients"].append(t1 - t0)
        times["plain_server"].append(time.perf_counter() - t1)
        times["plain_server_cpu"].append(time.process_time() - c1)
    out = {k: statistics.median(v) for k, v in times.items()}
    if args.json:
        print(json.dumps({"workload": args.workload, "rounds": args.rounds, "server_in_round": args.server_in_round, **out}))
        return
    for k, v in out.items():
        print(f"{k:<18} {v:8.3f} s")


if __name__ == "__main__":
    main()
