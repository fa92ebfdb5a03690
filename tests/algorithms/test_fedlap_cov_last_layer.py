"""FedLap-Cov with the last-layer structure (dense GGN over the output layer, diagonal elsewhere): on
a one-layer model it is the full-covariance method; on a small network with SGD clients the server
reaches the MAP of all the data and the block GGN Laplace precision there; model.npz, the
predictive's draws, the prior precision search and the config's refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from test_fedep_full import NUM_CLIENTS, PER_CLIENT, _problem

from fedbayes import gaussian_block
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms.fedlap_cov import fedlap_cov
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.federation import Federation
from fedbayes.evaluation.evaluators import dense_spread, marginal_metrics, restrict_to_subset
from fedbayes.evaluation.prior_precision import make_prior_precision_search
from fedbayes.gaussian_block import BlockPrecision
from fedbayes.inference import LocalTrainer
from fedbayes.inference.curvature import batch_diag_ggn, batch_full_ggn, data_block_ggn, data_full_ggn
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.runs.export import load_model, save_model
from fedbayes.sim.simulator import Simulator

DELTA = 1.0


def _run(alg, fed, params, rounds):
    sim = Simulator(alg, fed, clients_per_round=NUM_CLIENTS, seed=0)
    state = sim.init(params)
    for _ in range(rounds):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    return state.server_state


def _algorithm(model, covariance, lr=0.2, epochs=200):
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(lr), epochs, PER_CLIENT)
    curvature = data_block_ggn if covariance == "last_layer" else data_full_ggn
    return fedlap_cov(
        trainer, lambda p, d: curvature(apply, p, d, batch_size=PER_CLIENT), delta=DELTA, damping=damping_policy.adaptive(), covariance=covariance
    )


def test_one_layer_model_is_the_full_covariance_method():
    fed, model, params = _problem()
    block = _run(_algorithm(model, "last_layer", epochs=20), fed, params, 4)
    full = _run(_algorithm(model, "full", epochs=20), fed, params, 4)
    assert block.q.precision.diagonal == {}  # the only layer is the last
    np.testing.assert_allclose(np.asarray(block.q.precision.dense), np.asarray(full.q.precision), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ravel_pytree(block.params)[0], ravel_pytree(full.params)[0], rtol=1e-5, atol=1e-6)


def _network():
    """A tanh MLP (5 -> 4 -> 3) on 3 clients of a 3-class problem, the clients' features shifted."""
    rng = np.random.default_rng(1)
    w = rng.normal(size=(5, 3))
    xs, ys = [], []
    for k in range(NUM_CLIENTS):
        x = rng.normal(size=(PER_CLIENT, 5)) + 0.5 * k
        logits = x @ w
        ys.append(np.array([rng.choice(3, p=np.exp(r - r.max()) / np.exp(r - r.max()).sum()) for r in logits], np.int32))
        xs.append(x)
    parts = tuple(np.arange(k * PER_CLIENT, (k + 1) * PER_CLIENT) for k in range(NUM_CLIENTS))
    model = make_model("mlp", 3, hidden=(4,), activation="tanh")
    params = init_params(model, jax.random.key(0), (5,))
    return Federation(np.concatenate(xs).astype(np.float32), np.concatenate(ys), parts), model, params


