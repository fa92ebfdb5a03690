"""What a run leaves behind and how the CLI protects it: no overwrite without --overwrite, resumable
comparisons, per-variant --set, compare --json, model.npz and load_run, loggers, clients.jsonl,
the config reference, --version, the calibration warning."""

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import fedbayes
from fedbayes.cli import app
from fedbayes.config.schema import RunConfig, read_stored, validate
from fedbayes.runs.build import build_experiment
from fedbayes.runs.export import flatten
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.health import CALIBRATION_ROUNDS, CalibrationCheck
from fedbayes.runs.loop import run_experiment

runner = CliRunner()

BASE = {
    "rounds": 2,
    "checkpoint_every": 0,
    "data": {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5},
    "model": {"name": "logreg"},
    "client": {"lr": 0.1, "batch_size": 16},
    "server": {"clients_per_round": 4},
}

RUN = """
name = "tiny"
rounds = 2
checkpoint_every = 1
[data]
dataset = "digits"
num_clients = 6
partition = "dirichlet"
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 16
[server]
clients_per_round = 4
"""

COMPARE = """
[base]
rounds = 2
checkpoint_every = 1
[base.data]
dataset = "digits"
num_clients = 6
partition = "dirichlet"
[base.model]
name = "logreg"
[base.client]
lr = 0.1
batch_size = 16
[base.server]
clients_per_round = 4
[variants.fedavg]
[variants.fedprox]
algorithm = { name = "fedprox", mu = 0.1 }
"""


def _file(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_run_refuses_a_non_empty_out_without_overwrite(tmp_path):
    cfg, out = _file(tmp_path, RUN), tmp_path / "out"
    assert runner.invoke(app, ["run", str(cfg), "--out", str(out)]).exit_code == 0
    before = (out / "metrics.jsonl").read_text()
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--set", "rounds=1"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--overwrite" in lines[0] and str(out) in lines[0]
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--set", "rounds=1", "--overwrite"])
    assert res.exit_code == 0, res.output
    assert [r["round"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert runner.invoke(app, ["run", str(cfg), "--out", str(empty)]).exit_code == 0  # an empty folder is fine


def test_compare_resumes_without_rerunning_finished_variants(tmp_path):
    cfg, out = _file(tmp_path, COMPARE), tmp_path / "cmp"
    assert runner.invoke(app, ["compare", str(cfg), "--out", str(out)]).exit_code == 0
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out)])
    assert res.exit_code == 2 and "--overwrite" in res.output and "--resume" in res.output
    # fedprox was interrupted: no summary; fedavg's finished files must not be touched again
    (out / "fedprox" / "summary.json").unlink()
    finished = {p.name: p.stat().st_mtime_ns for p in (out / "fedavg").iterdir() if p.is_file()}
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume"])
    assert res.exit_code == 0, res.output
    assert "fedavg: finished earlier, not rerun" in res.output
    assert {p.name: p.stat().st_mtime_ns for p in (out / "fedavg").iterdir() if p.is_file()} == finished
    assert (out / "fedprox" / "summary.json").is_file()
    # `fedbayes resume` knows a comparison folder: everything is finished, nothing reruns
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert res.output.count("finished earlier") == 2
    summaries = json.loads((out / "compare.json").read_text())
    assert set(summaries) == {"fedavg", "fedprox"}


def test_compare_resume_refuses_a_changed_variant(tmp_path):
    cfg, out = _file(tmp_path, COMPARE), tmp_path / "cmp"
    assert runner.invoke(app, ["compare", str(cfg), "--out", str(out)]).exit_code == 0
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume", "--set", "fedprox.algorithm.mu=0.5"])
    assert res.exit_code == 2 and "different config" in res.output


