"""Gaussian algebra with a block precision: dense over the last layer, diagonal elsewhere.

The last-layer structure of Laplace Redux (Daxberger, Kristiadi, Immer, Eschenhagen, Bauer and
Hennig, "Laplace Redux -- Effortless Bayesian Deep Learning", NeurIPS 2021, Sec. 3 "subnetwork
and last-layer" and their recommended default): the weights of a network's output layer are few
and carry most of the predictive uncertainty, so they get a dense precision, and every other
weight a diagonal one (docs/algorithms.md §1.1). With the parameters split into the last layer
``L`` (the last top-level entry of the parameter dict, :func:`last_layer_key`) and the rest ``R``,

    Lambda = [[diag(lambda_R), 0], [0, Lambda_L]],     eta = Lambda mu,

a :class:`BlockGaussian` stores ``eta`` as a pytree with the parameters' structure and the
precision as a :class:`BlockPrecision`: ``diagonal`` (a pytree with the structure of ``R``) and
``dense`` (``[B, B]`` over ``L``'s entries in :func:`jax.flatten_util.ravel_pytree` order).

The family is closed under every operation EP and PVI need: products, quotients, powers and
damping are sums, differences and scalings of the natural parameters, exactly as in the diagonal
and dense families, so they act on the two blocks independently (one ``jax.tree.map``). A density
in this family is the product of a diagonal Gaussian over ``R`` and a dense one over ``L``
(:func:`parts`); moments, draws, densities, the KL and the entropy are those of the two parts
(:mod:`fedbayes.gaussian` and :mod:`fedbayes.gaussian_full`), added where they add. Nothing is
clamped: :func:`is_proper` says whether a factor is a density.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian, gaussian_full
from fedbayes.gaussian import DiagGaussian, IsoGaussian
from fedbayes.gaussian_full import FullGaussian

__all__ = [
    "BlockGaussian",
    "BlockPrecision",
    "BlockScale",
    "damp",
    "dense_size",
    "difference",
    "entropy",
    "from_diag",
    "is_proper",
    "join",
    "kl",
    "last_layer_key",
    "log_prob",
    "matvec",
    "mean",
    "parts",
    "power",
    "precision_matrix",
    "predictive_variance",
    "product",
    "project_to_diag",
    "quotient",
    "row_bound",
    "sample",
    "sample_scaled",
    "scaled_identity",
    "shifted",
    "solve",
    "split",
    "uniform_like",
    "variance",
]

PyTree: TypeAlias = Any
OUTPUT = "output"  # the output layer's name in fedbayes's networks


def last_layer_key(params: PyTree) -> str:
    """The last layer: the entry ``output`` of a parameter dict (fedbayes's networks name their
    output layer so), else its last top-level entry (a model's parameters are created in call
    order; ``jax.tree`` operations rebuild dicts in sorted order, which keeps ``output`` last of
    the networks' ``hidden_i``, ``dense_i`` and ``conv_i``).

    Raises:
      ValueError: ``params`` is not a non-empty dict of layers.
    """
    if not isinstance(params, dict) or not params:
        raise ValueError(f"a last-layer structure needs the parameters as a dict of layers; got {type(params).__name__}")
    return OUTPUT if OUTPUT in params else list(params)[-1]


def split(params: PyTree, key: str | None = None) -> tuple[dict, PyTree]:
    """``(rest, last)``: the parameter dict without its last layer, and the last layer's subtree."""
    key = last_layer_key(params) if key is None else key
    return {k: v for k, v in params.items() if k != key}, params[key]


def join(rest: dict, last: PyTree, key: str) -> dict:
    """The inverse of :func:`split`: ``rest`` with ``last`` under ``key`` as its last entry."""
    return {**rest, key: last}


def dense_size(params: PyTree) -> int:
    """``B``: the number of scalar parameters of the last layer (the side of the dense block)."""
    return gaussian_full.num_params(split(params)[1])


@struct.dataclass
class BlockPrecision:
    """A block-diagonal precision over a parameter dict.

    Attributes:
      diagonal: the per-coordinate precisions of every layer but the last (a dict with the
        structure of :func:`split`'s ``rest``).
      dense: the last layer's ``[B, B]`` symmetric precision, in the ravel order of its subtree.
      key: the last layer's name (static).
    """

    diagonal: PyTree
    dense: jax.Array
    key: str = struct.field(pytree_node=False)


@struct.dataclass
class BlockGaussian:
    """Gaussian N(mu, Lambda^{-1}) over a parameter dict with a :class:`BlockPrecision`, in natural
    parameters.

    Attributes:
      precision_mean: eta = Lambda mu, a pytree with the parameters' structure.
      precision: Lambda.
    """

    precision_mean: PyTree
    precision: BlockPrecision


@struct.dataclass
class BlockScale:
    """A zero-mean Gaussian of the last-layer structure given by its scales, the form that draws
    without a factorisation (a predictive's spread, differentiable in the scales): ``std``, the
    other layers' standard deviations (a pytree like :func:`split`'s ``rest``), and ``root``, a
    ``[B, B]`` square root of the last layer's covariance, ``Sigma_L = root root^T``.

    Attributes:
      std: the other layers' standard deviations.
      root: the last layer's covariance root.
      key: the last layer's name (static).
    """

    std: PyTree
    root: jax.Array
    key: str = struct.field(pytree_node=False)


def sample_scaled(key: jax.Array, s: BlockScale, like: PyTree, num_samples: int) -> PyTree:
    """``num_samples`` draws of the zero-mean :class:`BlockScale` ``s``: ``std * eps`` on the other
    layers, ``root eps`` on the last (unravelled like ``like``'s last layer); leaves ``[num_samples, ...]``."""
    k_rest, k_last = jax.random.split(key)
    keys = optax.tree.split_key_like(k_rest, s.std)
    rest = jax.tree.map(lambda k, sd: sd[None] * jax.random.normal(k, (num_samples, *jnp.shape(sd)), jnp.result_type(sd)), keys, s.std)
    _, unravel = ravel_pytree(split(like, s.key)[1])
    eps = jax.random.normal(k_last, (s.root.shape[1], num_samples), s.root.dtype)
    return join(rest, jax.vmap(unravel)((s.root @ eps).T), s.key)


def _check(*gs: Any) -> None:
    for g in gs:
        if not isinstance(g, BlockGaussian):
            raise TypeError(f"expected BlockGaussian, got {type(g).__name__}")


def scaled_identity(params: PyTree, c: float | jax.Array) -> BlockPrecision:
    """``c I`` as a block precision for ``params``."""
    rest, last = split(params)
    flat, _ = ravel_pytree(last)
    return BlockPrecision(
        diagonal=jax.tree.map(lambda x: jnp.full_like(x, c), rest),
        dense=jnp.asarray(c, flat.dtype) * jnp.eye(flat.size, dtype=flat.dtype),
        key=last_layer_key(params),
    )


def uniform_like(params: PyTree) -> BlockGaussian:
    """The improper uniform factor over ``params``: eta = 0, Lambda = 0 (the identity of :func:`product`)."""
    return BlockGaussian(precision_mean=optax.tree.zeros_like(params), precision=scaled_identity(params, 0.0))


def parts(g: BlockGaussian) -> tuple[DiagGaussian, FullGaussian]:
    """The two independent factors of ``g``: a diagonal Gaussian over the rest, a dense one over
    the last layer; ``g`` is their product."""
    _check(g)
    rest, last = split(g.precision_mean, g.precision.key)
    return DiagGaussian(rest, g.precision.diagonal), FullGaussian(last, g.precision.dense)


def _from_parts(diag: DiagGaussian, full: FullGaussian, key: str) -> BlockGaussian:
    return BlockGaussian(join(diag.precision_mean, full.precision_mean, key), BlockPrecision(diag.precision, full.precision, key))


def matvec(p: BlockPrecision, x: PyTree) -> PyTree:
    """``Lambda x`` for a parameter pytree ``x``."""
    rest, last = split(x, p.key)
    flat, unravel = ravel_pytree(last)
    return join(jax.tree.map(jnp.multiply, p.diagonal, rest), unravel(p.dense @ flat.astype(p.dense.dtype)), p.key)


def solve(p: BlockPrecision, x: PyTree) -> PyTree:
    """``Lambda^{-1} x`` (coordinatewise on the rest, a Cholesky solve on the last layer; ``Lambda``
    positive definite)."""
    rest, last = split(x, p.key)
    flat, unravel = ravel_pytree(last)
    dense = gaussian_full.cholesky_solve(gaussian_full.cholesky(p.dense), flat.astype(p.dense.dtype))
    return join(jax.tree.map(jnp.divide, rest, p.diagonal), unravel(dense), p.key)


def shifted(p: BlockPrecision, c: float | jax.Array) -> BlockPrecision:
    """``Lambda + c I`` (a prior precision added or removed)."""
    return BlockPrecision(jax.tree.map(lambda d: d + jnp.asarray(c, d.dtype), p.diagonal), gaussian_full.shifted(p.dense, c), p.key)


def row_bound(p: BlockPrecision, params: PyTree) -> PyTree:
    """Per coordinate, a bound on the curvature of ``x^T Lambda x / 2``, shaped like ``params``:
    ``|lambda_i|`` on the diagonal block, the Gershgorin row sums on the dense one
    (:func:`fedbayes.gaussian_full.row_bound`)."""
    rest, last = split(params, p.key)
    return join(jax.tree.map(lambda d, x: jnp.abs(d).astype(x.dtype), p.diagonal, rest), gaussian_full.row_bound(p.dense, last), p.key)


def from_diag(g: DiagGaussian | IsoGaussian, key: str | None = None) -> BlockGaussian:
    """A diagonal or scaled-identity Gaussian in the block family (its last layer's block the
    diagonal matrix): exact, the same density."""
    d = gaussian.to_diag(g)
    key = last_layer_key(d.precision_mean) if key is None else key
    rest, last = split(d.precision, key)
    return BlockGaussian(d.precision_mean, BlockPrecision(rest, jnp.diag(ravel_pytree(last)[0]), key))


def _promote(g: Any, key: str | None = None) -> BlockGaussian:
    if isinstance(g, BlockGaussian):
        return g
    if isinstance(g, (DiagGaussian, IsoGaussian)):
        return from_diag(g, key)
    raise TypeError(f"expected BlockGaussian, DiagGaussian or IsoGaussian, got {type(g).__name__}")


def _block_indices(g: BlockGaussian) -> tuple[np.ndarray, np.ndarray]:
    """The ravel-order positions (over all parameters) of the other layers' coordinates, in their
    own ravel order, and of the last layer's."""
    flat, unravel = ravel_pytree(jax.tree.map(lambda x: np.zeros(np.shape(x)), g.precision_mean))
    index = unravel(np.arange(flat.size, dtype=np.float64))
    rest, last = split(index, g.precision.key)
    rest_flat = ravel_pytree(rest)[0] if rest else np.zeros((0,))
    return np.asarray(rest_flat).astype(int), np.asarray(ravel_pytree(last)[0]).astype(int)


def precision_matrix(g: BlockGaussian) -> np.ndarray:
    """The ``[D, D]`` precision over all parameters in :func:`jax.flatten_util.ravel_pytree` order
    (for tests and small models: it is mostly zeros)."""
    _check(g)
    rest_index, last_index = _block_indices(g)
    size = rest_index.size + last_index.size
    out = np.zeros((size, size), np.asarray(g.precision.dense).dtype)
    if rest_index.size:
        out[rest_index, rest_index] = np.asarray(ravel_pytree(g.precision.diagonal)[0])
    out[np.ix_(last_index, last_index)] = np.asarray(g.precision.dense)
    return out


def _natural(op, a: Any, b: Any) -> BlockGaussian:
    key = next((g.precision.key for g in (a, b) if isinstance(g, BlockGaussian)), None)
    a, b = _promote(a, key), _promote(b, key)
    if a.precision.key != b.precision.key:
        raise ValueError(f"Gaussians with different last layers: {sorted({a.precision.key, b.precision.key})}")
    return jax.tree.map(op, a, b)


def product(a: Any, b: Any) -> BlockGaussian:
    """Product of densities: (eta_1 + eta_2, Lambda_1 + Lambda_2), block by block. Either factor may
    be a ``DiagGaussian`` or ``IsoGaussian`` (promoted exactly by :func:`from_diag`)."""
    return _natural(jnp.add, a, b)


def quotient(a: Any, b: Any) -> BlockGaussian:
    """Quotient of densities: (eta_1 - eta_2, Lambda_1 - Lambda_2), possibly improper (EP's cavity);
    check with :func:`is_proper`."""
    return _natural(jnp.subtract, a, b)


def difference(new: Any, old: Any) -> BlockGaussian:
    """The natural-parameter difference new / old: :func:`quotient`."""
    return quotient(new, old)


def power(g: Any, a: float | jax.Array) -> BlockGaussian:
    """Power of a density: (a eta, a Lambda); ``a = 0`` gives the uniform factor."""
    g = _promote(g)
    if jnp.ndim(a) != 0:
        raise ValueError(f"exponent must be a scalar, got shape {jnp.shape(a)}")
    return jax.tree.map(lambda x: jnp.asarray(a, jnp.result_type(x)) * x, g)


def damp(old: BlockGaussian, new: BlockGaussian, damping: float | jax.Array) -> BlockGaussian:
    """Damped update old^(1 - damping) new^damping, as :func:`fedbayes.gaussian.damp`: natural
    parameters (1 - damping) old + damping new."""
    return product(power(old, 1 - damping), power(new, damping))


def is_proper(g: BlockGaussian) -> jax.Array:
    """True iff both blocks are proper: every diagonal precision > 0 and the last layer's dense
    precision positive definite, with finite natural parameters."""
    diag, full = parts(g)
    return gaussian.is_proper(diag) & gaussian_full.is_proper(full)


def mean(g: BlockGaussian) -> PyTree:
    """mu = Lambda^{-1} eta, a pytree with the parameters' structure."""
    diag, full = parts(g)
    return join(gaussian.mean(diag), gaussian_full.mean(full), g.precision.key)


def variance(g: BlockGaussian) -> PyTree:
    """Marginal variances: ``1 / lambda_R`` on the rest, ``diag(Lambda_L^{-1})`` on the last layer."""
    diag, full = parts(g)
    return join(gaussian.variance(diag), gaussian_full.variance(full), g.precision.key)


def sample(key: jax.Array, g: BlockGaussian, num_samples: int | None = None) -> PyTree:
    """Reparameterised draws, independent across the two blocks (:func:`fedbayes.gaussian.sample`
    on the rest, :func:`fedbayes.gaussian_full.sample` on the last layer); leaves ``[num_samples,
    ...]`` if requested."""
    diag, full = parts(g)
    k_rest, k_last = jax.random.split(key)
    return join(gaussian.sample(k_rest, diag, num_samples), gaussian_full.sample(k_last, full, num_samples), g.precision.key)


def log_prob(g: BlockGaussian, x: PyTree) -> jax.Array:
    """log N(x; mu, Lambda^{-1}): the sum of the two blocks' log densities."""
    diag, full = parts(g)
    rest, last = split(x, g.precision.key)
    return gaussian.log_prob(diag, rest) + gaussian_full.log_prob(full, last)


def kl(p: BlockGaussian, q: BlockGaussian) -> jax.Array:
    """KL(p || q): the sum of the blocks' KLs (both factorise over the same blocks); both proper."""
    (pd, pf), (qd, qf) = parts(p), parts(q)
    return gaussian.kl(pd, qd) + gaussian_full.kl(pf, qf)


def entropy(g: BlockGaussian) -> jax.Array:
    """Differential entropy: the sum of the blocks' entropies."""
    diag, full = parts(g)
    return gaussian.entropy(diag) + gaussian_full.entropy(full)


def predictive_variance(g: BlockGaussian, jacobian: jax.Array) -> jax.Array:
    """The variance of the linearised predictive f(theta) ~ f(mu) + J (theta - mu): J Sigma J^T, the
    sum of the blocks' ``J_R diag(1 / lambda_R) J_R^T`` and ``J_L Lambda_L^{-1} J_L^T``
    (:func:`fedbayes.gaussian_full.predictive_variance`).

    Args:
      g: a proper Gaussian over ``D`` parameters.
      jacobian: J, ``[K, D]`` (the outputs' Jacobian in :func:`jax.flatten_util.ravel_pytree` order
        over all the parameters).

    Returns:
      ``[K, K]``.
    """
    diag, full = parts(g)
    rest_index, last_index = _block_indices(g)
    jacobian = jnp.asarray(jacobian)
    rest_precision = ravel_pytree(diag.precision)[0] if diag.precision else jnp.zeros((0,), jacobian.dtype)
    j_rest = jacobian[:, rest_index]
    return (j_rest / rest_precision[None, :]) @ j_rest.T + gaussian_full.predictive_variance(full, jacobian[:, last_index])


def project_to_diag(g: BlockGaussian) -> DiagGaussian:
    """Moment-matching projection onto the diagonal family: the same mean and marginal variances
    (the minimiser of KL(g || q) over diagonal q; the rest is diagonal already)."""
    return gaussian.from_moments(mean(g), variance(g))
