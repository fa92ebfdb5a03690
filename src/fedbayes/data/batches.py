"""One client's data as the client update sees it: shuffled epochs laid out in a flat order buffer.

Features live on the device once (the whole training set, or the cohort's generated data for an
on-demand federation; docs/design.md "Put the training data on every device once"). The simulator
draws each client's shuffles on the host and lays the cohort out in one flat int32 buffer:
client k's ``E`` epochs, each a permutation of its ``n_k`` positions, one after the other from
``offset_k``. Client k takes exactly ``E * ceil(n_k / B)`` steps; step ``s`` of epoch
``e = s // ceil(n_k/B)`` reads ``B`` entries from ``offset_k + e * n_k + b * B`` and masks those
past ``n_k`` (the partial last batch). Nothing is padded per client: only the buffer's tail
(at least one batch, so that a slice never runs off the end).

A client's shuffles come from ``numpy.random.default_rng([seed, 12, round, client])``: they do not
depend on which other clients share its cohort, on the layout or on the device split.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.protocol import shuffle_rng


class ClientData(NamedTuple):
    """One client's data.

    Attributes:
      x: pooled features ``[N, *feature_shape]`` (shared by the cohort).
      y: pooled targets ``[N]``.
      order: the cohort's flat order buffer ``[L]`` int32 of positions in ``x`` (shared).
      offset: int32 scalar, where this client's epochs start in ``order``.
      num_examples: int32 scalar, the client's size ``n_k`` (0 for a padding slot).
    """

    x: jax.Array
    y: jax.Array
    order: jax.Array
    offset: jax.Array
    num_examples: jax.Array


# vmap axes: features, targets and the order buffer are shared; offsets and sizes are per client.
CLIENT_AXES = ClientData(x=None, y=None, order=None, offset=0, num_examples=0)


def steps_per_epoch(num_examples, batch_size: int):
    """``ceil(n_k / B)``: one step per (possibly partial) batch."""
    return (num_examples + batch_size - 1) // batch_size


def num_local_steps(num_examples, batch_size: int, num_epochs: int):
    """Total local steps of a client: ``E * ceil(n_k / B)``."""
    return num_epochs * steps_per_epoch(num_examples, batch_size)


def get_batch(data: ClientData, step: jax.Array, batch_size: int):
    """The ``step``-th local minibatch ``(x, y, mask)``; ``mask`` is float32 ``[batch_size]``."""
    spe = jnp.maximum(steps_per_epoch(data.num_examples, batch_size), 1)
    epoch, b = step // spe, step % spe
    start = data.offset + epoch * data.num_examples + b * batch_size
    pos = jax.lax.dynamic_slice(data.order, (start,), (batch_size,))
    mask = (b * batch_size + jnp.arange(batch_size)) < data.num_examples
    return data.x[pos], data.y[pos], mask.astype(jnp.float32)


def client_rng(seed: int, round_idx: int, client_id: int) -> np.random.Generator:
    """The host generator of one client's shuffles in one round (:func:`fedbayes.protocol.shuffle_rng`,
    where every stream's tag is kept)."""
    return shuffle_rng(seed, round_idx, client_id)


def size_class(n: int, minimum: int = 256) -> int:
    """Rounds ``n`` up to ``2^k * {1, 1.25, 1.5, 1.75}``: at most 20% padding, few distinct shapes."""
    n = max(int(n), minimum)
    top = 1 << (n - 1).bit_length()  # the power of two >= n
    for frac in (0.5, 0.625, 0.75, 0.875):
        if top * frac >= n:
            return int(top * frac)
    return top


def layout_orders(
    seed: int,
    round_idx: int,
    client_ids: Sequence[int],
    positions: Sequence[np.ndarray],
    num_epochs: int,
    batch_size: int,
    length: int | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Builds a cohort's order buffer on the host.

    Args:
      seed, round_idx: the run's seed and the round (with the client id they seed the shuffles).
      client_ids: the cohort's client ids (``-1`` marks a padding slot: no data).
      positions: each client's positions in the pooled features (empty for padding slots).
      num_epochs: epochs ``E`` laid out per client.
      batch_size: ``B``; the buffer keeps at least one batch of tail padding.
      length: the buffer length ``L`` (at least ``used + B``); default ``size_class(used + B)``.

    Returns:
      ``(order, offsets, used)``: the buffer ``[L]`` int32, per-client offsets ``[M]`` int32, and
      the number of used entries.
    """
    chunks, offsets, used = [], [], 0
    for cid, pos in zip(client_ids, positions):
        offsets.append(used)
        if cid < 0 or len(pos) == 0:
            continue
        rng = client_rng(seed, round_idx, int(cid))
        for _ in range(num_epochs):
            chunks.append(rng.permutation(pos))
        used += num_epochs * len(pos)
    if length is None:
        length = size_class(used + batch_size)
    if length < used + batch_size:
        raise ValueError(f"order buffer length {length} < used entries + batch size ({used} + {batch_size})")
    order = np.zeros(length, dtype=np.int32)
    if chunks:
        order[:used] = np.concatenate(chunks)
    return order, np.asarray(offsets, dtype=np.int32), used
