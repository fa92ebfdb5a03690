"""Split conformal prediction sets calibrated across a federation, by counts only.

Split conformal (Angelopoulos and Bates 2021, "A Gentle Introduction to Conformal Prediction and
Distribution-Free Uncertainty Quantification", Sec. 1): a nonconformity score ``s(x, y)`` of a
fitted predictive, ``n`` calibration scores ``s_1..s_n``, the threshold

    q = s_(k),   k = ceil((n + 1)(1 - alpha))          (the k-th smallest; q = +inf when k > n)

and the set ``C(x) = {y : s(x, y) <= q}``. If the test pair is exchangeable with the calibration
pairs, ``1 - alpha <= P(y in C(x))``, and ``<= 1 - alpha + 1/(n + 1)`` when the scores have no ties
(ibid., Sec. 1 and Appendix D).

Scores of a predictive ``p(. | x)`` (:data:`SCORES`):

* ``"lac"``: ``s = 1 - p_y`` (ibid. Sec. 1, the least ambiguous set-valued classifier);
* ``"aps"``: ``s = sum_{c : p_c > p_y} p_c + p_y``, the mass of the classes at least as likely as
  ``y`` (ibid. Sec. 2.1, adaptive prediction sets, without the randomisation). The sets are
  ``{y : s <= q}`` for both scores; ibid.'s APS sets also take the class that crosses ``q``, which
  keeps every set non-empty at the price of coverage above the upper bound.

**Federated quantile.** Client ``j`` holds ``n_j`` calibration scores; ``N = sum_j n_j``. The
server needs ``s_(k)`` of the pooled ``N`` scores, and no score leaves a client. It asks for
counts: ``c_j(t) = #{i : s_ji <= t}`` at thresholds ``t`` it chooses, summed over the clients
(``c(t) = sum_j c_j(t)``, a secure sum: the server learns the total, never a client's count).

*Claim:* ``s_(k) = min{t in F : c(t) >= k}``, ``F`` the floats of the scores' dtype. ``c`` is
non-decreasing and ``c(s_(k)) >= k``; for ``t < s_(k)`` only scores below ``s_(k)`` count, and
there are at most ``k - 1`` of them. The floats are a finite totally ordered set, and their IEEE
bit patterns map monotonically onto the integers (:func:`_ordered_key`), so bisection on those
integers finds this minimum exactly, after at most 64 count queries (float64). So the federated
threshold *is* the pooled one (not an approximation to float resolution: the same float; a zero
may come back as ``-0.0``, which compares equal) and every set equals the pooled sets. The server learns ``N`` and ``c`` at the bisection's thresholds.

With exchangeability across clients (a test point from the pool's distribution, each client's
calibration examples a uniform sample of its data) the pooled rank above gives the marginal
guarantee; Lu et al. 2023 ("Federated Conformal Predictors for Distributed Uncertainty
Quantification", ICML) weaken this to partial exchangeability and raise the rank; the count
protocol reaches any rank ``k``, so only :func:`conformal_rank` would change.

**Per-client coverage.** Under label skew (the Dirichlet and shard partitions: client ``j``'s data
are ``p(x | y) pi_j(y)``), client ``j``'s coverage is ``sum_y pi_j(y) cov(y)`` with ``cov(y)`` the
class-conditional coverage on the test set (:func:`mixture_coverage`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import NamedTuple

import numpy as np

__all__ = [
    "SCORES",
    "Quantile",
    "all_scores",
    "class_coverage",
    "client_counts",
    "conformal_rank",
    "count_at_most",
    "coverage",
    "federated_quantile",
    "label_scores",
    "min_calibration",
    "mixture_coverage",
    "pooled_quantile",
    "prediction_sets",
    "set_sizes",
]

SCORES = ("lac", "aps")


def all_scores(probs: np.ndarray, score: str = "lac") -> np.ndarray:
    """The score ``s(x, c)`` of every candidate class ``c``: ``[n, C]`` float64 from ``probs [n, C]``."""
    p = np.asarray(probs, dtype=np.float64)
    if score == "lac":
        return 1.0 - p
    if score == "aps":
        # sum_{c'} p_c' [p_c' > p_c] + p_c, by pairs of classes, in blocks of rows that keep the
        # [rows, C, C] comparison near 8 MB (CIFAR-100's 10,000 x 100 x 100 at once would be 800 MB)
        rows = max(1, 1_000_000 // max(1, p.shape[1] ** 2))
        return (
            np.concatenate([np.einsum("nk,nck->nc", b, (b[:, None, :] > b[:, :, None]).astype(np.float64)) + b for b in np.split(p, range(rows, len(p), rows))])
            if len(p)
            else p.copy()
        )
    raise ValueError(f"score must be one of {', '.join(SCORES)}; got {score!r}")


def label_scores(probs: np.ndarray, labels: np.ndarray, score: str = "lac") -> np.ndarray:
    """The scores ``s(x_i, y_i)`` of the true labels: ``[n]`` float64."""
    labels = np.asarray(labels)
    return np.take_along_axis(all_scores(probs, score), labels[:, None], axis=1)[:, 0]


def conformal_rank(num_scores: int, alpha: float) -> int:
    """``k = ceil((n + 1)(1 - alpha))``, in exact arithmetic on ``alpha`` as it prints (``0.1``
    is one tenth: in floats ``10 * (1 - 0.1)`` is above 9 and would round up to 10)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must be in (0, 1); got {alpha}")
    if num_scores < 0:
        raise ValueError(f"num_scores must be >= 0; got {num_scores}")
    return math.ceil((num_scores + 1) * (1 - Fraction(repr(float(alpha)))))


