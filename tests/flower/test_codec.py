"""fedbayes.flower.codec: pytrees to Flower's ``ArrayRecord`` and back by tree path, checked on
decode; small arrays inline in a ``ConfigRecord``. Needs the flower extra (Flower's record types),
no Flower process."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from flwr.app import Array, ConfigRecord, RecordDict  # noqa: E402

from fedbayes.flower.codec import INLINE_BYTES, PACKED, MalformedMessage, decode, encode, leaf_names, pack, packed, put, take, unpack  # noqa: E402

pytestmark = pytest.mark.flower


def test_codec_round_trip_keeps_names_shapes_dtypes_and_keys():
    tree = {
        "mean": {"Dense_0": {"kernel": jnp.ones((3, 2)), "bias": jnp.zeros(2)}},
        "count": jnp.int32(4),
        "key": jax.random.key(7),
        "flags": np.array([True, False]),
    }
    record = encode(tree)
    assert list(record.keys()) == [PACKED]  # one Array for the whole tree: few objects in transit
    assert set(unpack(record)) == set(leaf_names(tree)) == {"mean/Dense_0/kernel", "mean/Dense_0/bias", "count", "key#key", "flags"}
    back = decode(record, tree)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back)):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(jax.random.key_data(a), jax.random.key_data(b))
        else:
            assert np.asarray(b).shape == np.shape(a) and np.asarray(b).dtype == np.asarray(a).dtype
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


@pytest.mark.parametrize(
    "corrupt, words",
    [
        (lambda r: r.pop("b"), "missing array 'b'"),
        (lambda r: r.__setitem__("c", np.zeros(1, np.float32)), "unexpected array 'c'"),
        (lambda r: r.__setitem__("a", np.zeros((2, 3), np.float32)), "array 'a' has shape (2, 3), expected (3, 2)"),
        (lambda r: r.__setitem__("a", np.zeros((3, 2), np.float64)), "array 'a' has dtype float64, expected float32"),
    ],
)
def test_codec_rejects_a_record_that_does_not_match(corrupt, words):
    template = {"a": np.zeros((3, 2), np.float32), "b": np.zeros((), np.int32)}
    arrays = unpack(encode(template))
    corrupt(arrays)
    with pytest.raises(MalformedMessage, match=words.replace("(", r"\(").replace(")", r"\)")):
        decode(pack(arrays), template)


def test_codec_rejects_a_damaged_packed_buffer_in_one_line():
    record = encode({"a": np.ones(3, np.float32)})
    record[PACKED] = Array(record[PACKED].numpy()[:-7])
    with pytest.raises(MalformedMessage, match="the packed arrays cannot be read"):
        decode(record, {"a": np.zeros(3, np.float32)})


def test_small_arrays_travel_inline_in_the_config_record_and_large_ones_as_a_packed_record():
    small = {"a": np.arange(6, dtype=np.float32).reshape(3, 2)}
    content = RecordDict({"meta": ConfigRecord({"n": 1})})
    put(content, "reply", packed(small), "meta")
    assert list(content.keys()) == ["meta"] and isinstance(content.config_records["meta"]["reply"], bytes)  # one object a hop
    np.testing.assert_array_equal(take(content, "reply", "meta")["a"], small["a"])
    large = {"a": np.zeros(INLINE_BYTES // 4 + 1, np.float32)}  # over Flower's chunk size
    content = RecordDict({"meta": ConfigRecord({"n": 1})})
    put(content, "reply", packed(large), "meta")
    assert "reply" not in content.config_records["meta"] and list(content.array_records["reply"].keys()) == [PACKED]
    assert take(content, "reply", "meta")["a"].shape == large["a"].shape
    with pytest.raises(MalformedMessage, match="the message has no 'reply' arrays"):
        take(RecordDict({"meta": ConfigRecord({"n": 1})}), "reply", "meta")
    damaged = RecordDict({"meta": ConfigRecord({"reply": packed(small)[:-7]})})
    with pytest.raises(MalformedMessage, match="the packed arrays cannot be read"):
        take(damaged, "reply", "meta")


def test_structured_gaussian_messages_round_trip_exactly():
    """A dense (full-covariance), a low-rank-plus-diagonal, a last-layer and a shared-basis
    low-rank Gaussian message travel as any pytree: the [D, D] precision, the factors, the blocks,
    the core and the sketch come back bit for bit, and a precision of another shape is refused."""
    from fedbayes import gaussian_block, gaussian_full, gaussian_lowrank
    from fedbayes.gaussian import DiagGaussian

    mean = {"dense": {"kernel": jnp.arange(6.0).reshape(3, 2), "bias": jnp.ones(2)}}
    d = 8
    a = jax.random.normal(jax.random.key(0), (d, d))
    full = gaussian_full.FullGaussian(precision_mean=mean, precision=a @ a.T + jnp.eye(d))
    diag = DiagGaussian(precision_mean=mean, precision=jax.tree.map(lambda m: jnp.full_like(m, 2.0), mean))
    low = gaussian_lowrank.from_diag(diag, rank=2)
    net = {"hidden_0": {"kernel": jnp.ones((2, 3)), "bias": jnp.zeros(3)}, **{"output": mean["dense"]}}
    block = gaussian_block.BlockGaussian(net, gaussian_block.scaled_identity(net, 2.0))
    from fedbayes import gaussian_subspace
    from fedbayes.algorithms.sites import GaussianMessage

    # the low-rank structure in a shared basis: coordinates, a validity flag and the [D, r] sketch
    core = gaussian_subspace.SubspaceGaussian(mean, gaussian_subspace.SubspacePrecision(diag.precision, jnp.eye(2) * 3.0))
    shared = GaussianMessage(core, jnp.asarray(True), None, jax.random.normal(jax.random.key(1), (8, 2)))
    for message in (full, low, block, shared):
        back = decode(encode(message), message)
        assert type(back) is type(message)
        for x, y in zip(jax.tree.leaves(message), jax.tree.leaves(back), strict=True):
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    other = gaussian_full.FullGaussian(precision_mean=mean, precision=jnp.eye(d + 1))
    with pytest.raises(MalformedMessage):
        decode(encode(other), full)
