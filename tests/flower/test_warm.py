"""The warm executor (fedbayes.flower.executor), nodes that own their data
(fedbayes.flower.nodedata), the per-round times, and the loopback federation that uses them.

Needs the flower extra (``pip install -e ".[flower]"``); without it the module is skipped.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np
import pytest
import tomli_w

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from flwr.app import ConfigRecord, RecordDict  # noqa: E402

from fedbayes.config.schema import validate  # noqa: E402
from fedbayes.flower import executor, fastnode, node  # noqa: E402
from fedbayes.flower.apps import train_reply  # noqa: E402
from fedbayes.flower.codec import packed, to_arrays  # noqa: E402
from fedbayes.flower.nodedata import NodeDataError, node_source, read_file  # noqa: E402
from fedbayes.flower.rounds import FlowerRounds, Reply, broadcast_payload, data_spec, round_times, sent_config  # noqa: E402
from fedbayes.runs.build import build_experiment  # noqa: E402
from fedbayes.runs.loop import run_experiment  # noqa: E402

pytestmark = pytest.mark.flower

from test_flower import assert_same_server_state, no_process_left, raw_config, records  # noqa: E402


@pytest.fixture(scope="module")
def exp():
    return build_experiment(validate(raw_config("fedavg", rounds=1)))


def _message(exp, client: int, config_text: str | None = None) -> RecordDict:
    rounds = FlowerRounds(exp, None)
    state = rounds.init(exp.params)
    make = rounds.request(0, client, -1, broadcast_payload(packed(to_arrays(exp.algorithm.broadcast(state.server_state))), 3))
    content = make()
    if config_text is not None:
        content.config_records["fedbayes"]["config"] = config_text
    return content


def _node_config(tmp_path: Path, client: int = 0, **data) -> dict:
    return {"partition-id": client, "num-partitions": 3, "state-dir": str(tmp_path / "state"), **data}


# ----- nodes own their data ----------------------------------------------------------------------
def test_the_server_never_sends_a_data_path_and_a_node_refuses_one_in_one_line(exp, tmp_path):
    with_path = exp.config.model_copy(update={"data": exp.config.data.model_copy(update={"data_dir": "/srv/other/data"})})
    assert "data_dir" not in sent_config(with_path) and "/srv/other" not in sent_config(with_path)
    text = sent_config(exp.config).replace("[data]\n", "[data]\ndata_dir = '/srv/other/data'\n")
    with pytest.raises(
        NodeDataError, match=r"^this node refuses the run's data.data_dir = '/srv/other/data': a node's data comes from its own configuration"
    ) as err:
        train_reply(_message(exp, 0, text), _node_config(tmp_path), RecordDict())
    assert "\n" not in str(err.value)
    assert not (tmp_path / "state" / "data").exists()  # refused before anything was read


def test_a_node_holding_another_dataset_refuses_the_run(exp, tmp_path):
    with pytest.raises(NodeDataError, match="this node holds dataset 'wine'; the run is configured for 'breast_cancer'"):
        train_reply(_message(exp, 0), _node_config(tmp_path, dataset="wine"), RecordDict())


def _evil_module(tmp_path: Path) -> tuple[str, Path]:
    """A model file that leaves a marker when imported (by whom: the importing process's argv)."""
    marker = tmp_path / "IMPORTED"
    evil = tmp_path / "evil_model.py"
    evil.write_text(
        f"import sys\nwith open({str(marker)!r}, 'a') as f:\n    f.write(' '.join(sys.argv) + '\\n')\n"
        "import flax.linen as nn\nclass Net(nn.Module):\n    num_classes: int = 2\n    @nn.compact\n    def __call__(self, x):\n"
        "        return nn.Dense(self.num_classes, name='dense')(x.reshape((x.shape[0], -1)))\n"
    )
    return f"{evil}:Net", marker


def _with(exp, **sections) -> str:
    raw = tomllib.loads(sent_config(exp.config))
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values}
    return tomli_w.dumps(raw)


