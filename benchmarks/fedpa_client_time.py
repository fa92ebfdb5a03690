"""FedPA's client update time relative to FedAvg's, as a function of the dimension (Al-Shedivat et al. 2021 (FedPA) Table 1).

Al-Shedivat et al. 2021 (FedPA) Table 1 times one client update of 5 epochs of 100 steps on synthetic least squares:
FedAvg (plain SGD) against FedPA (IASG samples + the O(l^2 d) dynamic-programming delta), for
d = 100 .. 100K, and reports +26% .. +4%. Here: the same schedule (5 epochs of 100 steps, batch
10, lr 0.01; FedPA's first epoch is burn-in, then one sample per epoch: l = 4) on
``0.5 mean((X w - y)^2)`` over a pool of 50 examples cycled in minibatches of 10 (a larger data
set would not fit in memory at d = 10^6), for d = 10^3 .. 10^6. Both updates are jitted; the
median of ``--reps`` timed calls after a warm-up is reported.

    .venv/bin/python benchmarks/fedpa_client_time.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import optax

from fedbayes.algorithms.fedpa import shrinkage_delta
from fedbayes.inference.iasg import iasg

EPOCHS, STEPS, BATCH, LR, POOL = 5, 100, 10, 0.01, 50


def make_updates(dim: int):
    key = jax.random.key(0)
    w_true = jax.random.normal(jax.random.fold_in(key, 1), (dim,)) / jnp.sqrt(dim)
    pool_x = jax.random.normal(jax.random.fold_in(key, 2), (POOL, dim)) / jnp.sqrt(dim)
    pool_y = pool_x @ w_true

    def batch(step):
        start = (step * BATCH) % POOL
        return jax.lax.dynamic_slice_in_dim(pool_x, start, BATCH), jax.lax.dynamic_slice_in_dim(pool_y, start, BATCH)

    def loss(w, x, y):
        return 0.5 * jnp.mean(jnp.square(x @ w - y))

    grad = jax.grad(loss)
    opt = optax.sgd(LR)

    @jax.jit
    def fedavg(theta):
        def body(s, carry):
            w, st = carry
            u, st = opt.update(grad(w, *batch(s)), st, w)
            return optax.apply_updates(w, u), st

        w, _ = jax.lax.fori_loop(0, EPOCHS * STEPS, body, (theta, opt.init(theta)))
        return theta - w

    @jax.jit
    def fedpa(theta):
        samples, _ = iasg(theta, batch, grad, opt, burn_in_steps=STEPS, steps_per_sample=STEPS, num_samples=EPOCHS - 1)
        return shrinkage_delta(samples, theta, 0.01)

    return fedavg, fedpa


def timed(fn, x, reps):
    jax.block_until_ready(fn(x))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dims", default="1000,10000,100000,1000000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = {}
    for dim in map(int, args.dims.split(",")):
        fedavg, fedpa = make_updates(dim)
        theta = jnp.zeros(dim)
        a, p = timed(fedavg, theta, args.reps), timed(fedpa, theta, args.reps)
        rows[str(dim)] = {"fedavg_ms": 1e3 * a, "fedpa_ms": 1e3 * p, "overhead_pct": 100 * (p / a - 1)}
        if not args.json:
            print(f"d={dim:>8}  fedavg {1e3 * a:8.1f} ms  fedpa {1e3 * p:8.1f} ms  ({100 * (p / a - 1):+.1f}%)", flush=True)
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
