"""Pytrees to Flower's ``ArrayRecord`` and back, keyed by tree path, checked on decode.

A message (a broadcast, a client's reply, a client state) is a pytree of arrays: parameters,
natural-parameter Gaussians, optimizer states, PRNG keys. :func:`encode` writes each leaf under
its tree path (``"mean/Dense_0/kernel"``, :func:`fedbayes.runs.export.flatten`'s names; PRNG keys as
their key data under ``"<path>#key"``). :func:`decode` rebuilds the pytree of a *template* (the
structure the receiver expects) and checks that the record holds exactly the template's names,
each with the template's shape and dtype; anything else raises :class:`MalformedMessage` naming
the first difference. Values (NaN, a non-positive precision) are the algorithm's business
(``message_ok`` in :func:`fedbayes.protocol.server_step`), not the codec's.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flwr.app import Array, ArrayRecord

from fedbayes.runs.export import _path_key

__all__ = ["MalformedMessage", "decode", "encode", "leaf_names", "to_arrays"]

KEY_SUFFIX = "#key"


class MalformedMessage(ValueError):
    """A record that does not have the expected names, shapes or dtypes."""


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _name(path, leaf) -> str:
    name = _path_key(path) or "."
    return name + KEY_SUFFIX if _is_key(leaf) else name


def leaf_names(tree: Any) -> list[str]:
    """The names :func:`encode` gives ``tree``'s leaves, in leaf order."""
    return [_name(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def to_arrays(tree: Any) -> dict[str, np.ndarray]:
    """``{name: host array}`` of ``tree`` (PRNG keys as their key data)."""
    out: dict[str, np.ndarray] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = _name(path, leaf)
        if name in out:
            raise ValueError(f"two leaves share the name {name!r}")
        out[name] = np.asarray(jax.random.key_data(leaf) if _is_key(leaf) else leaf)
    return out


def encode(tree: Any) -> ArrayRecord:
    """``tree`` as an ``ArrayRecord``, one ``Array`` per leaf, named by its tree path."""
    return ArrayRecord({name: Array(np.array(a, order="C", copy=True)) for name, a in to_arrays(tree).items()})


def _spec(leaf) -> tuple[tuple[int, ...], np.dtype]:
    if _is_key(leaf):
        data = jax.eval_shape(jax.random.key_data, leaf)
        return tuple(data.shape), np.dtype(data.dtype)
    return tuple(np.shape(leaf)), np.dtype(leaf.dtype)


def _key_impl(leaf):
    return jax.random.key_impl(leaf) if isinstance(leaf, jax.Array) else leaf.dtype._impl


def decode(record: ArrayRecord | dict[str, np.ndarray], template: Any) -> Any:
    """The pytree of ``template``'s structure from ``record`` (an ``ArrayRecord`` or a dict of
    arrays), after checking names, shapes and dtypes against ``template`` (arrays or
    ``jax.ShapeDtypeStruct``\\ s).

    Raises:
      MalformedMessage: a missing or unexpected name, a wrong shape or dtype, an unreadable array.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    names = [_name(p, leaf) for p, leaf in flat]
    have = set(record.keys())
    missing = [n for n in names if n not in have]
    if missing:
        raise MalformedMessage(f"missing array {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(have - set(names))
    if extra:
        raise MalformedMessage(f"unexpected array {extra[0]!r}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
    leaves = []
    for name, (_, leaf) in zip(names, flat):
        value = record[name]
        try:
            a = value.numpy() if isinstance(value, Array) else np.asarray(value)
        except Exception as exc:  # a damaged buffer: Flower's deserialisation raises various errors
            raise MalformedMessage(f"array {name!r} cannot be read: {' '.join(str(exc).split())}") from None
        shape, dtype = _spec(leaf)
        if a.shape != shape:
            raise MalformedMessage(f"array {name!r} has shape {a.shape}, expected {shape}")
        if a.dtype != dtype:
            raise MalformedMessage(f"array {name!r} has dtype {a.dtype}, expected {dtype}")
        leaves.append(jax.random.wrap_key_data(a, impl=_key_impl(leaf)) if _is_key(leaf) else a)
    return jax.tree_util.tree_unflatten(treedef, leaves)