def test_a_resumed_comparison_keeps_each_variants_set_and_marks_it(tmp_path):
    """After `--set fedprox.algorithm.mu=0.5 --rerun fedprox`, a plain `--resume` (as `make demo`
    runs it) and `fedbayes resume` keep FedProx's mu instead of refusing its run; the tables name
    it fedprox*; `--rerun fedprox` alone runs it as the file says."""
    cfg, out = _file(tmp_path, COMPARE), tmp_path / "cmp"
    assert runner.invoke(app, ["compare", str(cfg), "--out", str(out)]).exit_code == 0
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume", "--set", "fedprox.algorithm.mu=0.5", "--rerun", "fedprox"])
    assert res.exit_code == 0, res.output
    assert "\nmu = 0.5\n" in (out / "fedprox" / "config.toml").read_text()
    for args in (["compare", str(cfg), "--out", str(out), "--resume"], ["resume", str(out)]):
        res = runner.invoke(app, args, env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert res.output.count("finished earlier, not rerun") == 2
        assert "fedprox* " in res.output and "fedavg* " not in res.output
        assert "* changed by --set (comparison.toml keeps it): fedprox (algorithm.mu=0.5)" in res.output
        assert "fedprox*" in (out / "compare.md").read_text()
    assert "fedprox: runs with its earlier --set algorithm.mu=0.5" in runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume"]).output
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume", "--rerun", "fedprox"])
    assert res.exit_code == 0, res.output
    assert "fedprox*" not in res.output and "mu = 0.5" not in (out / "fedprox" / "config.toml").read_text()
    assert "overrides" not in (out / "comparison.toml").read_text()


def test_set_targets_one_variant_and_json_goes_to_stdout(tmp_path):
    cfg, out = _file(tmp_path, COMPARE), tmp_path / "cmp"
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--set", "fedprox.algorithm.mu=0.5", "--set", "seed=3", "--json"])
    assert res.exit_code == 0, res.output
    summaries = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(summaries) == {"fedavg", "fedprox"} and "accuracy" in summaries["fedavg"]["final"]
    prox = (out / "fedprox" / "config.toml").read_text()
    avg = (out / "fedavg" / "config.toml").read_text()
    assert "\nmu = 0.5\n" in prox and "\nmu = " not in avg
    assert "seed = 3" in prox and "seed = 3" in avg


def test_compare_help_keeps_the_brackets():
    res = runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"})
    assert "[base] + [variants.NAME]" in res.output


def test_version():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"fedbayes {fedbayes.__version__}"


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "fedep", "burn_in_rounds": 1, "scale": 50.0, "weight_decay": 1e-3}])
def test_model_npz_loads_without_fedbayes_and_equals_the_server_parameters(tmp_path, algorithm):
    cfg = validate({**BASE, "name": "m", "algorithm": algorithm})
    out = tmp_path / "run"
    summary = run_experiment(cfg, out)
    # the same run rebuilt and replayed gives the server state to compare with (runs are deterministic)
    exp = build_experiment(cfg, store_dir=tmp_path / "store")
    state = exp.simulator.init(exp.params)
    for _ in range(cfg.rounds):
        state, _ = exp.simulator.run_round(state)
    expected = flatten(exp.simulator.server_params(state), "params")
    if algorithm["name"] == "fedep":
        mean, variance = exp.simulator.algorithm.server_posterior(state.server_state)
        expected |= flatten(mean, "posterior_mean") | flatten(variance, "posterior_variance")
    # numpy alone, in a fresh interpreter without fedbayes on the path
    code = "import numpy as np, json, sys; z = np.load(sys.argv[1]); print(json.dumps({k: z[k].tolist() for k in z.files}))"
    env = {"PATH": "/usr/bin:/bin"}
    got = json.loads(subprocess.run([sys.executable, "-I", "-c", code, str(out / "model.npz")], capture_output=True, text=True, env=env, check=True).stdout)
    assert set(got) == set(expected)
    for k, v in expected.items():
        np.testing.assert_allclose(np.asarray(got[k], v.dtype), v, rtol=1e-6, atol=1e-7)
    # load_run: config, params (nested as the model takes them) and metrics; the params reproduce the final accuracy
    config, params, records = fedbayes.load_run(out)
    assert read_stored(out / "config.toml") == cfg and config.model_dump() == read_stored(out / "config.toml", method=False).model_dump()
    assert config.algorithm.name == cfg.algorithm.name and records == read_metrics(out / "metrics.jsonl")
    assert exp.evaluate(state.server_state, state.round)["accuracy"] == pytest.approx(summary["final"]["accuracy"])
    logits = exp.model.apply({"params": params}, exp.dataset.x_test)
    assert float(np.mean(np.argmax(logits, -1) == exp.dataset.y_test)) == pytest.approx(summary["final"]["accuracy"], abs=1e-6)


