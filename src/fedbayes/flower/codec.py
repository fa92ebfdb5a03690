"""Pytrees to Flower's ``ArrayRecord`` and back, keyed by tree path, checked on decode.

A message (a broadcast, a client's reply, a client state) is a pytree of arrays: parameters,
natural-parameter Gaussians, optimizer states, PRNG keys. :func:`encode` writes each leaf under
its tree path (``"mean/Dense_0/kernel"``, :func:`fedbayes.tree.to_named_arrays`, as checkpoints and
``model.npz`` name them; PRNG keys as their key data under ``"<path>#key"``). :func:`decode` rebuilds the pytree of a *template* (the
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

from fedbayes import tree as tree_lib
from fedbayes.tree import KEY_SUFFIX

__all__ = ["KEY_SUFFIX", "MalformedMessage", "decode", "encode", "leaf_names", "to_arrays"]


class MalformedMessage(ValueError):
    """A record that does not have the expected names, shapes or dtypes."""


def leaf_names(tree: Any) -> list[str]:
    """The names :func:`encode` gives ``tree``'s leaves, in leaf order."""
    return [tree_lib.leaf_name(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def to_arrays(tree: Any) -> dict[str, np.ndarray]:
    """``{name: host array}`` of ``tree`` (PRNG keys as their key data): :func:`fedbayes.tree.to_named_arrays`."""
    return tree_lib.to_named_arrays(tree)


def encode(tree: Any) -> ArrayRecord:
    """``tree`` as an ``ArrayRecord``, one ``Array`` per leaf, named by its tree path."""
    return ArrayRecord({name: Array(np.array(a, order="C", copy=True)) for name, a in to_arrays(tree).items()})


def _read(value) -> np.ndarray:
    return value.numpy() if isinstance(value, Array) else np.asarray(value)


def decode(record: ArrayRecord | dict[str, np.ndarray], template: Any) -> Any:
    """The pytree of ``template``'s structure from ``record`` (an ``ArrayRecord`` or a dict of
    arrays), after checking names, shapes and dtypes against ``template`` (arrays or
    ``jax.ShapeDtypeStruct``\\ s): :func:`fedbayes.tree.from_named_arrays`.

    Raises:
      MalformedMessage: a missing or unexpected name, a wrong shape or dtype, an unreadable array.
    """
    return tree_lib.from_named_arrays(record, template, error=MalformedMessage, read=_read)
