"""PVI with the natural-gradient diagonal client (docs/algorithms.md §8.2, ``local_vi = "natural"``):
several logistic-regression clients reach the central mean-field VI optimum, the sites stay proper,
and the settings and their refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian
from fedbayes.algorithms.pvi import default_samples, pvi
from fedbayes.config.schema import ConfigError, stored_meaning, validate
from fedbayes.data.federation import Federation
from fedbayes.evaluation.reference import mean_field_vi
from fedbayes.inference import LocalTrainer
from fedbayes.inference.vi_natural import NATURAL_SAMPLES, natural_diag_vi
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.sim.simulator import Simulator

DELTA = 1.0


def test_pvi_with_the_natural_client_reaches_the_central_mean_field_optimum():
    """Three logistic-regression clients of unequal sizes and shifted features: for a GLM with its
    canonical link the natural client's fixed point is the tilted mean-field optimum, so damped PVI
    goes to the central one (float64 Newton on the ELBO); every site's precision is an average of
    GGNs, never negative."""
    rng = np.random.default_rng(3)
    sizes, d = (40, 15, 65), 3
    x = rng.normal(size=(sum(sizes), d)).astype(np.float32)
    bounds = np.cumsum((0,) + sizes)
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        x[a:b, 0] += k - 1.0  # the clients see different parts of the feature space
    y = (x @ np.array([1.5, -1.0, 0.5]) + 0.7 * rng.normal(size=len(x)) > 0).astype(np.int32)
    fed = Federation(x, y, tuple(np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)))
    model = make_model("logreg", 2)
    params = init_params(model, jax.random.key(0), (d,))
    apply = lambda p, xs: model.apply({"params": p}, xs)  # noqa: E731
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(0.0), 1, 65)
    local = natural_diag_vi(trainer, apply_fn=apply, samples=8, step_size=0.3, passes=1, min_steps=100)
    algo = pvi(trainer, optax.sgd(1.0), prior_precision=DELTA, damping=0.5, local=local)
    sim = Simulator(algo, fed, clients_per_round=len(sizes), seed=0)
    state = sim.init(params)
    for _ in range(8):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    mean, var = mean_field_vi(apply, jax.tree.map(jnp.zeros_like, params), x, y, DELTA)
    q = state.server_state.q
    m_ref, v_ref = ravel_pytree(mean)[0], ravel_pytree(var)[0]
    assert float(jnp.linalg.norm(ravel_pytree(gaussian.mean(q))[0] - m_ref) / jnp.linalg.norm(m_ref)) < 0.015  # measured 0.006
    np.testing.assert_allclose(ravel_pytree(gaussian.variance(q))[0], v_ref, rtol=0.02)  # measured 0.0064
    assert all(float(jnp.min(leaf)) >= 0.0 for leaf in jax.tree.leaves(state.client_states.site.precision))


def test_the_local_vi_is_a_setting_with_its_refusals():
    plain = validate({"algorithm": {"name": "pvi"}}).algorithm
    natural = validate({"algorithm": {"name": "pvi", "local_vi": "natural"}}).algorithm
    sgd = validate({"algorithm": {"name": "pvi", "local_vi": "sgd"}}).algorithm
    assert (natural.local_vi, sgd.local_vi) == ("natural", "sgd") and plain.local_vi in ("natural", "sgd")
    # the natural client's draws per step by default; samples sets it
    assert (default_samples(natural), default_samples(sgd)) == (NATURAL_SAMPLES, 1)
    assert default_samples(validate({"algorithm": {"name": "pvi", "local_vi": "natural", "samples": 6}}).algorithm) == 6
    # a run stored before the setting existed kept the SGD client; a dense one has no diagonal local VI
    old = {"algorithm": {"name": "pvi", "rho": "adaptive", "estimator": "local", "init_std": "auto", "init_mean": "auto"}}
    assert validate(stored_meaning(old)).algorithm.local_vi == "sgd"
    assert validate(stored_meaning({"algorithm": {**old["algorithm"], "local_vi": "natural"}})).algorithm.local_vi == "natural"
    dense = validate(stored_meaning({"algorithm": {**old["algorithm"], "covariance": "full"}})).algorithm
    assert dense.covariance == "full" and dense.local_vi == plain.local_vi
    other = "sgd" if plain.local_vi == "natural" else "natural"
    for algorithm, field in (
        ({"covariance": "full", "local_vi": other}, "algorithm.local_vi: chooses the diagonal local VI"),
        ({"local_vi": "natural", "estimator": "weights"}, "algorithm.estimator: a setting of the sgd local VI"),
        ({"local_vi": "natural", "parameterisation": "softplus"}, "algorithm.parameterisation: a setting of the sgd local VI"),
        ({"local_vi": "adam"}, "algorithm.local_vi"),
    ):
        with pytest.raises(ConfigError, match=field) as err:
            validate({"algorithm": {"name": "pvi", **algorithm}})
        assert "\n" not in str(err.value)


def test_the_natural_client_is_refused_on_a_network():
    from fedbayes.runs.build import build_experiment

    cfg = validate(
        {
            "algorithm": {"name": "pvi", "local_vi": "natural"},
            "data": {"dataset": "digits", "num_clients": 2},
            "server": {"clients_per_round": 2},
            "model": {"name": "mlp", "hidden": [8]},
        }
    )
    with pytest.raises(ConfigError, match="algorithm.local_vi: 'natural' is for generalised linear models") as err:
        build_experiment(cfg)
    assert "\n" not in str(err.value)
