"""Rounds fused into one compiled program (``Simulator(fuse=...)``, ``fuse_rounds``) give bitwise
the results of one round at a time, and a killed fused run resumes exactly."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import digits_federation, logreg_setup
from test_pipeline import SIZES, algorithm_named, assert_bitwise
from test_store import CONFIG

from fedbayes.config.schema import validate
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment
from fedbayes.sim.simulator import Simulator


@pytest.mark.parametrize(
    "name, store, layout",
    [("fedavg", "memory", "sequential"), ("fedavg", "memory", "vmap"), ("admm", "device", "sequential"), ("admm", "device", "vmap")],
)
def test_fused_rounds_equal_one_round_at_a_time(name, store, layout, monkeypatch):
    """7 rounds of 3 of 7 unequal clients, at most 3 a program, the caller keeping round 3: blocks
    end there and wherever the cohort's order buffer changes size."""
    traced = []
    fused_program = Simulator.fused_program

    def counted(self, *args, **kwargs):  # traced once for each program of several rounds compiled
        traced.append(args[7].shape[0])  # the rounds in the program
        return fused_program(self, *args, **kwargs)

    monkeypatch.setattr(Simulator, "fused_program", counted)
    fed = digits_federation(SIZES)
    _, params, trainer = logreg_setup(epochs=2, batch_size=16)
    alg = algorithm_named(name, trainer, fed.num_clients)
    make = lambda fuse: Simulator(alg, fed, clients_per_round=3, seed=5, layout=layout, store=store, fuse=fuse)  # noqa: E731
    one = make(1)
    state, want = one.init(params), []
    for _ in range(7):
        state, info = one.run_round(state)
        want.append((state, info))
    sim = make(3)
    got, kept = [], None
    for s, info in sim.rounds(sim.init(params), 7, keep=lambda r: r == 3):
        got.append((s, info))
        if s.round == 4:  # kept intact until the iteration resumes
            kept = [np.array(a) for a in jax.tree.leaves(s.client_states)]
    assert traced and max(traced) > 1  # rounds did run fused
    assert [s.round for s, _ in got] == list(range(1, 8))
    for (s, info), (w, winfo) in zip(got, want):
        assert_bitwise(s.server_state, w.server_state)
        np.testing.assert_array_equal(info.cohort, winfo.cohort)
        np.testing.assert_array_equal(info.clients["loss"], winfo.clients["loss"])
        np.testing.assert_array_equal(info.clients["accepted"], winfo.clients["accepted"])
    assert_bitwise(got[-1][0].client_states, want[-1][0].client_states)
    assert_bitwise(kept, want[3][0].client_states)


# test_store's ADMM run with its states in device memory, 9 rounds, 3 a program.
FUSED = (
    CONFIG.format(store="device").replace("rounds = 5", "rounds = 9\neval_every = 6\nfuse_rounds = 3").replace("checkpoint_every = 2", "checkpoint_every = 3")
)


@pytest.mark.slow
def test_killed_fused_run_resumes_exactly(tmp_path):
    """The CLI with 3 rounds a program (blocks 0-2, 3-5, 6-8 between checkpoints), killed abruptly
    after round 4 (inside a block), resumes to the metrics and states of an uninterrupted run one
    round at a time, bit for bit."""
    root = Path(__file__).resolve().parents[2]
    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(FUSED)
    cfg = validate(tomllib.loads(FUSED))
    broken, plain = tmp_path / "broken", tmp_path / "plain"
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off")
    cmd = [sys.executable, str(root / "tests" / "killed_run.py"), "4", "run", str(cfg_path), "--out", str(broken)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root)
    assert r.returncode == 137, r.stderr
    assert [json.loads(x)["round"] for x in (broken / "metrics.jsonl").read_text().splitlines()] == [0]
    assert sorted(p.name for p in (broken / "checkpoints").iterdir()) == ["round_000003.npz"]
    quiet = PlainReporter(lambda s: None)
    run_experiment(cfg, broken, resume=True, reporter=quiet)
    run_experiment(cfg.model_copy(update={"fuse_rounds": 1}), plain, reporter=quiet)
    strip = lambda records: [{k: v for k, v in x.items() if k != "seconds"} for x in records]  # noqa: E731
    b, c = (read_metrics(d / "metrics.jsonl") for d in (broken, plain))
    assert [x["round"] for x in b] == [0, 6, 9] and strip(b) == strip(c)
    with np.load(broken / "checkpoints" / "round_000009.npz") as f, np.load(plain / "checkpoints" / "round_000009.npz") as g:
        assert sorted(f.files) == sorted(g.files) and any(k.startswith("client/") for k in f.files)
        for k in f.files:
            if k.startswith(("server/", "client/")):
                np.testing.assert_array_equal(f[k], g[k])
