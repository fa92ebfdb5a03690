"""The marginalised predictive of a variational network (Ozer et al. 2022, "How to Combine
Variational Bayesian Networks in Federated Learning"; docs/algorithms.md §12): ``S`` stochastic
forward passes of a model that draws its own weights' noise from a key (:mod:`fedbayes.models.variational`),
their probabilities averaged.

It does not share :func:`fedbayes.evaluation.evaluators.make_marginal_evaluator`'s machinery, which
would change its numbers: that evaluator pads the test set to whole batches (a variational
forward pass draws noise shaped by its batch, so padding changes the draws) and merges summable
statistics batch by batch, where this one draws batch ``b``'s passes from ``fold_in(key, b)`` on the
unpadded batches and computes the metrics once over the concatenated log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedbayes.evaluation.metrics import classification_metrics
from fedbayes.models.variational import std_norm

__all__ = ["make_predictive_metrics", "predictive_log_probs", "predictive_metrics"]


def predictive_log_probs(apply_fn: Callable, params: Any, key: jax.Array, x: jax.Array, num_samples: int = 10) -> jax.Array:
    """``log (1/S sum_s softmax(f(x; eps_s)))``, the marginalised predictive over ``S`` stochastic
    forward passes (Ozer et al. 2022 (VBNN aggregation) uses S = 10); pass ``s`` draws its noise from ``fold_in(key, s)``.

    Raises:
        ValueError: for ``num_samples < 1``.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be at least 1, got {num_samples}")

    def one(s):
        return jax.nn.log_softmax(apply_fn(params, jax.random.fold_in(key, s), x), axis=-1)

    log_p = jax.lax.map(one, jnp.arange(num_samples))
    return jax.nn.logsumexp(log_p, axis=0) - jnp.log(float(num_samples))


def make_predictive_metrics(apply_fn: Callable, *, num_samples: int = 10, num_bins: int = 15, batch_size: int = 1000) -> Callable[..., dict[str, float]]:
    """Returns ``metrics(params, key, x, y) -> dict``, :func:`predictive_metrics` with its program
    compiled once (per batch shape) for every call: a run evaluates every round, and builds this
    once. The compiled program lives as long as the returned function."""
    predict = jax.jit(lambda p, k, xb: predictive_log_probs(apply_fn, p, k, xb, num_samples))

    def metrics(params: Any, key: jax.Array, x: jax.Array, y: jax.Array) -> dict[str, float]:
        chunks = []
        for b, start in enumerate(range(0, len(x), batch_size)):
            chunks.append(predict(params, jax.random.fold_in(key, b), jnp.asarray(x[start : start + batch_size])))
        log_probs = jnp.concatenate(chunks)
        out = {k: float(v) for k, v in classification_metrics(log_probs, jnp.asarray(y), num_bins).items()}
        out["std_norm"] = float(std_norm(params))
        out["std_norm_clamped"] = float(std_norm(params, clamp=True))
        return out

    return metrics


def predictive_metrics(
    apply_fn: Callable,
    params: Any,
    key: jax.Array,
    x: jax.Array,
    y: jax.Array,
    *,
    num_samples: int = 10,
    num_bins: int = 15,
    batch_size: int = 1000,
) -> dict[str, float]:
    """Accuracy, NLL and ECE (``num_bins`` bins) of the marginalised predictive on ``(x, y)``, plus
    ``std_norm``, the L2 norm of the learned standard deviations ``exp(logvar / 2)`` as stored
    (Ozer et al. 2022 (VBNN aggregation) Table 4; ``std_norm_clamped`` with the forward pass's clamp). Batched over
    examples; batch ``b`` uses ``fold_in(key, b)``. Compiles its program at every call: to
    evaluate repeatedly, build :func:`make_predictive_metrics` once."""
    return make_predictive_metrics(apply_fn, num_samples=num_samples, num_bins=num_bins, batch_size=batch_size)(params, key, x, y)
