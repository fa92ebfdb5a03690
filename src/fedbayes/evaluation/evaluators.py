"""Evaluation of a model on a held-out set: accuracy, NLL, ECE (classification) or MSE (regression).

The test set is put on the device once, padded to whole batches with a mask, and evaluated in one
compiled function that accumulates summable statistics over batches (docs/algorithms.md §13.1).

The marginalised prediction draws weights from the posterior: from its marginal variances (a
pytree like the mean: a diagonal Gaussian), or, for a posterior with a dense precision
(``covariance = "full"``), from the full Gaussian (:func:`dense_spread`): its draws keep the
weights' correlations, which the marginals alone drop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes import gaussian_block, gaussian_full, gaussian_kron, gaussian_lowrank
from fedbayes.evaluation import metrics, multilabel, next_word
from fedbayes.gaussian_block import BlockGaussian, BlockPrecision, BlockScale
from fedbayes.gaussian_full import FullGaussian
from fedbayes.gaussian_kron import KronSpread
from fedbayes.gaussian_lowrank import LowRankGaussian


def make_evaluator(
    apply_fn: Callable, x: np.ndarray, y: np.ndarray, *, task: str = "classification", batch_size: int = 2000, num_bins: int = 15
) -> Callable[[object], dict[str, float]]:
    """Returns ``evaluate(params) -> {metric: float}`` over ``(x, y)``.

    Args:
      apply_fn: ``(params, x) -> logits`` (or predictions for regression).
      x, y: host arrays of the evaluation set.
      task: ``"classification"`` (accuracy, nll, ece), ``"regression"`` (mse, rmse),
        ``"multilabel"`` (:mod:`fedbayes.evaluation.multilabel`) or ``"next_word"``
        (:mod:`fedbayes.evaluation.next_word`).
      batch_size: evaluation batch size.
      num_bins: ECE bins.
    """
    n = len(x)
    data = _batches(x, y, batch_size)  # an argument of the compiled function, not a constant of it:
    # the same model evaluated on another set of this shape (fedbayes compare --shift) reuses its compilation

    if task == "classification":

        @jax.jit
        def run(params, data):
            def body(acc, batch):
                xs, ys, ms = batch
                return metrics.merge_stats(acc, metrics.classification_stats(apply_fn(params, xs), ys, ms, num_bins)), None

            stats, _ = jax.lax.scan(body, metrics.init_stats(num_bins), data)
            return metrics.finalize_stats(stats)

    elif task in _SUMMED:
        init, stats_of, finalize = _SUMMED[task]

        @jax.jit
        def run(params, data):
            def body(acc, batch):
                xs, ys, ms = batch
                return jax.tree.map(jnp.add, acc, stats_of(apply_fn(params, xs), ys, ms)), None

            stats, _ = jax.lax.scan(body, init(y), data)
            return finalize(stats)

    else:

        @jax.jit
        def run(params, data):
            def body(acc, batch):
                xs, ys, ms = batch
                err = jnp.square(apply_fn(params, xs) - ys) * ms
                return acc + jnp.sum(err), None

            sse, _ = jax.lax.scan(body, jnp.zeros(()), data)
            mse = sse / n
            return {"mse": mse, "rmse": jnp.sqrt(mse)}

    def evaluate(params) -> dict[str, float]:
        return {k: float(v) for k, v in run(params, data).items()}

    return evaluate


# task -> (initial statistics from the labels, one batch's statistics, the metrics): summable
# statistics accumulated over the padded batches as classification's.
_SUMMED = {
    "multilabel": (lambda y: multilabel.init_multilabel(y.shape[1]), multilabel.multilabel_stats, multilabel.finalize_multilabel),
    "next_word": (lambda y: next_word.init_next_word(), next_word.next_word_stats, next_word.finalize_next_word),
}

PREDICTIVES = ("sample", "linearised")  # make_marginal_evaluator's choices
SUBSETS = ("all", "last_layer")  # restrict_to_subset's choices


def dense_spread(mean, precision: jax.Array | BlockPrecision | LowRankGaussian | KronSpread) -> FullGaussian | BlockGaussian | LowRankGaussian | KronSpread:
    """The spread of a posterior with a dense precision ``N(mean, Lambda^{-1})`` about its mean, as
    the marginalised prediction takes it in place of the marginal variances: the zero-mean
    :class:`~fedbayes.gaussian_full.FullGaussian` with precision ``Lambda`` (``[D, D]``, ravel order
    of ``mean``), from which ``theta_s - mean = L^{-T} eps_s`` is drawn
    (:func:`fedbayes.gaussian_full.sample`); for a last-layer structure
    (:class:`~fedbayes.gaussian_block.BlockPrecision`), the zero-mean
    :class:`~fedbayes.gaussian_block.BlockGaussian` (draws dense over the last layer, diagonal
    elsewhere); for a low-rank one (a :class:`~fedbayes.gaussian_lowrank.LowRankGaussian`, the
    precision ``diag(d) + U diag(s) U^T``), itself with a zero mean (draws at ``O(D r)`` each); a
    Kronecker-factored one (a :class:`~fedbayes.gaussian_kron.KronSpread`) is its own spread."""
    if isinstance(precision, KronSpread):
        return precision
    if isinstance(precision, BlockPrecision):
        return BlockGaussian(precision_mean=optax.tree.zeros_like(mean), precision=precision)
    if isinstance(precision, LowRankGaussian):  # a low-rank structure's precision diag(d) + U diag(s) U^T
        return precision.replace(precision_mean=optax.tree.zeros_like(mean))
    return FullGaussian(precision_mean=optax.tree.zeros_like(mean), precision=jnp.asarray(precision))


def restrict_to_subset(variance, subset: str):
    """The posterior's variance over the weights the marginalised prediction draws: ``"all"``, or
    ``"last_layer"``: the last layer (:func:`fedbayes.gaussian_block.last_layer_key`: the output
    layer of fedbayes's models), the other weights at the mean (variance 0); a last-layer
    structure's spread (:func:`dense_spread`) keeps its dense block and makes the rest a point. The last-layer Laplace is Laplace Redux's default (Daxberger et al., "Laplace
    Redux -- Effortless Bayesian Deep Learning", NeurIPS 2021): a diagonal posterior over every
    weight of a network ignores the correlations between them, and its predictive is far wider
    than the network's function-space uncertainty (docs/algorithms.md §13.3)."""
    if subset not in SUBSETS:
        raise ValueError(f"subset_of_weights must be one of {', '.join(SUBSETS)}; got {subset!r}")
    if subset == "all":
        return variance
    if isinstance(variance, BlockGaussian):  # the other layers' precision infinite: their draws are the mean
        p = variance.precision
        point = jax.tree.map(lambda d: jnp.full_like(d, jnp.inf), p.diagonal)
        return BlockGaussian(variance.precision_mean, BlockPrecision(point, p.dense, p.key))
    if isinstance(variance, LowRankGaussian):  # the last layer's marginal: the joint's draws, the other layers at the mean
        return gaussian_lowrank.marginal(variance, gaussian_block.last_layer_key(variance.precision_mean))
    if isinstance(variance, KronSpread):  # block-diagonal over the leaves: the last layer's own blocks
        return gaussian_kron.marginal(variance, gaussian_block.last_layer_key(variance.precision))
    if isinstance(variance, FullGaussian):
        raise ValueError(
            "evaluation.subset_of_weights: 'last_layer' keeps the last layer's marginal variances; a dense posterior (covariance = 'full') "
            "is drawn over all its weights: use 'all'"
        )
    if not isinstance(variance, dict) or not variance:
        raise ValueError(f"subset_of_weights 'last_layer' needs parameters as a dict of layers; got {type(variance).__name__}")
    last = gaussian_block.last_layer_key(variance)
    return {k: v if k == last else jax.tree.map(jnp.zeros_like, v) for k, v in variance.items()}


def _safe_sqrt(v: jax.Array) -> jax.Array:
    """``sqrt(v)`` with a zero (not infinite) derivative where ``v = 0`` (a point coordinate), so
    that a search over the variance gets finite gradients."""
    positive = v > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, v, 1.0)), 0.0)


