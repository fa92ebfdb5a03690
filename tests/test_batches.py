"""Client batching: exact step counts, every example once per epoch, partial last batch masked."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.data.batches import ClientData, epoch_orders, get_batch, num_local_steps


N_MAX = 64  # fixed padded length: hypothesis varies the traced size n, so programs compile once


@functools.partial(jax.jit, static_argnums=(2, 3))
def _all_batches(key, n, batch, epochs):
    x = jnp.arange(1000, dtype=jnp.float32)
    data = ClientData(x, x, jnp.arange(500, 500 + N_MAX, dtype=jnp.int32), n)
    orders = epoch_orders(key, data, epochs, batch)
    max_steps = epochs * -(-N_MAX // batch)
    xb, _, mb = jax.vmap(lambda s: get_batch(data, orders, s, batch))(jnp.arange(max_steps))
    return xb, mb, num_local_steps(n, batch, epochs)


@given(n=st.integers(1, N_MAX), batch=st.sampled_from([1, 5, 16, 64]), epochs=st.sampled_from([1, 3]), seed=st.integers(0, 99))
def test_each_epoch_visits_every_example_once(n, batch, epochs, seed):
    xb, mb, steps = _all_batches(jax.random.key(seed), jnp.int32(n), batch, epochs)
    xb, mb, steps = np.asarray(xb), np.asarray(mb), int(steps)
    spe = -(-n // batch)
    assert steps == epochs * spe
    for e in range(epochs):
        seen = []
        for b in range(spe):
            m = mb[e * spe + b]
            # only the last batch of an epoch may be partial
            assert m.sum() == (batch if b < spe - 1 else n - batch * (spe - 1))
            seen.extend(xb[e * spe + b][m > 0].astype(int).tolist())
        assert sorted(seen) == list(range(500, 500 + n))


def test_shuffles_differ_between_epochs_and_keys():
    x = jnp.arange(100, dtype=jnp.float32)
    data = ClientData(x, x, jnp.arange(100, dtype=jnp.int32), jnp.int32(100))
    o = np.asarray(epoch_orders(jax.random.key(0), data, 2, 10))
    o2 = np.asarray(epoch_orders(jax.random.key(1), data, 2, 10))
    assert not np.array_equal(o[0], o[1])
    assert not np.array_equal(o[0], o2[0])
