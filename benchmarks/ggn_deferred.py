"""FedLap-Cov's curvature pass with the dense layers' products deferred: measured, not adopted.

    PYTHONPATH=src .venv/bin/python benchmarks/ggn_deferred.py [--reps R] [--json]

FedLap-Cov's client ends with one pass of the exact GGN diagonal over its examples
(:func:`fedbayes.inference.curvature.data_curvature`): per minibatch, the output Hessian's square
root columns are pulled back through the network and each dense layer adds
``(a^2)^T (sum_c g_c^2)`` to a running sum of the kernel's size. The deferred form keeps every
batch's ``a^2`` and ``sum_c g_c^2`` in buffers of ``[batches, B, features]`` and multiplies once per
client, over all its examples. XLA needs the buffers' length statically, so in a simulator it is
the largest client's number of batches: every client pays for that length.

In one process with one single-threaded XLA host device, pinned to one core, on the first client
of ``fedlap_cov_100``'s first round (``fedbayes.bench``: MLP 784-200-100-10, Fashion-MNIST, 600
examples, batch 32), interleaved over ``--reps`` passes in a rotated order
(:func:`fedbayes.bench.relative.interleaved_times`):

* ``per_batch``: ``data_curvature`` as FedLap-Cov runs it;
* ``per_batch_b128``: the same at batch 128 (fewer, longer products);
* ``deferred_exact``: deferred, buffers of exactly this client's batches (every client the size of
  the largest);
* ``deferred_2x``: deferred, buffers twice as long (the largest client twice this one's size).

Prints each form's median milliseconds and its ratio to ``per_batch`` (``ratio``: median and
``range`` over the passes), and the
largest relative difference of the deferred kernels from ``per_batch``'s.
"""

from __future__ import annotations

import argparse
import json
import os

from fedbayes.sim import hostdevices

os.environ["XLA_FLAGS"] = hostdevices.xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=1, single_thread=True)
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def deferred_curvature(apply_fn, batch_size: int, num_batches: int):
    """The dense layers' GGN diagonal of a client's examples, the products deferred to one per
    layer over ``num_batches`` stacked batches (a static bound; unused rows stay zero)."""
    import jax
    import jax.numpy as jnp

    from fedbayes.data.batches import get_batch, steps_per_epoch
    from fedbayes.inference import curvature
    from fedbayes.models.layers import find_layers

    def run(params, data):
        x0, _, _ = get_batch(data, 0, batch_size)
        layers, _ = find_layers(apply_fn, params, x0)
        if any(layer.kind != "dense" for layer, _ in layers.values()):
            raise ValueError("this measurement covers dense layers only")

        def one(x, y, mask):
            pert0 = {path: jnp.zeros(shape.shape, shape.dtype) for path, (_, shape) in layers.items()}
            fwd = curvature.instrumented_forward(apply_fn, params, x, layers)
            out, vjp_fn, inputs = jax.vjp(fwd, pert0, has_aux=True)
            u = curvature._output_vectors("ggn", "classification", jax.lax.stop_gradient(out), y, mask, None, 1)
            (grads,) = jax.vmap(vjp_fn)(u)
            return {p: (jnp.square(inputs[p]), jnp.sum(jnp.square(grads[p]), axis=0)) for p in layers}

        shapes = jax.eval_shape(one, *get_batch(data, 0, batch_size))
        init = {p: tuple(jnp.zeros((num_batches,) + s.shape, s.dtype) for s in pair) for p, pair in shapes.items()}

        def body(s, bufs):
            new = one(*get_batch(data, s, batch_size))
            return {p: (bufs[p][0].at[s].set(new[p][0]), bufs[p][1].at[s].set(new[p][1])) for p in bufs}

        bufs = jax.lax.fori_loop(0, jnp.minimum(steps_per_epoch(data.num_examples, batch_size), num_batches), body, init)
        out = {}
        for p, (a2, g2) in bufs.items():
            a2, g2 = a2.reshape(-1, a2.shape[-1]), g2.reshape(-1, g2.shape[-1])
            out[p] = {"kernel": a2.T @ g2, "bias": jnp.sum(g2, axis=0)}
        return out

    return jax.jit(run)


def _at(tree, path):
    for name in path:
        tree = tree[name]
    return tree


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import jax
    import numpy as np

    from fedbayes import bench as fb
    from fedbayes.bench.relative import format_rows, interleaved_times, paired_rows
    from fedbayes.bench.workloads import model_and_trainer
    from fedbayes.data.batches import steps_per_epoch
    from fedbayes.inference.curvature import data_curvature

    settings = fb.FULL
    dataset = fb.load_data(settings)
    sim, state = fb.build_simulator(fb.WORKLOADS["fedlap_cov_100"], settings, dataset)
    inputs = fb.prepare_plain_round(sim, state, 1)
    data = inputs.data[0]
    batch = sim.algorithm.local_batch_size
    params, _, apply_fn = model_and_trainer(settings, dataset, batch)
    params = jax.device_put(params, inputs.devices[0])
    batches = int(steps_per_epoch(np.asarray(data.num_examples), batch))
    forms = {
        "per_batch": jax.jit(data_curvature(apply_fn, batch_size=batch)),
        "per_batch_b128": jax.jit(data_curvature(apply_fn, batch_size=128)),
        "deferred_exact": deferred_curvature(apply_fn, batch, batches),
        "deferred_2x": deferred_curvature(apply_fn, batch, 2 * batches),
    }
    calls = {name: (lambda fn=fn: fn(params, data)) for name, fn in forms.items()}
    times = interleaved_times(calls, args.reps)  # compiles first, then rotates the order each pass
    ref = jax.device_get(forms["per_batch"](params, data))
    differences = {}
    for name in ("deferred_exact", "deferred_2x"):
        got = jax.device_get(forms[name](params, data))
        differences[name] = max(float(np.max(np.abs(got[p]["kernel"] - _at(ref, p)["kernel"])) / np.max(np.abs(_at(ref, p)["kernel"]))) for p in got)
    out = {"examples": int(data.num_examples), "batches": batches, "max_relative_difference": differences, **paired_rows(times, "per_batch")}
    if args.json:
        print(json.dumps(out))
        return
    print(f"one client, {out['examples']} examples, {batches} batches of {batch}; deferred kernels within {max(differences.values()):.1e} (relative)")
    print("\n".join(format_rows({name: out[name] for name in forms}, " of per_batch")))


if __name__ == "__main__":
    main()
