"""Reliability: damaged run folders recover or fail in one line, one process per folder, strict inputs
and strict JSON, documented exit codes, and bitwise resume after a kill at a random moment."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import DIGITS_RUN as CFG
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, read_toml, validate
from fedbayes.data.dataset import DatasetNotFoundError
from fedbayes.data.idx import read_idx
from fedbayes.data.registry import load_dataset
from fedbayes.errors import DataError, exit_code_for
from fedbayes.protocol import SimState
from fedbayes.runs import runlock
from fedbayes.runs.checkpoint import CheckpointError, find_resume_checkpoint, list_checkpoints, read_checkpoint, save_checkpoint
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.strictjson import dumps_record, loads_strict, restore_record

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

FEDEP_DISK = dict(algorithm="fedep", extra="burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3", top='store = "disk"')


def write_cfg(folder: Path, rounds=6, algorithm="fedavg", extra="", top="", name="c.toml") -> Path:
    p = folder / name
    p.write_text(CFG.format(rounds=rounds, algorithm=algorithm, extra=extra, top=top))
    return p


def strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def one_line_error(res, code):
    """Exit ``code``, no traceback, and exactly one non-warning line on stderr."""
    assert res.exit_code == code, (res.exit_code, res.output)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    lines = [x for x in res.stderr.splitlines() if x.strip() and not x.startswith("warning:")]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """Uninterrupted reference runs: fedavg (memory) and FedEP (I) with a disk store."""
    tmp = tmp_path_factory.mktemp("ref")
    out = {}
    for key, kw in (("fedavg", {}), ("fedep", FEDEP_DISK)):
        cfg = write_cfg(tmp, name=f"{key}.toml", **kw)
        res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp / key)])
        assert res.exit_code == 0, res.output
        out[key] = (cfg, tmp / key)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    store = dst / "client_store"
    if store.is_dir():  # the checkpoints name the store's absolute path: keep it pointing here
        pass
    return dst


def _newest(out: Path) -> Path:
    return list_checkpoints(out / "checkpoints")[-1]


def _flip(path: Path, every=False):
    b = bytearray(path.read_bytes())
    for i in range(0, len(b), max(1, len(b) // 64)) if every else range(len(b) // 2, len(b) // 2 + 16):
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def _dup_line(path: Path):
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:3] + lines[2:3] + lines[3:]))


DAMAGE = {
    "newest checkpoint truncated": lambda o: _newest(o).write_bytes(_newest(o).read_bytes()[:-300]),
    "newest checkpoint garbled": lambda o: _flip(_newest(o)),
    "newest checkpoint 0 bytes": lambda o: _newest(o).write_bytes(b""),
    "metrics.jsonl deleted": lambda o: (o / "metrics.jsonl").unlink(),
    "metrics.jsonl torn": lambda o: (o / "metrics.jsonl").write_text((o / "metrics.jsonl").read_text()[:-40]),
    "metrics.jsonl line duplicated": lambda o: _dup_line(o / "metrics.jsonl"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_run_folder_resumes_exactly(tmp_path, finished, damage):
    """The newest checkpoint damaged (fallback to the older, one warning line) or metrics.jsonl
    lost: the resumed run's metrics equal the uninterrupted run's, twice in a row."""
    cfg, ref = finished["fedavg"]
    out = _copy(ref, tmp_path / "o")
    (out / "summary.json").unlink()
    DAMAGE[damage](out)
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    if "checkpoint" in damage:
        warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
        assert len(warnings) == 1 and "round_000006.npz" in warnings[0] and "round_000004.npz" in warnings[0]
        assert (out / "checkpoints" / "round_000006.npz.damaged").exists()
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(ref / "metrics.jsonl"))
    assert json.loads((out / "summary.json").read_text())["rounds_to"] == json.loads((ref / "summary.json").read_text())["rounds_to"]
    assert runner.invoke(app, ["resume", str(out)]).exit_code == 0


def test_disk_store_falls_back_to_the_older_checkpoint(tmp_path, finished):
    """FedEP's sites on disk: the undo logs the older kept checkpoint needs are kept."""
    cfg, ref = finished["fedep"]
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 0
    _newest(out).unlink()
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(ref / "metrics.jsonl"))
    _flip(_newest(out))
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(ref / "metrics.jsonl"))


