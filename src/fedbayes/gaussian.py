"""Gaussian algebra in natural parameters: mean-field (diagonal) and scaled-identity Gaussians.

Every Gaussian computation of fedbayes lives here (docs/algorithms.md §1.1; Guo et al. 2023 (FedEP) footnote 3). A Gaussian
over a parameter pytree is stored in natural (information) parameters

    eta = Lambda mu  (``precision_mean``),   Lambda = Sigma^{-1}  (``precision``),

so that products, quotients and powers of densities are sums, differences and scalings of the
natural parameters. Two containers are provided:

* :class:`DiagGaussian`: ``precision`` is a pytree with the parameters' structure (one precision
  per coordinate, the mean-field family used by FedEP, PVI and FedLap-Cov).
* :class:`IsoGaussian`: ``precision`` is one scalar shared by every coordinate,
  Lambda = lambda I (FedEP's scaled-identity method, docs/algorithms.md §7.6; FedLap, docs/algorithms.md §9).

Both are immutable pytrees (``flax.struct.dataclass``), so they pass through ``jit``, ``vmap``
and optax transformations unchanged. Binary operations on two ``IsoGaussian`` stay isotropic;
mixing the two kinds promotes the ``IsoGaussian`` to a ``DiagGaussian`` (:func:`to_diag`).

Factors may be improper (a quotient with a non-positive precision difference, the uniform factor,
a negative power); a distribution that is sampled from or used as a prior may not (docs/algorithms.md §1.1).
Nothing here clamps: operations that can yield an improper result say so, and callers check with
:func:`is_proper` / :func:`proper_mask` and choose their own policy (reject, damp or project).
"""

from __future__ import annotations

import math
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax.tree
from flax import struct

__all__ = [
    "DiagGaussian",
    "Gaussian",
    "IsoGaussian",
    "damp",
    "difference",
    "entropy",
    "from_moments",
    "is_proper",
    "kl",
    "log_prob",
    "mean",
    "power",
    "product",
    "project_full_to_diag",
    "proper_mask",
    "quotient",
    "sample",
    "to_diag",
    "to_moments",
    "uniform_like",
    "variance",
]

PyTree: TypeAlias = Any

_LOG_2PI = math.log(2.0 * math.pi)


@struct.dataclass
class DiagGaussian:
    """Mean-field Gaussian N(mu, diag(1 / Lambda)) over a pytree, in natural parameters.

    Attributes:
      precision_mean: eta = Lambda * mu (elementwise), a pytree with the parameters' structure.
      precision: Lambda, a pytree with the same structure; Lambda > 0 everywhere for a proper
        density, Lambda = 0 for the uniform factor.
    """

    precision_mean: PyTree
    precision: PyTree


@struct.dataclass
class IsoGaussian:
    """Scaled-identity Gaussian N(mu, I / lambda) over a pytree, in natural parameters.

    Attributes:
      precision_mean: eta = lambda * mu, a pytree with the parameters' structure.
      precision: lambda, one scalar (0-d array) shared by all coordinates; lambda > 0 for a
        proper density.
    """

    precision_mean: PyTree
    precision: jax.Array


Gaussian: TypeAlias = DiagGaussian | IsoGaussian


def _check_gaussian(*gs: Any) -> None:
    for g in gs:
        if not isinstance(g, (DiagGaussian, IsoGaussian)):
            raise TypeError(f"expected DiagGaussian or IsoGaussian, got {type(g).__name__}")


def _check_scalar(value: Any, name: str) -> None:
    if np.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")


def _is_scalar(x: Any) -> bool:
    """True for a Python number or a 0-d array (tracers included), i.e. not a pytree container."""
    if isinstance(x, (int, float)):
        return True
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and np.ndim(x) == 0


def _scale(a: Any, tree: PyTree) -> PyTree:
    # Unlike optax.tree.scale, cast the scalar to each leaf's dtype so float32 leaves stay
    # float32 when ``a`` is a float64 array (x64 mode) or the promotion mode is strict.
    return jax.tree.map(lambda x: jnp.asarray(a, dtype=jnp.result_type(x)) * x, tree)


def _broadcast_like(scalar: Any, leaf: jax.Array) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(scalar, dtype=jnp.result_type(leaf)), jnp.shape(leaf))


def _all(tree: PyTree) -> jax.Array:
    result = jnp.asarray(True)
    for leaf in jax.tree.leaves(tree):
        result = jnp.logical_and(result, jnp.all(leaf))
    return result


