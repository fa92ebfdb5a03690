"""Gaussian algebra with a diagonal-plus-low-rank precision: Lambda = diag(d) + U diag(s) U^T.

The structure for networks too large for a dense matrix (docs/algorithms.md §1.1): a
:class:`LowRankGaussian` keeps, beside the diagonal precision ``d`` (a pytree with the parameters'
structure), ``r`` directions ``U`` (``[D, r]``, rows in :func:`jax.flatten_util.ravel_pytree`
order) with signed weights ``s`` (``[r]``). The signs make the family closed under every
operation EP needs, exactly:

* product: (eta_1 + eta_2, d_1 + d_2, [U_1 U_2], [s_1 s_2]);
* quotient (the cavity): (eta_1 - eta_2, d_1 - d_2, [U_1 U_2], [s_1 -s_2]);
* power and damping: the weights and the diagonal scale, the directions stay.

Products and damping concatenate directions, so the rank grows; :func:`truncate` brings it back
to a budget by an eigendecomposition of the low-rank part, keeping the directions of largest
|weight| (exact whenever the budget is at least the part's rank).

Moments, densities and draws go through one canonical form, computed in O(D r^2):
with W = diag(d)^{-1/2} U = Q R (a thin QR) and R diag(s) R^T = V E V^T (an ``r x r``
eigendecomposition), P = Q V has orthonormal columns and

    Lambda = D^{1/2} (I + P E P^T) D^{1/2},
    Sigma = D^{-1/2} (I + P ((1 + E)^{-1} - 1) P^T) D^{-1/2},
    log|Lambda| = sum log d + sum log(1 + E).

So ``g`` is proper iff d > 0 and 1 + E > 0 (the form needs d > 0; EP's cavities keep the prior's
diagonal, so theirs is). Nothing is clamped: :func:`is_proper` says whether a factor is a density.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian
from fedbayes.gaussian import DiagGaussian, IsoGaussian

__all__ = [
    "LayerMarginal",
    "LowRankGaussian",
    "damp",
    "difference",
    "entropy",
    "from_diag",
    "is_proper",
    "kl",
    "log_prob",
    "marginal",
    "mean",
    "power",
    "precision_matrix",
    "predictive_variance",
    "product",
    "project_to_diag",
    "quotient",
    "rank",
    "sample",
    "sample_marginal",
    "truncate",
    "uniform_like",
    "variance",
]

PyTree: TypeAlias = Any

_LOG_2PI = math.log(2.0 * math.pi)


@struct.dataclass
class LowRankGaussian:
    """N(mu, Lambda^{-1}) with Lambda = diag(d) + U diag(s) U^T, in natural parameters.

    Attributes:
      precision_mean: eta = Lambda mu, a pytree with the parameters' structure.
      diag: d, a pytree with the parameters' structure.
      factors: U, ``[D, r]`` over the raveled parameters.
      weights: s, ``[r]``, of either sign.
    """

    precision_mean: PyTree
    diag: PyTree
    factors: jax.Array
    weights: jax.Array


@struct.dataclass
class LayerMarginal:
    """The marginal of a :class:`LowRankGaussian` ``joint`` over one top-level entry ``key`` of its
    parameter dict (a network's layer): a Gaussian's marginal is its draws' sub-vector, so it is drawn
    as the joint with every other entry at its mean (:func:`sample_marginal`)."""

    joint: LowRankGaussian
    key: str = struct.field(pytree_node=False)


def marginal(g: LowRankGaussian, key: str) -> LayerMarginal:
    """The marginal of ``g`` over its parameter dict's entry ``key``."""
    g = _check(g)
    if not isinstance(g.precision_mean, dict) or key not in g.precision_mean:
        raise ValueError(f"marginal: the parameters have no top-level entry {key!r}")
    return LayerMarginal(g, key)


def sample_marginal(key: jax.Array, m: LayerMarginal, num_samples: int | None = None) -> PyTree:
    """Draws of the joint with every entry but ``m.key`` at the joint's mean (exact draws of the
    marginal over ``m.key``)."""
    draws = sample(key, m.joint, num_samples)
    centre = mean(m.joint)
    if num_samples is not None:
        centre = jax.tree.map(lambda c: jnp.broadcast_to(c, (num_samples, *jnp.shape(c))), centre)
    return {k: (v if k == m.key else centre[k]) for k, v in draws.items()}


def rank(g: LowRankGaussian) -> int:
    """r: the number of directions ``g`` carries (static)."""
    return int(jnp.shape(g.weights)[0])


def _check(g: Any) -> LowRankGaussian:
    if isinstance(g, (DiagGaussian, IsoGaussian)):
        return from_diag(g)
    if not isinstance(g, LowRankGaussian):
        raise TypeError(f"expected LowRankGaussian, DiagGaussian or IsoGaussian, got {type(g).__name__}")
    d = sum(math.prod(jnp.shape(x)) for x in jax.tree.leaves(g.precision_mean))
    r = jnp.shape(g.weights)
    if len(r) != 1 or jnp.shape(g.factors) != (d, r[0]):
        raise ValueError(f"LowRankGaussian: factors must be [{d}, r] and weights [r]; got {jnp.shape(g.factors)} and {jnp.shape(g.weights)}")
    return g


def from_diag(g: DiagGaussian | IsoGaussian, rank: int = 0) -> LowRankGaussian:
    """The same density with ``rank`` zero directions (exact)."""
    d = gaussian.to_diag(g)
    flat, _ = ravel_pytree(d.precision)
    return LowRankGaussian(d.precision_mean, d.precision, jnp.zeros((flat.size, rank), flat.dtype), jnp.zeros((rank,), flat.dtype))


def uniform_like(params: PyTree, rank: int = 0) -> LowRankGaussian:
    """The improper uniform factor (all zeros), the identity of :func:`product`."""
    return from_diag(gaussian.uniform_like(params), rank)


def precision_matrix(g: Any) -> jax.Array:
    """Lambda as a dense ``[D, D]`` matrix (for small models and tests)."""
    g = _check(g)
    d, _ = ravel_pytree(g.diag)
    return jnp.diag(d) + (g.factors * g.weights[None, :]) @ g.factors.T


def product(a: Any, b: Any) -> LowRankGaussian:
    """Product of densities: natural parameters added, directions concatenated (rank r_a + r_b)."""
    a, b = _check(a), _check(b)
    return LowRankGaussian(
        precision_mean=jax.tree.map(jnp.add, a.precision_mean, b.precision_mean),
        diag=jax.tree.map(jnp.add, a.diag, b.diag),
        factors=jnp.concatenate([a.factors, b.factors], axis=1),
        weights=jnp.concatenate([a.weights, b.weights]),
    )


def power(g: Any, a: float | jax.Array) -> LowRankGaussian:
    """Power of a density: eta, d and s scaled by ``a`` (the directions unchanged)."""
    g = _check(g)
    if jnp.ndim(a) != 0:
        raise ValueError(f"exponent must be a scalar, got shape {jnp.shape(a)}")
    scale = lambda x: jnp.asarray(a, dtype=jnp.result_type(x)) * x  # noqa: E731
    return LowRankGaussian(jax.tree.map(scale, g.precision_mean), jax.tree.map(scale, g.diag), g.factors, scale(g.weights))


def quotient(a: Any, b: Any) -> LowRankGaussian:
    """Quotient of densities: product with b^{-1} (the cavity of EP), possibly improper."""
    return product(a, power(b, -1.0))


def difference(new: Any, old: Any) -> LowRankGaussian:
    """The natural-parameter difference new / old: :func:`quotient`."""
    return quotient(new, old)


def damp(old: Any, new: Any, damping: float | jax.Array) -> LowRankGaussian:
    """old^(1 - damping) new^damping (Guo et al. 2023 (FedEP) Sec. 2.2.3), rank r_old + r_new."""
    return product(power(old, 1 - damping), power(new, damping))


def truncate(g: Any, max_rank: int) -> LowRankGaussian:
    """The low-rank part U diag(s) U^T compressed to its ``max_rank`` eigendirections of largest
    |eigenvalue| (a thin QR of U, then the ``r x r`` eigendecomposition of R diag(s) R^T).

    Exact (the same Lambda up to rounding) when ``max_rank`` is at least the rank of U diag(s) U^T;
    otherwise the best rank-``max_rank`` approximation of that part in the Frobenius norm.
    """
    g = _check(g)
    r = rank(g)
    if r == 0:
        return from_diag(DiagGaussian(g.precision_mean, g.diag), max_rank)
    q, upper = jnp.linalg.qr(g.factors)
    values, vectors = jnp.linalg.eigh((upper * g.weights[None, :]) @ upper.T)
    keep = jnp.argsort(-jnp.abs(values))[: min(max_rank, values.shape[0])]
    factors, weights = q @ vectors[:, keep], values[keep]
    if factors.shape[1] < max_rank:  # fewer directions than the budget: pad with zero weights
        pad = max_rank - factors.shape[1]
        factors = jnp.concatenate([factors, jnp.zeros((factors.shape[0], pad), factors.dtype)], axis=1)
        weights = jnp.concatenate([weights, jnp.zeros((pad,), weights.dtype)])
    return LowRankGaussian(g.precision_mean, g.diag, factors, weights)


class _Canonical(NamedTuple):
    """Lambda = D^{1/2} (I + P E P^T) D^{1/2}: d (flat), P ``[D, m]`` orthonormal, E ``[m]``."""

    d: jax.Array
    basis: jax.Array
    values: jax.Array


def _canonical(g: LowRankGaussian) -> _Canonical:
    d, _ = ravel_pytree(g.diag)
    if rank(g) == 0:
        return _Canonical(d, jnp.zeros((d.size, 0), d.dtype), jnp.zeros((0,), d.dtype))
    q, upper = jnp.linalg.qr(g.factors * jax.lax.rsqrt(d)[:, None])
    values, vectors = jnp.linalg.eigh((upper * g.weights[None, :]) @ upper.T)
    return _Canonical(d, q @ vectors, values)


def _apply_cov(c: _Canonical, v: jax.Array) -> jax.Array:
    """Sigma v = D^{-1/2} (I + P ((1 + E)^{-1} - 1) P^T) D^{-1/2} v; ``v`` is ``[D]`` or ``[D, k]``."""
    scale = jax.lax.rsqrt(c.d) if v.ndim == 1 else jax.lax.rsqrt(c.d)[:, None]
    return scale * _inner(c, scale * v, -1.0)


def _apply_root(c: _Canonical, v: jax.Array) -> jax.Array:
    """B v with B = D^{-1/2} (I + P ((1 + E)^{-1/2} - 1) P^T), so B B^T = Sigma."""
    scale = jax.lax.rsqrt(c.d) if v.ndim == 1 else jax.lax.rsqrt(c.d)[:, None]
    return scale * _inner(c, v, -0.5)


def _inner(c: _Canonical, w: jax.Array, exponent: float) -> jax.Array:
    """(I + P E P^T)^{exponent} w = w + P ((1 + E)^{exponent} - 1) P^T w."""
    coef = (1.0 + c.values) ** exponent - 1.0
    proj = c.basis.T @ w
    proj = coef[:, None] * proj if w.ndim == 2 else coef * proj
    return w + c.basis @ proj


def mean(g: Any) -> PyTree:
    """Mean mu = Sigma eta (the canonical form; no matrix is formed)."""
    g = _check(g)
    eta, unravel = ravel_pytree(g.precision_mean)
    return unravel(_apply_cov(_canonical(g), eta))


def variance(g: Any) -> PyTree:
    """Marginal variances diag(Sigma) = (1 + sum_j P_ij^2 ((1 + E_j)^{-1} - 1)) / d_i."""
    g = _check(g)
    _, unravel = ravel_pytree(g.precision_mean)
    c = _canonical(g)
    coef = 1.0 / (1.0 + c.values) - 1.0
    return unravel((1.0 + jnp.square(c.basis) @ coef) / c.d)


def is_proper(g: Any) -> jax.Array:
    """True iff ``g`` is a proper density: d > 0, 1 + E > 0 and everything finite (a 0-d bool)."""
    g = _check(g)
    c = _canonical(g)
    eta, _ = ravel_pytree(g.precision_mean)
    finite = jnp.all(jnp.isfinite(eta)) & jnp.all(jnp.isfinite(c.values)) & jnp.all(jnp.isfinite(c.d))
    return finite & jnp.all(c.d > 0) & jnp.all(1.0 + c.values > 0)


def _log_det_precision(c: _Canonical) -> jax.Array:
    return jnp.sum(jnp.log(c.d)) + jnp.sum(jnp.log1p(c.values))


def sample(key: jax.Array, g: Any, num_samples: int | None = None) -> PyTree:
    """Reparameterised draw theta = mu + Sigma^{1/2} eps, eps ~ N(0, I), with the symmetric root
    Sigma^{1/2} = D^{-1/2} (I + P ((1 + E)^{-1/2} - 1) P^T) of the canonical form."""
    g = _check(g)
    eta, unravel = ravel_pytree(g.precision_mean)
    c = _canonical(g)
    loc = _apply_cov(c, eta)
    count = 1 if num_samples is None else num_samples
    eps = jax.random.normal(key, (eta.size, count), dtype=eta.dtype)
    draws = loc[:, None] + _apply_root(c, eps)
    if num_samples is None:
        return unravel(draws[:, 0])
    return jax.vmap(unravel)(draws.T)


def _apply_precision(g: LowRankGaussian, v: jax.Array) -> jax.Array:
    d, _ = ravel_pytree(g.diag)
    return d * v + g.factors @ (g.weights * (g.factors.T @ v))


def log_prob(g: Any, x: PyTree) -> jax.Array:
    """log N(x; mu, Lambda^{-1}) = 0.5 (log|Lambda| - D log 2 pi) - 0.5 (x - mu)^T Lambda (x - mu)."""
    g = _check(g)
    eta, _ = ravel_pytree(g.precision_mean)
    xf, _ = ravel_pytree(x)
    c = _canonical(g)
    diff = xf - _apply_cov(c, eta)
    return 0.5 * (_log_det_precision(c) - eta.size * _LOG_2PI) - 0.5 * diff @ _apply_precision(g, diff)


def kl(p: Any, q: Any) -> jax.Array:
    """KL(p || q) = 1/2 [tr(Lambda_q Sigma_p) - D + (mu_p - mu_q)^T Lambda_q (mu_p - mu_q)
    + log|Lambda_p| - log|Lambda_q|], with tr(Lambda_q Sigma_p) = d_q . diag(Sigma_p)
    + tr(diag(s_q) U_q^T Sigma_p U_q). Both must be proper."""
    p, q = _check(p), _check(q)
    cp, cq = _canonical(p), _canonical(q)
    eta_p, _ = ravel_pytree(p.precision_mean)
    eta_q, _ = ravel_pytree(q.precision_mean)
    var_p, _ = ravel_pytree(variance(p))
    trace = cq.d @ var_p
    if rank(q):
        trace = trace + jnp.sum(q.weights * jnp.sum(q.factors * _apply_cov(cp, q.factors), axis=0))
    diff = _apply_cov(cp, eta_p) - _apply_cov(cq, eta_q)
    quad = diff @ _apply_precision(q, diff)
    return 0.5 * (trace - eta_p.size + quad + _log_det_precision(cp) - _log_det_precision(cq))


def entropy(g: Any) -> jax.Array:
    """Differential entropy H = 1/2 [D (1 + log 2 pi) - log|Lambda|]."""
    g = _check(g)
    c = _canonical(g)
    return 0.5 * (c.d.size * (1 + _LOG_2PI) - _log_det_precision(c))


def project_to_diag(g: Any) -> DiagGaussian:
    """Moment-matching projection onto the diagonal family: the same mean and marginal variances."""
    g = _check(g)
    return gaussian.from_moments(mean(g), variance(g))


def predictive_variance(g: Any, jacobian: jax.Array) -> jax.Array:
    """J Sigma J^T for the linearised predictive (J: ``[K, D]`` in ravel order), ``[K, K]``."""
    g = _check(g)
    jac = jnp.asarray(jacobian)
    return jac @ _apply_cov(_canonical(g), jac.T)
