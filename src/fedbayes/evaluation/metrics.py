"""Evaluation metrics and curve summaries (docs/algorithms.md §13).

Device side (``jax.numpy``, jit-able): accuracy, negative log-likelihood and expected calibration
error of a classifier (docs/algorithms.md §13.1), in a one-shot form (:func:`classification_metrics`) and
in a masked, summable form for evaluation over padded test batches
(:func:`classification_stats`, :func:`merge_stats`, :func:`finalize_stats`); the mean squared
error of a regressor.

Host side (``numpy``): summaries of a metric curve over rounds (docs/algorithms.md §13.2). Evaluation may
run every k rounds, so every summary takes the metric values in round order together with their
round numbers, and **windows count consecutive evaluations, not rounds**. With evaluation every
round (the papers' protocol) a window of w evaluations is exactly the spec's
``m^(w)_r = (1/w) sum_{j=r-w+1}^{r} a_j``; with evaluation every k rounds the same window spans
w*k rounds, so pass ``window = ceil(w_rounds / k)`` to approximate a window of ``w_rounds``
rounds.

ECE is returned as a fraction in [0, 1]; reports show it in percent (docs/algorithms.md §13.1).

The public device-side functions are wrapped in ``jax.jit`` (``num_bins`` static), so an eager
call on the host compiles one program per input shape instead of one per primitive; inside an
outer ``jit`` they are simply inlined.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ClassificationStats",
    "accuracy",
    "best_within",
    "bin_index",
    "classification_metrics",
    "classification_stats",
    "ece",
    "final_max",
    "final_mean",
    "final_window_mean",
    "finalize_stats",
    "init_stats",
    "merge_stats",
    "nll",
    "regression_metrics",
    "rounds_to_threshold",
    "running_mean",
]


# --------------------------------------------------------------------------------------------
# Device side: classification
# --------------------------------------------------------------------------------------------


class ClassificationStats(NamedTuple):
    """Sums over (masked) test examples from which every classification metric follows.

    All fields are sums (in the floating dtype of the predictions, float32 by default) of
    ``mask``-weighted per-example quantities, so the stats of
    disjoint batches add (:func:`merge_stats`) and :func:`finalize_stats` divides once.

    Attributes:
        count: ``sum_i m_i``, the number of valid examples.
        correct: ``sum_i m_i [argmax_c p_ic = y_i]``.
        nll: ``sum_i m_i (-log p_{i y_i})``.
        bin_count: ``[num_bins]``, ``|I_b| = sum_{i in I_b} m_i``.
        bin_confidence: ``[num_bins]``, ``sum_{i in I_b} m_i max_c p_ic``.
        bin_correct: ``[num_bins]``, ``sum_{i in I_b} m_i [argmax_c p_ic = y_i]``.
    """

    count: jax.Array
    correct: jax.Array
    nll: jax.Array
    bin_count: jax.Array
    bin_confidence: jax.Array
    bin_correct: jax.Array


def bin_index(confidence: jax.Array, num_bins: int) -> jax.Array:
    """Index of the equal-width confidence bin of each confidence (docs/algorithms.md §13.1).

    The bins are ``I_b = (l_b, u_b]`` with edges ``e_j = j / num_bins`` (``j = 0..num_bins``,
    each edge the correctly rounded quotient in the confidence's dtype): a confidence exactly on
    an upper edge ``u_b`` belongs to bin ``b``, and a confidence of exactly 0 to the first bin.
    Confidences outside [0, 1] are clipped into the first or last bin.

    Args:
        confidence: ``[n]`` floats, the maximum predicted probability of each example.
        num_bins: number of bins B >= 1.

    Returns:
        int32 ``[n]`` in ``[0, num_bins - 1]``.

    Raises:
        ValueError: if ``num_bins < 1``.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    # On the host: NumPy divides exactly (correctly rounded), while XLA may compile a division by
    # a constant into a multiplication by its reciprocal, which moves some edges by one ulp.
    edges = jnp.asarray(np.arange(num_bins + 1, dtype=confidence.dtype) / num_bins)
    # searchsorted(side="left") returns j with e_{j-1} < c <= e_j, i.e. bin j - 1.
    idx = jnp.searchsorted(edges, confidence, side="left") - 1
    return jnp.clip(idx, 0, num_bins - 1).astype(jnp.int32)


def _stats(
    confidence: jax.Array,
    correct: jax.Array,
    nll_per_example: jax.Array,
    mask: jax.Array,
    num_bins: int,
) -> ClassificationStats:
    dtype = confidence.dtype
    valid = mask > 0
    zero = jnp.zeros((), dtype)
    weight = jnp.where(valid, mask.astype(dtype), zero)
    correct = correct.astype(dtype)
    # Padded rows may hold anything; zero them so that inf/NaN there cannot leak into the sums.
    confidence = jnp.where(valid, confidence, zero)
    nll_per_example = jnp.where(valid, nll_per_example.astype(dtype), zero)
    bins = bin_index(confidence, num_bins)
    empty = jnp.zeros((num_bins,), dtype)
    return ClassificationStats(
        count=jnp.sum(weight),
        correct=jnp.sum(weight * correct),
        nll=jnp.sum(weight * nll_per_example),
        bin_count=empty.at[bins].add(weight),
        bin_confidence=empty.at[bins].add(weight * confidence),
        bin_correct=empty.at[bins].add(weight * correct),
    )


def _full_mask(labels: jax.Array) -> jax.Array:
    return jnp.ones(labels.shape, jnp.float32)


def _safe_labels(labels: jax.Array, mask: jax.Array, num_classes: int) -> jax.Array:
    """Labels with padded rows set to 0, so that gathers never read out of range."""
    return jnp.clip(jnp.where(mask > 0, labels, jnp.zeros_like(labels)), 0, num_classes - 1)


def _probability_stats(probs: jax.Array, labels: jax.Array, mask: jax.Array, num_bins: int, eps: float) -> ClassificationStats:
    safe = _safe_labels(labels, mask, probs.shape[-1])
    p_true = jnp.take_along_axis(probs, safe[:, None], axis=-1)[:, 0]
    correct = jnp.argmax(probs, axis=-1) == labels
    return _stats(jnp.max(probs, axis=-1), correct, -jnp.log(p_true + eps), mask, num_bins)


@functools.partial(jax.jit, static_argnames=("num_bins",))
def classification_stats(logits: jax.Array, labels: jax.Array, mask: jax.Array | None = None, num_bins: int = 15) -> ClassificationStats:
    """Summable statistics of one (padded) batch, from logits or log-probabilities.

    The predictive distribution is ``p = softmax(logits)``, computed through ``log_softmax`` so
    that ``-log p_y`` is numerically stable. Because ``log_softmax`` is idempotent, normalised
    log-probabilities may be passed instead of logits, e.g. ``log(mean_s softmax(f(x; theta_s)))``
    for the marginalised prediction of docs/algorithms.md §13.1 (entries of ``-inf`` are allowed).

    Args:
        logits: ``[n, C]`` logits or log-probabilities.
        labels: int ``[n]`` true classes (padded rows may hold any value).
        mask: float ``[n]``, 1 for a real example and 0 for padding; ``None`` means all real.
        num_bins: number of ECE bins (default 15, "ECE-15" of Guo et al. 2023 (FedEP)).

    Returns:
        The :class:`ClassificationStats` of the valid rows.
    """
    if mask is None:
        mask = _full_mask(labels)
    safe = _safe_labels(labels, mask, logits.shape[-1])
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    log_p_true = jnp.take_along_axis(log_probs, safe[:, None], axis=-1)[:, 0]
    correct = jnp.argmax(log_probs, axis=-1) == labels
    confidence = jnp.exp(jnp.max(log_probs, axis=-1))
    return _stats(confidence, correct, -log_p_true, mask, num_bins)


def init_stats(num_bins: int = 15, dtype: jnp.dtype = jnp.float32) -> ClassificationStats:
    """Zero statistics: the identity of :func:`merge_stats`."""
    zero = jnp.zeros((), dtype)
    bins = jnp.zeros((num_bins,), dtype)
    return ClassificationStats(zero, zero, zero, bins, bins, bins)


@jax.jit
def merge_stats(a: ClassificationStats, b: ClassificationStats) -> ClassificationStats:
    """Statistics of the union of two disjoint sets of examples (elementwise sum)."""
    return jax.tree.map(jnp.add, a, b)


@jax.jit
def finalize_stats(stats: ClassificationStats) -> dict[str, jax.Array]:
    """Metrics from accumulated statistics (docs/algorithms.md §13.1).

    With ``n = stats.count``:
    ``accuracy = correct / n``; ``nll = nll_sum / n`` (the mean cross-entropy, i.e. the mean of
    ``-log p(y|x)``: the training loss and the papers' NLL are the same number, kept once);
    ``ece = sum_b |bin_correct_b - bin_confidence_b| / n
    = sum_b (|I_b| / n) |acc(I_b) - conf(I_b)|`` (empty bins contribute 0), a fraction in [0, 1].
    With no valid example (``n = 0``) every metric is NaN.
    """
    n = stats.count
    mean_nll = stats.nll / n
    return {
        "accuracy": stats.correct / n,
        "nll": mean_nll,
        "ece": jnp.sum(jnp.abs(stats.bin_correct - stats.bin_confidence)) / n,
    }


@functools.partial(jax.jit, static_argnames=("num_bins",))
def classification_metrics(logits: jax.Array, labels: jax.Array, num_bins: int = 15) -> dict[str, jax.Array]:
    """Accuracy, NLL, ECE and loss of logits (or log-probabilities) ``[n, C]`` on int labels.

    Equivalent to ``finalize_stats(classification_stats(logits, labels, None, num_bins))``; see
    those functions for the definitions.
    """
    return finalize_stats(classification_stats(logits, labels, None, num_bins))


def _mask_or_ones(mask: jax.Array | None, labels: jax.Array) -> jax.Array:
    return _full_mask(labels) if mask is None else mask


@jax.jit
def accuracy(probs: jax.Array, labels: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Top-1 accuracy ``sum_i m_i [argmax_c p_ic = y_i] / sum_i m_i`` (docs/algorithms.md §13.1).

    ``probs`` ``[n, C]`` may be probabilities, logits or log-probabilities (argmax is the same);
    ties go to the lowest class index. ``mask`` (float ``[n]``, default all ones) excludes padded
    rows.
    """
    stats = _probability_stats(probs, labels, _mask_or_ones(mask, labels), 1, 0.0)
    return stats.correct / stats.count


@jax.jit
def nll(probs: jax.Array, labels: jax.Array, eps: float = 0.0, mask: jax.Array | None = None) -> jax.Array:
    """Mean negative log-likelihood ``sum_i m_i (-log(p_{i y_i} + eps)) / sum_i m_i``, natural log.

    docs/algorithms.md §13.1; BFL-P (Ozer et al. 2022 (VBNN aggregation)) uses ``eps = 1e-8``. ``probs`` ``[n, C]`` are probabilities;
    for logits use :func:`classification_metrics`, which works in log space. ``mask`` as in
    :func:`accuracy`.
    """
    stats = _probability_stats(probs, labels, _mask_or_ones(mask, labels), 1, eps)
    return stats.nll / stats.count


@functools.partial(jax.jit, static_argnames=("num_bins",))
def ece(probs: jax.Array, labels: jax.Array, num_bins: int = 15, mask: jax.Array | None = None) -> jax.Array:
    """Expected calibration error with equal-width confidence bins (docs/algorithms.md §13.1, Guo et al. 2023 (FedEP)).

    ``ECE = sum_b (|I_b| / n) |acc(I_b) - conf(I_b)|``, where ``conf`` is the maximum predicted
    probability and a point goes into bin ``(l_b, u_b]`` of :func:`bin_index`. Returns a
    fraction in [0, 1] (multiply by 100 for the papers' percent).

    Args:
        probs: ``[n, C]`` predicted probabilities.
        labels: int ``[n]`` true classes.
        num_bins: number of bins B (default 15; BFL-P's code uses 100).
        mask: float ``[n]``, 1 for a real example and 0 for padding; ``None`` means all real.
    """
    stats = _probability_stats(probs, labels, _mask_or_ones(mask, labels), num_bins, 0.0)
    return jnp.sum(jnp.abs(stats.bin_correct - stats.bin_confidence)) / stats.count


# --------------------------------------------------------------------------------------------
# Device side: regression
# --------------------------------------------------------------------------------------------


@jax.jit
def regression_metrics(pred: jax.Array, y: jax.Array, mask: jax.Array | None = None) -> dict[str, jax.Array]:
    """Mean squared error of predictions ``[n]`` against targets ``[n]``.

    Returns ``mse = sum_i m_i (f_i - y_i)^2 / sum_i m_i``, ``rmse = sqrt(mse)`` and
    ``loss = 0.5 * mse`` (the training objective of :func:`fedbayes.models.loss_fn` for task
    "regression"). ``mask`` (float ``[n]``, default all ones) excludes padded rows.
    """
    if mask is None:
        mask = _full_mask(y)
    mask = mask.astype(pred.dtype)
    valid = mask > 0
    sq = jnp.where(valid, jnp.square(pred - y), jnp.zeros((), pred.dtype))
    mse = jnp.sum(sq * mask) / jnp.sum(mask)
    return {"mse": mse, "rmse": jnp.sqrt(mse), "loss": 0.5 * mse}


# --------------------------------------------------------------------------------------------
# Host side: curve summaries (docs/algorithms.md §13.2)
# --------------------------------------------------------------------------------------------


def _check_window(window: int) -> int:
    if int(window) != window or window < 1:
        raise ValueError(f"window must be a positive integer, got {window!r}")
    return int(window)


def _check_curve(rounds: Sequence[int], values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    r = np.asarray(rounds)
    v = np.asarray(values, dtype=np.float64)
    if r.ndim != 1 or v.ndim != 1 or r.shape != v.shape:
        raise ValueError(f"rounds and values must be 1-D of equal length, got {r.shape}, {v.shape}")
    if r.size > 1 and np.any(np.diff(r) <= 0):
        raise ValueError("rounds must be strictly increasing")
    return r, v


def running_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Trailing running mean over consecutive evaluations (docs/algorithms.md §13.2, ``m^(w)``).

    ``out[i] = mean(values[i - window + 1 : i + 1])`` for ``i >= window - 1`` and NaN before
    (pandas ``rolling(window).mean()``).

    Args:
        values: metric values in evaluation order.
        window: number of consecutive evaluations averaged, >= 1.

    Returns:
        float64 array of the same length as ``values``.
    """
    window = _check_window(window)
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1:
        raise ValueError(f"values must be 1-D, got shape {v.shape}")
    out = np.full(v.shape, np.nan)
    if v.size >= window:
        # Windowed means directly (not by differences of a cumulative sum, which lose precision).
        windows = np.lib.stride_tricks.sliding_window_view(v, window)
        out[window - 1 :] = windows.mean(axis=1)
    return out


def rounds_to_threshold(rounds: Sequence[int], values: Sequence[float], threshold: float, window: int = 10) -> int | None:
    """First round whose trailing mean reaches the threshold (Guo et al. 2023 (FedEP) and Al-Shedivat et al. 2021 (FedPA); docs/algorithms.md §13.2).

    ``min{r_i : m^(window)_i >= threshold}``, the window over consecutive evaluations.

    Returns:
        That round, or ``None`` if it is never reached (reported as "—").
    """
    r, v = _check_curve(rounds, values)
    m = running_mean(v, window)
    hits = np.flatnonzero(m >= threshold)  # NaN compares False, so too-early rounds never hit
    return int(r[hits[0]]) if hits.size else None


def best_within(rounds: Sequence[int], values: Sequence[float], max_round: int, window: int = 100) -> float | None:
    """Best trailing mean up to a round budget (Guo et al. 2023 (FedEP); docs/algorithms.md §13.2).

    ``max{m^(window)_i : r_i <= max_round}``, i.e. with evaluation every round
    ``max_{window <= r <= R} m^(window)_r``.

    Returns:
        That maximum, or ``None`` if fewer than ``window`` evaluations lie at or before
        ``max_round``. No shorter window is substituted: that would report a different, noisier
        statistic under the same name; pass ``window=min(window, n)`` explicitly to opt in.
    """
    r, v = _check_curve(rounds, values)
    m = running_mean(v[r <= max_round], window)
    defined = m[window - 1 :]
    return float(np.max(defined)) if defined.size else None


def final_mean(values: Sequence[float], last: int = 3) -> float | None:
    """Mean of the last ``last`` evaluations (Swaroop et al. 2025 (ADMM and Bayes) Table 1: ``(a_{R-2} + a_{R-1} + a_R) / 3``).

    Returns ``None`` if there are fewer than ``last`` values.
    """
    last = _check_window(last)
    v = np.asarray(values, dtype=np.float64)
    return float(np.mean(v[-last:])) if v.size >= last else None


def final_max(values: Sequence[float], last: int = 3) -> float | None:
    """Max of the last ``last`` evaluations (Swaroop et al. 2025 (ADMM and Bayes) Table 2). ``None`` if fewer values."""
    last = _check_window(last)
    v = np.asarray(values, dtype=np.float64)
    return float(np.max(v[-last:])) if v.size >= last else None


def final_window_mean(values: Sequence[float], window: int = 100) -> float | None:
    """Trailing mean at the last evaluation, ``m^(window)_R`` (Al-Shedivat et al. 2021 (FedPA): "averaged over the last
    100 rounds before the round limit"; docs/algorithms.md §13.2). ``None`` if fewer than ``window``
    values.
    """
    return final_mean(values, last=window)
