"""The round protocol (fedbayes.protocol): cohorts, keys and streams, weights, the server step and
the end of a round, apart from any runner."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes import protocol
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.data.batches import layout_orders
from fedbayes.errors import DivergedError
from fedbayes.inference.sgd import LocalTrainer


# ----- cohorts -----------------------------------------------------------------------------------
def test_floyd_sampling_is_uniform_over_subsets():
    rng = np.random.default_rng(0)
    counts = Counter(tuple(protocol.sample_without_replacement(rng, 6, 3)) for _ in range(20000))
    assert len(counts) == 20  # every 3-subset of 6 occurs
    chi2 = sum((c - 1000) ** 2 / 1000 for c in counts.values())
    assert chi2 < 43.8  # chi-square, 19 degrees of freedom, p = 0.001


def test_cohorts_are_sorted_distinct_and_seeded():
    a = [protocol.sample_cohort(3, r, 50, 7) for r in range(20)]
    for c in a:
        assert len(set(c.tolist())) == 7 and np.all(np.diff(c) > 0) and c.min() >= 0 and c.max() < 50
    for r, c in enumerate(a):
        np.testing.assert_array_equal(c, protocol.sample_cohort(3, r, 50, 7))
    assert len({tuple(c) for c in a}) > 1
    np.testing.assert_array_equal(protocol.sample_cohort(3, 0, 9, 9), np.arange(9))  # M = K: everyone


# ----- keys and streams: a client's randomness is its own ----------------------------------------
def test_client_keys_depend_on_seed_round_and_client_only():
    k = protocol.client_key(0, 4, 17)
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(jax.random.fold_in(protocol.client_round_key(0, 4), 17)))
    traced = jax.jit(protocol.client_key)(0, jnp.int32(4), jnp.int32(17))  # traceable round and client
    np.testing.assert_array_equal(jax.random.key_data(k), jax.random.key_data(traced))
    others = [protocol.client_key(1, 4, 17), protocol.client_key(0, 5, 17), protocol.client_key(0, 4, 18), protocol.server_key(0, 4)]
    for o in others:
        assert not np.array_equal(jax.random.key_data(k), jax.random.key_data(o))


def test_a_clients_shuffles_do_not_depend_on_its_cohort():
    """Client 5's epoch shuffles are the same alone, in a cohort, after other clients or with
    padding slots: its stream is seeded by (seed, round, client) only."""
    positions = {c: np.arange(10 * c, 10 * c + 6 + c) for c in (2, 5, 9)}

    def orders_of(cohort, client):
        slots = list(cohort)
        order, offsets, _ = layout_orders(0, 3, slots, [positions[c] if c >= 0 else np.zeros(0, np.int64) for c in slots], 2, 4)
        i = slots.index(client)
        return order[offsets[i] : offsets[i] + 2 * len(positions[client])]  # its two epochs (a last batch reads past them, masked)

    alone = orders_of([5], 5)
    for cohort in ([2, 5], [9, 5, 2], [-1, 5, -1, 9]):
        np.testing.assert_array_equal(orders_of(cohort, 5), alone)
    a, b = protocol.shuffle_rng(0, 3, 5).permutation(20), protocol.shuffle_rng(0, 3, 5).permutation(20)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, protocol.shuffle_rng(0, 3, 6).permutation(20))


# ----- weights -----------------------------------------------------------------------------------
def test_client_weights():
    n = np.array([5, 0, 12], np.int32)
    w = protocol.client_weights(n, "examples")
    assert isinstance(w, np.ndarray) and w.dtype == np.float32
    np.testing.assert_array_equal(w, [5.0, 0.0, 12.0])
    np.testing.assert_array_equal(protocol.client_weights(n, "uniform"), [1.0, 0.0, 1.0])
    wj = protocol.client_weights(jnp.asarray(n), "uniform")
    assert isinstance(wj, jax.Array) and wj.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(wj), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="weighting must be one of examples, uniform"):
        protocol.client_weights(n, "bogus")


# ----- the server step ---------------------------------------------------------------------------
def _fedavgm():
    trainer = LocalTrainer(lambda p, k, x, y, m: jnp.sum(p["w"]), optax.sgd(1.0), 1, 4)
    algo = fedavg(trainer, optax.sgd(1.0, momentum=0.9))
    params = {"w": jnp.arange(3, dtype=jnp.float32)}
    return algo, algo.server_init(protocol.server_init_key(0), params)


def test_server_step_with_zero_weights_accepts_nothing():
    algo, state = _fedavgm()
    messages = {"w": jnp.ones((4, 3), jnp.float32)}
    _, ok, info = protocol.server_step(protocol.server_key(0, 0), algo, state, messages, jnp.zeros(4))
    assert not np.asarray(ok).any() and int(info["num_accepted"]) == 0
    _, ok, info = protocol.server_step(protocol.server_key(0, 0), algo, state, messages, jnp.array([1.0, 0.0, 2.0, 0.0]))
    assert np.asarray(ok).tolist() == [True, False, True, False] and int(info["num_accepted"]) == 2


def test_server_step_rejects_what_message_ok_rejects():
    algo, state = _fedavgm()
    messages = {"w": jnp.array([[1.0, 2.0, 3.0], [jnp.nan, 0.0, 0.0]], jnp.float32)}
    new, ok, _ = protocol.server_step(protocol.server_key(0, 0), algo, state, messages, jnp.ones(2))
    assert np.asarray(ok).tolist() == [True, False]
    # the rejected message has weight zero: the step equals one with the first message alone
    alone, _, _ = protocol.server_step(protocol.server_key(0, 0), algo, state, {"w": messages["w"][:1]}, jnp.ones(1))
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(alone)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----- the end of a round ------------------------------------------------------------------------
def _finish(accepted, rejected, fail_fast=False):
    old, new = {"w": np.zeros(2)}, {"w": np.ones(2)}
    return (
        old,
        new,
        protocol.finish_round(
            old,
            new,
            np.asarray(accepted, np.bool_),
            round_idx=7,
            cohort=np.array([1, 4, 6]),
            rejected=np.asarray(rejected, np.int64),
            fail_fast=fail_fast,
            bytes_up=30,
            bytes_down=60,
            server={"num_accepted": int(np.sum(accepted))},
        ),
    )


def test_finish_round_keeps_the_server_state_when_nothing_was_accepted():
    old, new, (state, info) = _finish([True, False, True], [4])
    assert state is new
    assert info.round == 7 and info.cohort.tolist() == [1, 4, 6] and info.rejected.tolist() == [4]
    assert (info.bytes_up, info.bytes_down, info.padding_waste, info.step_waste) == (30, 60, 0.0, 0.0)
    assert info.server == {"num_accepted": 2} and info.clients is None and info.dropped is None and info.late is None
    old, new, (state, info) = _finish([False, False, False], [1, 4, 6])
    assert state is old  # nothing was learned
    assert info.rejected.tolist() == [1, 4, 6]
    old, new, (state, _) = _finish([False, False, False], [])  # every client dropped or missing
    assert state is old


def test_finish_round_fail_fast_raises_on_a_rejected_message_only():
    _, new, (state, _) = _finish([True, True, True], [], fail_fast=True)
    assert state is new
    with pytest.raises(DivergedError, match=r"^round 7: client messages rejected .* from clients \[4, 6\] \(server.fail_fast\)$"):
        _finish([True, False, False], [4, 6], fail_fast=True)


def test_keep_unless_accepted_selects_per_leaf_bit_for_bit():
    old = {"w": jnp.array([1.0, 2.0]), "n": jnp.int32(3), "key": jax.random.key(1)}
    new = {"w": jnp.array([0.1, jnp.nan]), "n": jnp.int32(4), "key": jax.random.key(2)}
    select = jax.jit(protocol.keep_unless_accepted)
    kept = select(jnp.array([False, False]), new, old)
    took = select(jnp.array([False, True]), new, old)
    for got, want in ((kept, old), (took, new)):
        np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
        assert got["n"].dtype == want["n"].dtype and int(got["n"]) == int(want["n"])
        np.testing.assert_array_equal(jax.random.key_data(got["key"]), jax.random.key_data(want["key"]))


# ----- message shapes ----------------------------------------------------------------------------
def test_message_templates_give_the_shapes_of_a_rounds_messages():
    from fedbayes.sim.simulator import client_data_template

    algo, state = _fedavgm()
    params = {"w": jnp.arange(3, dtype=jnp.float32)}
    data = client_data_template((4,), jnp.float32, jnp.int32, epochs=2, batch_size=8)
    assert data.x.shape == (8, 4) and data.y.shape == (8,) and data.order.shape[0] >= 2 * 8 + 8
    t = protocol.message_templates(algo, params, data)
    spec = lambda tree: jax.tree.map(lambda a: (a.shape, a.dtype), tree)  # noqa: E731
    assert spec(t.broadcast) == spec(t.message) == {"w": ((3,), jnp.float32)}
    assert set(t.info) and all(isinstance(v, jax.ShapeDtypeStruct) for v in jax.tree.leaves(t.info))
    assert spec(protocol.message_templates(algo, None, data, server_state=state, client_state=()).message) == spec(t.message)
    only = protocol.message_templates(algo, params)  # what a node decodes the broadcast against
    assert spec(only.broadcast) == spec(t.broadcast) and only.message is None and only.info is None
