"""Gaussian algebra with a dense precision matrix: the full-covariance family.

The structured companion of :mod:`fedbayes.gaussian` (docs/algorithms.md §1.1), for models small
enough that a ``[D, D]`` matrix over all ``D`` parameters fits in memory (a GLM, a small network's
last layer). A :class:`FullGaussian` over a parameter pytree is stored in natural parameters

    eta = Lambda mu  (``precision_mean``, a pytree with the parameters' structure),
    Lambda = Sigma^{-1}  (``precision``, a ``[D, D]`` symmetric matrix),

where the matrix's rows and columns follow the order of :func:`jax.flatten_util.ravel_pytree`
over the parameters (leaf by leaf in ``jax.tree`` order, each leaf row-major). Products, quotients,
powers and damping are sums, differences and scalings of the natural parameters, exactly as in
the diagonal family; moments, sampling, densities and the KL go through one Cholesky factor of
Lambda (``jnp.linalg.cholesky``): nothing here inverts a matrix explicitly.

Mixed operations promote a :class:`~fedbayes.gaussian.DiagGaussian` or
:class:`~fedbayes.gaussian.IsoGaussian` to the dense family with :func:`to_full` (exact: the same
density). A factor may be improper (a quotient whose precision difference is not positive
definite, the uniform factor); :func:`is_proper` says so (a Cholesky factor with no NaN), and
nothing is clamped: callers choose their policy, as with the diagonal family.
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian
from fedbayes.gaussian import DiagGaussian, IsoGaussian

__all__ = [
    "FullGaussian",
    "cholesky",
    "cholesky_solve",
    "covariance",
    "damp",
    "difference",
    "entropy",
    "from_moments",
    "from_scale_tril",
    "is_proper",
    "kl",
    "log_prob",
    "lower_transpose_solve",
    "matvec",
    "mean",
    "num_params",
    "power",
    "predictive_variance",
    "product",
    "project_to_diag",
    "quotient",
    "row_bound",
    "sample",
    "scale_tril",
    "shifted",
    "to_full",
    "uniform_like",
    "variance",
]

PyTree: TypeAlias = Any

_LOG_2PI = math.log(2.0 * math.pi)


@struct.dataclass
class FullGaussian:
    """Gaussian N(mu, Lambda^{-1}) over a pytree with a dense precision, in natural parameters.

    Attributes:
      precision_mean: eta = Lambda mu, a pytree with the parameters' structure.
      precision: Lambda, a ``[D, D]`` symmetric matrix over the raveled parameters
        (:func:`jax.flatten_util.ravel_pytree` order); positive definite for a proper density,
        zero for the uniform factor.
    """

    precision_mean: PyTree
    precision: jax.Array


def num_params(params: PyTree) -> int:
    """D: the number of scalar parameters of a pytree (the side of a full precision matrix)."""
    return int(sum(math.prod(jnp.shape(leaf)) for leaf in jax.tree.leaves(params)))


def _check(*gs: Any) -> None:
    for g in gs:
        if not isinstance(g, FullGaussian):
            raise TypeError(f"expected FullGaussian, got {type(g).__name__}")
        d = num_params(g.precision_mean)
        if jnp.shape(g.precision) != (d, d):
            raise ValueError(f"FullGaussian.precision must be [{d}, {d}] for {d} parameters; got {jnp.shape(g.precision)}")


def _promote(g: Any) -> FullGaussian:
    if isinstance(g, FullGaussian):
        _check(g)
        return g
    return to_full(g)


def to_full(g: DiagGaussian | IsoGaussian | FullGaussian) -> FullGaussian:
    """Promotes a diagonal or scaled-identity Gaussian to the dense family: Lambda = diag(lambda).

    Exact: the two represent the same density. A ``FullGaussian`` is returned unchanged.
    """
    if isinstance(g, FullGaussian):
        _check(g)
        return g
    if not isinstance(g, (DiagGaussian, IsoGaussian)):
        raise TypeError(f"expected FullGaussian, DiagGaussian or IsoGaussian, got {type(g).__name__}")
    d = gaussian.to_diag(g)
    flat, _ = ravel_pytree(d.precision)
    return FullGaussian(precision_mean=d.precision_mean, precision=jnp.diag(flat))


def from_moments(mean: PyTree, cov: jax.Array) -> FullGaussian:
    """Builds a dense Gaussian from moments: Lambda = Sigma^{-1}, eta = Lambda mu.

    Args:
      mean: mu, a pytree of floating arrays.
      cov: Sigma, a ``[D, D]`` symmetric positive definite matrix in ravel order.

    Returns:
      The Gaussian in natural parameters (Lambda from the Cholesky factor of Sigma).
    """
    flat, unravel = ravel_pytree(mean)
    cov = jnp.asarray(cov, dtype=flat.dtype)
    if cov.shape != (flat.size, flat.size):
        raise ValueError(f"cov must be [{flat.size}, {flat.size}] for {flat.size} parameters; got {cov.shape}")
    chol = cholesky(cov)
    eye = jnp.eye(flat.size, dtype=flat.dtype)
    inv_chol = _lower_solve(chol, eye)
    precision = inv_chol.T @ inv_chol
    precision = 0.5 * (precision + precision.T)
    return FullGaussian(precision_mean=unravel(precision @ flat), precision=precision)


def from_scale_tril(mean: PyTree, scale: jax.Array) -> FullGaussian:
    """Builds a dense Gaussian from its mean and a lower-triangular factor of its covariance,
    Sigma = C C^T (the parameterisation of full-covariance VI): Lambda = C^{-T} C^{-1}, eta = Lambda mu.

    Args:
      mean: mu, a pytree of floating arrays.
      scale: C, ``[D, D]`` lower triangular with a positive diagonal, in ravel order.
    """
    flat, unravel = ravel_pytree(mean)
    scale = jnp.asarray(scale, dtype=flat.dtype)
    if scale.shape != (flat.size, flat.size):
        raise ValueError(f"scale must be [{flat.size}, {flat.size}] for {flat.size} parameters; got {scale.shape}")
    inv = _lower_solve(scale, jnp.eye(flat.size, dtype=flat.dtype))
    precision = inv.T @ inv
    precision = 0.5 * (precision + precision.T)
    return FullGaussian(precision_mean=unravel(precision @ flat), precision=precision)


def scale_tril(g: Any) -> jax.Array:
    """C, the lower Cholesky factor of the covariance Sigma = Lambda^{-1} = C C^T (the inverse of
    :func:`from_scale_tril`); ``[D, D]``, for a proper ``g``."""
    return cholesky(covariance(g))


# One matrix at a time also under vmap (a cohort's clients): XLA:CPU's batched LAPACK call waited
# for threads that a second host device held in the round's collective, and the round hung.
@jax.custom_batching.sequential_vmap
def cholesky(matrix: jax.Array) -> jax.Array:
    """The lower Cholesky factor of ``(matrix + matrix^T) / 2`` (symmetrised first: sums of messages
    drift from symmetry by rounding); NaN where the matrix is not positive definite. Under ``vmap``
    the matrices are factored one at a time."""
    return jnp.linalg.cholesky(0.5 * (matrix + matrix.T))


def _cholesky(g: FullGaussian) -> jax.Array:
    return cholesky(g.precision)


# The triangular solves too: a batched LAPACK call under vmap is what hung (as cholesky's).
@jax.custom_batching.sequential_vmap
def _lower_solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """L^{-1} b for a lower-triangular L."""
    return jax.scipy.linalg.solve_triangular(chol, b, lower=True)


@jax.custom_batching.sequential_vmap
def _lower_t_solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """L^{-T} b for a lower-triangular L."""
    return jax.scipy.linalg.solve_triangular(chol, b, lower=True, trans="T")


def _solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """(L L^T)^{-1} b."""
    return _lower_t_solve(chol, _lower_solve(chol, b))


def cholesky_solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """``(L L^T)^{-1} b`` for the lower Cholesky factor ``L`` of :func:`cholesky`: two triangular
    solves, one matrix at a time under ``vmap`` (as :func:`cholesky`)."""
    return _solve(chol, b)


def lower_transpose_solve(chol: jax.Array, b: jax.Array) -> jax.Array:
    """``L^{-T} b`` for a lower-triangular ``L``, one matrix at a time under ``vmap``: with ``L`` the
    Cholesky factor of a precision and ``b ~ N(0, I)``, a draw of ``N(0, (L L^T)^{-1})``."""
    return _lower_t_solve(chol, b)


def matvec(precision: jax.Array, x: PyTree) -> PyTree:
    """``Lambda x`` for a parameter pytree ``x`` (ravel order)."""
    flat, unravel = ravel_pytree(x)
    return unravel(precision @ flat.astype(precision.dtype))


def row_bound(precision: jax.Array, params: PyTree) -> PyTree:
    """Per coordinate, the Gershgorin bound ``sum_j |Lambda_ij|`` on the curvature of ``x^T Lambda x / 2``,
    shaped like ``params`` (a local step's control, :func:`fedbayes.inference.sgd.stiff_step_control`)."""
    flat, unravel = ravel_pytree(params)
    return unravel(jnp.sum(jnp.abs(precision), axis=1).astype(flat.dtype))


def shifted(precision: jax.Array, c: float | jax.Array) -> jax.Array:
    """``Lambda + c I`` (a prior precision added or removed)."""
    return precision + jnp.asarray(c, precision.dtype) * jnp.eye(precision.shape[0], dtype=precision.dtype)


def mean(g: FullGaussian) -> PyTree:
    """Mean mu = Lambda^{-1} eta (a Cholesky solve), a pytree with the parameters' structure."""
    g = _promote(g)
    eta, unravel = ravel_pytree(g.precision_mean)
    return unravel(_solve(_cholesky(g), eta))


def covariance(g: FullGaussian) -> jax.Array:
    """Sigma = Lambda^{-1}, the ``[D, D]`` covariance in ravel order (meaningful for a proper ``g``)."""
    g = _promote(g)
    eye = jnp.eye(g.precision.shape[0], dtype=g.precision.dtype)
    cov = _solve(_cholesky(g), eye)
    return 0.5 * (cov + cov.T)


def variance(g: FullGaussian) -> PyTree:
    """Marginal variances diag(Lambda^{-1}), a pytree with the parameters' structure.

    Computed as the squared column norms of L^{-1} (Lambda = L L^T), so the ``D`` marginals cost
    one triangular inverse and no full covariance product.
    """
    g = _promote(g)
    _, unravel = ravel_pytree(g.precision_mean)
    chol = _cholesky(g)
    eye = jnp.eye(chol.shape[0], dtype=chol.dtype)
    inv_chol = _lower_solve(chol, eye)
    return unravel(jnp.sum(jnp.square(inv_chol), axis=0))


def _natural_binary(a: Any, b: Any, op) -> FullGaussian:
    a, b = _promote(a), _promote(b)
    if a.precision.shape != b.precision.shape:
        raise ValueError(f"Gaussians over different parameter counts: {a.precision.shape[0]} and {b.precision.shape[0]}")
    return FullGaussian(
        precision_mean=jax.tree.map(op, a.precision_mean, b.precision_mean),
        precision=op(a.precision, b.precision),
    )


def product(a: Any, b: Any) -> FullGaussian:
    """Product of densities: (eta_1 + eta_2, Lambda_1 + Lambda_2) (docs/algorithms.md §1.1).

    Either factor may be a ``DiagGaussian`` or ``IsoGaussian`` (promoted by :func:`to_full`).
    """
    return _natural_binary(a, b, jnp.add)


def quotient(a: Any, b: Any) -> FullGaussian:
    """Quotient of densities: (eta_1 - eta_2, Lambda_1 - Lambda_2), possibly improper (the
    cavity q / t_k of EP; docs/algorithms.md §7.4). Check with :func:`is_proper`."""
    return _natural_binary(a, b, jnp.subtract)


def difference(new: Any, old: Any) -> FullGaussian:
    """The natural-parameter difference new / old (a factor, usually improper): :func:`quotient`."""
    return quotient(new, old)


def power(g: Any, a: float | jax.Array) -> FullGaussian:
    """Power of a density: (a eta, a Lambda); ``a = 0`` gives the uniform factor."""
    g = _promote(g)
    if jnp.ndim(a) != 0:
        raise ValueError(f"exponent must be a scalar, got shape {jnp.shape(a)}")
    scale = lambda x: jnp.asarray(a, dtype=jnp.result_type(x)) * x  # noqa: E731
    return FullGaussian(precision_mean=jax.tree.map(scale, g.precision_mean), precision=scale(g.precision))


def damp(old: Any, new: Any, damping: float | jax.Array) -> FullGaussian:
    """Damped update old^(1 - damping) new^damping, as :func:`fedbayes.gaussian.damp` (Guo et al.
    2023 (FedEP) Sec. 2.2.3): natural parameters (1 - damping) old + damping new; ``damping = 1``
    returns ``new`` and ``0`` returns ``old``."""
    return product(power(old, 1 - damping), power(new, damping))


def uniform_like(params: PyTree) -> FullGaussian:
    """The improper uniform factor over ``params``: eta = 0, Lambda = 0 (the identity of :func:`product`)."""
    flat, unravel = ravel_pytree(params)
    zeros = jnp.zeros_like(flat)
    return FullGaussian(precision_mean=unravel(zeros), precision=jnp.zeros((flat.size, flat.size), flat.dtype))


def is_proper(g: Any) -> jax.Array:
    """True iff ``g`` is a proper density: Lambda symmetric positive definite (its Cholesky factor
    exists) and eta finite. A boolean 0-d array, usable under ``jit``."""
    g = _promote(g)
    eta, _ = ravel_pytree(g.precision_mean)
    chol = _cholesky(g)
    diag = jnp.diagonal(chol)
    return jnp.all(jnp.isfinite(chol)) & jnp.all(diag > 0) & jnp.all(jnp.isfinite(eta))


def sample(key: jax.Array, g: Any, num_samples: int | None = None) -> PyTree:
    """Reparameterised draw theta = mu + L^{-T} eps, eps ~ N(0, I), Lambda = L L^T.

    Args:
      key: a JAX PRNG key.
      g: a proper Gaussian.
      num_samples: if given, this many draws stacked on a new leading axis of every leaf.

    Returns:
      A pytree with the parameters' structure (leaves ``[num_samples, ...]`` if requested).
    """
    g = _promote(g)
    eta, unravel = ravel_pytree(g.precision_mean)
    chol = _cholesky(g)
    loc = _solve(chol, eta)
    count = 1 if num_samples is None else num_samples
    eps = jax.random.normal(key, (eta.size, count), dtype=eta.dtype)
    draws = loc[:, None] + _lower_t_solve(chol, eps)
    if num_samples is None:
        return unravel(draws[:, 0])
    return jax.vmap(unravel)(draws.T)


def _log_det_precision(chol: jax.Array) -> jax.Array:
    return 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol)))


