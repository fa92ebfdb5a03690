"""benchmarks/vbnn_fmnist.py --analyse: the log-variances of a comparison's runs at their start and
end, an IVON run's start read with the method's defaults for the keys its stored config omits."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedbayes.algorithms.vbnn import IVON_MINIBATCH
from fedbayes.cli import app
from fedbayes.data import load_dataset

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vbnn_fmnist.py"

CONFIG = """
[base]
seed = 0
rounds = 1
checkpoint_every = 0

[base.data]
dataset = "digits"
num_clients = 3

[base.server]
clients_per_round = 3

[base.model]
name = "mlp"
hidden = [8]
variational = true

[variants.bbb]
algorithm = { name = "vbnn" }

[variants.ivon]
algorithm = { name = "vbnn", method = "ivon", kl_weight = 0.5 }
"""


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("vbnn_fmnist", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


@pytest.mark.slow
def test_analyse_starts_an_ivon_run_at_h0_from_the_settings_and_reports_every_layer(script, tmp_path):
    (tmp_path / "c.toml").write_text(CONFIG)
    res = CliRunner().invoke(app, ["compare", str(tmp_path / "c.toml"), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    data = tmp_path / "rows.json"
    table = script.analyse(str(tmp_path / "out"), plot=None, data_out=str(data))
    rows = {r["run"]: r for r in json.loads(data.read_text())}
    assert set(rows) == {"bbb", "ivon"} and "| ivon | CF (bayes) |" in table
    # IVON's server start: every log-variance at -log(ess (h_0 + 1 / (ess s^2))), ess = N / kl_weight, s^2 = 1
    ess = load_dataset("digits").num_train / 0.5
    start = -np.log(ess * (IVON_MINIBATCH.hess_init + 1.0 / ess))
    np.testing.assert_allclose(rows["ivon"]["logvar_start"], [start] * 5, rtol=1e-5)
    assert not np.allclose(rows["bbb"]["logvar_start"][2], start, rtol=1e-2)  # Bayes-by-backprop starts elsewhere
    for r in rows.values():
        assert set(r["logvar_end_per_layer"]) == {"hidden_0/kernel", "output/kernel"}
        assert np.isfinite(r["nll"]) and 0.0 <= r["accuracy"] <= 1.0