def _batches(x: np.ndarray, y: np.ndarray, batch_size: int):
    """The evaluation set on the device as ``[num_batches, batch, ...]`` with a validity mask."""
    n = len(x)
    batch_size = min(batch_size, n)
    num_batches = -(-n // batch_size)
    pad = num_batches * batch_size - n
    xb = np.concatenate([x, np.zeros((pad, *x.shape[1:]), x.dtype)]).reshape(num_batches, batch_size, *x.shape[1:])
    yb = np.concatenate([y, np.zeros((pad, *y.shape[1:]), y.dtype)]).reshape(num_batches, batch_size, *y.shape[1:])
    mb = (np.arange(num_batches * batch_size) < n).astype(np.float32).reshape(num_batches, batch_size)
    return jax.device_put((xb, yb, mb))


def make_marginal_evaluator(
    apply_fn: Callable,
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_samples: int = 10,
    batch_size: int = 2000,
    num_bins: int = 15,
    predictive: str = "sample",
) -> Callable[..., dict[str, float]]:
    """Returns ``evaluate(key, mean, variance) -> {metric: float}``: the marginalised prediction
    (:func:`marginal_metrics`, compiled; ``variance`` the marginal variances or a :func:`dense_spread`)."""
    _check_marginal(num_samples, predictive)
    data = _batches(x, y, batch_size)  # an argument, not a constant (as make_evaluator's)
    run = jax.jit(lambda key, mean, variance, data: _marginal_stats(apply_fn, key, mean, variance, data, num_samples, num_bins, predictive))

    def evaluate(key, mean, variance) -> dict[str, float]:
        return {k: float(v) for k, v in run(key, mean, variance, data).items()}

    return evaluate


def marginal_metrics(
    apply_fn: Callable,
    x: np.ndarray,
    y: np.ndarray,
    *,
    num_samples: int = 10,
    batch_size: int = 2000,
    num_bins: int = 15,
    predictive: str = "sample",
) -> Callable[..., dict[str, jax.Array]]:
    """Returns ``metrics(key, mean, variance) -> {metric: array}`` (traceable): the marginalised
    prediction's accuracy, NLL and ECE on ``(x, y)``.

    Guo et al. 2023 (FedEP) Sec. 3.3 (docs/algorithms.md §13.1): draw ``S = num_samples`` parameter
    vectors ``theta_s = mean + sqrt(variance) * eps_s`` from the diagonal Gaussian posterior, average
    the softmax probabilities ``p(y | x) = mean_s softmax(f_s(x))``, and compute accuracy, NLL and
    ECE of the averaged probabilities. The same ``theta_s`` serve every test batch, and the same
    ``eps_s`` (from ``key``) serve every variance: a search over the variance compares the
    candidates on common random numbers (:mod:`fedbayes.evaluation.prior_precision`).

    ``variance`` may instead be a :func:`dense_spread` (a posterior with a dense precision
    ``Lambda``): then ``theta_s = mean + L^{-T} eps_s`` with ``Lambda = L L^T``, draws from the full
    Gaussian (:func:`fedbayes.gaussian_full.sample`), whose predictive keeps the correlations: for
    a linear model the logit's variance is ``x^T Sigma x``, not ``sum_j x_j^2 Sigma_jj``.

    ``predictive`` says what ``f_s`` is:

    * ``"sample"``: the network at the drawn weights, ``f_s(x) = f(x; theta_s)`` (FedEP's).
    * ``"linearised"``: the network linearised at the mean, ``f_s(x) = f(x; mean) + J(x) (theta_s -
      mean)`` with ``J`` the Jacobian of the logits in the weights (one ``jax.jvp`` per sample): the
      GLM predictive of Immer, Korzepa and Bauer, "Improving predictions of Bayesian neural nets via
      local linearization" (AISTATS 2021). It is the predictive that matches a Laplace/GGN posterior:
      a weight the data barely constrain (a dead unit, an input that is zero in training) keeps
      its prior variance, and the sampled network turns that into noise on every test point, while
      its Jacobian there is (near) zero. For a model linear in its weights both are the same.

    With ``variance = 0`` every sample is the mean and both equal the point prediction.
    """
    _check_marginal(num_samples, predictive)
    data = _batches(x, y, batch_size)

    def run(key, mean, variance):
        return _marginal_stats(apply_fn, key, mean, variance, data, num_samples, num_bins, predictive)

    return run


def _check_marginal(num_samples: int, predictive: str) -> None:
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1; got {num_samples}")
    if predictive not in PREDICTIVES:
        raise ValueError(f"predictive must be one of {', '.join(PREDICTIVES)}; got {predictive!r}")


def _marginal_stats(apply_fn, key, mean, variance, data, num_samples: int, num_bins: int, predictive: str) -> dict[str, jax.Array]:
    """:func:`marginal_metrics` on the batched set ``data = (xb, yb, mb)``."""
    steps = _weight_steps(key, mean, variance, num_samples)

    def body(acc, batch):
        xs, ys, ms = batch
        log_mean = _marginal_log_probs(apply_fn, mean, steps, xs, predictive)
        return metrics.merge_stats(acc, metrics.classification_stats(log_mean, ys, ms, num_bins)), None

    stats, _ = jax.lax.scan(body, metrics.init_stats(num_bins), data)
    return metrics.finalize_stats(stats)


def _weight_steps(key, mean, variance, num_samples: int):
    """``theta_s - mean = sqrt(variance) * eps_s``, ``[S, ...]`` per leaf: the same draws for every
    batch; for a :func:`dense_spread`, draws of the zero-mean full or last-layer Gaussian."""
    if isinstance(variance, BlockScale):  # a searched prior precision's spread (fedbayes.evaluation.prior_precision)
        draws = gaussian_block.sample_scaled(key, variance, mean, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    if isinstance(variance, BlockGaussian):
        draws = gaussian_block.sample(key, variance, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    if isinstance(variance, FullGaussian):
        draws = gaussian_full.sample(key, variance, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    if isinstance(variance, LowRankGaussian):
        draws = gaussian_lowrank.sample(key, variance, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    if isinstance(variance, gaussian_lowrank.LayerMarginal):
        draws = gaussian_lowrank.sample_marginal(key, variance, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    if isinstance(variance, KronSpread):
        draws = gaussian_kron.sample_spread(key, variance, num_samples)
        return jax.tree.map(lambda d, m: d.astype(m.dtype), draws, mean)
    keys = optax.tree.split_key_like(key, mean)
    return jax.tree.map(lambda k, m, v: _safe_sqrt(v)[None] * jax.random.normal(k, (num_samples, *m.shape), m.dtype), keys, mean, variance)


def _marginal_log_probs(apply_fn, mean, steps, xs, predictive: str) -> jax.Array:
    """``log(1/S sum_s softmax(f_s(x)))`` of one batch, ``f_s`` as :func:`marginal_metrics` says."""

    def logits(step):
        if predictive == "sample":
            return apply_fn(optax.tree.add(mean, step), xs)
        f, jd = jax.jvp(lambda p: apply_fn(p, xs), (mean,), (step,))
        return f + jd

    log_probs = jax.vmap(lambda s: jax.nn.log_softmax(logits(s), axis=-1))(steps)
    # log of the mean probability, stably: logsumexp over samples minus log S.
    num_samples = jax.tree.leaves(steps)[0].shape[0]
    return jax.nn.logsumexp(log_probs, axis=0) - jnp.log(float(num_samples))


def make_probabilities(apply_fn: Callable, *, batch_size: int = 2000) -> Callable[[Any, np.ndarray], np.ndarray]:
    """Returns ``probabilities(params, x) -> [n, C]``: ``softmax(f(x; params))`` on the host, the
    point predictive whose accuracy and NLL :func:`make_evaluator` reports."""
    run = jax.jit(lambda params, xs: jax.nn.softmax(apply_fn(params, xs), axis=-1))

    def probabilities(params, x: np.ndarray) -> np.ndarray:
        return _in_batches(lambda xs: run(params, xs), x, batch_size)

    return probabilities


def make_marginal_probabilities(
    apply_fn: Callable, *, num_samples: int = 10, batch_size: int = 2000, predictive: str = "sample"
) -> Callable[[Any, Any, Any, np.ndarray], np.ndarray]:
    """Returns ``probabilities(key, mean, variance, x) -> [n, C]``: the marginalised predictive
    ``1/S sum_s softmax(f_s(x))`` of :func:`marginal_metrics`, with the very draws ``theta_s`` that
    :func:`make_marginal_evaluator` uses for the same key (one fixed predictive for every ``x``)."""
    _check_marginal(num_samples, predictive)
    run = jax.jit(lambda key, mean, variance, xs: jnp.exp(_marginal_log_probs(apply_fn, mean, _weight_steps(key, mean, variance, num_samples), xs, predictive)))

    def probabilities(key, mean, variance, x: np.ndarray) -> np.ndarray:
        return _in_batches(lambda xs: run(key, mean, variance, xs), x, batch_size)

    return probabilities


def _in_batches(run: Callable, x: np.ndarray, batch_size: int) -> np.ndarray:
    """``run`` over ``x`` in batches of one shape (the last padded), concatenated on the host."""
    n = len(x)
    if n == 0:
        raise ValueError("no examples to predict")
    size = min(batch_size, n)
    out = []
    for start in range(0, n, size):
        xs = x[start : start + size]
        pad = size - len(xs)
        if pad:
            xs = np.concatenate([xs, np.zeros((pad, *xs.shape[1:]), xs.dtype)])
        out.append(np.asarray(run(jnp.asarray(xs)))[: size - pad])
    return np.concatenate(out)
