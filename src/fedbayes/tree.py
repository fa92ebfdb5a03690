"""The few pytree helpers that ``optax.tree`` does not already give.

Arithmetic on pytrees (``add``, ``sub``, ``scale``, ``vdot``, ``zeros_like``, ``where``, ``sum``,
``norm``, ...) comes from ``optax.tree``; this module adds the client-axis reductions of the server
step (messages stacked on axis 0 with a weight vector, 0 = absent; docs/design.md "One round"), size
accounting for the bytes-up/bytes-down counters, and stacking.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

__all__ = [
    "all_finite",
    "num_params",
    "ravel",
    "stack",
    "tree_bytes",
    "unstack",
    "weighted_mean",
    "weighted_sum",
]

PyTree: TypeAlias = Any

ravel = ravel_pytree
"""``ravel(tree) -> (flat, unravel)``: ``jax.flatten_util.ravel_pytree`` under a short name."""


def _check_weights(stacked: PyTree, weights: jax.Array) -> jax.Array:
    weights = jnp.asarray(weights)
    if weights.ndim != 1:
        raise ValueError(f"weights must be a vector [M], got shape {weights.shape}")
    for leaf in jax.tree.leaves(stacked):
        if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != weights.shape[0]:
            raise ValueError(f"every leaf needs a leading axis of size {weights.shape[0]}, got {jnp.shape(leaf)}")
    return weights


def _leaf_weighted_sum(leaf: jax.Array, weights: jax.Array) -> jax.Array:
    w = weights.astype(jnp.result_type(leaf))
    # An entry with weight 0 is absent (padded or rejected client): it must contribute exactly
    # nothing, even if it holds NaN or inf (0 * nan = nan).
    present = (weights != 0).reshape((-1,) + (1,) * (jnp.ndim(leaf) - 1))
    leaf = jnp.where(present, leaf, jnp.zeros((), dtype=jnp.result_type(leaf)))
    return jnp.tensordot(w, leaf, axes=1)


def weighted_sum(stacked: PyTree, weights: jax.Array) -> PyTree:
    """Weighted sum over the leading axis: out = sum_m weights[m] * leaf[m], per leaf.

    The weights are cast to each leaf's dtype, so the output keeps the leaves' dtypes. Entries
    with weight exactly 0 are treated as absent and contribute nothing even when non-finite.

    Args:
      stacked: a pytree whose floating leaves have a leading axis ``[M, ...]``.
      weights: a vector ``[M]``.

    Returns:
      A pytree with the leading axis summed out.
    """
    weights = _check_weights(stacked, weights)
    return jax.tree.map(lambda x: _leaf_weighted_sum(x, weights), stacked)


def weighted_mean(stacked: PyTree, weights: jax.Array) -> PyTree:
    """Weighted mean over the leading axis: sum_m w_m leaf[m] / sum_m w_m (docs/algorithms.md §0, weights n_k).

    Returns zeros (not NaN) when ``sum_m w_m == 0``, e.g. when every client of a round was
    rejected. Entries with weight 0 contribute nothing even when non-finite.

    Args:
      stacked: a pytree whose floating leaves have a leading axis ``[M, ...]``.
      weights: a vector ``[M]``.

    Returns:
      A pytree with the leading axis averaged out, leaf dtypes kept.
    """
    weights = _check_weights(stacked, weights)
    total = jnp.sum(weights)
    nonzero = total != 0
    safe_total = jnp.where(nonzero, total, jnp.ones_like(total))

    def leaf_mean(x):
        dtype = jnp.result_type(x)
        out = _leaf_weighted_sum(x, weights) / safe_total.astype(dtype)
        return jnp.where(nonzero, out, jnp.zeros((), dtype=dtype))

    return jax.tree.map(leaf_mean, stacked)


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return tuple(leaf.shape), np.dtype(leaf.dtype)
    arr = np.asarray(leaf)
    return arr.shape, arr.dtype


def num_params(tree: PyTree) -> int:
    """Number of scalars in ``tree`` (product of each leaf's shape), as a Python int.

    Reads only shapes, so it works on arrays, tracers and ``jax.ShapeDtypeStruct``.

    Args:
      tree: a pytree.

    Returns:
      The total number of elements.
    """
    return sum(math.prod(_shape_dtype(leaf)[0]) for leaf in jax.tree.leaves(tree))


def tree_bytes(tree: PyTree) -> int:
    """Bytes to store ``tree``: sum over leaves of size * itemsize, as a Python int.

    Reads only shapes and dtypes, so it works on arrays and ``jax.ShapeDtypeStruct`` (used to
    count communication from message shapes, docs/design.md "Messages and their validation").

    Args:
      tree: a pytree.

    Returns:
      The total number of bytes.
    """
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape, dtype = _shape_dtype(leaf)
        total += math.prod(shape) * dtype.itemsize
    return total


def all_finite(tree: PyTree) -> jax.Array:
    """True iff every element of every leaf is finite (no NaN, no inf); True for an empty tree.

    Args:
      tree: a pytree of arrays.

    Returns:
      A scalar boolean array, usable under ``jit``.
    """
    result = jnp.asarray(True)
    for leaf in jax.tree.leaves(tree):
        result = jnp.logical_and(result, jnp.all(jnp.isfinite(leaf)))
    return result


def stack(trees: Sequence[PyTree]) -> PyTree:
    """Stacks a list of pytrees with one structure into one pytree with a leading axis [M, ...].

    Args:
      trees: a non-empty sequence of pytrees with identical structure and leaf shapes.

    Returns:
      One pytree whose leaves are ``jnp.stack`` of the corresponding leaves.
    """
    trees = list(trees)
    if not trees:
        raise ValueError("stack needs at least one pytree")
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def unstack(tree: PyTree, n: int | None = None) -> list[PyTree]:
    """Inverse of :func:`stack`: splits the leading axis into a list of ``n`` pytrees.

    Args:
      tree: a pytree whose leaves share a leading axis of size ``n``.
      n: the number of entries; inferred from the leaves when omitted.

    Returns:
      A list of ``n`` pytrees, entry ``i`` holding ``leaf[i]`` of every leaf.
    """
    leaves = jax.tree.leaves(tree)
    sizes = {jnp.shape(leaf)[0] if jnp.ndim(leaf) else None for leaf in leaves}
    if n is None:
        if len(sizes) != 1 or None in sizes:
            raise ValueError(f"cannot infer n: leading axis sizes {sizes}")
        (n,) = sizes
    elif sizes and sizes != {n}:
        raise ValueError(f"expected a leading axis of size {n} on every leaf, got {sizes}")
    return [jax.tree.map(lambda x, i=i: x[i], tree) for i in range(n)]
