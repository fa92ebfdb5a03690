"""Gaussian algebra with a precision diagonal in a per-layer Kronecker-factored eigenbasis.

The Kronecker-factored structure of Laplace Redux (Daxberger et al., "Laplace Redux -- Effortless
Bayesian Deep Learning", NeurIPS 2021, Sec. 3 "KFAC") with the eigenvalue correction of EKFAC
(George et al., "Fast Approximate Natural Gradient Descent in a Kronecker-factored Eigenbasis",
NeurIPS 2018, Sec. 3.2), made closed under the sums that a federated round does (docs/algorithms.md
§1.1). Each parameter leaf ``W``, read as a matrix ``[m, n]`` (``n`` its last axis, ``m`` the
product of the others; a bias is ``[1, n]``), has a basis ``(L, R)`` of two orthonormal matrices
(:class:`KronBasis`; ``None`` for an identity side), the eigenvectors of the layer's two Kronecker
factors (its inputs' and its output gradients' second moments, K-FAC, Martens and Grosse 2015,
Sec. 3). With ``U = L kron R`` over the leaf's row-major entries, a factor's precision is

    Lambda = U diag(s) U^T,         s shaped like W, one block per leaf,

and its mean part ``eta = Lambda mu`` is kept in the parameters' own coordinates. Every factor of
a run shares the bases, so products, quotients, powers and damping are sums and scalings of
``(eta, s)``, leafwise: the aggregator's sum of messages is the exact product, as in the diagonal
family. A dense Kronecker product ``A kron G`` has no such closure (a sum of two is no Kronecker
product); its eigenbasis with a free diagonal does.

In the basis everything is the diagonal family's: ``mu = U (U^T eta / s)``, draws ``mu + U (z /
sqrt(s))``, ``KL`` and densities from the rotated coordinates, the marginal variances
``(L o L) (1 / S) (R o R)^T`` (``o`` the elementwise product), each at ``O(m n (m + n))`` a leaf
and no ``[D, D]`` matrix. A curvature ``G`` enters the structure as ``s = diag(U^T G U)``
(:func:`fedbayes.inference.curvature.data_kron_ggn`), EKFAC's corrected eigenvalues: exact in the
directions of the basis, never negative.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeAlias

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_shared import damp, difference, power, product, quotient

__all__ = [
    "InBases",
    "KronBasis",
    "KronFrame",
    "KronGaussian",
    "KronSpread",
    "bases_from_factors",
    "damp",
    "dense_rotation",
    "difference",
    "factor_numbers",
    "identity_bases",
    "in_bases",
    "marginal",
    "move",
    "power",
    "product",
    "project",
    "quotient",
    "rotate",
    "sample_spread",
    "unrotate",
    "uniform_like",
]

PyTree: TypeAlias = Any


class KronBasis(NamedTuple):
    """A leaf's basis: ``left`` (``[m, m]``) and ``right`` (``[n, n]``) orthonormal, ``None`` for an
    identity side. For a leaf's Kronecker factors it holds the two second-moment matrices instead
    (:func:`bases_from_factors`)."""

    left: jax.Array | None
    right: jax.Array | None


@struct.dataclass
class KronGaussian:
    """``N(mu, Lambda^{-1})`` in natural parameters: ``precision_mean`` is ``eta = Lambda mu`` in the
    parameters' coordinates, ``precision`` the eigenvalues ``s`` in the bases kept elsewhere; both
    shaped like the parameters."""

    precision_mean: PyTree
    precision: PyTree


def _is_basis(x) -> bool:
    return isinstance(x, KronBasis)


def _sides(path, leaf) -> tuple[int, int]:
    """``(m, n)`` of a leaf's basis, 0 for an identity side: a dense or conv ``kernel`` (2-D or 4-D)
    is ``[m, n]``, a ``bias`` (1-D) ``[1, n]`` with no left side; any other leaf has none."""
    name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
    shape = tuple(getattr(leaf, "shape", jnp.shape(leaf)))
    if name == "kernel" and len(shape) in (2, 4):
        return math.prod(shape[:-1]), shape[-1]
    if name == "bias" and len(shape) == 1:
        return 0, shape[-1]
    return 0, 0


def identity_bases(params: PyTree) -> PyTree:
    """Identity bases shaped like ``params``: a dense or conv layer's ``kernel`` (2-D or 4-D) gets
    ``(I_m, I_n)``, its ``bias`` ``(None, I_n)``; every other leaf ``(None, None)``, a plain diagonal
    for good. The shapes are the ones :func:`bases_from_factors` later fills."""

    def one(path, leaf):
        m, n = _sides(path, leaf)
        dtype = jnp.result_type(leaf.dtype)
        return KronBasis(jnp.eye(m, dtype=dtype) if m else None, jnp.eye(n, dtype=dtype) if n else None)

    return jax.tree_util.tree_map_with_path(one, params)


def factor_numbers(params: PyTree) -> int:
    """The entries of a set of Kronecker factors (or bases) for ``params`` (arrays or shape
    structs): ``m^2 + n^2`` a kernel, ``n^2`` a bias."""
    sides = jax.tree_util.tree_leaves_with_path(params)
    return sum(m * m + n * n for m, n in (_sides(path, leaf) for path, leaf in sides))


def _rotate_leaf(x: jax.Array, basis: KronBasis, transpose: bool) -> jax.Array:
    if basis.left is None and basis.right is None:
        return x
    u = x.reshape(-1, x.shape[-1])
    left, right = basis.left, basis.right
    if left is not None:
        u = (left.T if transpose else left) @ u
    if right is not None:
        u = u @ (right if transpose else right.T)
    return u.reshape(x.shape)


def rotate(x: PyTree, bases: PyTree) -> PyTree:
    """``U^T x`` per leaf: ``L^T W R``, the coordinates in the bases."""
    return jax.tree.map(lambda leaf, b: _rotate_leaf(leaf, b, True), x, bases, is_leaf=_is_basis)


def unrotate(u: PyTree, bases: PyTree) -> PyTree:
    """``U u`` per leaf: ``L V R^T``, back to the parameters' coordinates."""
    return jax.tree.map(lambda leaf, b: _rotate_leaf(leaf, b, False), u, bases, is_leaf=_is_basis)


