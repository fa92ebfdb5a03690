"""Evaluation of a model on a held-out set: accuracy, NLL, ECE (classification) or MSE (regression).

The test set is put on the device once, padded to whole batches with a mask, and evaluated in one
compiled function that accumulates summable statistics over batches (spec 13.1).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import metrics


def make_evaluator(
    apply_fn: Callable, x: np.ndarray, y: np.ndarray, *, task: str = "classification", batch_size: int = 2000, num_bins: int = 15
) -> Callable[[object], dict[str, float]]:
    """Returns ``evaluate(params) -> {metric: float}`` over ``(x, y)``.

    Args:
      apply_fn: ``(params, x) -> logits`` (or predictions for regression).
      x, y: host arrays of the evaluation set.
      task: ``"classification"`` (accuracy, nll, ece, loss) or ``"regression"`` (mse, rmse, loss).
      batch_size: evaluation batch size.
      num_bins: ECE bins.
    """
    n = len(x)
    batch_size = min(batch_size, n)
    num_batches = -(-n // batch_size)
    pad = num_batches * batch_size - n
    xb = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]).reshape(num_batches, batch_size, *x.shape[1:])
    yb = np.concatenate([y, np.zeros((pad,), y.dtype)]).reshape(num_batches, batch_size)
    mb = (np.arange(num_batches * batch_size) < n).astype(np.float32).reshape(num_batches, batch_size)
    xb, yb, mb = jax.device_put((xb, yb, mb))

    if task == "classification":

        @jax.jit
        def run(params):
            def body(acc, batch):
                xs, ys, ms = batch
                return metrics.merge_stats(acc, metrics.classification_stats(apply_fn(params, xs), ys, ms, num_bins)), None

            stats, _ = jax.lax.scan(body, metrics.init_stats(num_bins), (xb, yb, mb))
            return metrics.finalize_stats(stats)

    else:

        @jax.jit
        def run(params):
            def body(acc, batch):
                xs, ys, ms = batch
                err = jnp.square(apply_fn(params, xs) - ys) * ms
                return acc + jnp.sum(err), None

            sse, _ = jax.lax.scan(body, jnp.zeros(()), (xb, yb, mb))
            mse = sse / n
            return {"mse": mse, "rmse": jnp.sqrt(mse), "loss": 0.5 * mse}

    def evaluate(params) -> dict[str, float]:
        return {k: float(v) for k, v in run(params).items()}

    return evaluate
