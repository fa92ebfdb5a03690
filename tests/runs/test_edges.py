"""Reliability at the edges: every file of a run folder checked or rebuilt on resume, health checks
that continue across a resume, divergence by rejection, and the comparison resume that checks each
variant's files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import DIGITS_RUN
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.runs import folder, health

runner = CliRunner()

CFG = DIGITS_RUN.format(rounds=6, top="", algorithm="fedavg", extra="")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run (FedAvg on digits, 6 rounds, checkpoints every 2)."""
    tmp = tmp_path_factory.mktemp("edge")
    cfg = tmp / "c.toml"
    cfg.write_text(CFG)
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp / "ref")])
    assert res.exit_code == 0, res.output
    return cfg, tmp / "ref"


def model_arrays(path: Path) -> dict:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def assert_same_run(out: Path, ref: Path, *, exact_seconds: bool = True) -> None:
    """Every file of ``out`` holds what the uninterrupted ``ref`` holds (wall-clock seconds aside
    when the resume retrained rounds)."""
    strip = (lambda t: t) if exact_seconds else (lambda t: "".join(_no_seconds(line) for line in t.splitlines(keepends=True)))
    assert strip((out / folder.METRICS).read_text()) == strip((ref / folder.METRICS).read_text())
    assert (out / folder.CLIENTS).read_bytes() == (ref / folder.CLIENTS).read_bytes()
    a, b = json.loads((out / folder.SUMMARY).read_text()), json.loads((ref / folder.SUMMARY).read_text())
    if not exact_seconds:
        a["final"].pop("seconds"), b["final"].pop("seconds")
    assert a == b
    ma, mb = model_arrays(out / folder.MODEL), model_arrays(ref / folder.MODEL)
    assert ma.keys() == mb.keys() and all(np.array_equal(ma[k], mb[k]) for k in ma)
    assert (out / folder.CURVES).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _no_seconds(line: str) -> str:
    r = json.loads(line)
    r.pop("seconds", None)
    return json.dumps(r)


def _garble_line(path: Path, i: int, text: str) -> None:
    lines = path.read_text().splitlines(keepends=True)
    lines[i] = text + "\n"
    path.write_text("".join(lines))