def _squares(basis: KronBasis) -> KronBasis:
    return KronBasis(*(None if m is None else jnp.square(m) for m in basis))


def _abs(basis: KronBasis) -> KronBasis:
    return KronBasis(*(None if m is None else jnp.abs(m) for m in basis))


def _sandwich(x: jax.Array, basis: KronBasis) -> jax.Array:
    """``left x right^T`` on the leaf's matrix (no transposes: the caller passes the sides)."""
    return _rotate_leaf(x, basis, False)


def uniform_like(params: PyTree) -> KronGaussian:
    """The improper uniform factor (all zeros), the identity of :func:`product`."""
    return KronGaussian(optax.tree.zeros_like(params), optax.tree.zeros_like(params))


def bases_from_factors(factors: PyTree) -> PyTree:
    """Bases from Kronecker factors: each side's eigenvectors (``jnp.linalg.eigh`` of the
    symmetrised matrix). A side whose factor is zero (no data reached the layer) keeps the identity,
    so a zero factor leaves the diagonal family."""

    def side(a):
        if a is None:
            return None
        sym = 0.5 * (a + a.T)
        _, vectors = jnp.linalg.eigh(sym)
        return jnp.where(jnp.trace(jnp.abs(sym)) > 0, vectors, jnp.eye(a.shape[0], dtype=a.dtype)).astype(a.dtype)

    return jax.tree.map(lambda f: KronBasis(side(f.left), side(f.right)), factors, is_leaf=_is_basis)


