"""Gaussian algebra with a diagonal-plus-low-rank precision in a shared basis.

The low-rank structure of Laplace Redux (Daxberger et al., "Laplace Redux -- Effortless Bayesian
Deep Learning", NeurIPS 2021, Sec. 3 "low-rank"), made closed under the sums that a federated
round does (docs/algorithms.md §1.1). Every factor shares one orthonormal basis ``B`` (``[D, r]``
over the raveled parameters, :func:`jax.flatten_util.ravel_pytree` order) and has

    Lambda = diag(d) + B S B^T,     eta = Lambda mu,

with ``d`` a pytree shaped like the parameters and ``S`` a symmetric ``r x r`` core. A
:class:`SubspaceGaussian` holds the coordinates ``(eta, d, S)`` only; the basis is passed beside
them (:func:`in_basis`). With the basis fixed, products, quotients, powers and damping are sums,
differences and scalings of ``(eta, d, S)``: the aggregator's leafwise sum of messages is the
exact product of the clients' factors, as in the diagonal family. (A low-rank family whose factors
carry their own directions, :mod:`fedbayes.gaussian_lowrank`, concatenates directions under a
product: a sum of messages is not a product there.)

Everything else goes through that family: a factor in a basis is the
:class:`~fedbayes.gaussian_lowrank.LowRankGaussian` with directions ``B Q`` and weights ``s``
from the eigendecomposition ``S = Q diag(s) Q^T`` (:func:`to_lowrank`), whose moments, draws,
densities and KL need ``O(D r^2)`` and no ``[D, D]`` matrix.

A curvature ``G`` is put into the structure by :func:`from_curvature`: ``S = B^T G B`` (exact in the
span of ``B``) and ``d = diag((I - P) G (I - P))`` with ``P = B B^T``, the diagonal of what lies
outside it, never negative for a PSD ``G`` (``diag(G) - diag(P G P)`` can be). From the products
``Y = G B`` and ``diag(G)`` alone: ``d_i = G_ii - 2 sum_a B_ia Y_ia + (B S B^T)_ii``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_lowrank
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_lowrank import LowRankGaussian
from fedbayes.gaussian_shared import damp, difference, power, product, quotient

__all__ = [
    "InBasis",
    "SubspaceGaussian",
    "SubspacePrecision",
    "damp",
    "difference",
    "from_curvature",
    "in_basis",
    "orthonormal_basis",
    "power",
    "product",
    "project",
    "quotient",
    "scaled_identity",
    "uniform_like",
]

PyTree: TypeAlias = Any


@struct.dataclass
class SubspacePrecision:
    """``diag(d) + B S B^T`` without its basis: ``diagonal`` (``d``, shaped like the parameters) and
    ``core`` (``S``, ``[r, r]``, symmetric)."""

    diagonal: PyTree
    core: jax.Array


@struct.dataclass
class SubspaceGaussian:
    """``N(mu, Lambda^{-1})`` in natural parameters, ``Lambda`` a :class:`SubspacePrecision` in a basis
    kept elsewhere; ``precision_mean`` is ``eta = Lambda mu``, shaped like the parameters."""

    precision_mean: PyTree
    precision: SubspacePrecision


def scaled_identity(params: PyTree, c: float | jax.Array, rank: int) -> SubspacePrecision:
    """``c I``: diagonal ``c``, zero core."""
    flat, _ = ravel_pytree(params)
    return SubspacePrecision(optax.tree.full_like(params, c), jnp.zeros((rank, rank), flat.dtype))


def uniform_like(params: PyTree, rank: int) -> SubspaceGaussian:
    """The improper uniform factor (all zeros), the identity of :func:`product`."""
    return SubspaceGaussian(optax.tree.zeros_like(params), scaled_identity(params, 0.0, rank))


def orthonormal_basis(sketch: jax.Array) -> jax.Array:
    """An orthonormal basis ``[D, r]`` of the span of ``sketch`` (``[D, r]``): the ``Q`` of its
    thin QR decomposition (the range finder of Halko, Martinsson and Tropp 2011, "Finding structure
    with randomness", Alg. 4.1)."""
    q, _ = jnp.linalg.qr(sketch)
    return q


def from_curvature(diag: PyTree, sketch: jax.Array, basis: jax.Array) -> SubspacePrecision:
    """A PSD curvature ``G`` in the structure, from ``diag(G)`` and ``Y = G B``: core ``B^T G B`` and
    diagonal ``diag((I - P) G (I - P))``. Both are PSD, so round-off below zero is set to 0: in the
    diagonal, and in the core's eigenvalues (a basis direction in ``G``'s null space gives an
    eigenvalue of about ``-1e-7`` of the largest in float32)."""
    flat, unravel = ravel_pytree(diag)
    core = basis.T @ sketch
    values, vectors = jnp.linalg.eigh(0.5 * (core + core.T))
    core = (vectors * jnp.maximum(values, 0.0)[None, :]) @ vectors.T
    rest = flat - 2.0 * jnp.sum(basis * sketch, axis=1) + jnp.sum((basis @ core) * basis, axis=1)
    return SubspacePrecision(unravel(jnp.maximum(rest, 0.0).astype(flat.dtype)), core.astype(flat.dtype))


def project(g: SubspaceGaussian, old: jax.Array, new: jax.Array) -> SubspaceGaussian:
    """``g`` with its core moved from basis ``old`` to basis ``new``: ``S' = R S R^T``,
    ``R = new^T old`` (exact where the span is unchanged; what lies outside the new span is
    dropped)."""
    r = new.T @ old
    return SubspaceGaussian(g.precision_mean, SubspacePrecision(g.precision.diagonal, r @ g.precision.core @ r.T))


class InBasis(NamedTuple):
    """The family's algebra in one basis ``B`` (:func:`in_basis`): the additive operations of the
    module, and the ones that need ``B`` (moments, draws, densities) through
    :func:`to_lowrank`. Used where a family module is expected (``product``, ``damp``, ``mean``,
    ``variance``, ...)."""

    basis: jax.Array

    product = staticmethod(product)
    quotient = staticmethod(quotient)
    difference = staticmethod(difference)
    power = staticmethod(power)
    damp = staticmethod(damp)

    @property
    def rank(self) -> int:
        return int(self.basis.shape[1])

    def uniform_like(self, params: PyTree) -> SubspaceGaussian:
        return uniform_like(params, self.rank)

    def scaled_identity(self, params: PyTree, c: float | jax.Array) -> SubspacePrecision:
        return scaled_identity(params, c, self.rank)

    def to_lowrank(self, g: SubspaceGaussian) -> LowRankGaussian:
        """The same density as a :class:`~fedbayes.gaussian_lowrank.LowRankGaussian`: directions
        ``B Q`` and weights ``s`` from ``S = Q diag(s) Q^T``."""
        s, q = jnp.linalg.eigh(0.5 * (g.precision.core + g.precision.core.T))
        return LowRankGaussian(g.precision_mean, g.precision.diagonal, self.basis @ q, s)

    def matvec(self, p: SubspacePrecision, x: PyTree) -> PyTree:
        """``Lambda x``."""
        flat, unravel = ravel_pytree(x)
        d, _ = ravel_pytree(p.diagonal)
        return unravel(d * flat + self.basis @ (p.core @ (self.basis.T @ flat)))

    def quad(self, p: SubspacePrecision, x: PyTree) -> jax.Array:
        """``x^T Lambda x = sum_i d_i x_i^2 + z^T S z`` with ``z = B^T x``: one product with the basis
        (and one more in its gradient)."""
        flat, _ = ravel_pytree(x)
        d, _ = ravel_pytree(p.diagonal)
        z = self.basis.T @ flat
        return jnp.sum(d * jnp.square(flat)) + z @ (p.core @ z)

    def solve(self, p: SubspacePrecision, x: PyTree) -> PyTree:
        """``Lambda^{-1} x`` (``Lambda`` positive definite)."""
        return gaussian_lowrank.mean(self.to_lowrank(SubspaceGaussian(x, p)))

    def row_bound(self, p: SubspacePrecision, params: PyTree) -> PyTree:
        """Per coordinate, a bound on ``sum_j |Lambda_ij|``: ``|d_i| + sum_ab |B_ia| |S_ab| sum_j |B_jb|``."""
        d, unravel = ravel_pytree(p.diagonal)
        b = jnp.abs(self.basis)
        return unravel(jnp.abs(d) + b @ (jnp.abs(p.core) @ jnp.sum(b, axis=0)))

    def at_least(self, p: SubspacePrecision, c: float | jax.Array) -> SubspacePrecision:
        """The diagonal raised to at least ``c`` coordinatewise (a floor on a running sum's round-off)."""
        return SubspacePrecision(jax.tree.map(lambda s: jnp.maximum(s, jnp.asarray(c, s.dtype)), p.diagonal), p.core)

    def precision_matrix(self, p: SubspacePrecision) -> jax.Array:
        """``Lambda`` as a dense ``[D, D]`` matrix (small models and tests)."""
        d, _ = ravel_pytree(p.diagonal)
        return jnp.diag(d) + self.basis @ p.core @ self.basis.T

    def mean(self, g: SubspaceGaussian) -> PyTree:
        return gaussian_lowrank.mean(self.to_lowrank(g))

    def variance(self, g: SubspaceGaussian) -> PyTree:
        """The marginal variances ``diag(Lambda^{-1})``."""
        return gaussian_lowrank.variance(self.to_lowrank(g))

    def is_proper(self, g: SubspaceGaussian) -> jax.Array:
        return gaussian_lowrank.is_proper(self.to_lowrank(g))

    def sample(self, key: jax.Array, g: SubspaceGaussian, num_samples: int | None = None) -> PyTree:
        return gaussian_lowrank.sample(key, self.to_lowrank(g), num_samples)

    def log_prob(self, g: SubspaceGaussian, x: PyTree) -> jax.Array:
        return gaussian_lowrank.log_prob(self.to_lowrank(g), x)

    def kl(self, p: SubspaceGaussian, q: SubspaceGaussian) -> jax.Array:
        """``KL(p || q)``, both in this basis."""
        return gaussian_lowrank.kl(self.to_lowrank(p), self.to_lowrank(q))

    def project_to_diag(self, g: SubspaceGaussian) -> DiagGaussian:
        """The moment-matched diagonal Gaussian (the same mean and marginal variances)."""
        return gaussian_lowrank.project_to_diag(self.to_lowrank(g))


def in_basis(basis: jax.Array) -> InBasis:
    """The family's algebra in the orthonormal basis ``basis`` (``[D, r]``)."""
    return InBasis(basis)
