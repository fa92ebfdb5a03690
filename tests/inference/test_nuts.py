"""The moment-matching client: NUTS draws of the tilted distribution, their mean and precision."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_full
from fedbayes.algorithms.fedep import fedep_full
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.batches import ClientData
from fedbayes.data.federation import Federation
from fedbayes.inference import LocalTrainer
from fedbayes.inference.nuts import client_examples, make_full_nuts_inference
from fedbayes.inference.tilted import TiltedSettings
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.sim.simulator import Simulator

FEATURES = 3


def _linear():
    model = make_model("linear", 2)
    params = init_params(model, jax.random.key(0), (FEATURES,))
    return model, params


def _data(seed, n):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 + rng.normal(size=n)).astype(np.float32)
    return x, y


def _exact_tilted(x, y, cav_precision, cav_precision_mean):
    """The linear-Gaussian tilted distribution N(y | X w + b, 1) x N(theta; cavity), in closed form
    (theta = [b, w] in the model's raveled order is found from the design below)."""
    design = np.concatenate([np.ones((len(x), 1)), x], axis=1).astype(np.float64)
    precision = cav_precision + design.T @ design
    mean = np.linalg.solve(precision, cav_precision_mean + design.T @ y)
    return mean, precision


def _order_of(params):
    """The raveled positions of [bias, kernel...] so that the closed form's design matches."""
    flat, unravel = ravel_pytree(params)
    probe = unravel(jnp.arange(flat.size, dtype=flat.dtype))
    return np.concatenate([np.ravel(probe["dense"]["bias"]), np.ravel(probe["dense"]["kernel"])]).astype(int)


def test_client_examples_are_the_first_epoch_padded():
    order = jnp.asarray([4, 2, 0, 1, 3, 5, 2, 4, 0, 1], jnp.int32)  # two epochs of client 0 (3 examples), then client 1
    x = jnp.arange(6, dtype=jnp.float32)[:, None]
    data = ClientData(x, jnp.arange(6), order, jnp.int32(0), jnp.int32(3))
    xs, ys, mask = client_examples(data, 5)
    np.testing.assert_array_equal(np.asarray(ys), [4, 2, 0, 1, 3])
    np.testing.assert_array_equal(np.asarray(mask), [1, 1, 1, 0, 0])
    last = ClientData(x, jnp.arange(6), order, jnp.int32(8), jnp.int32(2))  # near the buffer's end: clipped, masked
    _, ys, mask = client_examples(last, 4)
    np.testing.assert_array_equal(np.asarray(ys)[:2], [0, 1])
    np.testing.assert_array_equal(np.asarray(mask), [1, 1, 0, 0])


def test_the_tilted_moments_of_a_linear_gaussian_model_are_exact():
    model, params = _linear()
    x, y = _data(0, 40)
    order = _order_of(params)
    d = FEATURES + 1
    rng = np.random.default_rng(1)
    a = rng.normal(size=(d, d))
    cav_p = a @ a.T + np.eye(d)
    cav_pm = rng.normal(size=d)
    # the cavity in the model's raveled order
    perm = np.empty(d, int)
    perm[order] = np.arange(d)
    flat_p = cav_p[np.ix_(perm, perm)]
    _, unravel = ravel_pytree(params)
    cavity = gaussian_full.FullGaussian(precision_mean=unravel(jnp.asarray(cav_pm[perm], jnp.float32)), precision=jnp.asarray(flat_p, jnp.float32))
    trainer = LocalTrainer(loss_fn(model, "regression"), optax.sgd(0.1), 1, 40)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    infer = make_full_nuts_inference(trainer, TiltedSettings(nuts_warmup=300, nuts_draws=3000), apply_fn=apply_fn, task="regression", max_examples=40)
    data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.arange(40, dtype=jnp.int32), jnp.int32(0), jnp.int32(40))
    tilted, info = jax.jit(infer)(jax.random.key(0), params, cavity, data)
    mean_exact, prec_exact = _exact_tilted(x, y, cav_p, cav_pm)
    mean = np.asarray(ravel_pytree(gaussian_full.mean(tilted))[0])[order]
    prec = np.asarray(tilted.precision)[np.ix_(order, order)]
    sd = np.sqrt(np.diag(np.linalg.inv(prec_exact)))
    assert np.all(np.abs(mean - mean_exact) <= 0.15 * sd), (mean, mean_exact, sd)  # 3000 draws: MC error about 0.03 sd
    np.testing.assert_allclose(prec, prec_exact, rtol=1e-4, atol=1e-4 * np.abs(prec_exact).max())  # the curvature is constant: exact
    assert 0.5 < float(info["acceptance"]) <= 1.0 and int(info["divergences"]) == 0
    assert int(info["steps"]) == 3300