DAMAGE = {
    "summary.json deleted": lambda o: (o / folder.SUMMARY).unlink(),
    "summary.json cut": lambda o: (o / folder.SUMMARY).write_text((o / folder.SUMMARY).read_text()[:50]),
    "model.npz deleted": lambda o: (o / folder.MODEL).unlink(),
    "model.npz cut": lambda o: (o / folder.MODEL).write_bytes((o / folder.MODEL).read_bytes()[:-100]),
    "curves.png deleted": lambda o: (o / folder.CURVES).unlink(),
    "metrics.jsonl line garbled": lambda o: _garble_line(o / folder.METRICS, 2, '{"round": 2, "accuracy": 0.99}'),
    "clients.jsonl deleted": lambda o: (o / folder.CLIENTS).unlink(),
    "clients.jsonl cut": lambda o: (o / folder.CLIENTS).write_text((o / folder.CLIENTS).read_text()[:300]),
    "clients.jsonl line garbled": lambda o: _garble_line(o / folder.CLIENTS, 4, '{"round": 2, "client": 9'),
    "clients.jsonl line 17": lambda o: _garble_line(o / folder.CLIENTS, 4, "17"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_file_of_a_finished_run_is_named_and_rebuilt_exactly(tmp_path, reference, damage):
    """Resume rebuilds the file from the final checkpoint, bit for bit, and names it in one line;
    a second resume finds every file intact and says so."""
    _, ref = reference
    out = tmp_path / "o"
    shutil.copytree(ref, out)
    DAMAGE[damage](out)
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    if damage == "summary.json deleted":  # as a run killed as it finished: written, nothing to name
        assert not warnings, res.stderr
    else:
        assert len(warnings) == 1 and damage.split()[0] in warnings[0], res.stderr
    assert_same_run(out, ref)
    again = runner.invoke(app, ["resume", str(out)])
    assert again.exit_code == 0 and "finished earlier" in again.output and not again.stderr.strip(), again.output


def test_resuming_a_finished_run_says_so_in_one_line(tmp_path, reference):
    _, ref = reference
    out = tmp_path / "o"
    shutil.copytree(ref, out)
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0 and res.stdout.strip().count("\n") == 0 and "finished earlier" in res.stdout, res.output
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file() and p.name in before} == before


@pytest.mark.parametrize("damage", ["clients.jsonl deleted", "clients.jsonl cut", "clients.jsonl line 17", "metrics.jsonl line garbled"])
def test_an_interrupted_run_rebuilds_its_logs_from_the_checkpoint(tmp_path, reference, damage):
    """Killed after round 4's checkpoint (the final one gone): the logs are rebuilt from round 4's
    checkpoint, the rounds after it retrained, and the run ends as the uninterrupted one."""
    _, ref = reference
    out = tmp_path / "o"
    shutil.copytree(ref, out)
    for name in (folder.SUMMARY, folder.CURVES, folder.MODEL):
        (out / name).unlink()
    (out / folder.CHECKPOINTS / folder.checkpoint_name(6)).unlink()
    DAMAGE[damage](out)
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 1 and "round 4" in warnings[0], res.stderr
    assert_same_run(out, ref, exact_seconds=False)


def test_a_comparison_resume_checks_each_variant_s_files(tmp_path, comparison):
    """A variant with a summary but without its metrics.jsonl or model.npz is not counted as
    finished: the resume rebuilds them (one line each) and writes the comparison's files."""
    out = tmp_path / "out"
    shutil.copytree(comparison, out)
    metrics_a, model_b = (out / "a" / folder.METRICS).read_bytes(), model_arrays(out / "b" / folder.MODEL)
    (out / "a" / folder.METRICS).unlink()
    (out / "b" / folder.MODEL).unlink()
    (out / folder.COMPARE_JSON).unlink()
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    warnings = [x for x in res.stderr.splitlines() if x.startswith("warning:")]
    assert len(warnings) == 2 and any("a/metrics.jsonl: missing" in w for w in warnings) and any("b/model.npz" in w for w in warnings), res.stderr
    assert (out / "a" / folder.METRICS).read_bytes() == metrics_a
    assert all(np.array_equal(model_arrays(out / "b" / folder.MODEL)[k], v) for k, v in model_b.items())
    assert (out / folder.COMPARE_JSON).is_file()


def test_the_calibration_and_fixed_point_checks_continue_across_a_resume():
    """The checks' state after round k, saved and restored, gives the same warnings as one pass."""
    rng = np.random.default_rng(0)
    snaps = [(1.0 + 0.1 * r + 0.001 * rng.normal(size=5), np.exp(0.01 * rng.normal(size=5) + 0.02 * r)) for r in range(31)]
    records = [{"round": r, "accuracy": 0.8, "accuracy_marg": 0.8 - (0.1 if 7 <= r < 7 + health.CALIBRATION_ROUNDS else 0.0)} for r in range(31)]

    def one_pass(split=None):
        check, cal = health.FixedPointCheck("x", 30), health.CalibrationCheck("x")
        done = []
        for r in range(31):
            if split is not None and r == split:
                saved = check.saved()
                check, cal = health.FixedPointCheck("x", 30), health.CalibrationCheck("x")
                cal.replay(done)
                check.restore(saved, r - 1, snaps[r - 1])
            check.observe(r, snaps[r])
            cal.check(records[r])
            done.append(records[r])
        return check.finish(), cal.message, check.change, check.result

    whole = one_pass()
    assert whole[0] is not None and whole[1] is not None  # both checks warn in this sequence
    assert whole[3]["settled"] is False and whole[3]["mean_drift"] > 0.01 and "mean" in whole[3]["moved"]  # the verdict summary.json keeps
    for split in (5, 9, 21, 25, 30):  # 9: inside the calibration gap's streak
        assert one_pass(split) == whole


def test_a_run_whose_every_message_is_rejected_stops_as_diverged(tmp_path):
    """PVI with a huge step: every message refused for server.max_rejected_rounds rounds in a row
    is exit 3 with one line whose advice names settings the method has."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(CFG.replace('name = "fedavg"', 'name = "pvi"').replace("lr = 0.1", "lr = 1e6"))
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "o"), "--set", "server.max_rejected_rounds=2"])
    assert res.exit_code == 3, res.output
    line = [x for x in res.stderr.splitlines() if x.startswith("diverged")]
    assert len(line) == 1 and "diverged at round 2: every client's message was rejected for 2 rounds in a row" in line[0], res.stderr
    assert "--set client.lr=..." in line[0]
    assert json.loads((tmp_path / "o" / folder.SUMMARY).read_text())["diverged"]["round"] == 2


def test_the_divergence_advice_names_only_settings_the_method_has():
    from fedbayes.config.schema import validate

    base = {"data": {"dataset": "digits", "num_clients": 3}, "server": {"clients_per_round": 3}}
    func = validate({**base, "algorithm": {"name": "fedlap_func"}})
    assert health.step_settings(func) == ["client.lr", "algorithm.server_lr"]  # server.lr is fixed at 1 for it
    assert health.step_settings(validate({**base, "algorithm": {"name": "fedavg"}})) == ["client.lr", "server.lr"]
    line = health.divergence_message(func, 3, "training loss", Path("o"), 2)
    assert "server.lr" not in line.replace("algorithm.server_lr", "") and "algorithm.server_lr=..." in line


def test_the_rejection_streak_counts_rounds_in_which_every_sent_message_was_refused():
    streak = health.RejectionStreak(3)

    class Info:
        def __init__(self, accepted, dropped=None):
            self.clients = {"client": np.arange(len(accepted)), "accepted": np.array(accepted)}
            if dropped is not None:
                self.clients.update(dropped=np.array(dropped), late=np.zeros(len(accepted), bool))

    assert streak.update(Info([False, False])) is None and streak.update(Info([False, False], [True, True])) is None  # nothing sent: no change
    assert streak.update(Info([False, False])) is None and streak.count == 2
    assert "every client's message was rejected for 3 rounds" in streak.update(Info([False, False]))
    assert health.RejectionStreak(3, 2).update(Info([True, False])) is None


# ----- resource limits and bounds as bad input ---------------------------------------------------


def one_line(res, code: int = 2) -> str:
    assert res.exit_code == code, res.output
    assert "Traceback" not in res.output and "please report" not in res.output
    lines = [x for x in res.stderr.splitlines() if x.strip() and not x.startswith(("warning:", "round ", "["))]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.mark.parametrize(
    "sets,needle",
    [
        (["seed=9223372036854775808"], "seed: must be at most 2**63 - 1"),
        (['model.name="mlp"', "model.hidden=[1000000000]"], "model.hidden: the model has 75,000,000,010 parameters"),
        (['algorithm.name="fedlap_func"', "algorithm.memory_per_class=99999999999999999999"], "algorithm.memory_per_class: must be at most 2**63 - 1"),
        (['algorithm.name="pvi"', "algorithm.samples=1000000000"], "lower its sizes: algorithm.samples = 1000000000"),
    ],
    ids=["seed 2**63", "hidden 1e9", "memory_per_class 1e20", "pvi samples 1e9"],
)
def test_sizes_and_integers_beyond_the_machine_are_one_line_exit_2(tmp_path, sets, needle):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CFG)
    args = ["run", str(cfg), "--out", str(tmp_path / "o"), "--set", "rounds=1"]
    for s in sets:
        args += ["--set", s]
    assert needle in one_line(runner.invoke(app, args))


def test_bad_paths_thresholds_and_seed_lists_are_one_line_exit_2(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CFG)
    assert "is a folder, not a config file" in one_line(runner.invoke(app, ["run", str(tmp_path)]))
    assert "--threshold: must be a number >= 0 and <= 1; got nan" in one_line(
        runner.invoke(app, ["compare", str(cfg), "--threshold", "nan", "--out", str(tmp_path / "c")])
    )
    line = one_line(runner.invoke(app, ["compare", str(cfg), "--seeds", "9223372036854775808,1", "--out", str(tmp_path / "s")]))
    assert "2**63 - 1" in line and not (tmp_path / "s").exists()  # refused before any folder is made
    assert "at most 10000 seeds" in one_line(
        runner.invoke(app, ["sweep", str(cfg), "--grid", "client.lr=0.1", "--seeds", "99999999999999", "--out", str(tmp_path / "w")])
    )


# ----- disk client stores: locked, owned, never half-made ------------------------------------------

FEDEP_EXTRA = "burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3"


def _store_cfg(tmp_path: Path, store_dir: Path | None) -> Path:
    top = 'store = "disk"' + (f'\nstore_dir = "{store_dir}"' if store_dir is not None else "")
    cfg = tmp_path / "disk.toml"
    cfg.write_text(DIGITS_RUN.format(rounds=4, top=top, algorithm="fedep", extra=FEDEP_EXTRA))
    return cfg


@pytest.mark.slow
def test_a_shared_store_dir_is_locked_and_owned_by_its_run(tmp_path):
    from fedbayes.runs import runlock

    store = tmp_path / "store"
    cfg = _store_cfg(tmp_path, store)
    assert runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "a")]).exit_code == 0
    assert (store / ".fedbayes_owner").read_text().strip() == str((tmp_path / "a").resolve())
    meta = (store / "store.json").read_bytes()
    # another run asking for the same store: refused before it touches it
    line = one_line(runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "b")]))
    assert f"store_dir: {store} holds the client store of the run in {(tmp_path / 'a').resolve()}" in line
    # a copy of the run folder cannot move the original's store forward
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    for name in (folder.SUMMARY, folder.CURVES, folder.MODEL):
        (tmp_path / "c" / name).unlink()
    (tmp_path / "c" / folder.CHECKPOINTS / folder.checkpoint_name(4)).unlink()
    line = one_line(runner.invoke(app, ["resume", str(tmp_path / "c")]), 4)
    assert "belongs to the run in" in line and "a copy of it" in line
    assert (store / "store.json").read_bytes() == meta
    # two processes at once: the second fails at once, naming the first
    with runlock.hold(store, "store"):
        line = one_line(runner.invoke(app, ["resume", str(tmp_path / "a"), "--set", "rounds=6"]), 5)
    assert f"{store} is in use by another fedbayes process (pid {os.getpid()})" in line


def test_a_store_that_could_not_be_created_leaves_nothing_behind(tmp_path, monkeypatch):
    """ENOSPC while the disk store is written (its files, or fallocate): the error comes out and no
    half-made store stays behind (a folder the store made is removed; another keeps its own files)."""
    import errno

    import fedbayes.sim.store as store_module

    template = {"site": np.ones((3, 4), np.float32)}

    def full(src, dst, **kwargs):  # the store's metadata, its last file, put in place
        raise OSError(errno.ENOSPC, "No space left on device", str(dst))

    with monkeypatch.context() as patched:
        patched.setattr(os, "replace", full)
        with pytest.raises(OSError, match="No space left"):
            store_module.DiskStore.create(tmp_path / "new", template, 5)
        assert not (tmp_path / "new").exists()
        (tmp_path / "kept").mkdir()
        (tmp_path / "kept" / ".fedbayes_owner").write_text("x\n")
        with pytest.raises(OSError, match="No space left"):
            store_module.DiskStore.create(tmp_path / "kept", template, 5)
        assert [p.name for p in (tmp_path / "kept").iterdir()] == [".fedbayes_owner"]

    def no_fallocate(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_module.os, "posix_fallocate", no_fallocate)
    with pytest.raises(OSError, match="No space left"):  # not hidden by the sparse-file fallback
        store_module.DiskStore.create(tmp_path / "sparse", template, 5)
    assert not (tmp_path / "sparse").exists()


# ----- the property: any damage to any file is recovered exactly, or one line and exit 4 ---------

FILE_KINDS = [folder.METRICS, folder.CLIENTS, folder.SUMMARY, folder.MODEL, folder.CURVES, folder.CONFIG, "newest checkpoint", "older checkpoint"]


def _target(run: Path, kind: str) -> Path:
    if kind.endswith("checkpoint"):
        ckpts = sorted((run / folder.CHECKPOINTS).glob(folder.CHECKPOINT_GLOB))
        return ckpts[-1] if kind.startswith("newest") else ckpts[0]
    return run / kind


def _damage(path: Path, how: str, where: float, junk: bytes) -> None:
    data = path.read_bytes()
    at = int(where * len(data))
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        path.write_bytes(data[:at])
    elif how == "flip":
        b = bytearray(data)
        for i in range(at, min(len(b), at + max(1, len(junk)))):
            b[i] ^= 0xA5
        path.write_bytes(bytes(b))
    elif how == "replace line":
        lines = data.splitlines(keepends=True) or [b""]
        lines[min(int(where * len(lines)), len(lines) - 1)] = junk + b"\n"
        path.write_bytes(b"".join(lines))
    else:  # append
        path.write_bytes(data + junk)


def _same_but_seconds(a: Path, b: Path) -> bool:
    if a.name == folder.METRICS:
        return [_no_seconds(x) for x in a.read_text().splitlines()] == [_no_seconds(x) for x in b.read_text().splitlines()]
    ja, jb = json.loads(a.read_text()), json.loads(b.read_text())
    for j in (ja, jb):
        j.get("final", {}).pop("seconds", None)
    return ja == jb


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("FEDBAYES_PROPERTY_EXAMPLES", 14)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    in_comparison=st.booleans(),
    kind=st.sampled_from(FILE_KINDS),
    how=st.sampled_from(["delete", "truncate", "flip", "replace line", "append"]),
    where=st.floats(0, 1),
    junk=st.binary(min_size=1, max_size=40),
)
def test_any_damage_to_any_file_is_recovered_exactly_or_one_line_exit_4(tmp_path_factory, reference, comparison, in_comparison, kind, how, where, junk):
    tmp = tmp_path_factory.mktemp("prop")
    src, variant = (comparison, "a") if in_comparison else (reference[1], None)
    top = tmp / "o"
    shutil.copytree(src, top)
    run = top / variant if variant else top
    ref = src / variant if variant else src
    _damage(_target(run, kind), how, where, junk)
    res = runner.invoke(app, ["resume", str(top)])
    assert "Traceback" not in res.output and "please report" not in res.output, res.output
    if res.exit_code != 0:  # refused: one line, a damaged folder (4) or a config that no longer reads (2)
        assert res.exit_code in (2, 4) and (kind == folder.CONFIG or res.exit_code == 4), res.output
        assert len([x for x in res.stderr.splitlines() if x.strip() and not x.startswith("warning:")]) == 1, res.stderr
        return
    # recovered: every file as the uninterrupted run's (wall-clock seconds aside where rounds were retrained)
    assert (run / folder.CLIENTS).read_bytes() == (ref / folder.CLIENTS).read_bytes()
    assert _same_but_seconds(run / folder.METRICS, ref / folder.METRICS)
    assert _same_but_seconds(run / folder.SUMMARY, ref / folder.SUMMARY)
    ma, mb = model_arrays(run / folder.MODEL), model_arrays(ref / folder.MODEL)
    assert ma.keys() == mb.keys() and all(np.array_equal(ma[k], mb[k]) for k in ma)
    assert (run / folder.CURVES).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if in_comparison:
        assert (top / folder.COMPARE_JSON).is_file()


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    """A finished comparison of two variants (FedAvg, FedProx), 3 rounds each."""
    tmp = tmp_path_factory.mktemp("comparison")
    comp = tmp / "comp.toml"
    base = CFG.split("[algorithm]")[0].replace('name = "rel"\n', "").replace("rounds = 6", "rounds = 3")
    for section in ("data", "model", "client", "server"):
        base = base.replace(f"[{section}]", f"[base.{section}]")
    comp.write_text("[base]\n" + base + '\n[variants.a.algorithm]\nname = "fedavg"\n[variants.b.algorithm]\nname = "fedprox"\n')
    res = runner.invoke(app, ["compare", str(comp), "--out", str(tmp / "out")])
    assert res.exit_code == 0, res.output
    return tmp / "out"
