"""Client batching: exact step counts, every example once per epoch, partial last batch masked."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.data.batches import ClientData, get_batch, layout_orders, num_local_steps, size_class


@functools.partial(jax.jit, static_argnums=(3, 4))
def _all_batches(order, offset, n, batch, max_steps):
    x = jnp.arange(5000, dtype=jnp.float32)
    data = ClientData(x, x, order, offset, n)
    xb, _, mb = jax.vmap(lambda s: get_batch(data, s, batch))(jnp.arange(max_steps))
    return xb, mb


@given(
    sizes=st.lists(st.integers(1, 60), min_size=1, max_size=4),
    batch=st.sampled_from([1, 5, 16, 64]),
    epochs=st.sampled_from([1, 3]),
    seed=st.integers(0, 99),
)
def test_each_client_sees_each_example_once_per_epoch(sizes, batch, epochs, seed):
    starts = np.cumsum([0] + sizes[:-1]) + 100
    positions = [np.arange(s, s + n) for s, n in zip(starts, sizes)]
    ids = list(range(len(sizes)))
    order, offsets, used = layout_orders(seed, 3, ids, positions, epochs, batch)
    assert used == epochs * sum(sizes) and len(order) >= used + batch
    max_steps = epochs * -(-max(sizes) // batch)
    for k, n in enumerate(sizes):
        xb, mb = _all_batches(jnp.asarray(order), jnp.int32(offsets[k]), jnp.int32(n), batch, max_steps)
        xb, mb = np.asarray(xb), np.asarray(mb)
        spe = -(-n // batch)
        assert int(num_local_steps(n, batch, epochs)) == epochs * spe
        for e in range(epochs):
            seen = []
            for b in range(spe):
                m = mb[e * spe + b]
                # only the last batch of an epoch may be partial
                assert m.sum() == (batch if b < spe - 1 else n - batch * (spe - 1))
                seen.extend(xb[e * spe + b][m > 0].astype(int).tolist())
            assert sorted(seen) == positions[k].tolist()


def test_shuffles_depend_on_client_round_and_seed_only():
    pos = [np.arange(50), np.arange(50, 90)]
    a, off_a, _ = layout_orders(0, 5, [3, 7], pos, 2, 8)
    b, off_b, _ = layout_orders(0, 5, [7, 3], pos[::-1], 2, 8)  # other cohort order
    np.testing.assert_array_equal(a[:100], b[off_b[1] : off_b[1] + 100])  # client 3 unchanged
    c, _, _ = layout_orders(0, 6, [3, 7], pos, 2, 8)
    assert not np.array_equal(a[:50], c[:50])  # next round reshuffles
    assert not np.array_equal(a[:50], a[50:100])  # epochs differ


def test_padding_slots_take_no_room():
    order, offsets, used = layout_orders(0, 0, [2, -1, 4], [np.arange(10), np.zeros(0, np.int64), np.arange(10, 13)], 1, 4)
    assert used == 13 and offsets.tolist() == [0, 10, 10]


@given(st.integers(1, 10**7))
def test_size_classes_pad_at_most_20_percent(n):
    c = size_class(n, minimum=1)
    assert c >= n and (c - n) / c <= 0.2 + 1e-12 or c <= 8


def test_numpy_streams_of_a_run_are_distinct():
    """Cohort sampling, shuffles, subsample and partition use different seed sequences (numpy
    drops trailing zeros of a seed list, so [s, 1, 0] would equal [s, 1])."""
    from fedbayes.data.batches import client_rng
    from fedbayes.protocol import cohort_rng

    seed = 0
    streams = {
        "subsample": np.random.default_rng([seed, 1]),
        "partition": np.random.default_rng([seed, 2]),
        "cohort r1": cohort_rng(seed, 1),
        "cohort r2": cohort_rng(seed, 2),
        "shuffle r1 c0": client_rng(seed, 1, 0),
        "shuffle r2 c0": client_rng(seed, 2, 0),
        "shuffle r0 c1": client_rng(seed, 0, 1),
    }
    draws = {k: tuple(g.integers(0, 2**31, 4)) for k, g in streams.items()}
    assert len(set(draws.values())) == len(draws)
