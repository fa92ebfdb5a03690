"""Client batching: exact step counts, every example once per epoch, partial last batch masked."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.data.batches import ClientData, epoch_orders, get_batch, num_local_steps


@given(n=st.integers(1, 70), extra=st.integers(0, 30), batch=st.integers(1, 17), epochs=st.integers(1, 3))
def test_each_epoch_visits_every_example_once(n, extra, batch, epochs):
    n_max = n + extra
    pool = np.arange(500, 500 + n_max, dtype=np.int32)
    x = jnp.arange(1000, dtype=jnp.float32)
    data = ClientData(x, x, jnp.asarray(pool), jnp.int32(n))
    orders = epoch_orders(jax.random.key(n), data, epochs, batch)
    steps = int(num_local_steps(data.num_examples, batch, epochs))
    assert steps == epochs * -(-n // batch)
    spe = steps // epochs
    for e in range(epochs):
        seen = []
        for b in range(spe):
            xb, _, mb = get_batch(data, orders, jnp.int32(e * spe + b), batch)
            mb = np.asarray(mb)
            # only the last batch of an epoch may be partial
            assert mb.sum() == (batch if b < spe - 1 else n - batch * (spe - 1))
            seen.extend(np.asarray(xb)[mb > 0].astype(int).tolist())
        assert sorted(seen) == list(range(500, 500 + n))


def test_shuffles_differ_between_epochs_and_keys():
    x = jnp.arange(100, dtype=jnp.float32)
    data = ClientData(x, x, jnp.arange(100, dtype=jnp.int32), jnp.int32(100))
    o = np.asarray(epoch_orders(jax.random.key(0), data, 2, 10))
    o2 = np.asarray(epoch_orders(jax.random.key(1), data, 2, 10))
    assert not np.array_equal(o[0], o[1])
    assert not np.array_equal(o[0], o2[0])
