"""The predictive probabilities (fedbayes.evaluation.evaluators): the point and marginalised
probabilities the conformal sets use are those whose metrics the evaluators report."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes.evaluation.evaluators import make_evaluator, make_marginal_evaluator, make_marginal_probabilities, make_probabilities


def _problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype(np.float32)
    y = rng.integers(0, 3, 70)
    mean = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    variance = {"w": jnp.full((5, 3), 0.3, jnp.float32), "b": jnp.full(3, 0.1, jnp.float32)}
    return (lambda p, xs: jnp.tanh(xs @ p["w"]) * 3 + p["b"][None, :]), x, y, mean, variance


def _nll_and_accuracy(probs, y):
    return -np.mean(np.log(probs[np.arange(len(y)), y])), np.mean(probs.argmax(1) == y)


@pytest.mark.parametrize("predictive", ["sample", "linearised"])
def test_the_marginal_probabilities_are_the_evaluated_predictive(predictive):
    apply_fn, x, y, mean, variance = _problem()
    key = jax.random.key(3)
    # batches of 32 against the evaluator's one batch: the same draws theta_s for every example
    probs = make_marginal_probabilities(apply_fn, num_samples=4, batch_size=32, predictive=predictive)(key, mean, variance, x)
    assert probs.shape == (70, 3)
    np.testing.assert_allclose(probs.sum(1), 1.0, rtol=1e-5)
    reported = make_marginal_evaluator(apply_fn, x, y, num_samples=4, predictive=predictive)(key, mean, variance)
    nll, acc = _nll_and_accuracy(probs, y)
    assert nll == pytest.approx(reported["nll"], rel=1e-5) and acc == pytest.approx(reported["accuracy"], abs=1e-6)  # the evaluator sums in float32
    other = make_marginal_probabilities(apply_fn, num_samples=4, predictive=predictive)(jax.random.key(4), mean, variance, x)
    assert not np.allclose(other, probs)  # the key decides the draws


def test_the_point_probabilities_are_the_evaluated_predictive():
    apply_fn, x, y, mean, _ = _problem()
    probs = make_probabilities(apply_fn, batch_size=32)(mean, x)
    reported = make_evaluator(apply_fn, x, y)(mean)
    nll, acc = _nll_and_accuracy(probs, y)
    assert nll == pytest.approx(reported["nll"], rel=1e-5) and acc == pytest.approx(reported["accuracy"], abs=1e-6)  # the evaluator sums in float32
