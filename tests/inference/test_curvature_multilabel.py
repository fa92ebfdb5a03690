"""The curvature of the multi-label likelihood (independent Bernoulli labels, the mean sigmoid
cross-entropy of tag prediction) against its closed form on a linear model."""

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.inference.curvature import diag_empirical_fisher, diag_fisher, diag_ggn
from fedbayes.models import init_params, make_model


def _setup():
    model = make_model("logreg", 3)
    params = init_params(model, jax.random.key(0), (4,))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(6, 4)).astype(np.float32))
    y = jnp.asarray((rng.random((6, 3)) < 0.4).astype(np.float32))
    p = np.asarray(jax.nn.sigmoid(model.apply({"params": params}, x)), np.float64)
    return (lambda q, xs: model.apply({"params": q}, xs)), params, np.asarray(x, np.float64), np.asarray(y, np.float64), p


def test_ggn_and_empirical_fisher_of_the_mean_sigmoid_cross_entropy():
    apply_fn, params, x, y, p = _setup()
    c = 3  # l_n = (1/C) sum_c bce: Hessian diag(p (1 - p)) / C; the empirical Fisher's vectors (p - y) / sqrt(C)
    ggn = diag_ggn(apply_fn, params, x.astype(np.float32), task="multilabel")
    np.testing.assert_allclose(ggn["dense"]["kernel"], (x**2).T @ (p * (1 - p) / c), rtol=1e-5)
    np.testing.assert_allclose(ggn["dense"]["bias"], (p * (1 - p) / c).sum(0), rtol=1e-5)
    emp = diag_empirical_fisher(apply_fn, params, x.astype(np.float32), y.astype(np.float32), task="multilabel")
    np.testing.assert_allclose(emp["dense"]["kernel"], (x**2).T @ ((p - y) ** 2 / c), rtol=1e-5)


def test_sampled_fisher_estimates_the_ggn():
    apply_fn, params, x, _, p = _setup()
    fisher = diag_fisher(apply_fn, params, x.astype(np.float32), key=jax.random.key(1), num_samples=4000, task="multilabel")
    want = (x**2).T @ (p * (1 - p) / 3)
    # Monte Carlo over 4000 label draws per example: a few percent
    np.testing.assert_allclose(fisher["dense"]["kernel"], want, rtol=0.08)