def project(precision: PyTree, old: PyTree | None, new: PyTree) -> PyTree:
    """Eigenvalues ``s`` in bases ``old`` moved to bases ``new``: ``diag(N^T O diag(s) O^T N)``, per
    leaf ``(M_L o M_L) S (M_R o M_R)^T`` with ``M = N^T O`` on each side. Exact when the bases
    agree; otherwise the diagonal of the same matrix in the new bases (the off-diagonal part is
    dropped), linear in ``s`` and non-negative for ``s >= 0``. ``old = None``: the identity bases
    (``M = N^T``, no product formed)."""

    def one(s, n, o=None):
        if n.left is None and n.right is None:
            return s
        sides = zip(o, n, strict=True) if o is not None else ((None, b) for b in n)
        mix = KronBasis(*(None if b is None else jnp.square(b.T if a is None else b.T @ a) for a, b in sides))
        return _sandwich(s, mix)

    if old is None:
        return jax.tree.map(one, precision, new, is_leaf=_is_basis)
    return jax.tree.map(one, precision, new, old, is_leaf=_is_basis)


class KronFrame(NamedTuple):
    """The bases a method keeps in its server state and broadcast: the per-leaf bases
    (:class:`KronBasis`) and ``anchor``, the global mean ``w_s`` at the round they were fixed
    (zeros before), about which factors of the identity bases are moved (:func:`move`)."""

    bases: PyTree
    anchor: PyTree


def move(g: KronGaussian, bases: PyTree, anchor: PyTree) -> KronGaussian:
    """A factor of the identity bases (a diagonal precision ``V``) moved into ``bases`` about
    ``anchor`` (``w_s``): ``V' = project(V)`` and ``v' = v + (V' - V) w_s``. Applied to every factor
    of a product it keeps the product's mean at ``w_s`` when that was its mean
    (``eta' = Lambda' w_s``), and it is linear, so a product of moved factors is the moved product
    (docs/algorithms.md §10.4)."""
    moved = project(g.precision, None, bases)
    shift = optax.tree.sub(in_bases(bases).matvec(moved, anchor), jax.tree.map(jnp.multiply, g.precision, anchor))
    return KronGaussian(optax.tree.add(g.precision_mean, shift), moved)