def test_load_run_of_an_unfinished_folder_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.toml"):
        fedbayes.load_run(tmp_path)


def test_csv_log_and_clients_jsonl(tmp_path):
    cfg, out = _file(tmp_path, RUN), tmp_path / "out"
    res = runner.invoke(app, ["run", str(cfg), "--out", str(out), "--log", "csv"])
    assert res.exit_code == 0, res.output
    rows = (out / "metrics.csv").read_text().splitlines()
    records = read_metrics(out / "metrics.jsonl")
    assert rows[0].split(",")[:2] == ["round", "accuracy"] and len(rows) == len(records) + 1
    assert [float(r.split(",")[1]) for r in rows[1:]] == [r["accuracy"] for r in records]
    lines = [json.loads(x) for x in (out / "clients.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [1] * 4 + [2] * 4  # 4 sampled clients a round
    exp = build_experiment(validate({**BASE, "name": "x"}))
    sizes = exp.federation.sizes
    assert all(x["examples"] == sizes[x["client"]] and x["rejected"] is False for x in lines)
    assert len({x["client"] for x in lines if x["round"] == 1}) == 4


def test_unknown_logger_is_one_line(tmp_path):
    res = runner.invoke(app, ["run", str(_file(tmp_path, RUN)), "--out", str(tmp_path / "o"), "--log", "bogus"])
    assert res.exit_code == 2 and "--log: unknown logger 'bogus'; allowed: csv, tensorboard, wandb" in res.output


def test_tensorboard_log(tmp_path):
    pytest.importorskip("tensorboardX", reason="tensorboardX (the tensorboard extra) is not installed")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(_file(tmp_path, RUN)), "--out", str(out), "--log", "tensorboard"])
    assert res.exit_code == 0, res.output
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_wandb_log_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb (the wandb extra) is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(_file(tmp_path, RUN)), "--out", str(out), "--log", "wandb", "--log", "csv"])
    assert res.exit_code == 0, res.output
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs and any(p.suffix == ".wandb" for p in runs[0].iterdir())
    assert (out / "metrics.csv").is_file()


def _models(annotation) -> list:
    """The pydantic models an annotation holds directly or as union members (typing's public API)."""
    import types
    import typing

    from pydantic import BaseModel

    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    return []


def _all_keys(model, prefix=""):
    keys = set()
    for name, field in model.model_fields.items():
        members = _models(field.annotation)
        if not members:
            keys.add(prefix + name)
        for m in members:
            keys |= _all_keys(m, f"{prefix}{name}.")
    return keys


def test_config_reference_lists_every_key():
    res = runner.invoke(app, ["config"])
    assert res.exit_code == 0
    text = res.output
    listed = set()
    section = ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            section = "" if line == "top level" else line.split("]")[0].lstrip("[") + "."
        elif line.startswith("  ") and " = " in line:
            listed.add(section + line.split()[0])
    expected = {k for k in _all_keys(RunConfig) if not k.endswith(".name") or k == "model.name"}
    assert expected <= listed, expected - listed
    for algorithm in ("fedavg", "fedprox", "feddyn", "admm", "fedpa", "fedep", "fedsep"):
        assert f"[algorithm] name = '{algorithm}'" in text
    fedep = runner.invoke(app, ["config", "fedep"]).output
    assert "scale = 1.0" in fedep and "(float, > 0)" in fedep and "fedsep" not in fedep and "preset = 'posterior'" in fedep
    bad = runner.invoke(app, ["config", "nope"])
    assert bad.exit_code == 2 and "unknown section 'nope'" in bad.output


