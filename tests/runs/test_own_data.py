"""Your own data and model end to end: a CSV with a client column and a flax module in a local
file through `fedbayes run`, `compare` (three methods), `sweep` and `resume`; the same from Python
with arrays and a module; models with mutable state refused with one line before any work."""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import numpy as np
import pytest
from sklearn.datasets import load_digits
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, validate
from fedbayes.errors import BadInputError
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "own_data" / "model.py"  # the worked example's module
runner = CliRunner()

RUN = """
name = "own"
rounds = {rounds}
checkpoint_every = 2
[data]
dataset = "files"
path = "{csv}"
client_column = "client"
partition = "natural"
num_clients = 4
[model]
module = "{module}"
kwargs = {{ width = 8 }}
[client]
batch_size = 16
lr = 0.1
[server]
clients_per_round = 3
[algorithm]
name = "fedavg"
"""


@pytest.fixture
def csv(tmp_path):
    """240 digits in a CSV: client, label, 64 features."""
    x, y = load_digits(return_X_y=True)
    x, y = x[:240] / 16.0, y[:240]
    path = tmp_path / "own.csv"
    header = ",".join(["client", "label", *(f"p{i}" for i in range(64))])
    np.savetxt(path, np.column_stack([np.arange(240) % 4, y, x]), delimiter=",", header=header, comments="", fmt="%.4g")
    return path


def _config(tmp_path, csv, rounds=3, module=f"{MODEL}:SmallNet"):
    p = tmp_path / "own.toml"
    p.write_text(RUN.format(rounds=rounds, csv=csv, module=module))
    return p


@pytest.mark.slow
def test_run_compare_and_sweep_a_csv_with_a_local_module(tmp_path, csv):
    cfg = _config(tmp_path, csv)
    res = runner.invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [0, 1, 2, 3] and metrics[-1]["accuracy"] > metrics[0]["accuracy"]
    assert 'module = "' in (tmp_path / "run" / "config.toml").read_text()

    base = cfg.read_text().replace("[data]", "[base.data]").replace("[model]", "[base.model]").replace("[client]", "[base.client]")
    base = base.replace("[server]", "[base.server]").replace('[algorithm]\nname = "fedavg"\n', "")
    base = base.replace('name = "own"\nrounds = 3\ncheckpoint_every = 2\n', "[base]\nrounds = 3\ncheckpoint_every = 2\n")
    variants = '[variants.fedavg]\nalgorithm = { name = "fedavg" }\n[variants.fedprox]\nalgorithm = { name = "fedprox", mu = 0.01 }\n'
    variants += '[variants.fedep]\nalgorithm = { name = "fedep" }\n'
    (tmp_path / "cmp.toml").write_text(base + variants)
    res = runner.invoke(app, ["compare", str(tmp_path / "cmp.toml"), "--out", str(tmp_path / "cmp"), "--json"])
    assert res.exit_code == 0, res.output
    table = (tmp_path / "cmp" / "compare.md").read_text()
    assert all(f"| {v} " in table for v in ("fedavg", "fedprox", "fedep"))

    res = runner.invoke(app, ["sweep", str(cfg), "--grid", "client.lr=0.05,0.1", "--select-on", "test", "--out", str(tmp_path / "sweep")])
    assert res.exit_code == 0, res.output
    cells = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert "0.05" in json.dumps(cells) and "0.1" in json.dumps(cells)


class _Interrupt(PlainReporter):
    def update(self, round_idx, total, record):
        super().update(round_idx, total, record)
        if round_idx == 3:
            raise KeyboardInterrupt


