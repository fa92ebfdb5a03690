"""Pipelined rounds and the device-resident client store give bitwise the results of the plain
round loop with the host store (docs/design.md, "Pipelined rounds")."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup

from fedbayes.algorithms.admm import admm
from fedbayes.algorithms.base import Algorithm
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.feddyn import feddyn
from fedbayes.sim.scenario import Scenario
from fedbayes.sim.simulator import Simulator

SIZES = (37, 90, 213, 11, 150, 64, 23)


def _poisoned(alg: Algorithm, bad_size: int) -> Algorithm:
    """The client of size ``bad_size`` (sizes are distinct) sends NaNs: rejected, its state kept."""

    def client_update(key, message, state, data):
        m, s, info = alg.client_update(key, message, state, data)
        m = jax.tree.map(lambda a: jnp.where(data.num_examples == bad_size, jnp.nan, a), m)
        return m, s, info

    return alg._replace(client_update=client_update)


def algorithm_named(name, trainer, k):
    if name == "fedavg":
        return fedavg(trainer, optax.sgd(1.0, momentum=0.9))
    if name == "feddyn":
        return feddyn(trainer, optax.sgd(1.0), alpha=0.1, num_clients=k, weight_decay=1e-3)
    return admm(trainer, optax.sgd(1.0), rho=0.1, num_clients=k)


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def assert_bitwise(a, b):
    la, lb = _leaves(a), _leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def _loop(sim, params, rounds, donate):
    state = sim.init(params)
    infos = []
    for _ in range(rounds):
        state, info = sim.run_round(state, donate=donate)
        infos.append(info)
    return state, infos


CASES = [(name, store, layout, 3) for name in ("fedavg", "admm") for store in ("memory", "device") for layout in ("sequential", "vmap")]


@pytest.mark.parametrize("name, store, layout, per_round", CASES + [("feddyn", "device", "sequential", 7), ("feddyn", "memory", "sequential", 7)])
def test_pipelined_and_device_store_equal_plain_loop(name, store, layout, per_round):
    """5 rounds; with 3 of 7 clients, some consecutive cohorts overlap (a memory store then waits
    for the write-back) and some do not (the next round is launched early)."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=2, batch_size=16)
    alg = algorithm_named(name, trainer, fed.num_clients)
    make = lambda store: Simulator(alg, fed, clients_per_round=per_round, seed=5, layout=layout, store=store, scenario=Scenario(dropout=0.2))  # noqa: E731
    ref, ref_infos = _loop(make("memory"), params, 5, donate=False)
    sim = make(store)
    got = list(sim.rounds(sim.init(params), 5))
    assert [s.round for s, _ in got] == [1, 2, 3, 4, 5]
    state = got[-1][0]
    assert_bitwise(state.server_state, ref.server_state)
    assert_bitwise(state.client_states, ref.client_states)
    for (_, info), want in zip(got, ref_infos):
        np.testing.assert_array_equal(info.cohort, want.cohort)
        np.testing.assert_array_equal(info.dropped, want.dropped)
        assert (info.bytes_up, info.bytes_down, info.padding_waste) == (want.bytes_up, want.bytes_down, want.padding_waste)
        for key in want.clients:
            np.testing.assert_array_equal(info.clients[key], want.clients[key])
        assert info.server == want.server
    # The plain loop on the device store, donating, agrees too.
    dev, _ = _loop(make(store), params, 5, donate=True)
    assert_bitwise(dev.client_states, ref.client_states)


def test_early_launch_happens_only_when_allowed(monkeypatch):
    """With a memory store, round r + 1 is launched before round r completes exactly when it reads
    no row round r writes (3 clients on 2 devices: one padding slot, which reads row 0); stateless:
    always; after a ``keep`` round: never."""
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    events = []

    def spy(sim):
        launch, complete = sim.launch, sim.complete
        monkeypatch.setattr(sim, "launch", lambda st, p, **kw: (events.append(("launch", p.round)), launch(st, p, **kw))[1])
        monkeypatch.setattr(sim, "complete", lambda st, l, **kw: (events.append(("complete", l.prepared.round)), complete(st, l, **kw))[1])
        return sim

    sim = spy(Simulator(algorithm_named("admm", trainer, fed.num_clients), fed, clients_per_round=3, seed=5))
    cohorts = [set(sim.sample_cohort(r).tolist()) for r in range(6)]
    list(sim.rounds(sim.init(params), 6))
    for r in range(5):
        early = events.index(("launch", r + 1)) < events.index(("complete", r))
        assert early == (not cohorts[r] & (cohorts[r + 1] | {0}))
    assert any(events.index(("launch", r + 1)) < events.index(("complete", r)) for r in range(5)), "no round was launched early: pick another seed"
    events.clear()
    sim = spy(Simulator(algorithm_named("fedavg", trainer, fed.num_clients), fed, clients_per_round=7, seed=5))
    list(sim.rounds(sim.init(params), 4, keep=lambda r: r == 1))
    launched_early = [events.index(("launch", r + 1)) < events.index(("complete", r)) for r in range(3)]
    assert launched_early == [True, False, True]


