"""FedEP's laplace method with the last-layer structure (dense over the output layer, diagonal
elsewhere): on a one-layer model it is the full-covariance method; on a small network its fixed
point is the MAP of all the data with the block GGN Laplace precision there; the config's refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from test_fedep_full import NUM_CLIENTS, PER_CLIENT, PRIOR, _problem
from test_fedlap_cov_last_layer import _network

from fedbayes import gaussian_block
from fedbayes.algorithms.fedep import fedep_full
from fedbayes.config.schema import ConfigError, validate
from fedbayes.gaussian_block import BlockGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.curvature import batch_diag_ggn, batch_full_ggn
from fedbayes.inference.tilted import TiltedSettings, make_full_laplace_inference
from fedbayes.models import loss_fn
from fedbayes.sim.simulator import Simulator


def _run(fed, model, params, covariance, rounds, lr=0.5, epochs=50):
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(lr), epochs, PER_CLIENT)
    inference = make_full_laplace_inference(trainer, TiltedSettings(), apply_fn=lambda p, x: model.apply({"params": p}, x))
    algo = fedep_full(
        trainer, optax.sgd(1.0), inference, total_examples=NUM_CLIENTS * PER_CLIENT, num_clients=NUM_CLIENTS, damping=0.5, alpha_cov=0.0,
        prior_precision=PRIOR, exact_late_sites=True, covariance=covariance,
    )  # fmt: skip
    sim = Simulator(algo, fed, clients_per_round=NUM_CLIENTS, seed=0)
    state = sim.init(params)
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return algo, state.server_state


def test_one_layer_model_is_the_full_covariance_method():
    fed, model, params = _problem()
    _, block = _run(fed, model, params, "last_layer", 3)
    _, full = _run(fed, model, params, "full", 3)
    assert isinstance(block.q, BlockGaussian) and block.q.precision.diagonal == {}
    np.testing.assert_allclose(np.asarray(block.q.precision.dense), np.asarray(full.q.precision), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ravel_pytree(block.q.precision_mean)[0], ravel_pytree(full.q.precision_mean)[0], rtol=1e-5, atol=1e-4)


def test_network_reaches_the_map_and_the_block_laplace_precision():
    fed, model, params = _network()
    algo, state = _run(fed, model, params, "last_layer", 30, lr=0.1, epochs=200)
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    x, y, mask = jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.ones(len(fed.y))

    def objective(p):
        logits = apply(p, x)
        return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)) + 0.5 * PRIOR * optax.tree.norm(p, squared=True)

    w = algo.server_params(state)
    grad = ravel_pytree(jax.grad(objective)(w))[0]
    scale = ravel_pytree(jax.grad(objective)(params))[0]
    assert float(jnp.linalg.norm(grad)) < 5e-2 * float(jnp.linalg.norm(scale))  # a stationary point of the central objective (tilted modes: SGD iterate means)
    rest, last = gaussian_block.split(w)
    diag = gaussian_block.split(batch_diag_ggn(apply, w, x, y, mask), "output")[0]
    dense = batch_full_ggn(lambda t, xs: apply(gaussian_block.join(rest, t, "output"), xs), last, x, mask)
    prec = state.q.precision
    np.testing.assert_allclose(ravel_pytree(prec.diagonal)[0], ravel_pytree(diag)[0] + PRIOR, rtol=5e-2, atol=5e-2)
    target = np.asarray(dense) + PRIOR * np.eye(dense.shape[0])
    # each site's GGN is taken at its tilted mode, found by local gradient steps: 5% of the block's scale
    np.testing.assert_allclose(np.asarray(prec.dense), target, rtol=5e-2, atol=5e-2 * np.abs(target).max())
    assert np.abs(np.asarray(prec.dense) - np.diag(np.diag(np.asarray(prec.dense)))).max() > 0.1  # the last layer's block is dense
    mean, variance = algo.server_posterior(state)
    np.testing.assert_allclose(ravel_pytree(variance)[0], ravel_pytree(gaussian_block.variance(state.q))[0])
    assert isinstance(algo.server_precision(state), gaussian_block.BlockPrecision)


def test_last_layer_is_a_fedep_laplace_setting():
    cfg = validate({"algorithm": {"name": "fedep", "covariance": "last_layer"}, "model": {"name": "mlp"}})
    assert cfg.algorithm.covariance == "last_layer" and cfg.evaluation.prior_precision == "marglik"
    for algorithm, field in (
        ({"name": "fedep", "covariance": "last_layer", "method": "ngvi"}, "algorithm.covariance: 'last_layer' takes the laplace method"),
        ({"name": "fedep", "covariance": "last_layer", "burn_in_rounds": 2}, "set burn_in_rounds = 0"),
        ({"name": "fedsep", "covariance": "last_layer"}, "algorithm.covariance: fedsep takes diagonal or full"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": algorithm, "model": {"name": "mlp"}})
        assert "\n" not in str(err.value)