def to_diag(g: Gaussian) -> DiagGaussian:
    """Promotes a Gaussian to the diagonal family: lambda I -> diag(lambda, ..., lambda).

    A ``DiagGaussian`` is returned unchanged. The shared precision is broadcast to every leaf
    and cast to the leaf's dtype. Exact: the two represent the same density (docs/algorithms.md §1.1).

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      The same density as a ``DiagGaussian``.
    """
    _check_gaussian(g)
    if isinstance(g, DiagGaussian):
        return g
    _check_scalar(g.precision, "IsoGaussian.precision")
    precision = jax.tree.map(lambda x: _broadcast_like(g.precision, x), g.precision_mean)
    return DiagGaussian(precision_mean=g.precision_mean, precision=precision)


def from_moments(mean: PyTree, variance: PyTree | float | jax.Array) -> Gaussian:
    """Builds a Gaussian from moments: Lambda = 1 / sigma^2, eta = mu / sigma^2 (docs/algorithms.md §0, 1.1).

    Args:
      mean: mu, a pytree of floating arrays.
      variance: sigma^2. A pytree with ``mean``'s structure gives a ``DiagGaussian``; a scalar
        (Python number or 0-d array) gives an ``IsoGaussian`` with Sigma = sigma^2 I. A variance
        <= 0 or infinite gives an improper or degenerate result; nothing is clamped.

    Returns:
      The Gaussian in natural parameters.
    """
    if _is_scalar(variance):
        leaves = jax.tree.leaves(mean)
        dtype = jnp.result_type(*leaves) if leaves else jnp.result_type(float)
        precision = jnp.reciprocal(jnp.asarray(variance, dtype=dtype))
        return IsoGaussian(precision_mean=_scale(precision, mean), precision=precision)
    precision = jax.tree.map(lambda v: jnp.reciprocal(jnp.asarray(v)), variance)
    precision_mean = jax.tree.map(lambda m, p: jnp.asarray(m) * p, mean, precision)
    return DiagGaussian(precision_mean=precision_mean, precision=precision)


def to_moments(g: Gaussian) -> tuple[PyTree, PyTree | jax.Array]:
    """Moments of a Gaussian: mu = eta / Lambda, sigma^2 = 1 / Lambda (docs/algorithms.md §0, 1.1).

    For an improper factor (Lambda <= 0) the results are not moments of any density
    (negative or infinite variance, mean possibly NaN for the uniform factor 0/0); check
    :func:`is_proper` first.

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      ``(mean, variance)``: mean is a pytree; variance is a pytree for ``DiagGaussian`` and a
      scalar for ``IsoGaussian``.
    """
    return mean(g), variance(g)


def mean(g: Gaussian) -> PyTree:
    """Mean mu = eta / Lambda, elementwise (docs/algorithms.md §7.7: the point estimate mu_g = eta_g / Lambda_g).

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      A pytree with the parameters' structure.
    """
    d = to_diag(g)
    return jax.tree.map(lambda e, p: e / p, d.precision_mean, d.precision)


def variance(g: Gaussian) -> PyTree | jax.Array:
    """Variance sigma^2 = 1 / Lambda (a pytree for ``DiagGaussian``, a scalar for ``IsoGaussian``).

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      The (diagonal) variance.
    """
    _check_gaussian(g)
    if isinstance(g, IsoGaussian):
        return jnp.reciprocal(jnp.asarray(g.precision))
    return jax.tree.map(jnp.reciprocal, g.precision)


def _natural_binary(a: Gaussian, b: Gaussian, op) -> Gaussian:
    _check_gaussian(a, b)
    if isinstance(a, IsoGaussian) and isinstance(b, IsoGaussian):
        return IsoGaussian(
            precision_mean=op(a.precision_mean, b.precision_mean),
            precision=op(a.precision, b.precision),
        )
    a, b = to_diag(a), to_diag(b)
    return DiagGaussian(
        precision_mean=op(a.precision_mean, b.precision_mean),
        precision=op(a.precision, b.precision),
    )


def product(a: Gaussian, b: Gaussian) -> Gaussian:
    """Product of densities: N(eta1, L1) N(eta2, L2) ∝ N(eta1 + eta2, L1 + L2).

    docs/algorithms.md §1.1; Guo et al. 2023 (FedEP) footnote 3. Two ``IsoGaussian`` give an ``IsoGaussian``; otherwise the
    result is a ``DiagGaussian``. The product of two proper factors is proper; with an improper
    factor the result may be improper.

    Args:
      a: first factor.
      b: second factor, over the same parameter structure.

    Returns:
      The (unnormalised) product as a Gaussian factor.
    """
    return _natural_binary(a, b, optax.tree.add)


def quotient(a: Gaussian, b: Gaussian) -> Gaussian:
    """Quotient of densities: N(eta1, L1) / N(eta2, L2) ∝ N(eta1 - eta2, L1 - L2).

    docs/algorithms.md §1.1; Guo et al. 2023 (FedEP) footnote 3 (the cavity q_g / q_k, docs/algorithms.md §7.4). The result is a proper
    density only where L1 - L2 > 0; otherwise it is an improper factor, returned as is (check
    with :func:`is_proper`).

    Args:
      a: numerator.
      b: denominator, over the same parameter structure.

    Returns:
      The quotient as a Gaussian factor (possibly improper).
    """
    return _natural_binary(a, b, optax.tree.sub)


