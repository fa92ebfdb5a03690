"""PVI's natural diagonal client on a network: where its precisions go (docs/results/pvi_natural.md).

Two measurements on the setting of a config (``[base]`` of a ``fedbayes compare`` file, e.g.
``examples/fmnist_defaults.toml``):

* ``trace``: one client's local step of round 1 (the broadcast prior, the model's initial weights,
  the precision started at ``1 / 0.03^2``), step by step with the client's defaults (step ``b``,
  draws in antithetic pairs, its minibatches): per layer the median of ``n_k`` times the GGN
  diagonal at the draws, the median precision ``P`` and the largest ``|m|``;
* ``ggn``: per layer the 5/50/95% quantiles of ``delta + diag GGN`` of the whole training set at the
  mean of a run's ``model.npz``, the precision that the data give a mean-field or Laplace posterior
  there, and of the run's own posterior precision ``1 / posterior_variance``.

    PYTHONPATH=src python benchmarks/pvi_natural_network.py trace examples/fmnist_defaults.toml --client 1
    PYTHONPATH=src python benchmarks/pvi_natural_network.py ggn examples/fmnist_defaults.toml runs/pvi_natural_net/pvi_sgd/model.npz
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import gaussian
from fedbayes.algorithms.pvi import NETWORK_INIT_STD, start_of
from fedbayes.config.schema import validate
from fedbayes.data.batches import get_batch, steps_per_epoch
from fedbayes.inference.curvature import batch_diag_ggn, diag_ggn
from fedbayes.inference.vi import standard_normal_like
from fedbayes.inference.vi_natural import NATURAL_SAMPLES, NATURAL_STEP, natural_step
from fedbayes.runs.build import build_experiment

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def _experiment(path: str):
    raw = tomllib.load(open(path, "rb"))
    return build_experiment(validate({**raw["base"], "algorithm": {"name": "pvi", "local_vi": "natural"}}))


def _name(kp) -> str:
    return "/".join(str(getattr(k, "key", k)) for k in kp)


def trace(args) -> None:
    from helpers import single_client_data  # the test suite's one-client layout

    exp = _experiment(args.config)
    sim = exp.simulator
    state = sim.init(exp.params)
    message = sim.algorithm.broadcast(state.server_state)
    data = single_client_data(sim, 0, args.client)
    apply = lambda p, x: exp.model.apply({"params": p}, x)  # noqa: E731
    loss_fn = sim.algorithm.trainer.loss_fn
    batch = sim.algorithm.trainer.batch_size
    n = float(data.num_examples)
    laid_out = int(steps_per_epoch(data.num_examples, batch)) * sim.algorithm.local_epochs
    cavity = message.q
    m = gaussian.mean(start_of(message))
    p = jax.tree.map(lambda a: jnp.maximum(a, 1.0 / NETWORK_INIT_STD**2), cavity.precision)
    pairs = NATURAL_SAMPLES // 2
    print(f"client {args.client}: {int(n)} examples, batch {batch}, step {NATURAL_STEP}, {NATURAL_SAMPLES} draws")
    print("step  " + "  ".join(f"{_name(kp)[:16]:>16s}: n*GGN  P  max|m|" for kp, _ in jax.tree_util.tree_leaves_with_path(m) if "kernel" in _name(kp)))

    @jax.jit
    def step(t, m, p):
        x, y, mask = get_batch(data, t % laid_out, batch)
        weight = jnp.maximum(jnp.sum(mask), 1.0)
        gs, hs = [], []
        for s in range(2 * pairs):
            key = jax.random.fold_in(jax.random.key(t), s // 2)
            eps = standard_normal_like(key, m)
            theta = jax.tree.map(lambda mi, pi, e: mi + (1.0 - 2.0 * (s % 2)) * e * jax.lax.rsqrt(pi), m, p, eps)
            gs.append(jax.grad(loss_fn)(theta, key, x, y, mask))
            hs.append(jax.tree.map(lambda h: h / weight, batch_diag_ggn(apply, theta, x, y, mask)))
        g = jax.tree.map(lambda *a: sum(a) / len(a), *gs)
        h = jax.tree.map(lambda *a: sum(a) / len(a), *hs)
        m, p = natural_step(m, p, g, h, cavity.precision, gaussian.mean(cavity), n, NATURAL_STEP)
        return m, p, h

    for t in range(args.steps):
        m, p, h = step(t, m, p)
        if t % args.every == 0 or t == args.steps - 1:
            cols = []
            for (kp, mm), pp, hh in zip(jax.tree_util.tree_leaves_with_path(m), jax.tree.leaves(p), jax.tree.leaves(h), strict=True):
                if "kernel" in _name(kp):
                    cols.append(f"{float(jnp.median(n * hh)):9.3g} {float(jnp.median(pp)):8.1f} {float(jnp.max(jnp.abs(mm))):8.3g}")
            print(f"{t:4d}  " + "  ".join(cols), flush=True)


def ggn(args) -> None:
    exp = _experiment(args.config)
    stored = np.load(args.model)
    params = jax.tree_util.tree_map_with_path(lambda kp, a: jnp.asarray(stored["params/" + _name(kp)]), exp.params)
    apply = lambda p, x: exp.model.apply({"params": p}, x)  # noqa: E731
    delta = validate({"algorithm": {"name": "pvi"}}).algorithm.delta
    curvature = diag_ggn(apply, params, jnp.asarray(exp.dataset.x_train), batch_size=256)
    print(f"{len(exp.dataset.x_train)} training examples; quantiles 5% / 50% / 95%")
    print(f"{'layer':18s} {'delta + diag GGN (data)':>32s}   {'the run: 1 / posterior variance':>32s}")
    for kp, g in jax.tree_util.tree_leaves_with_path(curvature):
        name = _name(kp)
        data_q = np.quantile(delta + np.asarray(g).ravel(), [0.05, 0.5, 0.95])
        run_q = np.quantile(1.0 / stored["posterior_variance/" + name].ravel(), [0.05, 0.5, 0.95])
        print(f"{name:18s} {data_q[0]:10.2f} {data_q[1]:10.2f} {data_q[2]:10.2f}   {run_q[0]:10.1f} {run_q[1]:10.1f} {run_q[2]:10.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    t = sub.add_parser("trace")
    t.add_argument("config")
    t.add_argument("--client", type=int, default=1)
    t.add_argument("--steps", type=int, default=60)
    t.add_argument("--every", type=int, default=5)
    g = sub.add_parser("ggn")
    g.add_argument("config")
    g.add_argument("model")
    args = ap.parse_args()
    trace(args) if args.what == "trace" else ggn(args)


if __name__ == "__main__":
    main()