@pytest.mark.parametrize(
    "damage,needle",
    [
        (lambda s: (s / "leaf_00000.bin").write_bytes((s / "leaf_00000.bin").read_bytes()[:-100]), "leaf_00000.bin: holds"),
        (lambda s: _flip(s / "leaf_00000.bin", every=True), "does not match its checksum"),
        (lambda s: (s / "store.json").unlink(), "store.json: missing"),
        (lambda s: (s / "rowsums.bin").unlink(), "rowsums.bin: missing"),
    ],
    ids=["leaf truncated", "leaf garbled", "store.json deleted", "checksums deleted"],
)
def test_a_damaged_disk_store_is_one_line_exit_4(tmp_path, finished, damage, needle):
    cfg, _ = finished["fedep"]
    out = tmp_path / "o"
    assert runner.invoke(app, ["run", str(cfg), "--out", str(out)]).exit_code == 0
    _newest(out).unlink()  # the resume must read the store (roll back and replay two rounds)
    damage(out / "client_store")
    line = one_line_error(runner.invoke(app, ["resume", str(out)]), 4)
    assert needle in line


def test_no_intact_checkpoint_is_exit_4(tmp_path, finished):
    _, ref = finished["fedavg"]
    out = _copy(ref, tmp_path / "o")
    for c in list_checkpoints(out / "checkpoints"):
        c.write_bytes(b"junk")
    line = one_line_error(runner.invoke(app, ["resume", str(out)]), 4)
    assert "no intact checkpoint" in line and "round_000004.npz" in line


def test_a_changed_config_is_refused_unless_set_and_then_recorded(tmp_path, finished):
    _, ref = finished["fedavg"]
    out = _copy(ref, tmp_path / "o")
    cfg = out / "config.toml"
    cfg.write_text(cfg.read_text().replace("lr = 0.1", "lr = 0.3").replace("rounds = 6", "rounds = 8"))
    line = one_line_error(runner.invoke(app, ["resume", str(out)]), 2)
    assert "client.lr (0.1 -> 0.3)" in line and "rounds (6 -> 8)" in line and "--set client.lr=0.3" in line
    line = one_line_error(runner.invoke(app, ["resume", str(out), "--set", "rounds=8"]), 2)
    assert "client.lr" in line and "rounds (" not in line
    res = runner.invoke(app, ["resume", str(out), "--set", "rounds=8", "--set", "client.lr=0.3"])
    assert res.exit_code == 0, res.output
    assert [r["round"] for r in read_metrics(out / "metrics.jsonl")][-1] == 8
    change = json.loads((out / "resume_changes.jsonl").read_text().splitlines()[0])
    assert change == {"round": 6, "changed": {"client.lr": [0.1, 0.3], "rounds": [6, 8]}}
    assert runner.invoke(app, ["resume", str(out)]).exit_code == 0  # the checkpoint now holds the new config


def test_checkpoint_checksum_and_fallback_unit(tmp_path):
    state = lambda r: SimState(r, {"w": np.full(3, r, np.float32), "key": jax.random.key(r)}, ())  # noqa: E731
    for r in (2, 4):
        save_checkpoint(tmp_path, state(r), {"counters": {}, "metrics": [{"round": r}]})
    arrays, meta = read_checkpoint(tmp_path / "round_000004.npz")
    assert meta["round"] == 4 and meta["metrics"] == [{"round": 4}]
    _flip(tmp_path / "round_000004.npz")
    with pytest.raises(CheckpointError, match="round_000004.npz: damaged checkpoint"):
        read_checkpoint(tmp_path / "round_000004.npz")
    said = []
    path, meta = find_resume_checkpoint(tmp_path, said.append)
    assert path.name == "round_000002.npz" and len(said) == 1 and said[0].startswith("warning:")
    assert find_resume_checkpoint(tmp_path / "none") is None


# ----- one process per folder ---------------------------------------------------------------------
@pytest.mark.parametrize("command", ["run", "resume", "compare"])
def test_a_second_process_on_a_folder_exits_at_once_naming_the_holder(tmp_path, command):
    cfg = write_cfg(tmp_path)
    out = tmp_path / "o"
    (out).mkdir()
    (out / "config.toml").write_text(cfg.read_text())
    args = {"run": ["run", str(cfg), "--out", str(out)], "resume": ["resume", str(out)], "compare": ["compare", str(cfg), "--out", str(out)]}[command]
    if command == "compare":
        with runlock.hold(out):
            line = one_line_error(runner.invoke(app, args), 5)
    else:
        with runlock.hold(out):
            line = one_line_error(runner.invoke(app, args), 5)
    assert f"pid {os.getpid()}" in line
    assert not (out / "metrics.jsonl").exists()


