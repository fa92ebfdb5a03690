"""The few pytree helpers that ``optax.tree`` does not already give.

Arithmetic on pytrees (``add``, ``sub``, ``scale``, ``vdot``, ``zeros_like``, ``where``, ``sum``,
``norm``, ...) comes from ``optax.tree``; this module adds the client-axis reductions of the server
step (messages stacked on axis 0 with a weight vector, 0 = absent; docs/design.md "One round"), size
accounting for the bytes-up/bytes-down counters, stacking, and the one tree-path serialisation
(:func:`to_named_arrays` / :func:`from_named_arrays`) that checkpoints, ``model.npz`` and the
Flower codec share: every leaf is stored under its tree path (``"Dense_0/kernel"``), typed PRNG
keys as their key data under ``"<path>#key"``.
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
    "KEY_SUFFIX",
    "from_named_arrays",
    "is_prng_key",
    "leaf_name",
    "path_key",
    "to_named_arrays",
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


# ----- tree-path serialisation ------------------------------------------------------------------

KEY_SUFFIX = "#key"
"""Appended to a typed PRNG key's name: the stored array is its raw key data."""


def path_key(path: Sequence[Any]) -> str:
    """A leaf's tree path as ``/``-joined names: dict keys, attribute names, sequence indices.

    ``{"Dense_0": {"kernel": w}}``'s leaf is ``"Dense_0/kernel"``; a NamedTuple field is its name,
    a list or tuple element its index; a tree that is one leaf has the empty path ``""``.
    """
    parts = []
    for p in path:
        for attr in ("key", "name", "idx"):
            if hasattr(p, attr):
                parts.append(str(getattr(p, attr)))
                break
        else:
            parts.append(str(p))
    return "/".join(parts)


def is_prng_key(leaf: Any) -> bool:
    """Whether ``leaf`` (an array or a ``jax.ShapeDtypeStruct``) holds typed PRNG keys."""
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def leaf_name(path: Sequence[Any], leaf: Any) -> str:
    """The stored name of one leaf: its :func:`path_key` (``"."`` for the root), plus
    :data:`KEY_SUFFIX` for a typed PRNG key."""
    name = path_key(path) or "."
    return name + KEY_SUFFIX if is_prng_key(leaf) else name


def to_named_arrays(tree: PyTree, prefix: str = "") -> dict[str, np.ndarray]:
    """``{name: host array}`` for every leaf of ``tree`` (:func:`leaf_name`; PRNG keys as their
    key data), each name under ``prefix/`` when ``prefix`` is given.

    Raises:
      ValueError: two leaves share a name (e.g. a dict key ``"a/b"`` beside ``{"a": {"b": ...}}``).
    """
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = leaf_name(path, leaf)
        name = f"{prefix}/{name}" if prefix else name
        if name in out:
            raise ValueError(f"two leaves share the name {name!r}")
        out[name] = np.asarray(jax.random.key_data(leaf) if is_prng_key(leaf) else leaf)
    return out


def _stored_spec(leaf: Any) -> tuple[tuple[int, ...], np.dtype]:
    if is_prng_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return _shape_dtype(leaf)


def _key_impl(leaf: Any):
    return jax.random.key_impl(leaf) if isinstance(leaf, jax.Array) else leaf.dtype._impl


def from_named_arrays(arrays: Any, template: PyTree, prefix: str = "", error: type[Exception] = ValueError, read=np.asarray) -> PyTree:
    """The pytree of ``template``'s structure from ``arrays`` (a mapping of names to arrays, as
    :func:`to_named_arrays` writes it), after checking that the names under ``prefix/`` are exactly
    the template's and that each array has the template leaf's shape and dtype (``template``:
    arrays or ``jax.ShapeDtypeStruct``\\ s). PRNG keys are rewrapped with the template's
    implementation; other leaves are returned as ``read(stored)`` (host arrays).

    Raises:
      error: with a one-line message naming the first missing or unexpected name, or the first
        wrong shape or dtype; a ``read`` failure too ("cannot be read").
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    head = f"{prefix}/" if prefix else ""
    names = [head + leaf_name(p, leaf) for p, leaf in flat]
    have = {k for k in arrays.keys() if k.startswith(head)}
    missing = [n for n in names if n not in have]
    if missing:
        raise error(f"missing array {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(have - set(names))
    if extra:
        raise error(f"unexpected array {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    leaves = []
    for name, (_, leaf) in zip(names, flat):
        try:
            a = read(arrays[name])
        except Exception as exc:  # a damaged buffer: readers raise various errors
            raise error(f"array {name!r} cannot be read: {' '.join(str(exc).split())}") from None
        shape, dtype = _stored_spec(leaf)
        if a.shape != shape:
            raise error(f"array {name!r} has shape {a.shape}, expected {shape}")
        if a.dtype != dtype:
            raise error(f"array {name!r} has dtype {a.dtype}, expected {dtype}")
        leaves.append(jax.random.wrap_key_data(a, impl=_key_impl(leaf)) if is_prng_key(leaf) else a)
    return jax.tree_util.tree_unflatten(treedef, leaves)
