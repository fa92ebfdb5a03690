"""The Flower adapter (fedbayes.flower): codec, rounds against the simulator, malformed replies,
and real Flower processes (a SuperLink and SuperNodes on loopback; marked ``slow``).

Needs the flower extra (``pip install -e ".[flower]"``); without it the module is skipped.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import tomli_w

pytest.importorskip("flwr", reason="the flower extra is not installed (pip install -e '.[flower]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

from fedbayes.config.schema import validate  # noqa: E402
from fedbayes.flower.apps import train_reply  # noqa: E402
from fedbayes.flower.codec import INLINE_BYTES, packed, put, take, unpack  # noqa: E402
from fedbayes.flower.rounds import FlowerRounds, Reply, Settings  # noqa: E402
from fedbayes.runs.build import build_experiment  # noqa: E402
from fedbayes.runs.checkpoint import latest_checkpoint, read_checkpoint  # noqa: E402
from fedbayes.runs.loop import run_experiment  # noqa: E402

pytestmark = pytest.mark.flower


def raw_config(algorithm: str, rounds: int = 3, num_clients: int = 3) -> dict:
    return {
        "name": f"flower_{algorithm}",
        "seed": 0,
        "rounds": rounds,
        "data": {"dataset": "breast_cancer", "num_clients": num_clients, "partition": "dirichlet", "alpha": 1.0},
        "model": {"name": "logreg"},
        "client": {"epochs": 1, "batch_size": 32, "lr": 0.05},
        "server": {"clients_per_round": num_clients},
        "algorithm": {"name": algorithm},
    }


def server_arrays(run_dir: Path) -> dict[str, np.ndarray]:
    arrays, _ = read_checkpoint(latest_checkpoint(Path(run_dir) / "checkpoints"))
    return {k: v for k, v in arrays.items() if k.startswith("server")}


def assert_same_server_state(a_dir: Path, b_dir: Path, tol: float = 1e-5, rtol: float = 0.0) -> None:
    a, b = server_arrays(a_dir), server_arrays(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=tol, rtol=rtol, err_msg=k)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# ----- the round's broadcast -----------------------------------------------------------------------
def test_a_rounds_broadcast_is_inline_unless_its_copies_are_large():
    from fedbayes.flower.rounds import INLINE_ROUND_BYTES, broadcast_payload

    data = packed({"w": np.ones(1000, np.float32)})
    assert broadcast_payload(data, 3) is data
    many = INLINE_ROUND_BYTES // len(data) + 1  # the SuperLink would hold too many copies: one shared record
    assert isinstance(broadcast_payload(data, many), ArrayRecord) and unpack(broadcast_payload(data, many))["w"].shape == (1000,)
    big = b"\0" * (INLINE_BYTES + 1)
    assert isinstance(broadcast_payload(big, 1), ArrayRecord)


# ----- rounds in one process (the node's handler called directly) ------------------------------------
class InProcess:
    """A transport that runs each client's ClientApp handler in this process, with node ids
    100 + client; ``corrupt(client, content) -> content or Reply`` tampers with replies."""

    def __init__(self, num_clients: int, state_root: Path, corrupt=None, cache: dict | None = None):
        self.states = {c: RecordDict() for c in range(num_clients)}
        self.num_clients, self.root, self.corrupt = num_clients, state_root, corrupt
        self.cache = cache  # (round, client) -> honest reply content, shared between transports of one test module

    def wait_for_nodes(self, count, timeout, num_partitions):
        pass

    def _reply(self, round_idx, c, make):
        node_config = {"partition-id": c, "num-partitions": self.num_clients, "state-dir": str(self.root)}
        if self.cache is None:
            return train_reply(make(), node_config, self.states[c])
        if (round_idx, c) not in self.cache:
            self.cache[round_idx, c] = train_reply(make(), node_config, self.states[c])
        return _copy(self.cache[round_idx, c])

    def exchange(self, round_idx, requests, timeout):
        out = {}
        for c, make in requests.items():
            content = self._reply(round_idx, c, make)
            got = self.corrupt(c, content) if self.corrupt else content
            out[c] = got if isinstance(got, Reply) else Reply(100 + c, got)
        return out


def _copy(content: RecordDict) -> RecordDict:
    arrays = {k: ArrayRecord({n: Array(a.numpy().copy()) for n, a in r.items()}) for k, r in content.array_records.items()}
    configs = {k: ConfigRecord(dict(r)) for k, r in content.config_records.items()}
    return RecordDict({**arrays, **configs})


@pytest.fixture(scope="module")
def fedep_experiment():
    return build_experiment(validate(raw_config("fedep", rounds=1)))


@pytest.fixture(scope="module")
def honest(fedep_experiment, tmp_path_factory):
    """The honest replies of FedEP's first round, computed once for the module's tests (the
    nodes' partitions written from the built experiment, as `fedbayes deploy` does)."""
    from fedbayes.flower.node import prepare_data

    root = tmp_path_factory.mktemp("nodes")
    prepare_data(fedep_experiment, dict.fromkeys(range(3), root))
    return {"cache": {}, "root": root}


def _message(content: RecordDict) -> dict[str, np.ndarray]:
    return take(content, "reply", "meta")  # the message's leaves under "message/", the info's under "info/"


def _set(content, name, fn):
    arrays = _message(content)
    arrays[name] = fn(arrays[name])
    put(content, "reply", packed(arrays), "meta")
    return content


def _drop(content, name):
    arrays = _message(content)
    del arrays[name]
    put(content, "reply", packed(arrays), "meta")
    return content


def _precision_leaf(content) -> str:
    return next(n for n in _message(content) if n.startswith("message/") and "/precision/" in n)


def _mean_leaf(content) -> str:
    return next(n for n in _message(content) if n.startswith("message/") and "/precision_mean/" in n)


MALFORMED = {
    "wrong shape": (lambda c: _set(c, _mean_leaf(c), lambda a: np.zeros((*a.shape, 2), a.dtype)), "has shape"),
    "NaN": (lambda c: _set(c, _mean_leaf(c), lambda a: np.full_like(a, np.nan)), "message_ok failed"),
    "missing key": (lambda c: _drop(c, _mean_leaf(c)), "missing array"),
    "non-positive precision": (lambda c: _set(c, _precision_leaf(c), lambda a: np.full_like(a, -1e9)), "message_ok failed"),
    "ClientApp exception": (lambda c: Reply(0, None, "<class 'RuntimeError'>:<'boom'>"), "the node reported an error: <class 'RuntimeError'>"),
}


@pytest.mark.parametrize("kind", sorted(MALFORMED))
def test_malformed_replies_are_rejected_with_the_node_id_and_leave_the_server_state(kind, fedep_experiment, honest, caplog):
    corrupt, words = MALFORMED[kind]

    def tamper(client, content):
        got = corrupt(content)
        return got._replace(node_id=100 + client) if isinstance(got, Reply) else got

    rounds = FlowerRounds(fedep_experiment, InProcess(3, honest["root"], tamper, honest["cache"]), Settings())
    state = rounds.init(fedep_experiment.params)
    with caplog.at_level(logging.WARNING, logger="fedbayes.flower"):
        new, info = rounds.run_round(state)
    assert sorted(info.rejected.tolist()) == [0, 1, 2]
    assert not info.clients["accepted"].any()
    assert new.client_states["base"].tolist() == [-1, -1, -1]  # no client state is taken as accepted
    from fedbayes import protocol

    # nothing learned: the state as it was, but for what the method changes after such a round (its
    # adaptive damping shrinks)
    kept = protocol.rejected_round_state(fedep_experiment.algorithm, state.server_state)
    assert float(kept.damping.value) < float(state.server_state.damping.value)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(new.server_state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for c in range(3):
        assert any(f"client {c} (node {100 + c})" in r.getMessage() and words in r.getMessage() for r in caplog.records), (kind, c)


def test_a_round_with_no_accepted_message_ends_the_same_in_both_runners(fedep_experiment, honest):
    """The protocol's end of a round (fedbayes.protocol.finish_round): every message of round 0
    is NaN, in a deployment (the nodes' replies) and in the simulator (a NaN message attack by
    every client). Both runners keep the server state bit for bit (but for what the method changes
    after such a round: its adaptive damping shrinks) and report the same round."""
    from fedbayes import protocol
    from fedbayes.sim.scenario import Scenario, message_attack
    from fedbayes.sim.simulator import Simulator

    nan, _ = MALFORMED["NaN"]
    flower = FlowerRounds(fedep_experiment, InProcess(3, honest["root"], lambda c, x: nan(x), honest["cache"]), Settings())
    f_start = flower.init(fedep_experiment.params)
    f_state, f_info = flower.run_round(f_start)
    sim = Simulator(
        fedep_experiment.simulator.algorithm,
        fedep_experiment.federation,
        clients_per_round=3,
        seed=0,
        scenario=Scenario(attack=message_attack("nan"), attackers=[0, 1, 2]),
    )
    assert isinstance(flower, protocol.Runner) and isinstance(sim, protocol.Runner)
    assert flower.counts_dropped and not sim.counts_dropped
    s_start = sim.init(fedep_experiment.params)
    s_state, s_info = sim.run_round(s_start)

    def kept(state):
        return protocol.rejected_round_state(fedep_experiment.algorithm, state.server_state)

    for start, end in ((kept(f_start), f_state.server_state), (kept(s_start), s_state.server_state), (s_state.server_state, f_state.server_state)):
        for a, b in zip(jax.tree.leaves(start), jax.tree.leaves(end), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert f_state.round == s_state.round == 1
    for info in (f_info, s_info):
        assert info.round == 0 and info.cohort.tolist() == [0, 1, 2] and sorted(info.rejected.tolist()) == [0, 1, 2]
        assert info.dropped.tolist() == [] and info.late.tolist() == []
        assert info.clients["client"].tolist() == [0, 1, 2] and not info.clients["accepted"].any()
        assert info.server["num_accepted"] == 0
    assert sorted(f_info.server) == sorted(s_info.server)


def test_one_malformed_reply_is_left_out_of_an_otherwise_normal_round(fedep_experiment, honest):
    """Client 1's NaN reply gets weight zero; the round equals one where client 1 sent nothing."""
    nan, _ = MALFORMED["NaN"]
    bad = FlowerRounds(fedep_experiment, InProcess(3, honest["root"], lambda c, x: nan(x) if c == 1 else x, honest["cache"]), Settings())
    absent = FlowerRounds(fedep_experiment, InProcess(3, honest["root"], None, honest["cache"]), Settings())
    full = absent.transport.exchange
    absent.transport.exchange = lambda r, req, t: {c: v for c, v in full(r, req, t).items() if c != 1}
    s_bad, info_bad = bad.run_round(bad.init(fedep_experiment.params))
    s_abs, info_abs = absent.run_round(absent.init(fedep_experiment.params))
    assert info_bad.rejected.tolist() == [1] and info_abs.dropped.tolist() == [1]
    assert s_bad.client_states["base"].tolist() == s_abs.client_states["base"].tolist() == [0, -1, 0]
    for a, b in zip(jax.tree.leaves(s_bad.server_state), jax.tree.leaves(s_abs.server_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("arrays", ["inline", "records"])
def test_in_process_rounds_equal_the_simulator_for_a_stateful_method(tmp_path, arrays, monkeypatch):
    """ADMM over 2 rounds through the ClientApp's handler; ``records``: with the inline limit at 0,
    every broadcast and reply travels as a packed ArrayRecord (the path of messages over 5 MB)."""
    from fedbayes.flower import apps, codec, rounds
    from fedbayes.flower.node import prepare_data

    seen = []
    if arrays == "records":
        monkeypatch.setattr(codec, "INLINE_BYTES", 0)
        monkeypatch.setattr(rounds, "INLINE_BYTES", 0)
    real = apps.train_reply

    def train_reply(content, *args, **kwargs):
        reply = real(content, *args, **kwargs)
        seen.append(("broadcast" in content.array_records, "reply" in reply.array_records))
        return reply

    monkeypatch.setattr(sys.modules[__name__], "train_reply", train_reply)
    cfg = validate(raw_config("admm", rounds=2))
    run_experiment(cfg, tmp_path / "sim")
    prepare_data(build_experiment(cfg), dict.fromkeys(range(3), tmp_path / "nodes"))
    run_experiment(cfg, tmp_path / "flower", rounds=lambda exp: FlowerRounds(exp, InProcess(3, tmp_path / "nodes")))
    assert_same_server_state(tmp_path / "sim", tmp_path / "flower", tol=1e-6)
    assert records(tmp_path / "flower" / "metrics.jsonl")[-1]["dropped"] == 0
    # one message's bytes, as each runner counts them: the simulator's from its template, the
    # deployment's from the replies' decoding spec; 2 rounds of 3 replies each
    sim_summary, flower_summary = (json.loads((tmp_path / run / "summary.json").read_text()) for run in ("sim", "flower"))
    assert flower_summary["message_bytes"] == sim_summary["message_bytes"]
    assert flower_summary["final"]["bytes_up"] == 6 * flower_summary["message_bytes"]["up"]
    assert len(seen) == 6 and set(seen) == {(arrays == "records",) * 2}


@pytest.mark.parametrize(
    "name, structure",
    [
        ("fedlap_cov", {"covariance": "low_rank", "rank": 4, "basis_rounds": 1}),
        ("fedlap_cov", {"covariance": "kron", "basis_rounds": 1}),
        ("fedep", {"covariance": "kron", "basis_rounds": 1}),
        ("fedep", {"covariance": "low_rank", "rank": 4, "basis_rounds": 1}),
    ],
    ids=["low_rank", "kron", "fedep_kron", "fedep_low_rank"],
)
def test_in_process_rounds_equal_the_simulator_for_shared_basis_sites(tmp_path, name, structure):
    """FedLap-Cov and FedEP with a structure in a shared basis over 3 rounds through the ClientApp's
    handler, crossing the round where the basis is fixed: the low-rank basis and its flag in the
    broadcast, the core and the curvature sketch in the replies; the Kronecker bases (identity sides
    absent) and the mean they were fixed about, the eigenvalues and the layers' Kronecker factors in
    the replies, and the sites' flag in the node's state."""
    from fedbayes.flower.node import prepare_data

    raw = raw_config(name, rounds=3)
    raw["algorithm"].update(structure)
    cfg = validate(raw)
    run_experiment(cfg, tmp_path / "sim")
    prepare_data(build_experiment(cfg), dict.fromkeys(range(3), tmp_path / "nodes"))
    run_experiment(cfg, tmp_path / "flower", rounds=lambda exp: FlowerRounds(exp, InProcess(3, tmp_path / "nodes")))
    # the precisions reach 87 (FedLap-Cov) and a few hundred (FedEP) on this problem, where a float32
    # ulp is 7.6e-6 and 3e-5: one ulp of a reordered sum exceeds 1e-5 alone (seen on an AMD Zen 4 CPU)
    assert_same_server_state(tmp_path / "sim", tmp_path / "flower", tol=1e-5, rtol=1e-6)
    assert records(tmp_path / "flower" / "metrics.jsonl")[-1]["dropped"] == 0


def test_simulator_only_settings_are_refused_naming_the_field(fedep_experiment):
    from fedbayes.errors import BadInputError

    exp = build_experiment(validate({**raw_config("fedavg", rounds=1), "server": {"clients_per_round": 3, "dropout": 0.1}}))
    with pytest.raises(BadInputError, match="server.dropout"):
        FlowerRounds(exp, None)
    with pytest.raises(BadInputError, match="on-missing"):
        Settings(on_missing="wait")


# ----- real Flower processes ---------------------------------------------------------------------
def no_process_left(fed) -> None:
    import psutil

    fed.stop()
    assert fed.processes() == []
    marks = (str(fed.workdir), f"127.0.0.1:{fed.superlink_port}")
    left = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(m in cmd for m in marks):
            left.append((p.info["pid"], cmd[:120]))
    assert left == []


def _run(fed, tmp: Path, raw: dict, name: str, **settings) -> tuple[dict, Path]:
    cfg = tmp / f"{name}.toml"
    cfg.write_text(tomli_w.dumps(raw))
    out = tmp / name
    status = fed.run({"config": str(cfg), "out": str(out), **settings}, timeout=600)
    return status, out


def _check_complete(out: Path, num_clients: int, rounds: int) -> None:
    last = records(out / "metrics.jsonl")[-1]
    assert last["round"] == rounds and last["rejected"] == 0 and last["dropped"] == 0
    lines = records(out / "clients.jsonl")
    assert len(lines) == num_clients * rounds and not any(line["rejected"] or line.get("dropped") for line in lines)


# Rerun once: the kill after round 1 is recorded can land after SuperNode 1 has already pulled
# round 2's message, and that reply is then lost (a dropped client, as a deployment should count
# it; seen twice in about a dozen CI runs), while the comparison with the simulator needs every
# reply. A defect that drops or changes a reply fails both runs.
@pytest.mark.flaky(reruns=1)
@pytest.mark.slow
def test_real_federation_runs_equal_the_simulator_and_survive_a_restart(tmp_path):
    """A SuperLink and 3 SuperNodes over TLS (certificates made here): FedAvg, FedEP (identity)
    and ADMM, 3 rounds, every reply; ADMM's run kills SuperNode 1 after round 1 and restarts it
    (its duals come from its state folder); each final server state equals the simulator's
    within 1e-5; then no process is left."""
    from fedbayes.flower.deploy import LocalFederation
    from fedbayes.flower.node import prepare_data

    fed = LocalFederation(tmp_path / "federation", 3, tls=True)
    try:
        prepare_data(build_experiment(validate(raw_config("fedavg"))), {n.partition: n.state_dir for n in fed.nodes})
        fed.start()
        for algorithm in ("fedavg", "fedep"):
            raw = raw_config(algorithm)
            status, out = _run(fed, tmp_path, raw, algorithm, **{"reply-timeout": 120.0})
            assert status == {"ok": True}, status
            _check_complete(out, 3, 3)
            run_experiment(validate(raw), tmp_path / f"sim_{algorithm}")
            assert_same_server_state(tmp_path / f"sim_{algorithm}", out)

        raw = raw_config("admm")
        cfg = tmp_path / "admm.toml"
        cfg.write_text(tomli_w.dumps(raw))
        out = tmp_path / "admm"
        run_id = fed.submit({"config": str(cfg), "out": str(out), "reply-timeout": 120.0})
        end = time.monotonic() + 300
        while not (out / "metrics.jsonl").is_file() or len(records(out / "metrics.jsonl")) < 2:  # round 1 recorded
            assert time.monotonic() < end, "round 1 did not finish"
            time.sleep(0.2)
        fed.kill_node(1)
        fed.start_node(1)
        status = fed.wait(run_id, out, 600)
        assert status == {"ok": True}, status
        _check_complete(out, 3, 3)
        restarted = (fed.workdir / "node1.log").read_text().split("Starting Flower SuperNode")
        assert len(restarted) == 3 and "train message" in restarted[2], "the restarted SuperNode trained rounds 2 and 3"
        folder = fed.nodes[1].state_dir
        assert any(folder.rglob("round_000002.npz")), "the restarted node wrote its round-2 state"
        run_experiment(validate(raw), tmp_path / "sim_admm")
        assert_same_server_state(tmp_path / "sim_admm", out)
    finally:
        no_process_left(fed)


@pytest.mark.slow
def test_a_node_that_never_returns_is_counted_missing_after_the_reply_timeout(tmp_path):
    """On Flower's stock path (a fresh ClientApp process per message, executor = "stock")."""
    from fedbayes.flower.deploy import LocalFederation
    from fedbayes.flower.node import prepare_data

    raw = raw_config("fedavg", rounds=1, num_clients=2)
    fed = LocalFederation(tmp_path / "federation", 2, executor="stock")
    try:
        prepare_data(build_experiment(validate(raw)), {n.partition: n.state_dir for n in fed.nodes})
        fed.start()
        cfg = tmp_path / "c.toml"
        cfg.write_text(tomli_w.dumps(raw))
        out = tmp_path / "out"
        run_id = fed.submit({"config": str(cfg), "out": str(out), "reply-timeout": 45.0})
        # Kill node 1 once the ServerApp knows both nodes (its first query has been answered).
        end = time.monotonic() + 300
        while "query message" not in (fed.workdir / "node1.log").read_text() or "Sent successfully" not in (fed.workdir / "node1.log").read_text():
            assert time.monotonic() < end
            time.sleep(0.2)
        fed.kill_node(1)
        status = fed.wait(run_id, out, 600)
        assert status == {"ok": True}, status
        last = records(out / "metrics.jsonl")[-1]
        assert last["round"] == 1 and last["dropped"] == 1 and last["rejected"] == 0
        lines = {line["client"]: line for line in records(out / "clients.jsonl")}
        assert lines[1]["dropped"] is True and lines[0].get("dropped") is not True
    finally:
        no_process_left(fed)


@pytest.mark.slow
def test_a_supernode_whose_key_is_not_registered_is_refused(tmp_path):
    """SuperNode authentication (TLS, --enable-supernode-auth): the node whose public key was
    registered joins; one with an unregistered key is refused (Flower's exit code 305)."""
    from fedbayes.flower.deploy import LocalFederation, free_port, make_node_key, supernode_command

    fed = LocalFederation(tmp_path / "federation", 1, tls=True, auth=True)
    try:
        fed.start()
        key, _ = make_node_key(tmp_path / "keys", "intruder")  # never registered
        log = tmp_path / "intruder.log"
        fed.spawn(supernode_command(fed.address, free_port(), 0, 1, tmp_path / "intruder_state", fed.certs, key), tmp_path / "intruder_home", log)
        end = time.monotonic() + 120
        while "Failed to activate SuperNode" not in log.read_text():
            assert time.monotonic() < end, log.read_text()[-2000:]
            time.sleep(0.5)
        listed = fed.flwr("supernode", "ls", "local", "--format", "json")
        nodes = json.loads(listed.stdout[listed.stdout.index("{") :])["nodes"]
        assert [n["status"] for n in nodes] == ["online"], nodes  # only the registered node
        assert "SuperNode ID" in (fed.workdir / "node0.log").read_text()
    finally:
        no_process_left(fed)


def test_resumed_run_and_nodes_without_memory_continue_from_the_state_folders(tmp_path):
    """A deployed run stopped after round 2 and resumed (server from its checkpoint, every node
    with an empty context.state, as after a SuperNode restart) ends as the simulator's 3 rounds."""
    from fedbayes.flower.node import prepare_data

    cfg2, cfg3 = validate(raw_config("admm", rounds=2)), validate(raw_config("admm", rounds=3))
    prepare_data(build_experiment(cfg3), dict.fromkeys(range(3), tmp_path / "nodes"))
    run_experiment(cfg2, tmp_path / "flower", rounds=lambda exp: FlowerRounds(exp, InProcess(3, tmp_path / "nodes")))
    run_experiment(cfg3, tmp_path / "flower", resume=True, accept_changes=["rounds"], rounds=lambda exp: FlowerRounds(exp, InProcess(3, tmp_path / "nodes")))
    run_experiment(cfg3, tmp_path / "sim")
    assert_same_server_state(tmp_path / "sim", tmp_path / "flower", tol=1e-6)
    assert [r["round"] for r in records(tmp_path / "flower" / "metrics.jsonl")] == [0, 1, 2, 3]


@pytest.mark.slow
def test_an_interrupted_deploy_names_its_resume_and_fedbayes_resume_finishes_it_on_flower(tmp_path):
    """Ctrl-C during `fedbayes deploy` (after round 2's checkpoint): exit 130 and the resume line;
    `fedbayes resume OUT` continues the run on Flower (its checkpoint holds no client arrays, which
    the simulator would have expected) to the end; a second resume says it is finished."""
    import os
    import signal
    import subprocess
    import sys

    cfg = tmp_path / "c.toml"
    cfg.write_text(tomli_w.dumps({**raw_config("fedavg", rounds=4), "checkpoint_every": 2}))
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off")
    cli = [sys.executable, "-m", "fedbayes.cli"]
    proc = subprocess.Popen([*cli, "deploy", str(cfg), "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 300
    while not (out / "checkpoints" / "round_000002.npz").exists() and proc.poll() is None:
        assert time.monotonic() < end, "round 2 did not finish"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and f"`fedbayes resume {out}` continues from its checkpoint" in err.strip().splitlines()[-1], err
    res = subprocess.run([*cli, "resume", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    _check_complete(out, 3, 4)
    res = subprocess.run([*cli, "resume", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "finished earlier" in res.stdout, res.stdout + res.stderr


def test_the_grid_transport_pulls_a_rounds_replies_after_half_the_last_rounds_wait():
    """Replies come ``delay`` seconds after the push: from the second round on, the first pull waits
    half the shortest recent time to a first reply, then pulls every poll; every reply arrives."""
    import types

    from fedbayes.flower.rounds import GridTransport

    now, delay = [0.0], 0.4

    class Grid:
        def __init__(self):
            self.pushed, self.pulls = {}, []

        def get_node_ids(self):
            return [7]

        def push_messages(self, messages):
            ids = []
            for m in messages:
                mid = f"m{len(self.pushed)}"
                self.pushed[mid] = (now[0], m)
                ids.append(mid)
            return ids

        def pull_messages(self, ids):
            self.pulls.append(now[0])
            out = []
            for mid in ids:
                at, m = self.pushed[mid]
                if m.metadata.message_type == "query":
                    content = RecordDict({"partition": ConfigRecord({"partition-id": 0, "num-partitions": 1})})
                elif now[0] - at < delay:
                    continue
                else:
                    content = RecordDict({"meta": ConfigRecord({})})
                out.append(types.SimpleNamespace(metadata=types.SimpleNamespace(reply_to_message_id=mid), has_error=lambda: False, content=content))
            return out

    grid = Grid()
    transport = GridTransport(grid, poll_interval=0.05, clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))
    # Flower's Message needs a run's identity; the transport only reads the kind back
    transport.message = lambda content, node, kind, group: types.SimpleNamespace(metadata=types.SimpleNamespace(message_type=kind), content=content)
    transport.wait_for_nodes(1, 10.0, 1)
    firsts = []
    for r in range(3):
        start, grid.pulls = now[0], []
        replies = transport.exchange(r, {0: lambda: RecordDict({"fedbayes": ConfigRecord({})})}, timeout=10.0)
        assert set(replies) == {0}
        firsts.append((grid.pulls[0] - start, len(grid.pulls)))
    assert firsts[0][0] == 0.0 and firsts[0][1] >= 9  # round 0: pulls from the start, every 50 ms
    assert firsts[1][0] == pytest.approx(delay / 2, abs=0.03) and firsts[1][1] <= 6  # then half the wait first


@pytest.mark.slow
def test_real_nodes_refuse_a_server_named_module_and_the_server_hears_it(tmp_path):
    """A hostile server: its config's model.module names a file that no node lists. Each node
    (a real SuperNode and its warm executor) refuses before importing it; the server logs each
    node's one line and counts the replies rejected; only the server process imported the file."""
    from fedbayes.flower.deploy import LocalFederation
    from fedbayes.flower.node import prepare_data

    marker = tmp_path / "IMPORTED"
    evil = tmp_path / "evil_model.py"
    evil.write_text(
        f"import os, sys\nwith open({str(marker)!r}, 'a') as f:\n    f.write(' '.join(sys.argv) + '\\n')\n"
        "import flax.linen as nn\nclass Net(nn.Module):\n    num_classes: int = 2\n    @nn.compact\n    def __call__(self, x):\n"
        "        return nn.Dense(self.num_classes, name='dense')(x.reshape((x.shape[0], -1)))\n"
    )
    plain = raw_config("fedavg", rounds=1, num_clients=2)
    hostile = {**plain, "model": {"name": "module", "module": f"{evil}:Net"}}
    fed = LocalFederation(tmp_path / "federation", 2)
    try:
        prepare_data(build_experiment(validate(plain)), {n.partition: n.state_dir for n in fed.nodes})
        fed.start()
        status, out = _run(fed, tmp_path, hostile, "hostile", **{"reply-timeout": 120.0})
        assert status == {"ok": True}, status
        last = records(out / "metrics.jsonl")[-1]
        assert last["round"] == 1 and last["rejected"] == 2
        log = (out / "flower_server.log").read_text()
        assert log.count("this node refuses the run's model.module") >= 2, log[-2000:]
        importers = marker.read_text().splitlines()
        assert importers and all("serverapp" in line for line in importers), importers
    finally:
        no_process_left(fed)


@pytest.mark.slow
def test_a_deployed_run_with_its_own_model_module_lists_it_for_its_nodes(tmp_path):
    """`fedbayes deploy` starts both sides: its nodes get the run's module in model-modules and
    import it; the run equals the simulator's with the same module."""
    from fedbayes.flower.deploy import deploy_local

    module = tmp_path / "own_model.py"
    module.write_text(
        "import flax.linen as nn\nclass Net(nn.Module):\n    num_classes: int = 2\n    @nn.compact\n    def __call__(self, x):\n"
        "        return nn.Dense(self.num_classes, name='dense')(x.reshape((x.shape[0], -1)))\n"
    )
    raw = {**raw_config("fedavg", rounds=2, num_clients=2), "model": {"name": "module", "module": f"{module}:Net"}}
    deploy_local(validate(raw), tmp_path / "deployed", run_config={"reply-timeout": 120.0}, timeout=600)
    _check_complete(tmp_path / "deployed", 2, 2)
    run_experiment(validate(raw), tmp_path / "sim")
    assert_same_server_state(tmp_path / "sim", tmp_path / "deployed")


# A hostile server, for a real federation's test: its ServerApp process (and only it) sends a
# path to the nodes in every train message (fedbayes's own server strips every path).
HOSTILE_SERVER = """
import sys
if any("serverapp" in a for a in sys.argv):
    import importlib.abc, importlib.machinery

    class _Hostile(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "fedbayes.flower.rounds":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                honest = module.sent_config
                module.sent_config = lambda config: honest(config).replace('dataset = "breast_cancer"', 'dataset = "files"\\npath = "SECRET"')

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Hostile())
"""


@pytest.mark.slow
def test_real_nodes_refuse_a_path_their_server_names_and_read_nothing(tmp_path):
    """A hostile server names a file on the nodes' machine (`dataset = "files"`, `path`) in its
    train messages; each real node refuses in one line, which the server logs, and reads no file."""
    from fedbayes.flower.deploy import LocalFederation
    from fedbayes.flower.node import prepare_data

    secret = tmp_path / "secret.csv"
    secret.write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(200)))
    hook = tmp_path / "hostile"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOSTILE_SERVER.replace("SECRET", str(secret)))
    raw = raw_config("fedavg", rounds=1, num_clients=2)
    fed = LocalFederation(tmp_path / "federation", 2, env={"PYTHONPATH": str(hook)})
    try:
        prepare_data(build_experiment(validate(raw)), {n.partition: n.state_dir for n in fed.nodes})
        fed.start()
        status, out = _run(fed, tmp_path, raw, "hostile", **{"reply-timeout": 120.0})
        assert status == {"ok": True}, status
        assert records(out / "metrics.jsonl")[-1]["rejected"] == 2
        log = (out / "flower_server.log").read_text()
        assert log.count(f"this node refuses the run's data.path = '{secret}'") >= 2, log[-2000:]
        for n in fed.nodes:  # only the data prepared for them: nothing read from the server's file
            assert len(list((n.state_dir / "data").iterdir())) == 1
    finally:
        no_process_left(fed)