def test_config_reference_fits_80_columns_and_keeps_every_meaning():
    wide = runner.invoke(app, ["config", "data"], env={"COLUMNS": "400"}).output
    narrow = runner.invoke(app, ["config", "data"], env={"COLUMNS": "80"}).output
    assert all(len(line) <= 80 for line in narrow.splitlines()), max(narrow.splitlines(), key=len)
    assert max(map(len, wide.splitlines())) > 80 and " ".join(narrow.split()) == " ".join(wide.split())


def test_run_help_points_to_the_config_reference():
    assert "fedbayes config" in runner.invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output


def test_calibration_warning_once(caplog):
    """A gap that persists CALIBRATION_ROUNDS evaluations warns once, in its last round."""
    check = CalibrationCheck("fedep", after_round=1)
    with caplog.at_level(logging.WARNING, logger="fedbayes"):
        check.check({"round": 1, "accuracy": 0.8, "accuracy_marg": 0.5})  # burn-in: not checked
        check.check({"round": 2, "accuracy": 0.8, "accuracy_marg": 0.76})  # 4 points: fine
        for r in range(3, 3 + CALIBRATION_ROUNDS - 1):
            check.check({"round": r, "accuracy": 0.77, "accuracy_marg": 0.57})
        assert check.message is None  # not yet CALIBRATION_ROUNDS in a row
        check.check({"round": 3 + CALIBRATION_ROUNDS - 1, "accuracy": 0.77, "accuracy_marg": 0.50})
        check.check({"round": 3 + CALIBRATION_ROUNDS, "accuracy": 0.77, "accuracy_marg": 0.40})
        assert check.finish() == check.message
    warnings = [r for r in caplog.records if "marginalised accuracy" in r.getMessage()]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "27.0 points" in message and f"for {CALIBRATION_ROUNDS} evaluated rounds in a row" in message and "evaluation.prior_precision" in message


def test_calibration_transient_after_the_posterior_forms_is_not_a_warning(caplog):
    """The digits fallback's FedEP: a 15.6-point gap in its first round after burn-in, closing
    within three rounds, is no verdict; a run that ends with the gap open is."""
    gaps = [0.156, 0.081, 0.039, 0.036, 0.072, 0.039, 0.017, 0.003, 0.006, 0.0]
    transient = CalibrationCheck("fedep", after_round=5)
    with caplog.at_level(logging.WARNING, logger="fedbayes"):
        for i, gap in enumerate(gaps):
            transient.check({"round": 6 + i, "accuracy": 0.95, "accuracy_marg": 0.95 - gap})
        assert transient.finish() is None
        assert not [r for r in caplog.records if "marginalised accuracy" in r.getMessage()]
        ending = CalibrationCheck("fedep", after_round=5)
        for i, gap in enumerate([0.0, 0.0, 0.08, 0.09, 0.07]):  # the gap opens at the end: median 0.07
            ending.check({"round": 6 + i, "accuracy": 0.95, "accuracy_marg": 0.95 - gap})
        assert ending.message is None
        assert "median over the run's last 5 evaluated rounds" in ending.finish()
        short = CalibrationCheck("fedep")  # a run evaluated once, at its end
        short.check({"round": 3, "accuracy": 0.9, "accuracy_marg": 0.7})
        assert "20.0 points" in short.finish() and "last 1 evaluated rounds" in short.message
    assert len([r for r in caplog.records if "marginalised accuracy" in r.getMessage()]) == 2


def test_no_system_data_hides_the_debian_dataset(tmp_path):
    """FEDBAYES_NO_SYSTEM_DATA=1 makes the machine look as if dataset-fashion-mnist were not installed."""
    code = "from fedbayes.data import dataset_status; print(dict((n, p) for n, p, _ in dataset_status())['fashion_mnist'])"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(fedbayes.__file__).parents[1]), "JAX_PLATFORMS": "cpu"}
    hidden = subprocess.run(
        [sys.executable, "-c", code], env={**env, "FEDBAYES_NO_SYSTEM_DATA": "1", "FEDBAYES_DATA": str(tmp_path)}, capture_output=True, text=True
    )
    assert hidden.returncode == 0, hidden.stderr
    assert hidden.stdout.strip() == "False"