class InBases(NamedTuple):
    """The family's algebra in one set of bases (:func:`in_bases`): the additive operations of the
    module, and the ones that need the bases (moments, draws, densities) through the rotated
    coordinates. Used where a family module is expected (``product``, ``damp``, ``mean``, ...)."""

    bases: PyTree

    product = staticmethod(product)
    quotient = staticmethod(quotient)
    difference = staticmethod(difference)
    power = staticmethod(power)
    damp = staticmethod(damp)
    uniform_like = staticmethod(uniform_like)

    def scaled_identity(self, params: PyTree, c: float | jax.Array) -> PyTree:
        """``c I``: every eigenvalue ``c`` (``c I`` is diagonal in every orthonormal basis)."""
        return optax.tree.full_like(params, c)

    def matvec(self, s: PyTree, x: PyTree) -> PyTree:
        """``Lambda x = U (s o U^T x)``."""
        return unrotate(jax.tree.map(jnp.multiply, s, rotate(x, self.bases)), self.bases)

    def quad(self, s: PyTree, x: PyTree) -> jax.Array:
        """``x^T Lambda x = sum s o (U^T x)^2``."""
        return optax.tree.sum(jax.tree.map(lambda a, b: a * jnp.square(b), s, rotate(x, self.bases)))

    def solve(self, s: PyTree, x: PyTree) -> PyTree:
        """``Lambda^{-1} x = U (U^T x / s)`` (``s > 0``)."""
        return unrotate(jax.tree.map(jnp.divide, rotate(x, self.bases), s), self.bases)

    def row_bound(self, s: PyTree, params: PyTree) -> PyTree:
        """Per coordinate, a bound on ``sum_j |Lambda_ij|``: ``sum_k |U_ik| |s_k| sum_j |U_jk|``,
        per leaf ``|L| (|S| o c_L c_R^T) |R|^T`` with ``c`` the columns' sums of ``|L|`` and ``|R|``."""

        def one(sk, basis):
            if basis.left is None and basis.right is None:
                return jnp.abs(sk)
            a = _abs(basis)
            mat = jnp.abs(sk).reshape(-1, sk.shape[-1])
            if a.left is not None:
                mat = mat * jnp.sum(a.left, axis=0)[:, None]
            if a.right is not None:
                mat = mat * jnp.sum(a.right, axis=0)[None, :]
            return _sandwich(mat.reshape(sk.shape), a)

        return jax.tree.map(one, s, self.bases, is_leaf=_is_basis)

    def at_least(self, s: PyTree, c: float | jax.Array) -> PyTree:
        """Eigenvalues raised to at least ``c`` (a floor on a running sum's round-off)."""
        return jax.tree.map(lambda v: jnp.maximum(v, jnp.asarray(c, v.dtype)), s)

    def precision_matrix(self, s: PyTree) -> jax.Array:
        """``Lambda`` as a dense ``[D, D]`` matrix over the raveled parameters (small models and
        tests): block-diagonal over the leaves, ``(L kron R) diag(s) (L kron R)^T`` each."""
        blocks = []
        for sk, basis in zip(jax.tree.leaves(s), jax.tree.leaves(self.bases, is_leaf=_is_basis), strict=True):
            u = _leaf_matrix(sk, basis)
            blocks.append((u * jnp.ravel(sk)[None, :]) @ u.T)
        return jax.scipy.linalg.block_diag(*blocks)

    def mean(self, g: KronGaussian) -> PyTree:
        return self.solve(g.precision, g.precision_mean)

    def variance(self, g: KronGaussian) -> PyTree:
        """The marginal variances ``diag(Lambda^{-1})``: per leaf ``(L o L) (1 / S) (R o R)^T``."""
        return jax.tree.map(lambda s, b: _sandwich(jnp.reciprocal(s), _squares(b)), g.precision, self.bases, is_leaf=_is_basis)

    def is_proper(self, g: KronGaussian) -> jax.Array:
        return jnp.all(jnp.asarray([jnp.all(s > 0) for s in jax.tree.leaves(g.precision)]))

    def sample(self, key: jax.Array, g: KronGaussian, num_samples: int | None = None) -> PyTree:
        """``mu + U (z / sqrt(s))``, ``z`` standard normal; a leading axis of ``num_samples`` if given."""
        mu = self.mean(g)

        def one(k):
            leaves, treedef = jax.tree.flatten(g.precision)
            keys = jax.random.split(k, len(leaves))
            z = jax.tree.unflatten(treedef, [jax.random.normal(kk, s.shape, s.dtype) * jax.lax.rsqrt(s) for kk, s in zip(keys, leaves, strict=True)])
            return optax.tree.add(mu, unrotate(z, self.bases))

        if num_samples is None:
            return one(key)
        return jax.vmap(one)(jax.random.split(key, num_samples))

    def log_prob(self, g: KronGaussian, x: PyTree) -> jax.Array:
        """``log N(x; mu, Lambda^{-1})``: the diagonal family's density of the rotated coordinates
        (an orthonormal ``U`` has unit determinant)."""
        z = rotate(optax.tree.sub(x, self.mean(g)), self.bases)
        size = sum(s.size for s in jax.tree.leaves(g.precision))
        quad = optax.tree.sum(jax.tree.map(lambda s, v: s * jnp.square(v), g.precision, z))
        logdet = optax.tree.sum(jax.tree.map(jnp.log, g.precision))
        return 0.5 * (logdet - quad - size * jnp.log(2.0 * jnp.pi))

    def kl(self, p: KronGaussian, q: KronGaussian) -> jax.Array:
        """``KL(p || q)``, both in these bases: the diagonal family's KL of the rotated coordinates,
        ``1/2 sum (s_q / s_p + s_q d^2 - 1 + log(s_p / s_q))``, ``d = U^T (mu_q - mu_p)``."""
        d = rotate(optax.tree.sub(self.mean(q), self.mean(p)), self.bases)
        terms = jax.tree.map(lambda sp, sq, v: sq / sp + sq * jnp.square(v) - 1.0 + jnp.log(sp / sq), p.precision, q.precision, d)
        return 0.5 * optax.tree.sum(terms)

    def project_to_diag(self, g: KronGaussian) -> DiagGaussian:
        """The moment-matched diagonal Gaussian (the same mean and marginal variances)."""
        mu, var = self.mean(g), self.variance(g)
        precision = jax.tree.map(jnp.reciprocal, var)
        return DiagGaussian(jax.tree.map(jnp.multiply, precision, mu), precision)


