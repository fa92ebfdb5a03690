"""The learning check (fedbayes.runs.health.LearningCheck, ``[health]``): its thresholds on records,
the warning, the stop, replay on resume, and a FedEP run whose client step is far too large stopping
with exit 3 and one line that names the knob."""

import json

import pytest
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, HealthConfig, validate
from fedbayes.runs.health import STOPPED_LEARNING, LearningCheck

runner = CliRunner()


def _records(accs, nlls, untrained_nll=2.3):
    out = [{"round": 0, "accuracy": 0.1, "nll": untrained_nll}]
    out += [{"round": r, "accuracy": a, "nll": n} for r, (a, n) in enumerate(zip(accs, nlls, strict=True), start=1)]
    return out


def _feed(check, records):
    stops = [check.check(r, log=False) for r in records]
    return next(((r["round"], s) for r, s in zip(records, stops, strict=True) if s), None)


def test_a_healthy_run_says_nothing():
    check = LearningCheck("fedavg", HealthConfig(), "a step too large")
    accs = [0.5, 0.6, 0.65, 0.45, 0.7, 0.72, 0.71, 0.74]  # one dip of 0.2 below the best: not a streak
    assert _feed(check, _records(accs, [1.0] * 8)) is None and check.message is None


def test_accuracy_far_below_its_best_warns_then_stops():
    check = LearningCheck("fedep", HealthConfig(), "a step too large (client.lr)")
    accs = [0.55, 0.69, 0.45, 0.3, 0.2, 0.35, 0.25, 0.3, 0.2]
    stop = _feed(check, _records(accs, [1.2] * len(accs)))
    assert check.message is not None and "round 5" in check.message and "below its best 0.6900 (round 2)" in check.message
    assert "client.lr" in check.message
    # past the stop bound (0.3 below the best): rounds 4, 5, 6 ... in a row; round 6 is 0.34 below
    assert stop is not None and stop[0] == 8 and stop[1].startswith(STOPPED_LEARNING)


def test_nll_above_the_untrained_models_warns_and_stops():
    check = LearningCheck("run", HealthConfig(warn_after=2, stop_after=3), "a step too large")
    stop = _feed(check, _records([0.3, 0.3, 0.3, 0.3], [2.0, 2.5, 4.0, 4.0]))  # untrained 2.3; stop bound 3.45
    assert check.message is not None and "round 3" in check.message and "untrained model's 2.3" in check.message
    assert stop is None  # only two evaluations past the stop bound
    stop = _feed(check, [{"round": 5, "accuracy": 0.3, "nll": 5.0}])
    assert stop == (5, stop[1]) and "test nll 5 above 1.5 times" in stop[1]


def test_zero_turns_each_part_off():
    check = LearningCheck("run", HealthConfig(warn_after=0, stop_after=0), "x")
    assert _feed(check, _records([0.1] * 10, [9.0] * 10)) is None and check.message is None


def test_regression_is_judged_by_its_mse():
    check = LearningCheck("run", HealthConfig(warn_after=1, stop_after=1), "x")
    records = [{"round": 0, "mse": 1.0}, {"round": 1, "mse": 2.0}]
    stop = _feed(check, records)
    assert stop is not None and stop[0] == 1 and "test mse 2 above" in check.message


def test_replay_reaches_the_same_state():
    records = _records([0.6, 0.2, 0.2], [1.0, 3.0, 3.0])
    a, b = LearningCheck("r", HealthConfig(), "x"), LearningCheck("r", HealthConfig(), "x")
    _feed(a, records)
    b.replay(records)
    assert (a.unhealthy, a.failing, a.best, a.untrained, a.message) == (b.unhealthy, b.failing, b.best, b.untrained, b.message)


def test_settings_are_checked():
    with pytest.raises(ConfigError, match="health.accuracy_drop"):
        validate({"health": {"accuracy_drop": 1.5}})
    with pytest.raises(ConfigError, match="health.stop_after"):
        validate({"health": {"stop_after": -1}})


DIGITS_FEDEP = """
name = "fedep_lr"
rounds = 12
checkpoint_every = 4
[data]
dataset = "digits"
num_clients = 5
partition = "dirichlet"
alpha = 0.5
[model]
name = "logreg"
[client]
lr = {lr}
[server]
clients_per_round = 5
[algorithm]
name = "fedep"
method = "identity"
"""


def test_a_step_far_too_large_stops_with_exit_3_naming_the_knob(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(DIGITS_FEDEP.format(lr="1e5"))
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 3, res.output
    lines = [line for line in res.output.splitlines() if STOPPED_LEARNING in line]
    assert len(lines) == 1 and "client.lr" in lines[0] and "fedbayes resume" in lines[0], res.output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"]["metric"] == STOPPED_LEARNING
    # resume replays the check: the run stops at once again, rather than starting the count afresh
    res = runner.invoke(app, ["resume", str(out), "--set", "rounds=14"])
    assert res.exit_code == 3 and STOPPED_LEARNING in res.output