def test_the_lock_is_released_when_its_holder_is_killed(tmp_path):
    code = "import sys, time; sys.path.insert(0, %r); from fedbayes.runs import runlock\nwith runlock.hold(%r):\n    print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code % (str(ROOT / "src"), str(tmp_path))], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(Exception, match=f"pid {proc.pid}"):
            with runlock.hold(tmp_path):
                pass
    finally:
        proc.kill()
        proc.wait()
    with runlock.hold(tmp_path):  # kill -9 released it
        pass


# ----- every error one line, documented exit codes ---------------------------------------------------
def test_bad_configs_are_one_line_exit_2(tmp_path):
    cfg = write_cfg(tmp_path)
    binary = tmp_path / "b.toml"
    binary.write_bytes(bytes(range(256)) * 3)
    empty = tmp_path / "e.toml"
    empty.write_text("# nothing\n")
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = [
        (["run", str(binary)], "not a text file"),
        (["run", str(empty)], "fedbayes config"),
        (["run", str(cfg), "--out", str(afile)], "is a file; pass a folder"),
        (["run", str(cfg), "--out", str(afile / "sub")], "is a file, not a folder"),
        (
            ["run", str(cfg), "--out", str(tmp_path / "sd"), "--set", 'store="disk"', "--set", 'algorithm.name="admm"', "--set", f'store_dir="{afile}"'],
            "store_dir",
        ),
        (["run", str(cfg), "--set", "rounds=true"], "rounds: must be a number, not a boolean"),
        (["run", str(cfg), "--set", "client.lr=inf"], "client.lr: Input should be a finite number"),
        (["run", str(cfg), "--set", "server.lr=nan"], "server.lr: Input should be a finite number"),
        (["run", str(cfg), "--set", 'name="../../x"'], "name: must be a plain file name"),
        (["run", str(cfg), "--set", 'name=""'], "name: must be a plain file name"),
    ]
    for args, needle in cases:
        line = one_line_error(runner.invoke(app, args), 2)
        assert needle in line, (args, line)
        assert line.startswith(("config error: ", "error: ")) and line.count("error:") == 1, line
    assert not (tmp_path.parent / "x").exists()


def test_fail_fast_is_one_line_exit_3(tmp_path, monkeypatch):
    """The simulator's fail_fast error (a DivergedError) reaches the user as one line, exit 3."""
    import fedbayes.runs.loop as experiment
    from fedbayes.errors import DivergedError

    def rejected(*a, **k):
        raise DivergedError("round 3: client messages rejected (non-finite or invalid) from clients [2] (server.fail_fast)")

    monkeypatch.setattr(experiment, "run_experiment", rejected)
    line = one_line_error(runner.invoke(app, ["run", str(write_cfg(tmp_path)), "--out", str(tmp_path / "o")]), 3)
    assert "rejected" in line and "server.fail_fast" in line


def test_unanticipated_errors_name_a_log_with_the_traceback_and_interrupts_say_how_to_resume(tmp_path, monkeypatch):
    import fedbayes.runs.loop as experiment

    cfg = write_cfg(tmp_path)
    out = tmp_path / "o"

    def boom(*a, **k):
        raise ZeroDivisionError("division by zero somewhere deep")

    monkeypatch.setattr(experiment, "run_experiment", boom)
    line = one_line_error(runner.invoke(app, ["run", str(cfg), "--out", str(out)]), 1)
    assert "internal error: ZeroDivisionError" in line and str(out / "error.log") in line
    assert "Traceback" in (out / "error.log").read_text() and "boom" in (out / "error.log").read_text()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment, "run_experiment", interrupted)
    line = one_line_error(runner.invoke(app, ["run", str(cfg), "--out", str(out), "--overwrite"]), 130)
    assert f"fedbayes resume {out}" in line
    assert exit_code_for(PermissionError(13, "denied")) == 2 and exit_code_for(KeyboardInterrupt()) == 130


def test_sigterm_during_a_run_exits_130_with_the_resume_line(tmp_path):
    cfg = write_cfg(tmp_path, rounds=500)
    out = tmp_path / "o"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE="off", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", "run", str(cfg), "--out", str(out)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and len(list_checkpoints(out / "checkpoints")) == 0:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and f"fedbayes resume {out}" in err.strip().splitlines()[-1]


