"""Client-state stores: memory and disk agree; the disk store is atomic per round, rolls back,
resumes a killed run exactly, and keeps peak memory at the cohort's size."""

import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import DIGITS_RUN, digits_federation, logreg_setup
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.algorithms.admm import admm
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.config.schema import validate
from fedbayes.protocol import SimState
from fedbayes.runs.build import build_experiment
from fedbayes.runs.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment
from fedbayes.sim.simulator import Simulator
from fedbayes.sim.store import ClientStore, DeviceStore, DiskStore, MemoryStore, as_store

ROOT = Path(__file__).resolve().parents[2]
SIZES = (37, 90, 213, 11, 150, 64)
DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int8, np.bool_)


def _all(store):
    return as_store(store).gather(np.arange(_num_clients(store)))


def _num_clients(store):
    return store.num_clients if isinstance(store, DiskStore) else len(jax.tree.leaves(store)[0])


def _assert_trees_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@st.composite
def _cases(draw):
    k = draw(st.integers(1, 9))
    shapes = draw(st.lists(st.lists(st.integers(0, 3), max_size=3).map(tuple), min_size=1, max_size=3))
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=len(shapes), max_size=len(shapes)))
    cohorts = draw(st.lists(st.lists(st.integers(0, k - 1), unique=True, max_size=k), min_size=1, max_size=3))
    return k, list(zip(shapes, dtypes)), cohorts, draw(st.integers(0, 2**16))


@given(_cases())
def test_gather_scatter_round_trip_in_both_stores(case):
    k, leaves, cohorts, seed = case
    rng = np.random.default_rng(seed)
    values = lambda shape, dtype: (rng.normal(size=shape) * 10).astype(dtype)  # noqa: E731
    template = {f"leaf{i}": values(shape, dtype) for i, (shape, dtype) in enumerate(leaves)}
    ref = {n: np.repeat(a[None], k, axis=0) for n, a in template.items()}
    with tempfile.TemporaryDirectory() as tmp:
        disk, mem = DiskStore.create(tmp, template, k, durable=False), MemoryStore.create(template, k)
        for r, ids in enumerate(cohorts):
            ids = np.array(ids, np.int64)
            rows = {n: values((len(ids), *a.shape), a.dtype) for n, a in template.items()}
            for n in ref:
                ref[n][ids] = rows[n]
            disk.scatter(ids, rows, r)
            mem = mem.scatter(ids, rows)
            probe = rng.integers(0, k, size=5)  # repeats allowed, as padding slots repeat client 0
            for store in (disk, mem):
                got = store.gather(probe, r + 1)
                for n in ref:
                    assert got[n].dtype == ref[n].dtype and got[n].shape == (5, *template[n].shape)
                    np.testing.assert_array_equal(got[n], ref[n][probe])
        assert disk.round == len(cohorts) and disk.undo_rounds() == list(range(len(cohorts)))
        disk.close()
        _assert_trees_equal(_all(DiskStore.open(tmp, template, k)), ref)


def test_memory_store_scatter_is_pure_unless_donated():
    store = MemoryStore.create({"w": np.zeros(3, np.float32)}, 4)
    new = store.scatter(np.array([2]), {"w": np.ones((1, 3), np.float32)})
    assert store.states["w"].sum() == 0 and new.states["w"][2].sum() == 3
    same = new.scatter(np.array([0]), {"w": np.ones((1, 3), np.float32)}, donate=True)
    assert same.states["w"] is new.states["w"] and new.states["w"].sum() == 6


