"""Device-side view of one client's data: padded index lists, per-epoch shuffles, masked batches.

The whole training set lives on the device once (DESIGN.md, "Put the training data on every
device once"); a client is a padded list of indices into it plus its true size ``num_examples``.
Client k takes exactly ``num_epochs * ceil(n_k / B)`` steps, the last batch of each epoch partial
(masked), with its own shuffle per epoch drawn from its own key. Padded positions never reach a
gradient: their mask is zero.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ClientData(NamedTuple):
    """One client's data as the client update sees it.

    Attributes:
      x: all training features on the device, ``[N, *feature_shape]`` (shared, not per client).
      y: all training targets, ``[N]``.
      indices: ``[n_max]`` int32 positions in ``x``; entries at or past ``num_examples`` are padding.
      num_examples: int32 scalar, the client's true size ``n_k``.
    """

    x: jax.Array
    y: jax.Array
    indices: jax.Array
    num_examples: jax.Array


# vmap axes: features and targets are shared by the cohort, indices and sizes are per client.
CLIENT_AXES = ClientData(x=None, y=None, indices=0, num_examples=0)


def steps_per_epoch(num_examples: jax.Array, batch_size: int) -> jax.Array:
    """``ceil(n_k / B)``: one step per (possibly partial) batch."""
    return (num_examples + batch_size - 1) // batch_size


def num_local_steps(num_examples: jax.Array, batch_size: int, num_epochs: int) -> jax.Array:
    """Total local steps of a client: ``E * ceil(n_k / B)``."""
    return num_epochs * steps_per_epoch(num_examples, batch_size)


def epoch_orders(key: jax.Array, data: ClientData, num_epochs: int, batch_size: int) -> jax.Array:
    """Per-epoch random orders of a client's valid positions, ``[num_epochs, padded_len]``.

    Each row lists the positions ``0..n_k-1`` in a random order first, then padding positions.
    Padding sorts last because it gets the key ``2 > any uniform draw``. Rows are padded to a
    multiple of ``batch_size`` so that every batch is a fixed-size slice.
    """
    n_max = data.indices.shape[0]
    padded_len = -(-n_max // batch_size) * batch_size
    positions = jnp.arange(padded_len)
    valid = positions < data.num_examples

    def one(k):
        u = jax.random.uniform(k, (padded_len,))
        return jnp.argsort(jnp.where(valid, u, 2.0)).astype(jnp.int32)

    return jax.vmap(one)(jax.random.split(key, num_epochs))


def get_batch(data: ClientData, orders: jax.Array, step: jax.Array, batch_size: int):
    """The ``step``-th local minibatch: ``(x, y, mask)`` with ``mask`` float32 ``[batch_size]``.

    Epoch ``e = step // ceil(n_k/B)`` and batch ``b = step % ceil(n_k/B)``; the batch is
    positions ``b*B .. b*B+B-1`` of epoch ``e``'s order, masked past ``n_k``.
    """
    spe = jnp.maximum(steps_per_epoch(data.num_examples, batch_size), 1)
    epoch, b = step // spe, step % spe
    start = b * batch_size
    pos = jax.lax.dynamic_slice(orders[epoch], (start,), (batch_size,))
    mask = (start + jnp.arange(batch_size)) < data.num_examples
    n_max = data.indices.shape[0]
    idx = data.indices[jnp.clip(pos, 0, n_max - 1)]
    return data.x[idx], data.y[idx], mask.astype(jnp.float32)