def test_device_store_keeps_rejected_clients_and_kept_states_are_intact():
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    k = fed.num_clients
    alg = _poisoned(algorithm_named("admm", trainer, k), SIZES[1])
    ref, ref_infos = _loop(Simulator(alg, fed, clients_per_round=k, seed=0), params, 3, donate=False)
    assert all(info.rejected.tolist() == [1] for info in ref_infos)
    sim = Simulator(alg, fed, clients_per_round=k, seed=0, store="device")
    kept = []
    for state, info in sim.rounds(sim.init(params), 3, keep=lambda r: r == 1):
        if state.round == 2:  # kept: the next round waits, so its store is still readable
            kept.append(_leaves(state.client_states))
    assert_bitwise(state.client_states, ref.client_states)
    np.testing.assert_array_equal(_leaves(ref.client_states)[0][1], _leaves(sim.init(params).client_states)[0][1])
    assert kept and all(np.isfinite(a).all() for a in kept[0])


def test_pipelined_fail_fast_raises_on_the_bad_round():
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup()
    alg = _poisoned(algorithm_named("fedavg", trainer, fed.num_clients), SIZES[1])
    sim = Simulator(alg, fed, clients_per_round=fed.num_clients, seed=0, fail_fast=True)
    seen = []
    with pytest.raises(RuntimeError, match=r"round 0: .*clients \[1\]"):
        for state, _ in sim.rounds(sim.init(params), 3):
            seen.append(state.round)
    assert seen == []


@pytest.mark.slow
def test_killed_pipelined_run_with_a_device_store_resumes_exactly(tmp_path):
    """The CLI (pipelined rounds, evaluation on its own thread, ADMM's states in device memory),
    killed abruptly after round 3 with checkpoints every 2 rounds, resumes to the metrics and
    client states of an uninterrupted run with the host store, bit for bit."""
    import json
    import os
    import subprocess
    import sys
    import tomllib
    from pathlib import Path

    from test_store import CONFIG

    from fedbayes.config.schema import validate
    from fedbayes.runs.folder import read_metrics
    from fedbayes.runs.loggers import PlainReporter
    from fedbayes.runs.loop import run_experiment

    root = Path(__file__).resolve().parents[2]
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(CONFIG.format(store="device"))
    cfg = validate(tomllib.loads(cfg_path.read_text()))
    broken, memory = tmp_path / "broken", tmp_path / "memory"
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off")
    r = subprocess.run(
        [sys.executable, str(root / "tests" / "killed_run.py"), "3", "run", str(cfg_path), "--out", str(broken)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
    )
    assert r.returncode == 137, r.stderr
    assert [json.loads(x)["round"] for x in (broken / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]
    quiet = PlainReporter(lambda s: None)
    run_experiment(cfg, broken, resume=True, reporter=quiet)
    run_experiment(cfg.model_copy(update={"store": "memory"}), memory, reporter=quiet)
    strip = lambda records: [{k: v for k, v in x.items() if k != "seconds"} for x in records]  # noqa: E731
    b, c = (read_metrics(d / "metrics.jsonl") for d in (broken, memory))
    assert [x["round"] for x in b] == [0, 1, 2, 3, 4, 5] and strip(b) == strip(c)
    with np.load(broken / "checkpoints" / "round_000005.npz") as f, np.load(memory / "checkpoints" / "round_000005.npz") as g:
        assert sorted(f.files) == sorted(g.files) and any(k.startswith("client/") for k in f.files)
        for k in f.files:
            if k.startswith(("server/", "client/")):  # the rest is metadata (the config's hash differs: store)
                np.testing.assert_array_equal(f[k], g[k])
