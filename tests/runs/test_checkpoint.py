"""Checkpoints: atomic, restore exactly, ignore torn temporary files, check structure."""

import numpy as np
import pytest
from helpers import DIGITS_RUN

from fedbayes.protocol import SimState
from fedbayes.runs.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


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


# ----- checkpoints of the first format (leaves keyed by flatten index) ---------------------------


def _digest(arrays):
    """The checkpoint format's checksum: SHA-256 over every entry's name, dtype, shape and bytes, in name order."""
    import hashlib

    h = hashlib.sha256()
    for k in sorted(arrays):
        if k == "checksum":
            continue
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def to_first_format(path, template):
    """Rewrites a checkpoint as fedbayes wrote it before tree paths (up to commit 97825e2): each
    tree's leaves keyed by their flatten index, ``server_00000``, ..., ``client_00000``, ... (a
    checkpoint written by 97825e2's save_checkpoint holds exactly these entries, checked by hand)."""
    import jax

    from fedbayes.tree import leaf_name

    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    old = {"meta": arrays.pop("meta")}
    arrays.pop("checksum")
    for k in [k for k in arrays if k.startswith("extra/")]:  # the first format carried no copies of the other files
        arrays.pop(k)
    for prefix, tree in (("server", template.server_state), ("client", template.client_states)):
        for i, (p, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
            old[f"{prefix}_{i:05d}"] = arrays.pop(f"{prefix}/{leaf_name(p, leaf)}")
    assert not arrays, sorted(arrays)
    old["checksum"] = np.frombuffer(_digest(old).encode(), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **old)


def test_a_checkpoint_of_the_first_format_still_loads(tmp_path):
    import jax

    state = SimState(
        3, {"w": np.full((3, 2), 1.5, np.float32), "opt": (np.int32(3), {"mu": np.ones(4, np.float32)}), "key": jax.random.key(7)}, _state(3).client_states
    )
    template = SimState(
        0, {"w": np.zeros((3, 2), np.float32), "opt": (np.int32(0), {"mu": np.zeros(4, np.float32)}), "key": jax.random.key(0)}, _state(0).client_states
    )
    path = save_checkpoint(tmp_path, state, {"counters": {"seconds": 1.0}})
    with np.load(path) as z:
        assert "server/w" in z.files and "server/key#key" in z.files and "client/dual" in z.files  # the tree-path format
    to_first_format(path, template)
    with np.load(path) as z:
        assert sorted(z.files) == ["checksum", "client_00000", "meta", "server_00000", "server_00001", "server_00002", "server_00003"]
    restored, meta = load_checkpoint(path, template)
    assert restored.round == 3 and meta["counters"] == {"seconds": 1.0}
    np.testing.assert_array_equal(restored.server_state["w"], state.server_state["w"])
    np.testing.assert_array_equal(restored.server_state["opt"][1]["mu"], state.server_state["opt"][1]["mu"])
    assert restored.server_state["opt"][0] == 3
    np.testing.assert_array_equal(jax.random.key_data(restored.server_state["key"]), jax.random.key_data(state.server_state["key"]))
    np.testing.assert_array_equal(restored.client_states["dual"], state.client_states["dual"])
    with pytest.raises(ValueError, match="server arrays"):
        load_checkpoint(path, SimState(0, {"w": np.zeros((3, 2), np.float32)}, _state(0).client_states))


def test_a_run_resumed_from_a_checkpoint_of_the_first_format_ends_as_an_uninterrupted_run(tmp_path):
    """FedDyn (server and client states in memory): its round-2 checkpoint rewritten in the first
    format, the run resumed from it ends with the uninterrupted run's metrics and model."""
    import shutil

    from typer.testing import CliRunner

    from fedbayes.cli import app
    from fedbayes.config.schema import load_config
    from fedbayes.runs.build import build_experiment
    from fedbayes.runs.folder import read_metrics

    runner = CliRunner()
    cfg = tmp_path / "c.toml"
    cfg.write_text(DIGITS_RUN.format(rounds=4, top="", algorithm="feddyn", extra=""))
    ref, out = tmp_path / "ref", tmp_path / "out"
    assert runner.invoke(app, ["run", str(cfg), "--out", str(ref)]).exit_code == 0
    shutil.copytree(ref, out)
    (out / "checkpoints" / "round_000004.npz").unlink()
    (out / "summary.json").unlink()
    exp = build_experiment(load_config(cfg))
    to_first_format(out / "checkpoints" / "round_000002.npz", exp.simulator.init(exp.params))
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    strip = lambda records: [{k: v for k, v in r.items() if k != "seconds"} for r in records]  # noqa: E731
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(ref / "metrics.jsonl"))
    with np.load(out / "model.npz") as a, np.load(ref / "model.npz") as b:
        assert sorted(a.files) == sorted(b.files) and all(np.array_equal(a[k], b[k]) for k in a.files)


# ----- the tree-path names checkpoints, model.npz and the Flower codec share ---------------------


def test_tree_path_names_round_trip_and_are_checked():
    from typing import NamedTuple

    import jax

    from fedbayes import tree

    class State(NamedTuple):
        params: dict
        opt: tuple

    t = State({"Dense_0": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3, np.float32)}}, (np.int32(4), [np.ones(2)]))
    named = tree.to_named_arrays({"q": t, "key": jax.random.key(1)}, "server")
    assert sorted(named) == ["server/key#key", "server/q/opt/0", "server/q/opt/1/0", "server/q/params/Dense_0/bias", "server/q/params/Dense_0/kernel"]
    assert tree.to_named_arrays(np.ones(2)).keys() == {"."}  # a tree that is one leaf
    template = {"q": jax.tree.map(np.zeros_like, t), "key": jax.random.key(0)}
    back = tree.from_named_arrays(named, template, "server")
    assert jax.tree.structure(back) == jax.tree.structure(template)
    np.testing.assert_array_equal(back["q"].params["Dense_0"]["kernel"], np.ones((2, 3), np.float32))
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(jax.random.key(1)))
    shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), t)  # a template of shapes only
    assert jax.tree.structure(tree.from_named_arrays(tree.to_named_arrays(t), shapes)) == jax.tree.structure(t)
    with pytest.raises(ValueError, match="missing array 'server/q/opt/0'"):
        tree.from_named_arrays({k: v for k, v in named.items() if k != "server/q/opt/0"}, template, "server")
    with pytest.raises(ValueError, match="unexpected array 'server/extra'"):
        tree.from_named_arrays({**named, "server/extra": np.ones(1)}, template, "server")
    with pytest.raises(KeyError, match="has shape"):
        tree.from_named_arrays({**named, "server/q/opt/1/0": np.ones(3)}, template, "server", error=KeyError)
    with pytest.raises(ValueError, match="has dtype"):
        tree.from_named_arrays({**named, "server/q/opt/1/0": np.ones(2, np.float32)}, template, "server")
    with pytest.raises(ValueError, match="share the name"):
        tree.to_named_arrays({"a/b": np.ones(1), "a": {"b": np.ones(1)}})