def test_fedep_with_nuts_sites_reaches_the_exact_posterior_of_a_linear_gaussian_model():
    """EP on a linear-Gaussian model with exact tilted moments is exact at its fixed point: the
    global is the posterior of all the data (sampling noise aside)."""
    model, params = _linear()
    xs, ys = zip(*(_data(k, 30) for k in range(3)), strict=True)
    x, y = np.concatenate(xs), np.concatenate(ys)
    fed = Federation(x, y, tuple(np.arange(30 * k, 30 * (k + 1)) for k in range(3)))
    trainer = LocalTrainer(loss_fn(model, "regression"), optax.sgd(0.1), 1, 30)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    inference = make_full_nuts_inference(trainer, TiltedSettings(nuts_warmup=200, nuts_draws=1500), apply_fn=apply_fn, task="regression", max_examples=30)
    algo = fedep_full(
        trainer, optax.sgd(1.0), inference, total_examples=90, num_clients=3, damping=1.0, alpha_cov=0.0, prior_precision=1.0,
        exact_late_sites=True,
    )  # fmt: skip
    sim = Simulator(algo, fed, clients_per_round=3, seed=0)
    state = sim.init(params)
    for _ in range(4):  # undamped: exact sites from the first round, the mean settles in the next
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    order = _order_of(params)
    mean_exact, prec_exact = _exact_tilted(x, y, np.eye(FEATURES + 1), np.zeros(FEATURES + 1))
    q = state.server_state.q
    mean = np.asarray(ravel_pytree(gaussian_full.mean(q))[0])[order]
    sd = np.sqrt(np.diag(np.linalg.inv(prec_exact)))
    assert np.all(np.abs(mean - mean_exact) <= 0.2 * sd), (mean, mean_exact, sd)
    np.testing.assert_allclose(np.asarray(q.precision)[np.ix_(order, order)], prec_exact, rtol=1e-3, atol=1e-3 * np.abs(prec_exact).max())


def _config(**algorithm):
    return {
        "data": {"dataset": "breast_cancer", "num_clients": 3},
        "model": {"name": "logreg"},
        "server": {"clients_per_round": 3},
        "algorithm": {"name": "fedep", **algorithm},
    }


def test_nuts_takes_dense_sites():
    with pytest.raises(ConfigError, match="algorithm.method: nuts matches the tilted mean with dense sites; set covariance = 'full'"):
        validate(_config(method="nuts"))
    assert validate(_config(method="nuts", covariance="full")).algorithm.nuts_draws == 1000
    with pytest.raises(ConfigError, match="algorithm.nuts_curvature_draws"):
        validate(_config(method="nuts", covariance="full", nuts_curvature_draws=0))


def test_a_run_logs_each_sampler_and_resumes_exactly(tmp_path):
    """Through the config: FedEP's nuts method on the breast-cancer logistic regression (62
    parameters), its sampler's acceptance and divergences in clients.jsonl, and an interrupted run
    resumed to the same result."""
    import json

    from fedbayes.runs.folder import read_metrics
    from fedbayes.runs.loggers import PlainReporter
    from fedbayes.runs.loop import run_experiment

    quiet = PlainReporter(lambda s: None)
    raw = _config(method="nuts", covariance="full", nuts_warmup=30, nuts_draws=150, nuts_max_doublings=4, nuts_curvature_draws=5)
    cfg = validate({**raw, "rounds": 2, "checkpoint_every": 1})
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_experiment(cfg, whole, reporter=quiet)
    run_experiment(cfg.model_copy(update={"rounds": 1}), part, reporter=quiet)
    run_experiment(cfg, part, resume=True, reporter=quiet, accept_changes=["rounds"])
    lines = [json.loads(line) for line in (whole / "clients.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(0.0 <= line["acceptance"] <= 1.0 and line["divergences"] >= 0 and line["steps"] == 180 for line in lines)
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert strip(read_metrics(whole / "metrics.jsonl")) == strip(read_metrics(part / "metrics.jsonl"))
    assert (whole / "clients.jsonl").read_text() == (part / "clients.jsonl").read_text()


def test_the_nuts_method_damps_by_a_small_fixed_step_by_default():
    from fedbayes.algorithms.fedep import NUTS_DAMPING

    assert validate(_config(method="nuts", covariance="full")).algorithm.damping == NUTS_DAMPING == 0.1
    assert validate(_config(method="nuts", covariance="full", damping="adaptive")).algorithm.damping == "adaptive"
    assert validate(_config(method="laplace", covariance="full")).algorithm.damping == "adaptive"
