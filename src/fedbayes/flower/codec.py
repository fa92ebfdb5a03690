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

A message's arrays travel *inline* where they are small (:func:`put`, :func:`take`): the packed
``.npz`` as a ``bytes`` value of the message's one ``ConfigRecord``. Flower sends an ``ArrayRecord``
as three objects (the record, its ``Array`` and each 5 MB chunk), each one HTTP request on every
hop, where a ``ConfigRecord`` is one object: a heavy-MLP round on loopback made 107 requests to
the SuperLink, 73 of them for objects, and the SuperLink spends about 4 ms of CPU on each
(docs/results/flower.md). Above Flower's chunk size (:data:`INLINE_BYTES`) the arrays go as a packed
``ArrayRecord``, chunked as Flower intends.
"""

from __future__ import annotations

import io
from typing import Any

import jax
import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

from fedbayes import tree as tree_lib
from fedbayes.flower.internals import chunk_size
from fedbayes.tree import KEY_SUFFIX

__all__ = [
    "INLINE_BYTES",
    "KEY_SUFFIX",
    "PACKED",
    "MalformedMessage",
    "decode",
    "encode",
    "leaf_names",
    "pack",
    "packed",
    "put",
    "take",
    "to_arrays",
    "unpack",
    "unpacked",
]

PACKED = "packed.npz"  # the one Array of a packed record
# Flower splits an Array into chunks of this size (5 MB in flwr 1.41 and 1.42, internals.chunk_size):
# larger arrays stay in an ArrayRecord so that no single object exceeds it
INLINE_BYTES = chunk_size()


class MalformedMessage(ValueError):
    """A record that does not have the expected names, shapes or dtypes."""


def leaf_names(tree: Any) -> list[str]:
    """The names :func:`encode` gives ``tree``'s leaves, in leaf order."""
    return [tree_lib.leaf_name(p, leaf) for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def to_arrays(tree: Any) -> dict[str, np.ndarray]:
    """``{name: host array}`` of ``tree`` (PRNG keys as their key data): :func:`fedbayes.tree.to_named_arrays`."""
    return tree_lib.to_named_arrays(tree)


def packed(arrays: dict[str, np.ndarray]) -> bytes:
    """``{name: array}`` as an uncompressed ``.npz`` in memory."""
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def pack(arrays: dict[str, np.ndarray] | bytes) -> ArrayRecord:
    """``{name: array}`` (or its :func:`packed` bytes) as an ``ArrayRecord`` of one ``Array``."""
    data = arrays if isinstance(arrays, bytes) else packed(arrays)
    return ArrayRecord({PACKED: Array(np.frombuffer(data, np.uint8))})


def unpacked(data: bytes) -> dict[str, np.ndarray]:
    """The named arrays of :func:`packed` bytes; a damaged buffer raises :class:`MalformedMessage`."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {name: z[name] for name in z.files}
    except Exception as exc:  # a damaged buffer: zipfile and numpy raise various errors
        raise MalformedMessage(f"the packed arrays cannot be read: {' '.join(str(exc).split())}") from None


def unpack(record: ArrayRecord) -> dict[str, np.ndarray]:
    """The named arrays of a record: a packed one's (:func:`pack`), or one ``Array`` per name."""
    if list(record.keys()) != [PACKED]:
        return {name: _read(value) for name, value in record.items()}
    return unpacked(_read(record[PACKED]).tobytes())


def put(content: RecordDict, name: str, data: bytes, config: str, inline: bool | None = None) -> None:
    """Puts :func:`packed` ``data`` into ``content`` under ``name``: inline, as a ``bytes`` value of
    the ``ConfigRecord`` ``content[config]`` (one object on every hop), when ``inline`` (default:
    at most :data:`INLINE_BYTES`), else as the packed ``ArrayRecord`` ``content[name]``."""
    if inline is None:
        inline = len(data) <= INLINE_BYTES
    if inline:
        content.config_records[config][name] = data
    else:
        content.array_records[name] = pack(data)


def take(content: RecordDict, name: str, config: str) -> dict[str, np.ndarray]:
    """The named arrays that :func:`put` put under ``name`` (inline or as a record)."""
    if name in content.array_records:
        return unpack(content.array_records[name])
    record = content.config_records.get(config)
    value = None if record is None else record.get(name)
    if not isinstance(value, bytes):
        raise MalformedMessage(f"the message has no {name!r} arrays")
    return unpacked(value)


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