def test_a_server_named_module_is_refused_unless_the_node_lists_it(exp, tmp_path):
    spec, marker = _evil_module(tmp_path)
    text = _with(exp, model={"name": "module", "module": spec})
    npz = node.write_client_file(exp, 0, tmp_path / "mine.npz")
    for own in ({}, {"data-file": str(npz)}):
        with pytest.raises(NodeDataError, match=r"^this node refuses the run's model.module = '.*evil_model.py:Net': a node imports only"):
            train_reply(_message(exp, 0, text), _node_config(tmp_path, **own), RecordDict())
    assert not marker.exists()
    # listed: imported, and the same model as logreg's gives logreg's reply
    reply = train_reply(_message(exp, 0, text), _node_config(tmp_path, **{"data-file": str(npz), "model-modules": f"pkg.other:Net,{spec}"}), RecordDict())
    plain = train_reply(_message(exp, 0), _node_config(tmp_path / "plain", **{"data-file": str(npz)}), RecordDict())
    assert marker.exists() and reply.config_records["meta"]["reply"] == plain.config_records["meta"]["reply"]


def test_a_server_named_data_file_is_refused_and_never_read(exp, tmp_path):
    secret = tmp_path / "secret.csv"
    secret.write_text("label,a\n0,1\n1,2\n")
    before = secret.stat().st_atime_ns
    for data in ({"dataset": "files", "path": str(secret)}, {"dataset": "files", "path": "mine.npz", "test_path": str(secret)}, {"dataset": "files"}):
        with pytest.raises(NodeDataError, match=r"^this node refuses the run's data\.(path|test_path|dataset)") as err:
            train_reply(_message(exp, 0, _with(exp, data=data)), _node_config(tmp_path), RecordDict())
        assert "\n" not in str(err.value)
    assert secret.stat().st_atime_ns == before and not (tmp_path / "state" / "data").exists()
    # the server's own-data run, without its paths (as the server sends it): the node's data-file is the data
    npz = node.write_client_file(exp, 0, tmp_path / "mine.npz")
    own = train_reply(_message(exp, 0, _with(exp, data={"dataset": "files"})), _node_config(tmp_path, **{"data-file": str(npz)}), RecordDict())
    plain = train_reply(_message(exp, 0), _node_config(tmp_path / "plain", **{"data-file": str(npz)}), RecordDict())
    assert own.config_records["meta"]["reply"] == plain.config_records["meta"]["reply"]


def test_a_server_named_model_larger_than_the_node_is_refused_before_it_is_allocated(exp, tmp_path):
    from fedbayes.config.schema import ConfigError

    npz = node.write_client_file(exp, 0, tmp_path / "mine.npz")
    text = _with(exp, model={"name": "mlp", "hidden": [10**9, 10**9]})
    with pytest.raises(ConfigError, match=r"^config error: model.hidden: the model has [\d,]+ parameters; .* this machine has") as err:
        train_reply(_message(exp, 0, text), _node_config(tmp_path, **{"data-file": str(npz)}), RecordDict())
    assert "\n" not in str(err.value)


def _write_csv(path: Path, x: np.ndarray, y: np.ndarray) -> Path:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*(f"f{j}" for j in range(x.shape[1])), "label"])
        for row, label in zip(x, y):
            w.writerow([*(repr(float(v)) for v in row), int(label)])
    return path


def test_a_node_with_its_own_npz_or_csv_file_replies_as_the_simulators_client(exp, tmp_path):
    """The same client's examples from the node's own .npz, its own .csv (through a node TOML),
    and the cache of the run's dataset give the same reply, bit for bit."""
    idx = exp.federation.client_indices[1]
    x, y = np.asarray(exp.federation.x[idx]), np.asarray(exp.federation.y[idx])
    npz = node.write_client_file(exp, 1, tmp_path / "mine.npz")
    toml = tmp_path / "node.toml"
    toml.write_text(f'data-file = "{_write_csv(tmp_path / "mine.csv", x, y)}"\n')
    node.prepare_data(exp, {1: tmp_path / "cache"})
    np.testing.assert_array_equal(read_file(tmp_path / "mine.csv")[0].astype(np.float32), x)
    replies = [
        train_reply(_message(exp, 1), {**_node_config(tmp_path / name, 1), **data}, RecordDict())
        for name, data in (("npz", {"data-file": str(npz)}), ("csv", {"node-toml": str(toml)}), ("cache", {"state-dir": str(tmp_path / "cache")}))
    ]
    for reply in replies:
        assert reply.config_records["meta"]["num_examples"] == len(y)
        assert reply.config_records["meta"]["reply"] == replies[0].config_records["meta"]["reply"]  # inline: a small reply


