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


@pytest.mark.parametrize("predictive", ["sample", "linearised"])
def test_a_dense_posterior_is_drawn_with_its_correlations(predictive):
    """Draws from a dense posterior (dense_spread) give a logistic regression the predictive of the
    full covariance, x' Sigma x (Gauss-Hermite, affine_predictive_metrics), not that of its
    marginals; the last-layer restriction refuses a dense posterior."""
    from jax.flatten_util import ravel_pytree

    from fedbayes.evaluation.evaluators import dense_spread, restrict_to_subset
    from fedbayes.evaluation.reference import affine_predictive_metrics
    from fedbayes.models import init_params, make_model

    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 2)).astype(np.float32)
    x[:, 1] = x[:, 0] + 0.1 * x[:, 1]  # two strongly correlated features
    y = (x[:, 0] + 0.5 * rng.normal(size=300) > 0).astype(np.int32)
    model = make_model("logreg", 2)
    apply_fn = lambda p, xs: model.apply({"params": p}, xs)  # noqa: E731
    mean = jax.tree.map(jnp.zeros_like, init_params(model, jax.random.key(0), (2,)))
    mean["dense"]["kernel"] = mean["dense"]["kernel"].at[0, 1].set(1.0)  # logit difference x_0
    d = ravel_pytree(mean)[0].size
    # weights that move against each other on the two features: wide marginals, a narrow logit
    a = rng.normal(size=(d, d))
    cov = 0.05 * (a @ a.T + np.eye(d))
    kernel = np.zeros((d, d))
    for c in (0, 1):  # kernel[0, c] and kernel[1, c] anti-correlated (ravel order: bias (2), then kernel rows)
        i, j = 2 + c, 4 + c
        kernel[np.ix_([i, j], [i, j])] = 4.0 * np.array([[1.0, -0.99], [-0.99, 1.0]])
    cov = cov + kernel
    precision = np.linalg.inv(cov)
    spread = dense_spread(mean, jnp.asarray(precision, jnp.float32))
    evaluate = make_marginal_evaluator(apply_fn, x, y, num_samples=4000, predictive=predictive)
    dense = evaluate(jax.random.key(1), mean, spread)
    exact = affine_predictive_metrics(apply_fn, mean, None, x, y, covariance=cov)
    marginals = affine_predictive_metrics(apply_fn, mean, ravel_pytree(mean)[1](jnp.asarray(np.diag(cov), jnp.float32)), x, y)
    assert abs(dense["nll"] - exact["nll"]) < 0.02 < abs(marginals["nll"] - exact["nll"])
    with pytest.raises(ValueError, match="evaluation.subset_of_weights"):
        restrict_to_subset(spread, "last_layer")