def test_device_store_gathers_and_scatters_in_a_program_dropping_out_of_range_rows():
    host = MemoryStore.create({"w": np.zeros(3, np.float32), "n": np.int32(0)}, 5)
    sharding = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.local_devices()), ("clients",)), jax.sharding.PartitionSpec())
    store = DeviceStore.place(host.held, sharding)
    assert store.num_clients == 5 and DeviceStore.place(store.held, sharding).held["w"] is store.held["w"]  # placed once
    assert jax.tree.map(lambda a: (a.shape, a.dtype), store.row_spec()) == jax.tree.map(lambda a: (a.shape, a.dtype), host.row_spec())

    @jax.jit
    def step(states, ids, rows):
        return DeviceStore(states).scatter(ids, rows).held

    rows = {"w": jnp.ones((3, 3), jnp.float32), "n": jnp.array([7, 8, 9], jnp.int32)}
    new = DeviceStore(step(store.held, jnp.array([1, 5, 3]), rows))  # id 5 is out of range: dropped
    np.testing.assert_array_equal(np.asarray(new.held["n"]), [0, 7, 0, 9, 0])
    got = jax.jit(lambda states, ids: DeviceStore(states).gather(ids))(new.held, jnp.array([3, 3, 0]))
    np.testing.assert_array_equal(np.asarray(got["n"]), [9, 9, 0])
    assert np.asarray(got["w"]).sum() == 6
    assert isinstance(new, ClientStore) and isinstance(host, ClientStore)


def _admm_sim(fed, trainer, **kwargs):
    return Simulator(admm(trainer, optax.sgd(1.0), rho=0.1, num_clients=fed.num_clients), fed, clients_per_round=3, seed=3, **kwargs)


def test_disk_store_equals_memory_store_over_admm_rounds_and_replays_after_rollback(tmp_path):
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=1)
    # one simulator (one compile): run_round serves whichever store the state holds
    disk_sim = _admm_sim(fed, trainer, store="disk", store_dir=tmp_path / "store")
    mem, donated = _admm_sim(fed, trainer).init(params), _admm_sim(fed, trainer).init(params)
    disk = disk_sim.init(params)
    assert isinstance(disk.client_states, DiskStore) and not isinstance(mem.client_states, DiskStore)
    servers = {}
    for _ in range(4):
        mem, _ = disk_sim.run_round(mem)
        donated, _ = disk_sim.run_round(donated, donate=True)
        disk, _ = disk_sim.run_round(disk)
        servers[disk.round] = disk.server_state
        for other in (donated, disk):  # bit for bit: the same program on the same inputs
            _assert_trees_equal(other.server_state, mem.server_state)
            _assert_trees_equal(_all(other.client_states), mem.client_states)
    store = disk.client_states
    assert store.round == 4 and store.undo_rounds() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="holds round 4, the state asks for round 2"):
        disk_sim.run_round(SimState(2, servers[2], store))  # an older state cannot continue in place
    store.rollback(2)
    again = SimState(2, servers[2], store)
    for _ in range(2):
        again, _ = disk_sim.run_round(again)
    _assert_trees_equal(again.server_state, mem.server_state)
    _assert_trees_equal(_all(again.client_states), mem.client_states)


def test_store_arguments_are_checked_and_stateless_algorithms_need_no_files(tmp_path):
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=1)
    with pytest.raises(ValueError, match="store must be one of memory, disk"):
        _admm_sim(fed, trainer, store="cloud")
    with pytest.raises(ValueError, match="needs store_dir"):
        _admm_sim(fed, trainer, store="disk")
    sim = Simulator(fedavg(trainer, optax.sgd(1.0)), fed, clients_per_round=2, store="disk", store_dir=tmp_path / "s")
    assert sim.init(params).client_states == () and not (tmp_path / "s").exists()


def _filled_store(path, num_rounds, k=8):
    """A store after ``num_rounds`` random rounds, and its full contents at every round."""
    template = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(5, np.int32)}
    store = DiskStore.create(path, template, k)
    rng = np.random.default_rng(0)
    snapshots = [_all(store)]
    for r in range(num_rounds):
        ids = rng.choice(k, 3, replace=False)
        store.scatter(ids, _random_rows(rng, 3), r)
        snapshots.append(_all(store))
    return store, template, snapshots


