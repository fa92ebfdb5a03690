"""Cost of the diagonal curvature flavours against a training step, in one process.

For the MLP (784-200-100-10) and the CNN on 28x28x1 inputs (Fashion-MNIST's shape), batch 32,
times one jitted call of each of

* ``step``: a training step (gradient of the mean loss and an SGD update), the unit;
* ``fisher``: :func:`fedbayes.inference.curvature.batch_diag_fisher`, one sampled label per example;
* ``empirical``: :func:`~fedbayes.inference.curvature.batch_diag_empirical_fisher`;
* ``ggn``: :func:`~fedbayes.inference.curvature.batch_diag_ggn` (exact, C = 10 output vectors);
* ``vmap_grad``: the squares of per-example ``vmap(grad)`` (the previous implementation).

Paired and interleaved: every repetition times each function once, in a rotated order, and the
ratio to the step of the same repetition is kept; the report is the median and range of those
ratios (never absolute times across runs). Targets: fisher and empirical <= 2x a step (MLP),
<= 3x (CNN); ggn <= (C + 1)x.

    PYTHONPATH=src python benchmarks/curvature.py [--reps 30] [--batch-size 32] [--json out.json]

``measure(model_name, batch_size, reps)`` returns the numbers (for ``fedbayes bench``).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes.inference import curvature as cv
from fedbayes.models import init_params, loss_fn, make_model

FEATURES = {"mlp": (784,), "cnn": (28, 28, 1)}
NUM_CLASSES = 10
TARGETS = {"mlp": {"fisher": 2.0, "empirical": 2.0, "ggn": NUM_CLASSES + 1.0}, "cnn": {"fisher": 3.0, "empirical": 3.0, "ggn": NUM_CLASSES + 1.0}}


def _functions(model_name: str, batch_size: int):
    model = make_model(model_name, NUM_CLASSES)
    shape = FEATURES[model_name]
    params = init_params(model, jax.random.key(0), shape)
    apply = lambda p, x: model.apply({"params": p}, x)
    loss = loss_fn(model, "classification")
    opt = optax.sgd(0.01)
    x = jax.random.normal(jax.random.key(1), (batch_size, *shape))
    y = jax.random.randint(jax.random.key(2), (batch_size,), 0, NUM_CLASSES)
    mask = jnp.ones((batch_size,))
    key = jax.random.key(3)

    @jax.jit
    def step(p, s):
        g = jax.grad(loss)(p, x, y, mask)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    def per_example(p, k):
        def one(xn, kn):
            def ll(q):
                out = apply(q, xn[None])[0]
                return jax.nn.log_softmax(out)[jax.random.categorical(kn, jax.lax.stop_gradient(out))]

            return jax.grad(ll)(p)

        grads = jax.vmap(one)(x, jax.random.split(k, batch_size))
        return jax.tree.map(lambda g: jnp.sum(jnp.square(g), axis=0), grads)

    state = opt.init(params)
    fns = {
        "step": lambda: step(params, state),
        "fisher": jax.jit(lambda p, k: cv.batch_diag_fisher(apply, p, x, y, mask, key=k)).__call__,
        "empirical": jax.jit(lambda p: cv.batch_diag_empirical_fisher(apply, p, x, y, mask)),
        "ggn": jax.jit(lambda p: cv.batch_diag_ggn(apply, p, x, y, mask)),
        "vmap_grad": jax.jit(per_example),
    }
    calls = {
        "step": fns["step"],
        "fisher": lambda: fns["fisher"](params, key),
        "empirical": lambda: fns["empirical"](params),
        "ggn": lambda: fns["ggn"](params),
        "vmap_grad": lambda: fns["vmap_grad"](params, key),
    }
    return calls


def measure(model_name: str = "mlp", batch_size: int = 32, reps: int = 30, inner: int = 5) -> dict:
    """Median and range of each flavour's time over a training step's, paired per repetition.

    Each timing is ``inner`` back-to-back calls (after a warm-up call that compiles)."""
    calls = _functions(model_name, batch_size)
    names = list(calls)
    for f in calls.values():
        jax.block_until_ready(f())
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                out = calls[n]()
            jax.block_until_ready(out)
            times[n].append((time.perf_counter() - t0) / inner)
    step = np.asarray(times["step"])
    result = {"model": model_name, "batch_size": batch_size, "reps": reps, "step_median_s": float(np.median(step)), "ratios": {}}
    for n in names:
        if n == "step":
            continue
        ratio = np.asarray(times[n]) / step
        result["ratios"][n] = {
            "median": float(np.median(ratio)), "min": float(ratio.min()), "max": float(ratio.max()),
            "target": TARGETS[model_name].get(n),
        }  # fmt: skip
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--models", default="mlp,cnn")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = [measure(m, args.batch_size, args.reps) for m in args.models.split(",")]
    for res in results:
        print(f"{res['model']} (batch {res['batch_size']}, {res['reps']} paired reps): a training step = 1")
        for n, r in res["ratios"].items():
            target = "" if r["target"] is None else f"  (target <= {r['target']:g})"
            print(f"  {n:10s} {r['median']:7.2f}x  [{r['min']:.2f}, {r['max']:.2f}]{target}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
