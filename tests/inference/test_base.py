"""Conformance of every client inference method to :class:`fedbayes.inference.base.CavityInference`:
``(key, start, cavity, data) -> (DiagGaussian, info)`` under ``jit`` and under ``vmap`` over clients
(the simulator's layout), with the structure and dtype of the parameters kept and finite outputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup

from fedbayes import gaussian
from fedbayes.data.batches import CLIENT_AXES, ClientData, layout_orders
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.base import CavityInference
from fedbayes.inference.tilted import DIAGONAL_METHODS, TiltedSettings, make_tilted_inference
from fedbayes.inference.vi import ESTIMATORS, reparameterised_vi

EPOCHS, BATCH = 2, 16


def _cohort(cids=(0, 1)) -> ClientData:
    """The cohort's stacked client data (offsets and sizes per client, the pooled arrays shared)."""
    fed = digits_federation()
    positions = [fed.client_indices[c] for c in cids]
    order, offsets, _ = layout_orders(0, 0, list(cids), positions, EPOCHS, BATCH)
    sizes = [len(p) for p in positions]
    return ClientData(jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.asarray(order), jnp.asarray(offsets), jnp.asarray(sizes, jnp.int32))


def _methods() -> dict[str, tuple[CavityInference, str]]:
    """Every inference method, and whether its ``start`` is a point (``"point"``) or a Gaussian."""
    model, _, trainer = logreg_setup(lr=0.05, epochs=EPOCHS, batch_size=BATCH)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    settings = TiltedSettings(scale=50.0, weight_decay=1e-3, laplace_epochs=1, ngvi_epochs=1, ngvi_samples=1)
    out = {f"tilted_{m}": (make_tilted_inference(m, trainer, settings, apply_fn=apply_fn), "point") for m in DIAGONAL_METHODS}
    vi_trainer = trainer._replace(optimizer=optax.adam(1e-2))
    out.update({f"vi_{e}": (reparameterised_vi(vi_trainer, samples=2, init_std=0.1, estimator=e), "gaussian") for e in ESTIMATORS})
    return out


METHOD_NAMES = sorted(_methods())


def _inputs(kind: str):
    _, params, _ = logreg_setup()
    cavity = DiagGaussian(precision_mean=optax.tree.zeros_like(params), precision=optax.tree.full_like(params, 1.0))
    start = params if kind == "point" else DiagGaussian(jax.tree.map(jnp.multiply, cavity.precision, params), cavity.precision)
    return params, start, cavity


def _check(q, params):
    assert isinstance(q, DiagGaussian)
    for part in (q.precision_mean, q.precision):
        assert jax.tree.structure(part) == jax.tree.structure(params)
        for a, p in zip(jax.tree.leaves(part), jax.tree.leaves(params)):
            assert a.dtype == p.dtype and a.shape[-p.ndim :] == p.shape
            assert bool(jnp.all(jnp.isfinite(a)))


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_inference_method_runs_under_jit(name):
    infer, kind = _methods()[name]
    params, start, cavity = _inputs(kind)
    data = jax.tree.map(lambda a, ax: a if ax is None else a[0], _cohort(), CLIENT_AXES)
    q, info = jax.jit(infer)(jax.random.key(0), start, cavity, data)
    _check(q, params)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(info))
    assert bool(gaussian.is_proper(q))


@pytest.mark.parametrize("name", METHOD_NAMES)
def test_every_inference_method_runs_under_vmap_over_clients(name):
    infer, kind = _methods()[name]
    params, start, cavity = _inputs(kind)
    cohort = _cohort()
    keys = jax.random.split(jax.random.key(0), 2)
    q, _ = jax.jit(jax.vmap(infer, in_axes=(0, None, None, CLIENT_AXES)))(keys, start, cavity, cohort)
    _check(q, params)
    # Each client's row equals that client run on its own, up to the batched program's rounding.
    one = jax.tree.map(lambda a, ax: a if ax is None else a[1], cohort, CLIENT_AXES)
    q1, _ = jax.jit(infer)(keys[1], start, cavity, one)
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(q1)):
        np.testing.assert_allclose(np.asarray(a[1]), np.asarray(b), rtol=2e-4, atol=2e-4)  # vmap vs one client: float32 fusion
