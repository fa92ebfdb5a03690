"""What a fresh Gaussian weight draw per step costs on this CPU, against a FedAvg step: the floor
of PVI's weight-draw estimator (``estimator = "weights"``).

    PYTHONPATH=src .venv/bin/python benchmarks/normal_cost.py [--size N] [--reps R] [--json]

In one process with one single-threaded XLA host device, pinned to one core (as
``benchmarks/step_cost.py --one-core``), interleaved over ``--reps`` passes in a rotated order
(:func:`fedbayes.bench.relative.interleaved_times`):

* ``fedavg_step``: one client's local training in ``fedavg_e3_100`` (``fedbayes.bench``'s model and
  data: an MLP 784-200-100-10 on Fashion-MNIST, batch 32), its ``client_update`` divided by its
  number of steps;
* ``normal[<impl>]``: ``jax.random.normal(key, (N,))`` with each of JAX's generators
  (``threefry2x32``, JAX's default; ``rbg`` and ``unsafe_rbg``, XLA's RngBitGenerator), in a jitted
  loop of 50 draws (a fresh ``fold_in`` key each, as a training step gets), per draw;
* ``bits[threefry2x32]``: the same draws' 32-bit words alone (the hash; ``normal`` adds the
  inverse error function).

``N`` defaults to the model's parameter count (178,110): one weight draw, the noise of one step of
the weight-draw estimator. Prints each row's median milliseconds and its ratio to the FedAvg
step (``ratio``: median and ``range`` over the passes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fedbayes.sim import hostdevices

os.environ["XLA_FLAGS"] = hostdevices.xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=1, single_thread=True)
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

DRAWS = 50  # draws per timed call


def _draws(kind: str, impl: str, size: int):
    import jax
    import jax.numpy as jnp

    def run(key):
        def body(i, acc):
            k = jax.random.fold_in(key, i)
            if impl != "threefry2x32":  # the same stream's words as another generator's key
                k = jax.random.wrap_key_data(jax.random.bits(k, (4,), jnp.uint32), impl=impl)
            x = jax.random.normal(k, (size,)) if kind == "normal" else jax.random.bits(k, (size,), jnp.uint32).astype(jnp.float32)
            return acc + x[i % size]  # one element kept: the draw is not removed, nothing else is added

        return jax.lax.fori_loop(0, DRAWS, body, jnp.float32(0))

    return jax.jit(run)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=None, help="normals per draw (default: the model's parameter count)")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from fedbayes import bench as fb
    from fedbayes.bench.own_limit import _programs, first_device_state
    from fedbayes.bench.relative import format_rows, interleaved_times, paired_rows
    from fedbayes.data.batches import num_local_steps

    settings = fb.FULL
    sim, state = fb.build_simulator(fb.WORKLOADS["fedavg_e3_100"], settings, fb.load_data(settings))
    inputs = fb.prepare_plain_round(sim, state, 1)
    client, broadcast, _ = _programs(sim)
    message = broadcast(first_device_state(sim, state.server_state))
    fedavg_args = (inputs.keys[0], message, inputs.states[0], inputs.data[0])
    steps = int(num_local_steps(np.asarray(inputs.data[0].num_examples), sim.algorithm.local_batch_size, sim.algorithm.local_epochs))
    size = args.size or sum(int(np.size(x)) for x in jax.tree.leaves(state.server_state.params))

    key = jax.random.key(0)
    rows = {"fedavg_step": (lambda: client(*fedavg_args), steps)}
    for kind, impl in (("normal", "threefry2x32"), ("normal", "rbg"), ("normal", "unsafe_rbg"), ("bits", "threefry2x32")):
        f = _draws(kind, impl, size)
        rows[f"{kind}[{impl}]"] = (lambda f=f: f(key), DRAWS)
    per_call = interleaved_times({name: fn for name, (fn, _) in rows.items()}, args.reps)  # compiles first
    times = {name: [t / rows[name][1] for t in ts] for name, ts in per_call.items()}  # per step or draw
    out = {"size": size, "fedavg_steps": steps, **paired_rows(times, "fedavg_step")}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{size:,} normals a draw; FedAvg step = one client's {steps} steps of fedavg_e3_100")
    print("\n".join(format_rows({name: out[name] for name in rows}, " FedAvg steps")))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