# ----- data checked once at load -----------------------------------------------------------------------
def _leaf(folder: Path, train: dict, test: dict) -> Path:
    for split, users in (("train", train), ("test", test)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        blob = {"users": list(users), "num_samples": [len(y) for _, y in users.values()], "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
        (folder / split / "d.json").write_text(json.dumps(blob))
    return folder


def _users(seed=0, n_users=3, n=6, dim=4, classes=3):
    rng = np.random.default_rng(seed)
    return {f"u{i}": (rng.normal(size=(n, dim)).round(3).tolist(), rng.integers(0, classes, n).tolist()) for i in range(n_users)}


def _nan_train():
    u = _users(1)
    u["u1"][0][2][1] = float("nan")
    return u


def _null_train():
    u = _users(1)
    u["u2"][0][0][0] = None
    return u


def _big_label():
    u = _users(1)
    u["u0"][1][3] = 1000
    return u


@pytest.mark.parametrize(
    "train,test,needle",
    [
        (_users(0), {u: ([], []) for u in _users(0)}, "the test split holds no examples"),
        (_nan_train(), _users(2), "user 'u1', example 2: a non-finite feature"),
        (_null_train(), _users(2), "user 'u2'"),
        (_users(0), _nan_train(), "user 'u1'"),
        (_big_label(), _users(2), "user 'u0': label 1000"),
    ],
    ids=["empty test", "NaN train", "null train", "NaN test", "label 1000"],
)
def test_bad_leaf_data_is_one_line_naming_file_and_client(tmp_path, train, test, needle):
    folder = _leaf(tmp_path / "leaf", train, test)
    with pytest.raises(DataError, match=needle) as err:
        load_dataset("leaf", data_dir=folder)
    assert "\n" not in str(err.value) and "d.json" in str(err.value) or "split" in needle


def _idx_file(path: Path, a: np.ndarray, code=0x08, compress=True):
    raw = struct.pack(">BBBB", 0, 0, code, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.astype(a.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)
    return path


def _idx_folder(folder: Path, test_labels=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    _idx_file(folder / "train-images-idx3-ubyte.gz", rng.integers(0, 255, (30, 28, 28), dtype=np.uint8))
    _idx_file(folder / "train-labels-idx1-ubyte.gz", rng.integers(0, 10, 30).astype(np.uint8))
    _idx_file(folder / "t10k-images-idx3-ubyte.gz", rng.integers(0, 255, (10, 28, 28), dtype=np.uint8))
    _idx_file(folder / "t10k-labels-idx1-ubyte.gz", test_labels if test_labels is not None else rng.integers(0, 10, 10).astype(np.uint8))
    return folder


def test_bad_idx_files_are_one_line_naming_the_file(tmp_path):
    labels = np.arange(10, dtype=np.uint8)
    labels[4] = 42
    with pytest.raises(DataError, match=r"t10k-labels-idx1-ubyte.gz: label 42 at position 4 is outside the 10 classes"):
        load_dataset("mnist", data_dir=_idx_folder(tmp_path / "a", labels))
    f = _idx_folder(tmp_path / "b") / "train-labels-idx1-ubyte.gz"
    b = bytearray(f.read_bytes())
    b[-8] ^= 0xFF  # the gzip trailer's CRC-32
    f.write_bytes(bytes(b))
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: damaged gzip file"):
        load_dataset("mnist", data_dir=tmp_path / "b")
    f = _idx_folder(tmp_path / "c") / "train-images-idx3-ubyte.gz"
    b = bytearray(f.read_bytes())
    for i in range(20, 60):
        b[i] ^= 0x5A
    f.write_bytes(bytes(b))
    with pytest.raises(DataError, match="train-images-idx3-ubyte.gz: damaged gzip file"):
        load_dataset("mnist", data_dir=tmp_path / "c")
    nan = _idx_file(tmp_path / "f.idx", np.array([1.0, np.nan], np.float32), code=0x0D, compress=False)
    with pytest.raises(DataError, match="non-finite"):
        read_idx(nan)


# ----- fuzz: configs and LEAF/IDX inputs give one-line errors, never tracebacks -----------------------------
_scalars = st.one_of(st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.none())
_keys = st.sampled_from(["rounds", "seed", "name", "eval_every", "checkpoint_every", "store", "layout", "bogus", "store_dir"])
_sections = {
    "data": ["dataset", "num_clients", "partition", "alpha", "fraction", "num_classes", "bogus"],
    "client": ["lr", "epochs", "batch_size", "momentum", "optimizer"],
    "server": ["lr", "clients_per_round", "optimizer", "fail_fast", "tau"],
    "algorithm": ["name", "mu", "rho", "damping", "scale", "method"],
    "model": ["name", "hidden"],
}


@st.composite
def raw_configs(draw):
    raw = {k: draw(_scalars) for k in draw(st.lists(_keys, max_size=3))}
    for sec, keys in _sections.items():
        if draw(st.booleans()):
            vals = st.one_of(
                _scalars, st.lists(st.integers(-2, 300), max_size=3), st.sampled_from(["fedavg", "fedprox", "admm", "fedep", "mlp", "logreg", "digits", "iid"])
            )
            raw[sec] = {k: draw(vals) for k in draw(st.lists(st.sampled_from(keys), max_size=3))}
    return raw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_configs())
def test_fuzzed_configs_validate_or_fail_in_one_line(raw):
    try:
        cfg = validate(raw)
    except ConfigError as exc:
        assert "\n" not in str(exc) and str(exc).startswith("config error: ")
        return
    assert isinstance(cfg.rounds, int) and not isinstance(cfg.rounds, bool)
    assert np.isfinite(cfg.client.lr) and np.isfinite(cfg.server.lr) and "/" not in cfg.name


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=200))
def test_fuzzed_config_files_read_or_fail_in_one_line(tmp_path, data):
    p = tmp_path / "f.toml"
    p.write_bytes(data)
    try:
        validate(read_toml(p))
    except ConfigError as exc:
        assert "\n" not in str(exc)


_json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-5, 70), st.floats(allow_nan=False, allow_infinity=False, width=32), st.text(max_size=3)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.sampled_from(["x", "y", "users", "num_samples", "user_data", "u0"]), c, max_size=4)),
    max_leaves=20,
)


