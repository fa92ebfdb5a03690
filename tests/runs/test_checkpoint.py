"""Checkpoints: atomic, restore exactly, ignore torn temporary files, check structure."""

import numpy as np
import pytest

from fedbayes.runs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from fedbayes.protocol import SimState


def _state(r, v=1.0):
    server = {"w": np.full((3, 2), v, np.float32), "opt": (np.int32(r),)}
    clients = {"dual": np.arange(12, dtype=np.float32).reshape(4, 3) * v}
    return SimState(r, server, clients)


def test_round_trip_and_keep_newest(tmp_path):
    for r in (2, 4, 6):
        save_checkpoint(tmp_path, _state(r, float(r)), {"counters": {"seconds": 1.5}}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["round_000004.npz", "round_000006.npz"]
    state, meta = load_checkpoint(latest_checkpoint(tmp_path), _state(0))
    assert state.round == 6 and meta["counters"]["seconds"] == 1.5
    np.testing.assert_array_equal(state.server_state["w"], np.full((3, 2), 6.0))
    np.testing.assert_array_equal(state.client_states["dual"], np.arange(12).reshape(4, 3) * 6.0)
    state.client_states["dual"][0, 0] = 5.0  # restored client store is writable


def test_torn_temporary_files_are_ignored(tmp_path):
    save_checkpoint(tmp_path, _state(2), {})
    (tmp_path / "round_000004.npz.tmp").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "round_000002.npz"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_structure_mismatch_is_a_clear_error(tmp_path):
    path = save_checkpoint(tmp_path, _state(2), {})
    other = SimState(0, {"w": np.zeros((3, 2), np.float32)}, {"dual": np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError, match="server arrays"):
        load_checkpoint(path, other)
    wrong_shape = SimState(0, {"w": np.zeros((2, 2), np.float32), "opt": (np.int32(0),)}, {"dual": np.zeros((4, 3), np.float32)})
    with pytest.raises(ValueError, match="shape"):
        load_checkpoint(path, wrong_shape)


def test_typed_prng_keys_round_trip_and_dtypes_are_checked(tmp_path):
    import jax

    key = jax.random.key(3)
    state = SimState(1, {"w": np.ones(2, np.float32), "key": key}, ())
    path = save_checkpoint(tmp_path, state, {})
    restored, _ = load_checkpoint(path, SimState(0, {"w": np.zeros(2, np.float32), "key": jax.random.key(0)}, ()))
    assert jax.dtypes.issubdtype(restored.server_state["key"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(restored.server_state["key"]), jax.random.key_data(key))
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(path, SimState(0, {"w": np.zeros(2, np.float64), "key": jax.random.key(0)}, ()))