def test_a_node_whose_examples_do_not_fit_the_model_refuses_in_one_line(exp, tmp_path):
    np.savez(tmp_path / "wide.npz", x=np.zeros((5, 31), np.float32), y=np.zeros(5, np.int64))
    with pytest.raises(NodeDataError, match=r"wide.npz: 5 examples of features \[31\] and 5 labels; the run's model takes features \[30\]"):
        train_reply(_message(exp, 0), _node_config(tmp_path, **{"data-file": str(tmp_path / "wide.npz")}), RecordDict())
    np.savez(tmp_path / "labels.npz", x=np.zeros((5, 30), np.float32), y=np.array([0, 1, 2, 0, 1]))
    with pytest.raises(NodeDataError, match=r"labels must be integers in \[0, 2\)"):
        train_reply(_message(exp, 0), _node_config(tmp_path, **{"data-file": str(tmp_path / "labels.npz")}), RecordDict())
    with pytest.raises(NodeDataError, match="give data-file or dataset, not both"):
        node_source({"data-file": "a.npz", "dataset": "wine"})


# ----- the warm process: bounded caches, times, environment ----------------------------------------------
def test_setups_are_kept_per_run_and_bounded(exp, tmp_path, monkeypatch):
    node.clear_setups()
    monkeypatch.setattr(node, "MAX_SETUPS", 2)
    node.prepare_data(exp, {0: tmp_path})
    spec = data_spec(exp)
    first = node.node_setup(exp.config, 0, tmp_path, spec)
    assert node.node_setup(exp.config, 0, tmp_path, spec) is first  # the second message of a run builds nothing
    for lr in (0.01, 0.02):
        cfg = exp.config.model_copy(update={"client": exp.config.client.model_copy(update={"lr": lr})})
        node.prepare_data(build_experiment(cfg), {0: tmp_path})
        node.node_setup(cfg, 0, tmp_path, spec)
    kept = node.kept_setups()
    node.clear_setups()
    assert len(kept) == 2 and first not in kept


def test_round_times_split_a_round_into_update_handler_and_the_ways_there_and_back():
    meta = {"seconds-update": 0.01, "seconds-handler": 0.02, "seconds-handler-end": 100.0, "seconds-to-node": 0.5}
    replies = {c: Reply(c, RecordDict({"meta": ConfigRecord({**meta, "seconds-update": 0.01 * (c + 1)})}), None, 100.25 + c) for c in range(3)}
    replies[3] = Reply(3, None, "boom", 101.0)
    t = round_times(4, 2.0, replies)
    assert t["round"] == 4 and t["seconds"] == 2.0 and t["replies"] == 3
    assert t["update_median"] == pytest.approx(0.02) and t["update_max"] == pytest.approx(0.03)
    assert t["to_node_median"] == 0.5 and t["from_node_median"] == pytest.approx(1.25) and t["from_node_max"] == pytest.approx(2.25)


def test_the_node_environment_sets_the_cache_and_telemetry_before_any_import(tmp_path):
    env = executor.node_environment(tmp_path, {})
    assert env == {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "FLWR_TELEMETRY_ENABLED": "0"}
    assert executor.node_environment(tmp_path, {"JAX_COMPILATION_CACHE_DIR": "/x"})["JAX_COMPILATION_CACHE_DIR"] == "/x"  # the operator's wins


