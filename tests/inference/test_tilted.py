"""FedEP's tilted inference (:mod:`fedbayes.inference.tilted`; docs/algorithms.md §7.5-7.6) on a
linear-Gaussian client, whose tilted mode is known in closed form: with the cavity ``(eta_c,
Lambda_c)`` and ``l(theta) = 1/2 ||Z theta - y||^2`` (``Z`` the features with a ones column for the
bias) it is ``(Z^T Z + diag(Lambda_c))^{-1} (Z^T y + eta_c)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import single_client_data

from fedbayes.algorithms.fedavg import fedavg
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.tilted import TiltedSettings, make_tilted_inference, tilted_prior
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.sim.simulator import Simulator

N, DIM = 200, 3


def test_the_tilted_prior_adds_weight_decay_per_example():
    """``(eta_c, Lambda_c + lambda_wd n_k)``: 10 examples at 0.5 add 5."""
    cavity = DiagGaussian(precision_mean=jnp.array([1.0, 2.0]), precision=jnp.array([3.0, 4.0]))
    prior = tilted_prior(cavity, jnp.int32(10), 0.5)
    np.testing.assert_array_equal(np.asarray(prior.precision), [8.0, 9.0])
    np.testing.assert_array_equal(np.asarray(prior.precision_mean), [1.0, 2.0])


def test_alpha_cov_is_the_scaled_initial_precision_plus_weight_decay():
    assert TiltedSettings(scale=2.0, initial_precision=0.5, weight_decay=0.25).alpha_cov == 1.5


def test_bad_methods_and_settings_are_refused():
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 4)
    with pytest.raises(ValueError, match="must be one of identity, mcmc, laplace, ngvi"):
        make_tilted_inference("gibbs", trainer)
    with pytest.raises(ValueError, match="the laplace method needs the model's apply_fn"):
        make_tilted_inference("laplace", trainer)
    with pytest.raises(ValueError, match="it needs >= 2 local epochs; got 1"):
        make_tilted_inference("mcmc", trainer)


class Client:
    """A linear-regression client of ``N`` examples, its data laid out as the simulator lays it out."""

    def __init__(self, epochs=4):
        rng = np.random.default_rng(0)
        self.x = (rng.normal(size=(N, DIM)) * np.array([1.0, 0.5, 0.3])).astype(np.float32)
        self.y = (self.x @ np.array([1.0, -2.0, 0.5]) + 0.7 + 0.3 * rng.normal(size=N)).astype(np.float32)
        self.model = make_model("linear", 1)
        self.apply_fn = lambda p, x: self.model.apply({"params": p}, x)
        self.trainer = LocalTrainer(loss_fn(self.model, "regression"), optax.sgd(0.01), epochs, N)
        self.params = init_params(self.model, jax.random.key(0), (DIM,))
        sim = Simulator(fedavg(self.trainer, optax.sgd(1.0)), Federation(self.x, self.y, (np.arange(N),)), clients_per_round=1, seed=0)
        self.data = single_client_data(sim, 0, 0)
        self.z = np.concatenate([self.x, np.ones((N, 1), np.float32)], axis=1).astype(np.float64)  # (kernel, bias)
        lam = np.array([2.0, 1.0, 4.0, 0.5])
        eta = np.array([0.5, -1.0, 0.0, 0.2])
        self.cavity = DiagGaussian(precision_mean=self.tree(eta), precision=self.tree(lam))
        self.lam_c, self.eta_c = lam, eta

    def tree(self, flat):
        return {"dense": {"kernel": jnp.asarray(flat[:DIM, None], jnp.float32), "bias": jnp.asarray(flat[DIM:], jnp.float32)}}

    def flat(self, tree):
        return np.concatenate([np.asarray(tree["dense"]["kernel"])[:, 0], np.asarray(tree["dense"]["bias"])]).astype(np.float64)

    def mode(self):
        return np.linalg.solve(self.z.T @ self.z + np.diag(self.lam_c), self.z.T @ self.y + self.eta_c)


def test_the_identity_method_started_at_the_tilted_mode_stays_there():
    """The sampler's iterates stay at the tilted mode (its gradient is zero there), so ``mu^`` is
    the mode; the identity method's precision is exactly ``Lambda_c + alpha_cov n_k`` and
    ``eta^ = Lambda^ mu^``."""
    c = Client()
    infer = jax.jit(make_tilted_inference("identity", c.trainer, TiltedSettings(initial_precision=0.5)))
    q, info = infer(jax.random.key(1), c.tree(c.mode()), c.cavity, c.data)
    lam = c.flat(q.precision)
    np.testing.assert_array_equal(lam, (c.lam_c + 0.5 * N).astype(np.float32))
    np.testing.assert_allclose(c.flat(q.precision_mean) / lam, c.mode(), atol=1e-5)  # float32 round-off of the start
    assert int(info["steps"]) == 4


def test_the_laplace_method_adds_the_fisher_of_the_data():
    """For a unit-variance Gaussian likelihood the Fisher is ``diag(Z^T Z)`` at any parameters;
    the sampled-label estimate over 5 passes of 200 examples is within 15% of it (a fixed key)."""
    c = Client()
    infer = jax.jit(make_tilted_inference("laplace", c.trainer, TiltedSettings(), apply_fn=c.apply_fn, task="regression"))
    q, _ = infer(jax.random.key(2), c.tree(c.mode()), c.cavity, c.data)
    np.testing.assert_allclose(c.flat(q.precision) - c.lam_c, np.diag(c.z.T @ c.z), rtol=0.15)
    np.testing.assert_allclose(c.flat(q.precision_mean) / c.flat(q.precision), c.mode(), atol=1e-5)