def test_an_interrupted_run_on_own_data_resumes_to_the_same_metrics(tmp_path, csv):
    from fedbayes.config.schema import load_config

    config = load_config(_config(tmp_path, csv, rounds=4))
    run_experiment(config, tmp_path / "whole", reporter=PlainReporter(lambda line: None))
    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, tmp_path / "cut", reporter=_Interrupt(lambda line: None))
    res = runner.invoke(app, ["resume", str(tmp_path / "cut")])
    assert res.exit_code == 0, res.output
    strip = lambda ms: [{k: v for k, v in m.items() if k != "seconds"} for m in ms]  # noqa: E731
    assert strip(read_metrics(tmp_path / "cut" / "metrics.jsonl")) == strip(read_metrics(tmp_path / "whole" / "metrics.jsonl"))


BATCHNORM = """
import flax.linen as nn

class Net(nn.Module):
    num_classes: int
    width: int = 8

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(x.reshape((x.shape[0], -1)))
        return nn.Dense(self.num_classes)(x)
"""


def test_a_batchnorm_model_is_refused_with_one_line_before_any_work(tmp_path, csv):
    (tmp_path / "bn.py").write_text(BATCHNORM)
    res = runner.invoke(app, ["run", str(_config(tmp_path, csv, module=f"{tmp_path / 'bn.py'}:Net")), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    line = " ".join(res.output.split())  # one line, wrapped by the terminal's width here
    assert line.startswith("config error: model.module: Net has the mutable collection(s) ['batch_stats']") and "GroupNorm" in line
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "module, needle",
    [
        ("examples/own_data/model.py", "expected 'package.module:Class' or 'path/to/file.py:Class'"),
        ("no_such_package.models:Net", "no module 'no_such_package'"),
        ("MISSING.py:Net", "'MISSING.py': no such file"),
        (f"{MODEL}:Missing", "has no 'Missing'"),
        ("numpy:ndarray", "is not a flax.linen.Module subclass"),
    ],
)
def test_bad_module_paths_are_config_errors(tmp_path, csv, module, needle):
    res = runner.invoke(app, ["run", str(_config(tmp_path, csv, module=module)), "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and needle in " ".join(res.output.split()), res.output


def test_unknown_module_keyword_names_the_allowed_ones(tmp_path, csv):
    res = runner.invoke(app, ["run", str(_config(tmp_path, csv)), "--set", "model.kwargs.depth=2", "--out", str(tmp_path / "out")])
    line = " ".join(res.output.split())
    assert res.exit_code == 2 and "model.kwargs: " in line and "has no attribute(s) ['depth']; allowed: num_classes, width" in line, line


class Tiny(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(x)


def test_python_arrays_and_a_module_run_resume_and_refuse_a_used_folder(tmp_path):
    x, y = load_digits(return_X_y=True)
    data = {"x": x[:200] / 16.0, "y": y[:200], "client_ids": np.arange(200) % 4}
    config = validate(
        {
            "rounds": 3,
            "data": {"dataset": "arrays", "num_clients": 4, "partition": "natural"},
            "model": {"name": "module"},
            "client": {"lr": 0.3},
            "server": {"clients_per_round": 2},
        }
    )
    quiet = PlainReporter(lambda line: None)
    summary = run_experiment(config, tmp_path / "run", data=data, model=Tiny(num_classes=10), reporter=quiet)
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert summary["final"]["accuracy"] == metrics[-1]["accuracy"] > metrics[0]["accuracy"] + 0.2
    with pytest.raises(BadInputError, match="is not empty .*pass overwrite=True to replace it, resume=True to continue it"):
        run_experiment(config, tmp_path / "run", data=data, model=Tiny(num_classes=10), reporter=quiet)
    again = run_experiment(config, tmp_path / "run", data=data, model=Tiny(num_classes=10), resume=True, reporter=quiet)
    assert again["final"] == summary["final"]
    with pytest.raises(ConfigError, match="data.dataset: 'arrays' are given from Python"):
        run_experiment(config, tmp_path / "other", model=Tiny(num_classes=10), reporter=quiet)
    with pytest.raises(ConfigError, match="model.name: 'module' is your own flax module"):
        run_experiment(config, tmp_path / "other2", data=data, reporter=quiet)