def _random_rows(rng, n):
    return {"a": rng.normal(size=(n, 2, 3)).astype(np.float32), "b": rng.integers(-9, 9, (n, 5)).astype(np.int32)}


@pytest.mark.parametrize("crash", ["writing_undo_log", "after_undo_log", "mid_rows", "before_commit"])
def test_a_round_killed_at_any_point_is_undone_when_the_store_opens(tmp_path, crash):
    store, template, snapshots = _filled_store(tmp_path, 2)
    ids, rows = np.array([1, 4, 6]), _random_rows(np.random.default_rng(1), 3)
    # round 2, killed part-way: the steps of DiskStore.scatter, stopped where the process dies
    if crash == "writing_undo_log":
        (tmp_path / "undo_000002.bin.tmp").write_bytes(b"FBUNDO1\n torn")
    else:
        store.write_undo_log(2, ids)
        if crash == "mid_rows":  # two clients written, the third torn inside its first leaf
            store.write_rows(ids[:2], jax.tree.map(lambda a: a[:2], rows))
            with open(store.leaf_path(0), "r+b") as f:
                os.pwrite(f.fileno(), b"\xff" * 7, int(ids[2]) * store.row_bytes[0])
        elif crash == "before_commit":
            store.write_rows(ids, rows)
    del store
    reopened = DiskStore.open(tmp_path, template, 8)
    assert reopened.round == 2 and reopened.undo_rounds() == [0, 1]
    assert not list(tmp_path.glob("*.tmp"))
    _assert_trees_equal(_all(reopened), snapshots[2])
    reopened.scatter(ids, rows, 2)  # and the round can run again
    reopened.rollback(0)
    _assert_trees_equal(_all(reopened), snapshots[0])


def test_a_killed_rollback_finishes_when_the_store_opens(tmp_path, monkeypatch):
    store, template, snapshots = _filled_store(tmp_path, 4)
    real, applied = DiskStore.apply_undo_log, []

    def dies_on_second_log(self, r):
        if applied:
            raise OSError("killed")
        applied.append(r)
        real(self, r)

    monkeypatch.setattr(DiskStore, "apply_undo_log", dies_on_second_log)
    with pytest.raises(OSError, match="killed"):
        store.rollback(1)
    monkeypatch.undo()
    assert applied == [3]
    del store
    reopened = DiskStore.open(tmp_path, template, 8)
    assert reopened.round == 1 and reopened.undo_rounds() == [0]
    _assert_trees_equal(_all(reopened), snapshots[1])


def test_checkpoints_record_the_store_prune_its_logs_and_roll_it_back(tmp_path):
    store, template, snapshots = _filled_store(tmp_path / "store", 4)
    server = {"w": np.arange(3, dtype=np.float32)}
    path = save_checkpoint(tmp_path / "ckpt", SimState(4, server, store), {"counters": {}})
    assert store.undo_rounds() == []  # nothing before round 4 is needed any more
    with np.load(path) as f:
        assert not [k for k in f.files if k.startswith("client/")]
        assert json.loads(f["meta"].tobytes())["client_store"]["uuid"] == store.uuid
    rng = np.random.default_rng(5)
    for r in (4, 5):
        store.scatter(np.array([0, r]), _random_rows(rng, 2), r)
    with pytest.raises(ValueError, match="client store is at round 6, the state at round 5"):
        save_checkpoint(tmp_path / "ckpt", SimState(5, server, store), {})
    state, _ = load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), SimState(0, server, store))
    assert state.round == 4 and state.client_states is store and store.round == 4
    _assert_trees_equal(_all(store), snapshots[4])
    with pytest.raises(ValueError, match="were pruned"):
        store.rollback(2)
    other = DiskStore.create(tmp_path / "other", template, 8)
    with pytest.raises(ValueError, match="belongs to the client store"):
        load_checkpoint(path, SimState(0, server, other))
    with pytest.raises(ValueError, match="disk client store"):
        load_checkpoint(path, SimState(0, server, {"a": np.zeros((8, 2, 3), np.float32), "b": np.zeros((8, 5), np.int32)}))