def test_network_reaches_the_map_and_the_block_laplace_precision(tmp_path):
    fed, model, params = _network()
    alg = _algorithm(model, "last_layer", lr=0.1)
    state = _run(alg, fed, params, 40)
    apply = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    x, y, mask = jnp.asarray(fed.x), jnp.asarray(fed.y), jnp.ones(len(fed.y))

    def objective(p):
        logits = apply(p, x)
        return -jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)) + 0.5 * DELTA * optax.tree.norm(p, squared=True)

    w = state.params
    grad = ravel_pytree(jax.grad(objective)(w))[0]
    scale = ravel_pytree(jax.grad(objective)(params))[0]
    assert float(jnp.linalg.norm(grad)) < 2e-2 * float(jnp.linalg.norm(scale))  # a stationary point of the central objective
    # S_g at the fixed point: delta plus the block GGN of all the data at w_g
    rest, last = gaussian_block.split(w)
    diag = gaussian_block.split(batch_diag_ggn(apply, w, x, y, mask), "output")[0]
    dense = batch_full_ggn(lambda t, xs: apply(gaussian_block.join(rest, t, "output"), xs), last, x, mask)
    prec = state.q.precision
    assert isinstance(prec, BlockPrecision) and prec.key == "output"
    np.testing.assert_allclose(ravel_pytree(prec.diagonal)[0], ravel_pytree(diag)[0] + DELTA, rtol=5e-2, atol=5e-2)
    np.testing.assert_allclose(np.asarray(prec.dense), np.asarray(dense) + DELTA * np.eye(dense.shape[0]), rtol=5e-2, atol=5e-2)
    assert np.abs(np.asarray(prec.dense) - np.diag(np.diag(np.asarray(prec.dense)))).max() > 0.1  # the last layer's block is dense
    # the posterior's marginals, model.npz and its reload
    mean, variance = alg.server_posterior(state)
    np.testing.assert_allclose(ravel_pytree(variance)[0], ravel_pytree(gaussian_block.variance(state.q))[0])
    saved = load_model(save_model(tmp_path / "model.npz", alg, state))
    again = saved["posterior_precision"]
    np.testing.assert_allclose(np.asarray(again.dense), np.asarray(prec.dense))
    np.testing.assert_allclose(ravel_pytree(again.diagonal)[0], ravel_pytree(prec.diagonal)[0], rtol=1e-6)
    with np.load(tmp_path / "model.npz") as z:
        assert "posterior_precision" not in z.files and z["posterior_precision_last_layer"].shape == (15, 15)
    # the predictive's draws: restricted to the last layer the other weights are the mean
    spread = restrict_to_subset(dense_spread(mean, alg.server_precision(state)), "last_layer")
    draws = gaussian_block.sample(jax.random.key(0), spread, 3)
    assert float(jnp.abs(ravel_pytree(gaussian_block.split(draws)[0])[0]).max()) == 0.0
    assert float(jnp.abs(ravel_pytree(gaussian_block.split(draws)[1])[0]).max()) > 0.0
    metrics = marginal_metrics(apply, fed.x, fed.y, num_samples=4, predictive="linearised")(jax.random.key(1), mean, spread)
    assert 0.0 < float(metrics["nll"]) < 1.2
    # the marglik search: the chosen prior precision maximises the block's Laplace evidence
    tune = make_prior_precision_search("marglik", DELTA)
    tuned, chosen = tune(jax.random.key(2), mean, spread)
    assert isinstance(tuned, gaussian_block.BlockScale) and 1e-6 * DELTA < float(chosen) < 1e6 * DELTA
    g = np.linalg.eigvalsh(np.asarray(prec.dense) - DELTA * np.eye(15)).clip(0)
    m = np.asarray(ravel_pytree(last)[0], np.float64)

    def evidence(d):
        return -0.5 * d * m @ m + 0.5 * m.size * np.log(d) - 0.5 * np.log(g + d).sum()

    grid = np.exp(np.linspace(np.log(chosen) - 1, np.log(chosen) + 1, 41))
    assert evidence(float(chosen)) >= max(evidence(d) for d in grid) - 1e-4
    root = np.asarray(tuned.root, np.float64)
    expected = np.linalg.inv(np.asarray(prec.dense, np.float64) + (float(chosen) - DELTA) * np.eye(15))
    np.testing.assert_allclose(root @ root.T, expected, rtol=1e-3, atol=1e-4 * np.abs(expected).max())
    assert all(float(jnp.max(s)) == 0.0 for s in jax.tree.leaves(tuned.std))  # the other layers stay a point
    # the validation search differentiates through the draws of the searched spread
    nll = marginal_metrics(apply, fed.x, fed.y, num_samples=4, predictive="linearised")
    searched, picked = make_prior_precision_search("validation", DELTA, validation_nll=lambda k, m, v: nll(k, m, v)["nll"])(jax.random.key(3), mean, spread)
    assert isinstance(searched, gaussian_block.BlockScale) and np.isfinite(float(picked))


def test_last_layer_is_a_fedlap_cov_setting():
    cfg = validate({"algorithm": {"name": "fedlap_cov", "covariance": "last_layer"}, "model": {"name": "mlp"}})
    assert cfg.algorithm.covariance == "last_layer"
    assert (cfg.evaluation.prior_precision, cfg.evaluation.subset_of_weights, cfg.evaluation.predictive) == ("marglik", "last_layer", "linearised")
    for extra, field in (
        ({"server": {"aggregator": "median"}}, "server.aggregator: fedlap_cov with covariance = 'last_layer'"),
        ({"privacy": {"clip": 1.0}, "server": {"weighting": "uniform"}}, "privacy.clip: fedlap_cov with covariance = 'last_layer'"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": {"name": "fedlap_cov", "covariance": "last_layer"}, **extra})
        assert "\n" not in str(err.value)
