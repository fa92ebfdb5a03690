"""Pytrees to Flower's ``ArrayRecord`` and back, keyed by tree path, checked on decode.

A message (a broadcast, a client's reply, a client state) is a pytree of arrays: parameters,
natural-parameter Gaussians, optimizer states, PRNG keys. :func:`encode` names each leaf by its
tree path (``"mean/Dense_0/kernel"``, :func:`fedbayes.tree.to_named_arrays`, as checkpoints and
``model.npz`` name them; PRNG keys as their key data under ``"<path>#key"``) and packs all of
them into *one* ``Array`` (an uncompressed ``.npz`` in memory, under :data:`PACKED`): Flower
sends every ``Array`` as separate objects over several HTTP hops, so one array per leaf cost
two objects per leaf per hop. :func:`unpack` gives the named arrays back (``np.load``, no
pickles). :func:`decode` rebuilds the pytree of a *template* (the
structure the receiver expects) and checks that the record holds exactly the template's names,
each with the template's shape and dtype; anything else raises :class:`MalformedMessage` naming
the first difference. Values (NaN, a non-positive precision) are the algorithm's business
(``message_ok`` in :func:`fedbayes.protocol.server_step`), not the codec's.
"""

from __future__ import annotations

import io
from typing import Any

import jax
import numpy as np
from flwr.app import Array, ArrayRecord

from fedbayes import tree as tree_lib
from fedbayes.tree import KEY_SUFFIX

__all__ = ["KEY_SUFFIX", "PACKED", "MalformedMessage", "decode", "encode", "leaf_names", "pack", "to_arrays", "unpack"]

PACKED = "packed.npz"  # the one Array of a packed record


class MalformedMessage(ValueError):
    """A record that does not have the expected names, shapes or dtypes."""


def leaf_names(tree: Any) -> list[str]:
    """The names :func:`encode` gives ``tree``'s leaves, in leaf order."""
    return [tree_lib.leaf_name(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def to_arrays(tree: Any) -> dict[str, np.ndarray]:
    """``{name: host array}`` of ``tree`` (PRNG keys as their key data): :func:`fedbayes.tree.to_named_arrays`."""
    return tree_lib.to_named_arrays(tree)


def pack(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """``{name: array}`` as an ``ArrayRecord`` of one ``Array``: the arrays in an uncompressed ``.npz``."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return ArrayRecord({PACKED: Array(np.frombuffer(buffer.getvalue(), np.uint8))})


def unpack(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The named arrays of a record: a packed one's (:func:`pack`), or one ``Array`` per name."""
    if list(record.keys()) != [PACKED]:
        return {name: _read(value) for name, value in record.items()}
    try:
        with np.load(io.BytesIO(_read(record[PACKED]).tobytes()), allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except Exception as exc:  # a damaged buffer: zipfile and numpy raise various errors
        raise MalformedMessage(f"the packed arrays cannot be read: {' '.join(str(exc).split())}") from None


def encode(tree: Any) -> ArrayRecord:
    """``tree`` as an ``ArrayRecord``: its leaves named by tree path, packed into one ``Array``."""
    return pack(to_arrays(tree))


def _read(value) -> np.ndarray:
    return value.numpy() if isinstance(value, Array) else np.asarray(value)


def decode(record: ArrayRecord | dict[str, np.ndarray], template: Any) -> Any:
    """The pytree of ``template``'s structure from ``record`` (an ``ArrayRecord`` or a dict of
    arrays), after checking names, shapes and dtypes against ``template`` (arrays or
    ``jax.ShapeDtypeStruct``\\ s): :func:`fedbayes.tree.from_named_arrays`.

    Raises:
      MalformedMessage: a missing or unexpected name, a wrong shape or dtype, an unreadable array.
    """
    arrays = unpack(record) if isinstance(record, ArrayRecord) else record
    return tree_lib.from_named_arrays(arrays, template, error=MalformedMessage, read=_read)