@st.composite
def leaf_blobs(draw):
    users = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    dim = draw(st.integers(1, 3))
    blob = {"users": users, "num_samples": [], "user_data": {}}
    for u in users:
        n = draw(st.integers(0, 3))
        x = [[draw(st.one_of(st.floats(width=32), st.none(), st.integers(-3, 3))) for _ in range(dim)] for _ in range(n)]
        y = [draw(st.one_of(st.integers(-1, 70), st.floats(), st.none(), st.booleans())) for _ in range(n)]
        blob["user_data"][u] = {"x": x, "y": y}
        blob["num_samples"].append(n)
    mode = draw(st.sampled_from(["ok", "junk", "truncate", "replace"]))
    text = json.dumps(blob)
    if mode == "junk":
        text = json.dumps(draw(_json_values))
    elif mode == "truncate":
        text = text[: draw(st.integers(0, len(text)))]
    elif mode == "replace":
        i = draw(st.integers(0, max(0, len(text) - 1)))
        text = text[:i] + draw(st.sampled_from(["NaN", "}", "[", "\x00", "1e999", '"'])) + text[i + 1 :]
    return text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(leaf_blobs(), leaf_blobs())
def test_fuzzed_leaf_folders_load_or_fail_in_one_line(tmp_path, train, test):
    folder = tmp_path / "leaf"
    for split, text in (("train", train), ("test", test)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        (folder / split / "d.json").write_text(text)
    try:
        ds = load_dataset("leaf", data_dir=folder)
    except (DataError, DatasetNotFoundError) as exc:
        assert "\n" not in str(exc)
        return
    assert np.isfinite(ds.x_train).all() and np.isfinite(ds.x_test).all() and ds.num_test > 0
    assert ds.y_train.max() < ds.num_classes and ds.y_test.max() < ds.num_classes


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzzed_idx_files_read_or_fail_in_one_line(tmp_path, data):
    a = np.arange(data.draw(st.integers(0, 12)), dtype=np.uint8).reshape(-1)
    raw = bytearray(struct.pack(">BBBB", 0, 0, 0x08, 1) + struct.pack(">I", len(a)) + a.tobytes())
    for _ in range(data.draw(st.integers(0, 3))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = bytes(raw[: data.draw(st.integers(0, len(raw)))])
    if data.draw(st.booleans()):
        z = bytearray(gzip.compress(raw))
        if data.draw(st.booleans()):
            z[data.draw(st.integers(0, len(z) - 1))] ^= data.draw(st.integers(1, 255))
        raw = bytes(z[: data.draw(st.integers(len(z) // 2, len(z)))])
    p = tmp_path / "f.idx"
    p.write_bytes(raw)
    try:
        read_idx(p)
    except DataError as exc:
        assert "\n" not in str(exc) and str(p) in str(exc)


# ----- strict JSON ------------------------------------------------------------------------------------------
def test_strict_json_round_trip():
    rec = {"round": 3, "accuracy": 0.5, "nll": float("nan"), "ece": float("inf")}
    text = dumps_record(rec)
    assert "NaN" not in text and "Infinity" not in text
    back = restore_record(loads_strict(text))
    assert back["accuracy"] == 0.5 and np.isnan(back["nll"]) and np.isnan(back["ece"]) and "nonfinite" not in back
    with pytest.raises(ValueError):
        loads_strict('{"a": NaN}')


def test_a_diverged_run_writes_strict_json(tmp_path):
    """A run that diverges exits 3, records where in summary.json, and every JSON file it wrote is strict JSON."""
    cfg = write_cfg(tmp_path, rounds=2)
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--set", "server.lr=1e30", "--set", "client.lr=1e30"])
    assert res.exit_code == 3, res.output
    summary = loads_strict((out / "summary.json").read_text())
    diverged = summary["diverged"]
    assert diverged["round"] in (1, 2), diverged
    assert diverged["metric"] in ("training loss", "server parameters") or diverged["metric"].startswith("evaluated "), diverged
    assert "checkpoint" in diverged
    written = sorted(p for p in out.rglob("*") if p.suffix in (".json", ".jsonl"))
    assert {p.name for p in written} >= {"summary.json", "metrics.jsonl", "clients.jsonl"}
    for f in written:
        for line in [f.read_text()] if f.suffix == ".json" else f.read_text().splitlines():
            loads_strict(line)


# ----- crash consistency: kill -9 at random moments, resume bitwise ---------------------------------------------
def _cli(args, env_extra=None, cache=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(cache or "off"), PYTHONPATH=str(ROOT / "src"), **(env_extra or {}))
    return subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", *map(str, args)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _final_arrays(out: Path):
    with np.load(_newest(out)) as f:
        return {k: f[k] for k in f.files if k.startswith(("server_", "client_"))}


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind,kw",
    [("stateless", dict(algorithm="fedavg")), ("dual", dict(algorithm="admm")), ("site, disk store", FEDEP_DISK), ("PVI", dict(algorithm="pvi"))],
)
def test_kill_at_random_moments_and_resume_bitwise(tmp_path, kind, kw):
    """Two kill -9s at random moments (seeded), each followed by a resume (which may itself be
    killed once): the final metrics, clients.jsonl, summary.json (warnings included) and checkpoint
    arrays equal an uninterrupted run's."""
    cache = tmp_path / "xla"
    cfg = write_cfg(tmp_path, rounds=8, **kw)
    ref = tmp_path / "ref"
    t0 = time.time()
    p = _cli(["run", cfg, "--out", ref], cache=cache)
    assert p.wait(timeout=300) == 0, p.stderr.read()
    duration = time.time() - t0
    rng = np.random.default_rng(abs(hash(kind)) % 2**32)
    out = tmp_path / "o"
    args = ["run", cfg, "--out", out]
    kills = 0
    for attempt in range(6):
        p = _cli(args, cache=cache)
        if kills < 2:
            try:
                p.wait(timeout=float(rng.uniform(0.3, 1.0)) * duration)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                kills += 1
        code = p.wait(timeout=300)
        err = p.stderr.read()
        assert "Traceback" not in err, err
        if code == 0:
            break
        # killed before the run wrote its config (during start-up): nothing to resume, run it again
        args = ["resume", out] if (out / "config.toml").is_file() else ["run", cfg, "--out", out]
    assert code == 0, err
    assert strip(read_metrics(out / "metrics.jsonl")) == strip(read_metrics(ref / "metrics.jsonl"))
    assert (out / "clients.jsonl").read_bytes() == (ref / "clients.jsonl").read_bytes()
    summaries = [json.loads((d / "summary.json").read_text()) for d in (out, ref)]
    for s in summaries:
        s["final"].pop("seconds")  # wall-clock
    assert summaries[0] == summaries[1]  # its warnings included
    a, b = _final_arrays(ref), _final_arrays(out)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    if "disk" in kind:
        for leaf in sorted((ref / "client_store").glob("leaf_*.bin")):
            assert leaf.read_bytes() == (out / "client_store" / leaf.name).read_bytes()