CONFIG = DIGITS_RUN.format(rounds=5, top='store = "{store}"', algorithm="admm", extra="")  # format it with the store


def _strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.mark.slow
def test_killed_run_with_a_disk_store_resumes_to_the_same_metrics(tmp_path):
    """Killed (abruptly, in its own process) after round 3 with checkpoints every 2 rounds: the
    store already holds round 3 (or 4) and is rolled back to round 2 on resume. The run ends as an
    uninterrupted one with the memory store, metric for metric and bit for bit (disk == memory
    store uninterrupted is tested above)."""
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(CONFIG.format(store="disk"))
    cfg = validate(tomllib.loads(cfg_path.read_text()))
    quiet = PlainReporter(lambda s: None)
    broken, memory = tmp_path / "broken", tmp_path / "memory"
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off")
    killed_run = str(Path(__file__).resolve().parents[1] / "killed_run.py")  # the CLI, killed abruptly after round 3
    r = subprocess.run([sys.executable, killed_run, "3", "run", str(cfg_path), "--out", str(broken)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 137, r.stderr
    meta = json.loads((broken / "client_store" / "store.json").read_text())
    # Round 3 is reported once evaluated, which the pipelined loop does while round 4 trains: the
    # store holds round 3 or 4, and the undo logs of every round since the checkpoint (round 2).
    ahead = meta["round"]
    assert ahead in (3, 4) and [p.name for p in sorted((broken / "client_store").glob("undo_*"))] == [f"undo_{r:06d}.bin" for r in range(2, ahead)]
    run_experiment(cfg, broken, resume=True, reporter=quiet)
    run_experiment(cfg.model_copy(update={"store": "memory"}), memory, reporter=quiet)
    b, c = (read_metrics(d / "metrics.jsonl") for d in (broken, memory))
    assert [x["round"] for x in b] == [0, 1, 2, 3, 4, 5]
    assert _strip(b) == _strip(c)
    assert json.loads((broken / "client_store" / "store.json").read_text())["round"] == 5
    # pruned by the final checkpoint down to what the older kept checkpoint (round 4) needs
    assert [p.name for p in (broken / "client_store").glob("undo_*")] == ["undo_000004.bin"]
    exp = build_experiment(cfg.model_copy(update={"store": "memory"}))  # the memory run's client arrays, in leaf order
    restored, _ = load_checkpoint(memory / "checkpoints" / "round_000005.npz", exp.simulator.init(exp.params))
    stacked = [np.asarray(x) for x in jax.tree.leaves(restored.client_states)]
    leaves = sorted((broken / "client_store").glob("leaf_*.bin"))
    assert len(leaves) == len(stacked) == 4  # ADMM's dual and contribution, each a kernel and a bias
    for path, want in zip(leaves, stacked):
        np.testing.assert_array_equal(np.fromfile(path, want.dtype).reshape(want.shape), want)


@pytest.mark.benchmark  # the process's resident memory: a bound that holds on a quiet machine
def test_peak_memory_grows_with_the_cohort_not_with_the_federation():
    """200 clients x 2 leaves x 262,144 float32 (400 MB on disk), cohorts of 10 (20 MB): the
    process's peak resident set grows by the cohort's rows, not by the store. The full-size
    measurement (500 clients x 1M parameters) is ``benchmarks/client_store.py``."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "benchmarks" / "client_store.py"), "--clients", "200", "--params", "262144"]
        cmd += ["--rounds", "5", "--modes", "disk", "--dir", tmp, "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["store_mb"] == 400.0 and out["cohort_mb"] == 20.0 and out["rollback_ok"]
    # the gathered rows themselves (20 MB) plus a little; a mapped store would add every touched page
    assert out["peak_rss_growth_mb"] < out["cohort_mb"] + 8
    assert out["init_peak_rss_growth_mb"] < 40  # initial rows are written in 32 MB chunks