def power(g: Gaussian, a: float | jax.Array) -> Gaussian:
    """Power of a density: N(eta, L)^a ∝ N(a eta, a L) (docs/algorithms.md §1.1).

    ``a = 0`` gives the uniform factor and ``a < 0`` an improper factor; both are returned as is.

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.
      a: scalar exponent (may be traced).

    Returns:
      A Gaussian of the same kind as ``g``.
    """
    _check_gaussian(g)
    _check_scalar(a, "exponent")
    return type(g)(precision_mean=_scale(a, g.precision_mean), precision=_scale(a, g.precision))


def uniform_like(params: PyTree) -> DiagGaussian:
    """The improper uniform factor over ``params``: eta = 0, Lambda = 0 (docs/algorithms.md §1.1, docs/algorithms.md §7.3).

    It is the identity of :func:`product` and the paper initialisation of FedEP's server and
    sites (Guo et al. 2023 (FedEP); docs/algorithms.md §7.3). Improper: ``is_proper`` is false.

    Args:
      params: a pytree whose structure, shapes and dtypes the factor copies.

    Returns:
      A ``DiagGaussian`` of zeros.
    """
    return DiagGaussian(precision_mean=optax.tree.zeros_like(params), precision=optax.tree.zeros_like(params))


def damp(old: Gaussian, new: Gaussian, damping: float | jax.Array) -> Gaussian:
    """Damped update old^(1 - damping) new^damping: natural parameters (1 - damping) old + damping new.

    Guo et al. 2023 (FedEP) Sec. 2.2.3 and App. A.1 (q_k^new ∝ q_k^(1 - delta) (q_tilted / q_cavity)^delta,
    the paper's ``delta`` is the damping); docs/algorithms.md §7.1, 7.7. Written as a convex combination
    so that ``damping = 1`` returns ``new`` and ``damping = 0`` returns ``old`` exactly (for finite
    inputs). With 0 <= damping <= 1 and both inputs proper, the result is proper; outside that range
    it may not be.

    Args:
      old: the current factor.
      new: the undamped target factor.
      damping: damping step, a scalar (may be traced).

    Returns:
      The damped factor; ``IsoGaussian`` if both inputs are, else ``DiagGaussian``.
    """
    _check_scalar(damping, "damping")
    return product(power(old, 1 - damping), power(new, damping))


def difference(new: Gaussian, old: Gaussian) -> Gaussian:
    """Natural-parameter difference new / old: (eta_new - eta_old, L_new - L_old).

    This is the client "update distribution" Delta q_k ∝ q_tilted / q_g of Guo et al. 2023 (FedEP) Sec. 2.2.3
    (docs/algorithms.md §7.7 step 1) that the server optimiser consumes. It is a factor, usually improper (its
    precision may be zero or negative); it is not meant to be sampled.

    Args:
      new: the updated factor.
      old: the reference factor.

    Returns:
      ``quotient(new, old)``.
    """
    return quotient(new, old)


def proper_mask(g: Gaussian) -> PyTree:
    """Elementwise validity: Lambda_i > 0 and eta_i, Lambda_i finite (docs/algorithms.md §1.1, docs/algorithms.md §7.10).

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      A pytree of booleans with the parameters' structure (the shared precision of an
      ``IsoGaussian`` is broadcast to every coordinate).
    """
    d = to_diag(g)
    return jax.tree.map(lambda e, p: (p > 0) & jnp.isfinite(p) & jnp.isfinite(e), d.precision_mean, d.precision)


def is_proper(g: Gaussian) -> jax.Array:
    """True iff ``g`` is a proper density: every precision > 0 and every parameter finite.

    docs/algorithms.md §1.1 ("quotient validity flags") and docs/algorithms.md §7.10 (non-PD precision). A boolean 0-d array,
    usable under ``jit``.

    Args:
      g: a ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      A scalar boolean array.
    """
    return _all(proper_mask(g))