def log_prob(g: Any, x: PyTree) -> jax.Array:
    """log N(x; mu, Lambda^{-1}) = 0.5 (log|Lambda| - D log 2 pi) - 0.5 (x - mu)^T Lambda (x - mu)."""
    g = _promote(g)
    eta, _ = ravel_pytree(g.precision_mean)
    xf, _ = ravel_pytree(x)
    chol = _cholesky(g)
    diff = xf - _solve(chol, eta)
    quad = diff @ (g.precision @ diff)
    return 0.5 * (_log_det_precision(chol) - eta.size * _LOG_2PI) - 0.5 * quad


def kl(p: Any, q: Any) -> jax.Array:
    """KL(p || q) between Gaussians, any mix of the dense, diagonal and isotropic families.

    KL = 1/2 [tr(Lambda_q Sigma_p) - D + (mu_p - mu_q)^T Lambda_q (mu_p - mu_q)
    + log|Lambda_p| - log|Lambda_q|] (standard result). tr(Lambda_q Sigma_p) is computed as
    ||L_p^{-1} M_q||_F^2 with Lambda_q = M_q M_q^T, so it is exactly D for p == q.
    Both must be proper.
    """
    p, q = _promote(p), _promote(q)
    eta_p, _ = ravel_pytree(p.precision_mean)
    eta_q, _ = ravel_pytree(q.precision_mean)
    chol_p, chol_q = _cholesky(p), _cholesky(q)
    trace = jnp.sum(jnp.square(_lower_solve(chol_p, chol_q)))
    diff = _solve(chol_p, eta_p) - _solve(chol_q, eta_q)
    quad = jnp.sum(jnp.square(chol_q.T @ diff))
    return 0.5 * (trace - eta_p.size + quad + _log_det_precision(chol_p) - _log_det_precision(chol_q))