def _leaf_matrix(leaf: jax.Array, basis: KronBasis) -> jax.Array:
    """``L kron R`` for one leaf, over its row-major entries (the identity where a side is ``None``)."""
    shape = jnp.shape(leaf)
    n = shape[-1] if shape else 1
    m = leaf.size // n if shape else 1
    if basis.left is None and basis.right is None:
        return jnp.eye(leaf.size, dtype=leaf.dtype)
    left = basis.left if basis.left is not None else jnp.eye(m, dtype=leaf.dtype)
    right = basis.right if basis.right is not None else jnp.eye(n, dtype=leaf.dtype)
    return jnp.kron(left, right)


@struct.dataclass
class KronSpread:
    """A zero-mean Gaussian of precision ``U diag(s) U^T`` in the bases ``bases``: a Kronecker
    posterior's spread about its mean, which the marginalised prediction draws from
    (``Algorithm.server_precision``). ``key``: ``None`` draws every weight; a top-level entry of the
    parameter dict (a network's layer) draws that layer's marginal, every other weight at the mean.
    The precision is block-diagonal over the leaves, so a layer's marginal is its own blocks: exact.

    Attributes:
      precision: the eigenvalues ``s``, shaped like the parameters.
      bases: a :class:`KronBasis` per leaf.
      key: the layer drawn, or ``None`` (static).
    """

    precision: PyTree
    bases: PyTree
    key: str | None = struct.field(pytree_node=False, default=None)


def marginal(spread: KronSpread, key: str) -> KronSpread:
    """``spread``'s marginal over its parameter dict's entry ``key``."""
    if not isinstance(spread.precision, dict) or key not in spread.precision:
        raise ValueError(f"marginal: the parameters have no top-level entry {key!r}")
    return spread.replace(key=key)


def sample_spread(key: jax.Array, spread: KronSpread, num_samples: int | None = None) -> PyTree:
    """Draws ``U (z / sqrt(s))`` of the zero-mean spread (zero outside its layer ``spread.key``)."""
    zero_mean = KronGaussian(optax.tree.zeros_like(spread.precision), spread.precision)
    draws = in_bases(spread.bases).sample(key, zero_mean, num_samples)
    if spread.key is None:
        return draws
    return {k: (v if k == spread.key else jax.tree.map(jnp.zeros_like, v)) for k, v in draws.items()}


def in_bases(bases: PyTree) -> InBases:
    """The family's algebra in the bases ``bases`` (a pytree shaped like the parameters with a
    :class:`KronBasis` per leaf)."""
    return InBases(bases)


def dense_rotation(params: PyTree, bases: PyTree) -> jax.Array:
    """``U`` as a dense ``[D, D]`` block-diagonal matrix over the raveled parameters (tests and the
    posterior benchmark's small models)."""
    mats = [_leaf_matrix(leaf, b) for leaf, b in zip(jax.tree.leaves(params), jax.tree.leaves(bases, is_leaf=_is_basis), strict=True)]
    flat, _ = ravel_pytree(params)
    return jax.scipy.linalg.block_diag(*mats).astype(flat.dtype)