def sample(key: jax.Array, g: Gaussian, num_samples: int | None = None) -> PyTree:
    """Reparameterised draw theta = mu + eps / sqrt(Lambda), eps ~ N(0, I) (docs/algorithms.md §7.7).

    One key is split off per leaf (``optax.tree.split_key_like``), so the draw is a
    deterministic function of ``key``, and an ``IsoGaussian`` gives exactly the draw of the
    ``DiagGaussian`` with its precision broadcast. ``g`` must be proper; an improper ``g`` gives
    NaN or infinite values (nothing is clamped).

    Args:
      key: a JAX PRNG key.
      g: a proper ``DiagGaussian`` or ``IsoGaussian``.
      num_samples: if given, draw this many samples, stacked on a new leading axis of every leaf.

    Returns:
      A pytree with the parameters' structure (leaves ``[num_samples, ...]`` if requested).
    """
    d = to_diag(g)
    keys = optax.tree.split_key_like(key, d.precision_mean)
    prefix = () if num_samples is None else (num_samples,)

    def draw(k, eta, lam):
        loc = eta / lam
        scale = jax.lax.rsqrt(lam)
        eps = jax.random.normal(k, prefix + jnp.shape(eta), dtype=jnp.result_type(eta))
        if num_samples is not None:
            loc, scale = loc[None], scale[None]
        return loc + eps * scale

    return jax.tree.map(draw, keys, d.precision_mean, d.precision)


def log_prob(g: Gaussian, x: PyTree) -> jax.Array:
    """Log density summed over coordinates: sum_i [log N(x_i; mu_i, 1 / Lambda_i)].

    log N(x; mu, 1/L) = 0.5 (log L - log 2 pi) - 0.5 L (x - mu)^2 (docs/algorithms.md §0 notation). Meaningful
    only for a proper ``g``. For a batch of points, ``jax.vmap`` over ``x``.

    Args:
      g: a proper ``DiagGaussian`` or ``IsoGaussian``.
      x: a point, a pytree with the parameters' structure.

    Returns:
      A scalar.
    """
    d = to_diag(g)

    def terms(eta, lam, xi):
        return 0.5 * (jnp.log(lam) - _LOG_2PI) - 0.5 * lam * jnp.square(xi - eta / lam)

    return optax.tree.sum(jax.tree.map(terms, d.precision_mean, d.precision, x))


def kl(p: Gaussian, q: Gaussian) -> jax.Array:
    """KL(p || q) between mean-field Gaussians, summed over coordinates (docs/algorithms.md §1.1).

    KL = 1/2 sum_i [log(s2_i^2 / s1_i^2) + (s1_i^2 + (m1_i - m2_i)^2) / s2_i^2 - 1], with
    (m1, s1^2) the moments of p and (m2, s2^2) those of q. Computed with r_i = L_q,i / L_p,i as
    1/2 sum_i [(r_i - 1 - log r_i) + L_q,i (m1_i - m2_i)^2], which is exactly 0 for p == q.
    Any combination of ``DiagGaussian`` and ``IsoGaussian``; both must be proper.

    Args:
      p: the first argument of the KL.
      q: the second argument, over the same parameter structure.

    Returns:
      A scalar >= 0.
    """
    dp, dq = to_diag(p), to_diag(q)

    def terms(eta_p, lam_p, eta_q, lam_q):
        ratio = lam_q / lam_p
        diff = eta_p / lam_p - eta_q / lam_q
        return 0.5 * (ratio - 1 - jnp.log(ratio) + lam_q * jnp.square(diff))

    return optax.tree.sum(jax.tree.map(terms, dp.precision_mean, dp.precision, dq.precision_mean, dq.precision))


def entropy(g: Gaussian) -> jax.Array:
    """Differential entropy: H = 1/2 sum_i [1 + log(2 pi) - log Lambda_i] (standard result).

    Args:
      g: a proper ``DiagGaussian`` or ``IsoGaussian``.

    Returns:
      A scalar.
    """
    return optax.tree.sum(jax.tree.map(lambda lam: 0.5 * (1 + _LOG_2PI - jnp.log(lam)), to_diag(g).precision))


def project_full_to_diag(mean: jax.Array, cov: jax.Array) -> DiagGaussian:
    """Moment-matching projection of N(mean, cov) onto the diagonal family.

    Keeps the mean and the diagonal of the **covariance** (not of the precision): sigma_i^2 =
    cov_ii, so Lambda_i = 1 / cov_ii and eta_i = mean_i / cov_ii. This minimises
    KL(N(mean, cov) || q) over diagonal q (docs/algorithms.md §1.1 last bullet; Guo et al. 2023 (FedEP) reference code
    ``toy.py``, docs/algorithms.md §7.11 item 2).

    Args:
      mean: a flat vector ``[d]``.
      cov: the full covariance matrix ``[d, d]`` (symmetric positive definite).

    Returns:
      A ``DiagGaussian`` over a flat ``[d]`` vector.
    """
    mean = jnp.asarray(mean)
    cov = jnp.asarray(cov)
    if mean.ndim != 1 or cov.shape != (mean.shape[0], mean.shape[0]):
        raise ValueError(f"expected mean [d] and cov [d, d]; got {mean.shape} and {cov.shape}")
    precision = jnp.reciprocal(jnp.diagonal(cov))
    return DiagGaussian(precision_mean=mean * precision, precision=precision)