def entropy(g: Any) -> jax.Array:
    """Differential entropy H = 1/2 [D (1 + log 2 pi) - log|Lambda|]."""
    g = _promote(g)
    d = g.precision.shape[0]
    return 0.5 * (d * (1 + _LOG_2PI) - _log_det_precision(_cholesky(g)))


def project_to_diag(g: Any) -> DiagGaussian:
    """Moment-matching projection onto the diagonal family: the same mean and marginal variances
    (Lambda_i = 1 / Sigma_ii), the minimiser of KL(g || q) over diagonal q (docs/algorithms.md
    §1.1, as :func:`fedbayes.gaussian.project_full_to_diag`)."""
    g = _promote(g)
    return gaussian.from_moments(mean(g), variance(g))


def predictive_variance(g: Any, jacobian: jax.Array) -> jax.Array:
    """The variance of the linearised predictive f(theta) ~ f(mu) + J (theta - mu): J Sigma J^T.

    Args:
      g: a proper Gaussian over ``D`` parameters.
      jacobian: J, ``[K, D]`` (the outputs' Jacobian in ravel order).

    Returns:
      ``[K, K]``, computed as (L^{-1} J^T)^T (L^{-1} J^T) with Lambda = L L^T.
    """
    g = _promote(g)
    half = _lower_solve(_cholesky(g), jnp.asarray(jacobian).T)
    return half.T @ half
