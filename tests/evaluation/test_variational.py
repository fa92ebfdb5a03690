"""fedbayes.evaluation.variational: the marginalised predictive of a variational network."""

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.evaluation.variational import make_predictive_metrics, predictive_log_probs, predictive_metrics


def _noisy_linear(traces: list):
    """A 'variational' linear classifier: weights plus key-drawn noise; counts its traces."""

    def apply_fn(params, key, x):
        traces.append(1)
        w = params["mean"] + jnp.exp(0.5 * params["logvar"]) * jax.random.normal(key, params["mean"].shape)
        return x @ w

    return apply_fn


def _problem():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=50)
    params = {"mean": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32), "logvar": jnp.full((4, 3), -1.0)}
    return x, y, params


def test_metrics_are_those_of_the_mean_of_the_passes_probabilities():
    x, y, params = _problem()
    apply_fn = _noisy_linear([])
    key = jax.random.key(3)
    out = predictive_metrics(apply_fn, params, key, x, y, num_samples=4, batch_size=20)
    # by hand: batch b's pass s draws from fold_in(fold_in(key, b), s)
    probs = []
    for b, start in enumerate(range(0, 50, 20)):
        kb = jax.random.fold_in(key, b)
        passes = [jax.nn.softmax(apply_fn(params, jax.random.fold_in(kb, s), x[start : start + 20]), axis=-1) for s in range(4)]
        probs.append(np.mean(np.asarray(passes), axis=0))
    p = np.concatenate(probs)
    np.testing.assert_allclose(out["accuracy"], np.mean(p.argmax(1) == y), atol=1e-7)
    np.testing.assert_allclose(out["nll"], -np.mean(np.log(p[np.arange(50), y])), rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(predictive_log_probs(apply_fn, params, jax.random.fold_in(key, 0), x[:20], 4)), np.log(probs[0]), rtol=1e-5, atol=1e-6
    )


def test_compiled_once_for_every_evaluation_of_a_run():
    """A run evaluates every round: the evaluator it builds once reuses its compiled program (the
    model is traced for the two batch shapes of the first call only), with the same numbers as
    the one-off function."""
    x, y, params = _problem()
    traces: list = []
    apply_fn = _noisy_linear(traces)
    metrics = make_predictive_metrics(apply_fn, num_samples=3, batch_size=20)
    first = metrics(params, jax.random.key(0), x, y)
    traced = len(traces)
    assert traced > 0
    moved = jax.tree.map(lambda a: a + 0.1, params)
    second = metrics(moved, jax.random.key(1), x, y)
    assert len(traces) == traced
    assert second["nll"] != first["nll"]
    assert predictive_metrics(apply_fn, moved, jax.random.key(1), x, y, num_samples=3, batch_size=20) == second
