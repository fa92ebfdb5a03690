"""fedbayes.runs.export: ``load_run`` reads a run folder's files without loading the simulator, the
run loop or any method's module."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import fedbayes
from fedbayes.algorithms import registry
from fedbayes.config.schema import ConfigError, StoredAlgorithm, read_stored, to_toml, validate
from fedbayes.runs import folder

ROOT = Path(__file__).resolve().parents[2]


def _run_folder(path: Path, algorithm: dict):
    cfg = validate({"name": "x", "data": {"dataset": "digits", "num_clients": 3}, "algorithm": algorithm, "server": {"clients_per_round": 3}})
    (path / folder.CONFIG).write_text(to_toml(cfg))
    np.savez(path / folder.MODEL, **{"params/Dense_0/kernel": np.ones((2, 3), np.float32)})
    folder.MetricsWriter(path / folder.METRICS).rewrite([{"round": 0, "accuracy": 0.5}])
    return cfg


def _method_modules() -> set[str]:
    """The modules that declare the built-in methods' settings and builders."""
    return {m for name in registry.names() for m in (registry.get(name).hparams.__module__, registry.get(name).build.__module__)}


@pytest.mark.parametrize("algorithm", [{"name": "fedavg"}, {"name": "fedep", "method": "laplace"}], ids=["fedavg", "fedep"])
def test_load_run_reads_the_stored_config_params_and_metrics(tmp_path, algorithm):
    cfg = _run_folder(tmp_path, algorithm)
    config, params, metrics = fedbayes.load_run(tmp_path)
    assert params["Dense_0"]["kernel"].shape == (2, 3) and metrics == [{"round": 0, "accuracy": 0.5}]
    assert config.model_dump(exclude={"algorithm"}) == cfg.model_dump(exclude={"algorithm"})
    # the [algorithm] table as stored: its name and settings, not the method's validated record
    assert isinstance(config.algorithm, StoredAlgorithm) and config.algorithm.name == cfg.algorithm.name
    stored = config.algorithm.model_dump()
    assert stored == {k: v for k, v in cfg.algorithm.model_dump(mode="json").items() if v is not None}
    assert config.spec is cfg.spec  # the method's traits, on demand
    assert read_stored(tmp_path / folder.CONFIG) == cfg  # validated against the method's settings


def test_load_run_imports_no_simulator_run_loop_or_method(tmp_path):
    """A fresh process that calls ``load_run`` on a FedEP run has imported neither the simulator,
    the builder, the loop, nor the module of any method (FedEP's included)."""
    _run_folder(tmp_path, {"name": "fedep", "method": "laplace"})
    heavy = sorted({"fedbayes.sim.simulator", "fedbayes.runs.build", "fedbayes.runs.loop"} | _method_modules())
    assert "fedbayes.algorithms.fedep" in heavy and "fedbayes.algorithms.fedavg" in heavy
    code = (
        "import json, sys\n"
        "import fedbayes.runs.export\n"
        f"config, _, _ = fedbayes.runs.export.load_run({str(tmp_path)!r})\n"
        f"print(json.dumps([config.algorithm.name, [m for m in {heavy!r} if m in sys.modules]]))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu"))
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == ["fedep", []]


def test_load_run_of_a_config_that_does_not_validate_says_so(tmp_path):
    _run_folder(tmp_path, {"name": "fedavg"})
    text = (tmp_path / folder.CONFIG).read_text()
    (tmp_path / folder.CONFIG).write_text(text.replace("rounds = 10", "rounds = 0"))
    with pytest.raises(ConfigError, match="rounds"):
        fedbayes.load_run(tmp_path)
    (tmp_path / folder.CONFIG).write_text(text.replace('name = "fedavg"', "name = 3"))
    with pytest.raises(ConfigError, match="algorithm.name"):
        fedbayes.load_run(tmp_path)