def min_calibration(alpha: float) -> int:
    """The fewest scores with a finite threshold: the least ``n`` with ``k <= n``, i.e.
    ``(n + 1)(1 - alpha) <= n``, ``n = ceil((1 - alpha) / alpha)`` (exact, as :func:`conformal_rank`)."""
    conformal_rank(0, alpha)  # checks alpha
    a = Fraction(repr(float(alpha)))
    return math.ceil((1 - a) / a)


def pooled_quantile(scores: np.ndarray, alpha: float) -> float:
    """``s_(k)`` of the pooled scores (+inf when ``k > n``): the reference the federated one equals."""
    s = np.sort(np.asarray(scores, dtype=np.float64))
    k = conformal_rank(len(s), alpha)
    return float(s[k - 1]) if k <= len(s) else math.inf


def count_at_most(scores: np.ndarray, threshold: float) -> int:
    """A client's whole reply to one query: how many of its scores are ``<= threshold``."""
    return int(np.count_nonzero(np.asarray(scores) <= threshold))


class Quantile(NamedTuple):
    """The federated threshold ``q = s_(k)``, the rank ``k`` of ``num_scores`` and the count queries asked."""

    value: float
    rank: int
    num_scores: int
    queries: int


_SIGN = np.uint64(1 << 63)


def _ordered_key(t: float) -> int:
    """An integer that orders float64s as ``<`` does (``-0.0`` just below ``+0.0``)."""
    bits = np.array(t, np.float64).view(np.uint64)
    return int(~bits) if bits & _SIGN else int(bits | _SIGN)


def _from_key(key: int) -> float:
    bits = np.uint64(key)
    bits = (bits & ~_SIGN) if bits & _SIGN else ~bits
    return float(np.array(bits, np.uint64).view(np.float64))


def federated_quantile(count: Callable[[float], int], num_scores: int, alpha: float) -> Quantile:
    """``s_(k)`` of ``num_scores`` scores spread over clients, from pooled counts only.

    Args:
      count: ``t -> c(t)``, the number of scores ``<= t`` summed over the clients (a secure sum of
        :func:`count_at_most`); each call is one query round.
      num_scores: ``N``, the number of scores (a secure sum of the clients' ``n_j``).
      alpha: the miscoverage.

    Returns:
      The :class:`Quantile`; its value equals :func:`pooled_quantile` of the pooled float64
      scores (the module docstring proves it), +inf without a query when ``k > N``.

    Raises:
      ValueError: ``count`` is not that of ``num_scores`` finite-or-infinite, non-NaN scores.
    """
    k = conformal_rank(num_scores, alpha)
    if k > num_scores:
        return Quantile(math.inf, k, num_scores, 0)
    lo, hi = _ordered_key(-math.inf), _ordered_key(math.inf)
    queries = 1
    if count(math.inf) != num_scores:
        raise ValueError(f"count(+inf) must be num_scores = {num_scores} (NaN scores, or a wrong total?)")
    while lo < hi:  # invariant: the least key with c >= k lies in [lo, hi]
        mid = lo + (hi - lo) // 2
        queries += 1
        if count(_from_key(mid)) >= k:
            hi = mid
        else:
            lo = mid + 1
    return Quantile(_from_key(lo), k, num_scores, queries)


def client_counts(client_scores: Sequence[np.ndarray]) -> tuple[Callable[[float], int], int]:
    """The protocol simulated over clients' score arrays: ``(t -> sum_j c_j(t), N)``."""
    scores = [np.asarray(s, dtype=np.float64) for s in client_scores]
    return (lambda t: sum(count_at_most(s, t) for s in scores)), sum(len(s) for s in scores)


def prediction_sets(scores: np.ndarray, threshold: float) -> np.ndarray:
    """``C(x_i) = {c : s(x_i, c) <= q}`` as a bool ``[n, C]`` from :func:`all_scores`."""
    return np.asarray(scores) <= threshold


def coverage(sets: np.ndarray, labels: np.ndarray) -> float:
    """The fraction of examples whose label is in its set."""
    return float(np.mean(sets[np.arange(len(labels)), np.asarray(labels)]))


def set_sizes(sets: np.ndarray) -> np.ndarray:
    """The number of classes in each set: int ``[n]``."""
    return np.sum(sets, axis=1)


def class_coverage(sets: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """``cov(y)``, the coverage among the examples of class ``y``: ``[num_classes]``, NaN for a class absent from ``labels``."""
    labels = np.asarray(labels)
    hit = sets[np.arange(len(labels)), labels].astype(np.float64)
    n = np.bincount(labels, minlength=num_classes).astype(np.float64)
    covered = np.bincount(labels, weights=hit, minlength=num_classes)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, covered / np.where(n > 0, n, 1.0), np.nan)


def mixture_coverage(per_class: np.ndarray, label_counts: np.ndarray) -> np.ndarray:
    """Each client's coverage ``sum_y pi_j(y) cov(y)`` under label skew: ``[num_clients]`` from
    ``label_counts [num_clients, C]`` (a client's training labels) and :func:`class_coverage`.
    Classes the test set lacks are left out of ``pi_j`` and the rest renormalised."""
    counts = np.asarray(label_counts, dtype=np.float64)
    known = ~np.isnan(per_class)
    counts = counts * known[None, :]
    totals = counts.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(totals > 0, counts @ np.where(known, per_class, 0.0) / np.where(totals > 0, totals, 1.0), np.nan)
