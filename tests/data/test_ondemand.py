"""Clients read on demand (fedbayes.data.ondemand, ``data.on_demand``) on small files written in
TFF's layout: the same federation and results as the in-memory loader, a bounded cache, the next
cohort prefetched, damaged files refused in one line with exit code 3, and an interrupted run
resumed to the uninterrupted one's numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data import load_dataset, writers
from fedbayes.data.ondemand import ClientCache
from fedbayes.data.stackoverflow import open_stackoverflow
from fedbayes.runs.build import build_experiment
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment

ROOT = Path(__file__).resolve().parents[2]
QUIET = PlainReporter(lambda s: None)


def _files(folder: Path, num_clients: int = 12) -> Path:
    return writers.write_stackoverflow(folder, np.random.default_rng(0), num_clients=num_clients, posts_per_client=(2, 9), vocab=30, tags=8)


def _config(data: Path, *, on_demand: bool, rounds: int = 4, **data_keys) -> dict:
    keys = {"dataset": "stackoverflow_lr", "data_dir": str(data), "num_clients": 12, "vocab_size": 30, "num_tags": 8, "test_examples": 7}
    if on_demand:
        keys |= {"on_demand": True, "cache_clients": 2}
    return {
        "seed": 0,
        "rounds": rounds,
        "checkpoint_every": 2,
        "data": keys | data_keys,
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "client": {"epochs": 2, "batch_size": 3, "optimizer": "sgd", "lr": 0.5, "momentum": 0.9},
        "server": {"clients_per_round": 3},
    }


def _strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.mark.parametrize("task", ["multilabel", "next_word"])
def test_each_client_and_the_test_split_are_the_in_memory_loaders(tmp_path, task):
    data = _files(tmp_path)
    import h5py

    with h5py.File(data / "stackoverflow_test.h5", "r+") as f:  # a test user without posts
        for k in ("tokens", "title", "tags"):
            f.create_dataset(f"examples/00000004b/{k}", shape=(0,), dtype=h5py.string_dtype())
    name = "stackoverflow_lr" if task == "multilabel" else "stackoverflow_nwp"
    params = {"vocab_size": 30, "max_clients": 10, "max_posts": 5, "test_examples": 9, "seed": 3} | (
        {"num_tags": 8} if task == "multilabel" else {"max_len": 6}
    )
    memory = load_dataset(name, data, **params)
    dataset, federation = open_stackoverflow(data, task, cache_clients=3, **params)
    assert federation.num_clients == 10 and dataset.num_train == 0
    for k in range(10):
        rows = np.flatnonzero(memory.client_ids == k)
        x, y = federation.client_data(k)
        assert federation.sizes[k] == len(rows)
        np.testing.assert_array_equal(x, memory.x_train[rows])
        np.testing.assert_array_equal(y, memory.y_train[rows])
    np.testing.assert_array_equal(dataset.x_test, memory.x_test)
    np.testing.assert_array_equal(dataset.y_test, memory.y_test)
    np.testing.assert_array_equal(dataset.test_client_ids, memory.test_client_ids)


def test_fedavg_on_demand_is_bit_for_bit_the_in_memory_run(tmp_path):
    data = _files(tmp_path / "data")
    run_experiment(validate(_config(data, on_demand=False)), tmp_path / "memory", reporter=QUIET)
    run_experiment(validate(_config(data, on_demand=True)), tmp_path / "od", reporter=QUIET)
    m, o = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("memory", "od"))
    assert [r["round"] for r in o] == [0, 1, 2, 3, 4] and _strip(m) == _strip(o)
    with np.load(tmp_path / "memory" / "checkpoints" / "round_000004.npz") as f, np.load(tmp_path / "od" / "checkpoints" / "round_000004.npz") as g:
        keys = [k for k in f.files if k.startswith("server/")]
        assert keys
        for k in keys:
            np.testing.assert_array_equal(f[k], g[k])


def test_the_cache_never_holds_more_than_its_bound():
    arrays = {c: (np.full((c + 1, 4), c, np.float32), np.zeros(c + 1, np.int32)) for c in range(20)}
    seen = []

    def read(c):
        seen.append(len(cache.held()))
        return arrays[c]

    cache = ClientCache(read, max_clients=3)
    rng = np.random.default_rng(0)
    for _ in range(10):
        cohort = rng.choice(20, 4, replace=False)
        cache.prefetch(cohort)
        for c in rng.choice(20, 5, replace=False):
            x, _ = cache.get(int(c))
            assert x[0, 0] == c
            assert len(cache.held()) <= 3
        cache.wait()
        assert len(cache.held()) <= 3
    assert max(seen) <= 3 and cache.reads > 3
    # the byte bound: 5 rows of 4 float32 + 5 int32 = 100 bytes per client of size 5
    small = ClientCache(lambda c: (np.zeros((5, 4), np.float32), np.zeros(5, np.int32)), max_clients=10, max_bytes=250)
    for c in range(6):
        small.get(c)
        assert small.num_bytes <= 250 and len(small.held()) <= 2
    assert small.held() == [4, 5]
    huge = ClientCache(lambda c: (np.zeros((100, 4), np.float32), np.zeros(100, np.int32)), max_clients=10, max_bytes=250)
    assert len(huge.get(0)[0]) == 100 and huge.held() == []  # returned, not kept


def test_an_on_demand_run_holds_at_most_cache_clients(tmp_path):
    exp = build_experiment(validate(_config(_files(tmp_path), on_demand=True)))
    cache = exp.federation.source.cache
    sim = exp.simulator
    state = sim.init(exp.params)
    most = []
    for state, _ in sim.rounds(state, 5):
        cache.wait()
        most.append(len(cache.held()))
    assert max(most) <= 2


def test_the_next_cohort_is_read_in_the_background(tmp_path):
    config = validate(_config(_files(tmp_path), on_demand=True, cache_clients=12))
    exp = build_experiment(config)
    sim, source = exp.simulator, exp.federation.source
    started = threading.active_count()
    sim.prepare_round(0)
    source.cache.wait()
    first, second = set(sim.sample_cohort(0).tolist()), set(sim.sample_cohort(1).tolist())
    assert second <= set(source.cache.held()) and source.cache.reads == len(first | second)
    assert threading.active_count() == started + 1  # the one prefetch thread
    sim.prepare_round(1)  # round 1's clients come from the cache
    source.cache.wait()
    third = set(sim.sample_cohort(2).tolist())
    assert source.cache.reads == len(first | second | third)


def _numbers_for_posts(path: Path, user: str) -> None:
    import h5py

    with h5py.File(path, "r+") as f:
        n = len(f["examples"][user]["tokens"])
        del f["examples"][user]["tokens"]
        f["examples"][user]["tokens"] = np.arange(float(n))


@pytest.mark.parametrize("how", ["numbers", "missing", "garbage", "lengths", "empty"])
def test_a_damaged_file_exits_3_in_one_line(tmp_path, how):
    data = _files(tmp_path / "data")
    train = data / "stackoverflow_train.h5"
    import h5py

    if how == "numbers":  # users' posts are numbers, found when such a user is sampled (mid-run)
        for user in ("00000000", "00000005", "00000009"):
            _numbers_for_posts(train, user)
    elif how == "missing":
        with h5py.File(train, "r+") as f:
            del f["examples"]["00000003"]["tokens"]
    elif how == "empty":  # a user without posts cannot take a step
        with h5py.File(train, "r+") as f:
            for k in ("tokens", "title", "tags"):
                del f["examples"]["00000007"][k]
                f.create_dataset(f"examples/00000007/{k}", shape=(0,), dtype=h5py.string_dtype())
    elif how == "garbage":
        train.write_bytes(b"\x89HDF\r\n\x1a\n" + os.urandom(600))
    else:
        with h5py.File(train, "r+") as f:
            n = len(f["examples"]["00000001"]["title"])
            del f["examples"]["00000001"]["title"]
            f["examples"]["00000001"]["title"] = np.array([b"a b"] * (n + 1), dtype=object)
    cfg = tmp_path / "c.toml"
    config = _config(data, on_demand=True, rounds=8)
    config["server"]["clients_per_round"] = 6
    cfg.write_text(_toml(config))
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o")])
    # found mid-run, the error follows the rounds' progress lines: it is the last line, the only one
    lines = [line for line in res.output.splitlines() if line.strip() and not line.startswith(("[run]", "round "))]
    assert res.exit_code == 3 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert str(train) in lines[0] and res.output.strip().splitlines()[-1] == lines[0]


def test_on_demand_refuses_what_needs_the_training_set_in_one_line(tmp_path):
    base = _config(tmp_path, on_demand=True)
    for data_keys, field in (
        ({"dataset": "digits", "num_clients": 4, "vocab_size": 10_000, "num_tags": 500, "test_examples": None}, "data.on_demand"),
        ({"validation_fraction": 0.1}, "data.validation_fraction"),
        ({"partition": "iid"}, "data.partition"),
    ):
        data = {k: v for k, v in (base["data"] | data_keys).items() if v is not None}
        if data["dataset"] == "digits":
            data = {k: v for k, v in data.items() if k not in ("vocab_size", "num_tags", "data_dir")}
        with pytest.raises((ConfigError, ValueError), match=field):
            validate(base | {"data": data})
    with pytest.raises((ConfigError, ValueError), match="evaluation.personal_fraction"):
        validate(base | {"evaluation": {"personal_fraction": 0.2}})


@pytest.mark.slow
def test_a_killed_on_demand_run_resumes_to_the_uninterrupted_numbers(tmp_path):
    data = _files(tmp_path / "data")
    cfg = tmp_path / "c.toml"
    cfg.write_text(_toml(_config(data, on_demand=True, rounds=6)))
    broken, whole = tmp_path / "broken", tmp_path / "whole"
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off")
    killed_run = str(ROOT / "tests" / "killed_run.py")  # the CLI, killed abruptly after round 3
    r = subprocess.run([sys.executable, killed_run, "3", "run", str(cfg), "--out", str(broken)], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 137, r.stderr
    config = validate(_config(data, on_demand=True, rounds=6))
    run_experiment(config, broken, resume=True, reporter=QUIET)
    run_experiment(config, whole, reporter=QUIET)
    b, w = (read_metrics(d / "metrics.jsonl") for d in (broken, whole))
    assert [x["round"] for x in b] == list(range(7)) and _strip(b) == _strip(w)


def _toml(config: dict) -> str:
    lines = []
    for key, value in config.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_value(value)}")
    for key, value in config.items():
        if isinstance(value, dict):
            lines.append(f"[{key}]")
            lines += [f"{k} = {_value(v)}" for k, v in value.items()]
    return "\n".join(lines) + "\n"


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return f'"{v}"' if isinstance(v, str) else repr(v)