def test_the_fast_node_caps_only_sleep(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    t = fastnode.capped_time(0.01)
    t.sleep(3)
    assert slept == [0.01] and t.monotonic is time.monotonic and t.time is time.time


def test_the_fast_node_caps_its_waits_apart_from_its_polls(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    t = fastnode.capped_time(0.05, 0.005)
    t.sleep(3)  # after an empty pull: the next pull is a request to the SuperLink
    t.sleep(0.5)  # waiting for the reply or its objects in the node's memory
    t.sleep(0.001)
    assert slept == [0.05, 0.005, 0.001]


def test_a_rhythm_waits_half_the_shortest_recent_idle_spell_first():
    now = [0.0]
    r = fastnode.Rhythm(fraction=0.5, most=1.0, keep=3, clock=lambda: now[0])
    assert r.idle() == 0.0  # nothing learnt yet
    now[0] = 0.4
    r.busy()
    assert r.idle() == pytest.approx(0.2)
    now[0] += 0.1  # a short spell: the next first wait is half of it
    r.busy()
    assert r.idle() == pytest.approx(0.05)
    now[0] += 9.0  # a long one (the next run) does not lengthen it
    r.busy()
    assert r.idle() == pytest.approx(0.05)
    for spell in (3.0, 4.0, 5.0):  # the short ones have left the window; capped at `most`
        now[0] += spell
        r.busy()
        r.idle()
    assert r.idle() == 1.0


def test_the_fast_node_waits_part_of_its_rhythm_after_a_message_then_polls_at_its_cap(monkeypatch):
    slept, now = [], [0.0]
    monkeypatch.setattr(time, "sleep", lambda s: slept.append(round(s, 6)) or now.__setitem__(0, now[0] + s))
    t = fastnode.capped_time(0.05, 0.005, fastnode.Rhythm(clock=lambda: now[0]))
    t.sleep(3)  # idle at start: nothing learnt
    for _ in range(9):  # polls every 50 ms until a message comes 0.5 s later
        t.sleep(3)
    t.sleep(0.5)  # a message: the node waits for its ClientApp
    t.sleep(3)  # the next idle spell starts with half the last one
    t.sleep(3)
    assert slept == [0.05] * 10 + [0.005, 0.25, 0.05]


# ----- real processes ------------------------------------------------------------------------------
def _submit(fed, tmp: Path, raw: dict, name: str) -> tuple[str, Path]:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(tomli_w.dumps(raw))
    out = tmp / name
    return fed.submit({"config": str(cfg), "out": str(out), "reply-timeout": 120.0}), out


@pytest.mark.slow
def test_warm_executors_with_their_own_data_equal_the_simulator_and_survive_a_replaced_executor(tmp_path):
    """3 SuperNodes with warm executors, each node's examples in a file of its own (node 2's a
    CSV named by a node TOML): ADMM (stateful) over 4 rounds. Node 1's executor runs with
    ``--max-tasks 2``: it leaves after round 1's task (a process gone between tasks, as a crash
    between rounds), and a new one, started after it left, takes rounds 2 and 3 from the node's
    queue: the node's state comes from Context.state and its state folder, and the final server
    state equals the simulator's; every round's times are in flower_times.jsonl; no process is
    left (how long the warm handlers take: the ``benchmark`` test below). (The executor leaves at a known point
    so that the test is deterministic: an executor killed *during* a task makes Flower answer
    that task with an error, and the server rejects that client for the round.)"""
    from fedbayes.flower.deploy import LocalFederation

    raw = raw_config("admm", rounds=4)
    exp = build_experiment(validate(raw))
    fed = LocalFederation(tmp_path / "federation", 3)
    for n in fed.nodes[:2]:
        n.data = {"data-file": str(node.write_client_file(exp, n.partition, tmp_path / f"node{n.partition}.npz"))}
    idx = exp.federation.client_indices[2]
    csv_file = _write_csv(tmp_path / "node2.csv", np.asarray(exp.federation.x[idx]), np.asarray(exp.federation.y[idx]))
    (tmp_path / "node2.toml").write_text(f'data-file = "{csv_file}"\n')
    fed.nodes[2].data = {"node-toml": str(tmp_path / "node2.toml")}
    fed.nodes[1].max_tasks = 2
    try:
        fed.start()
        old = fed.nodes[1].executor
        run_id, out = _submit(fed, tmp_path, raw, "admm")
        assert old.wait(timeout=300) == 0, "node 1's executor did not leave after 2 tasks"
        assert "served 2 tasks (--max-tasks): exiting" in (fed.workdir / "executor1.log").read_text()
        assert len(records(out / "clients.jsonl")) < 12  # the run is not over: rounds 2 and 3 wait for node 1
        fed.start_executor(1)
        status = fed.wait(run_id, out, 600)
        assert status == {"ok": True}, status
        last = records(out / "metrics.jsonl")[-1]
        assert last["round"] == 4 and last["rejected"] == 0 and last["dropped"] == 0
        assert len(records(out / "clients.jsonl")) == 12
        log1 = (fed.workdir / "executor1.log").read_text()
        assert log1.count("fedbayes warm executor") == 2 and fed.nodes[1].executor.pid != old.pid
        times = records(out / "flower_times.jsonl")
        assert [t["round"] for t in times] == [1, 2, 3, 4] and all(t["replies"] == 3 for t in times)  # as metrics.jsonl numbers them
        run_experiment(validate(raw), tmp_path / "sim")
        assert_same_server_state(tmp_path / "sim", out)
    finally:
        no_process_left(fed)
    assert json.loads((out / "flower_status.json").read_text()) == {"ok": True}


@pytest.mark.slow
def test_the_printed_commands_run_a_federation_on_loopback(tmp_path):
    """`fedbayes deploy --print-commands` for 2 nodes, with loopback addresses, free ports and
    this test's folders: every printed command run as written, each long-running one as its own
    process (a SuperLink with TLS and SuperNode authentication, two SuperNodes with
    --isolation process and their warm executors, each node's data in its own file); `flwr run
    --stream` ends with the run, which equals the simulator; no process is left."""
    import psutil

    from fedbayes.flower.deploy import free_port, kill_tree, make_certificates, make_node_key, print_commands

    raw = raw_config("fedavg", rounds=2, num_clients=2)
    cfg = validate(raw)
    cfg_file, out, files, nodes = tmp_path / "run.toml", tmp_path / "out", tmp_path / "files", tmp_path / "nodes"
    cfg_file.write_text(tomli_w.dumps(raw))
    make_certificates(files)
    exp = build_experiment(cfg)
    for i in range(2):
        make_node_key(files, f"node{i}")
        node.write_client_file(exp, i, nodes / f"node{i}" / "data.npz")
    port, node_ports = free_port(), [free_port(), free_port()]
    text = print_commands(cfg_file, cfg, out, "127.0.0.1", port, node_ports=node_ports, files=str(files), state_root=str(nodes))
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    env = {k: v for k, v in os.environ.items() if k != "FLWR_HOME"}
    env.update(HOME=str(tmp_path / "home"), PATH=str(Path(sys.executable).parent) + os.pathsep + env["PATH"])
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    (tmp_path / "home").mkdir()
    started: list[psutil.Process] = []

    def background(line: str, name: str) -> None:
        with open(tmp_path / f"{name}.log", "ab") as log:
            p = subprocess.Popen(["bash", "-c", line], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        started.append(psutil.Process(p.pid))

    def run(line: str) -> str:
        res = subprocess.run(["bash", "-c", line], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, (line, res.stdout[-2000:], res.stderr[-2000:])
        return res.stdout

    def tree() -> list[psutil.Process]:
        found = {}
        for p in started:
            with contextlib.suppress(psutil.Error):
                found[p.pid] = p
                found.update({c.pid: c for c in p.children(recursive=True)})
        return list(found.values())

    seen: dict[int, psutil.Process] = {}
    try:
        superlink = [line for line in lines if "flower-superlink" in line]
        assert len(superlink) == 1
        background(superlink[0], "superlink")
        end = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            assert time.monotonic() < end, (tmp_path / "superlink.log").read_text()[-2000:]
            time.sleep(0.2)
        for line in lines:
            if line.startswith(("mkdir -p ~/.flwr", "flwr supernode register")):
                run(line)
        for i, line in enumerate(line for line in lines if "flower-supernode" in line or "fedbayes.flower.executor" in line):
            background(line, f"node{i}")
        for line in lines:
            if line.startswith("mkdir -p fedbayes-app"):
                run(line)
        submit = [line for line in lines if line.startswith("flwr run")]
        assert len(submit) == 1
        seen.update({p.pid: p for p in tree()})
        run(submit[0])
        seen.update({p.pid: p for p in tree()})
        assert json.loads((out / "flower_status.json").read_text()) == {"ok": True}
        assert records(out / "metrics.jsonl")[-1]["round"] == 2 and records(out / "metrics.jsonl")[-1]["dropped"] == 0
        run_experiment(cfg, tmp_path / "sim")
        assert_same_server_state(tmp_path / "sim", out)
    finally:
        procs = list({**seen, **{p.pid: p for p in tree()}}.values())
        kill_tree(procs, signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=5)
        kill_tree(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
    left = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline", "status"])
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(tmp_path) in " ".join(p.info["cmdline"] or [])
    ]
    assert left == []


@pytest.mark.slow
def test_another_apps_tasks_on_a_warm_node_run_through_flowers_loader_and_then_a_fresh_clientapp(tmp_path):
    """Flower's own FedAvg (benchmarks/flower_fedavg_baseline.py, not fedbayes's app) on 2 warm
    nodes, 2 rounds: each executor runs the app's first task in its process (Flower's loader,
    to learn whose app it is) and the next in a fresh flwr-clientapp; the run completes."""
    from fedbayes.flower.deploy import LocalFederation

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    try:
        from flower_overhead import baseline_app
    finally:
        sys.path.remove(str(benchmarks))
    raw = raw_config("fedavg", rounds=2, num_clients=2)
    exp = build_experiment(validate(raw))
    fed = LocalFederation(tmp_path / "federation", 2, env={"PYTHONPATH": str(benchmarks)})
    for n in fed.nodes:
        n.data = {"data-file": str(node.write_client_file(exp, n.partition, tmp_path / f"node{n.partition}.npz"))}
    fed.app_dir = baseline_app(tmp_path / "baseline_app")
    cfg = tmp_path / "run.toml"
    cfg.write_text(tomli_w.dumps(raw))
    result = tmp_path / "flower_fedavg.json"
    try:
        fed.start()
        fed.submit({"config": str(cfg), "out": str(result)})
        end = time.monotonic() + 600
        while not result.is_file():
            assert time.monotonic() < end, (fed.workdir / "executor0.log").read_text()[-3000:]
            time.sleep(0.5)
        assert json.loads(result.read_text())["rounds"] == 2
        for i in range(2):
            log = (fed.workdir / f"executor{i}.log").read_text()
            assert log.count("its first task here, by Flower's loader") == 1 and log.count("started a fresh flwr-clientapp") >= 1, log[-3000:]
    finally:
        no_process_left(fed)


@pytest.mark.benchmark
@pytest.mark.slow
def test_warm_handlers_take_well_under_a_second_after_their_first_task(tmp_path):
    """A stopwatch (``--benchmarks`` only): on 2 warm nodes over 3 rounds, only the first round's
    handlers import, build or compile (a second or more); the warm ones take well under a second."""
    from fedbayes.flower.deploy import LocalFederation

    raw = raw_config("fedavg", rounds=3, num_clients=2)
    exp = build_experiment(validate(raw))
    fed = LocalFederation(tmp_path / "federation", 2)
    for n in fed.nodes:
        n.data = {"data-file": str(node.write_client_file(exp, n.partition, tmp_path / f"node{n.partition}.npz"))}
    try:
        fed.start()
        run_id, out = _submit(fed, tmp_path, raw, "timed")
        assert fed.wait(run_id, out, 600) == {"ok": True}
        times = records(out / "flower_times.jsonl")
        cold = [t["round"] for t in times if t["handler_max"] >= 1.0]  # a handler that imported, built or compiled
        assert cold == [1], times
    finally:
        no_process_left(fed)
