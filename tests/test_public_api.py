"""The curated root: ``import fedbayes`` stays light, and each public name is the object it names."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fedbayes

ROOT = Path(__file__).resolve().parents[1]


def test_import_fedbayes_imports_neither_jax_nor_any_method():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    code = "import sys, json, fedbayes; fedbayes.__version__; print(json.dumps(sorted(sys.modules)))"
    loaded = set(json.loads(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout))
    assert "jax" not in loaded and "numpy" not in loaded
    assert {m for m in loaded if m.startswith("fedbayes")} == {"fedbayes"}


def test_the_public_names_are_the_objects_they_name():
    from fedbayes import gaussian, protocol
    from fedbayes.algorithms import base, registry
    from fedbayes.config import schema
    from fedbayes.hparams import HParams
    from fedbayes.runs import export, loop
    from fedbayes.sim.simulator import Simulator

    assert (fedbayes.Algorithm, fedbayes.AlgorithmSpec, fedbayes.BuildContext) == (base.Algorithm, base.AlgorithmSpec, base.BuildContext)
    assert fedbayes.register is registry.register and fedbayes.HParams is HParams
    assert fedbayes.RunConfig is schema.RunConfig and fedbayes.load_config is schema.load_config
    assert fedbayes.Simulator is Simulator and fedbayes.run_experiment is loop.run_experiment and fedbayes.load_run is export.load_run
    assert fedbayes.gaussian is gaussian and fedbayes.protocol is protocol
    from fedbayes.data import dataset, user

    assert fedbayes.Dataset is dataset.Dataset and fedbayes.from_arrays is user.from_arrays and fedbayes.load_files is user.load_files
    assert set(fedbayes.__all__) <= set(dir(fedbayes))
    with pytest.raises(AttributeError, match="no attribute 'simulate'"):
        fedbayes.simulate  # noqa: B018


def test_all_lists_the_curated_names_and_each_resolves():
    assert set(fedbayes.__all__) == {
        "__version__", "Algorithm", "AlgorithmSpec", "BuildContext", "HParams", "register", "RunConfig", "load_config",
        "Simulator", "run_experiment", "load_run", "gaussian", "protocol", "Dataset", "from_arrays", "load_files",
    }  # fmt: skip
    assert all(getattr(fedbayes, name) is not None for name in fedbayes.__all__)


def test_the_api_reference_page_covers_the_curated_root():
    """docs/api.md documents every public name (the site's build checks that each reference resolves)."""
    page = (ROOT / "docs" / "api.md").read_text()
    for name in fedbayes.__all__:
        if name == "__version__":
            continue
        value = getattr(fedbayes, name)
        target = value.__name__ if inspect.ismodule(value) else f"{value.__module__}.{value.__name__}"  # where it is defined
        assert f"::: {target}\n" in page, target
