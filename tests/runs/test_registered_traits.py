"""Datasets and models registered from this file get the behaviour their spec's traits declare
wherever the package reads them, never their names: your own data (``user_data``) is scaled under
``data.standardize = "auto"``, stored without the key resumes unscaled and is refused on a Flower
node without a data file; a generated dataset (``generated``) is loaded again for each seed under
``--shift``; a regression (``task``) is compared as a regression; a dataset read from a file of your
own (``file_based``) is described by the file's name; a model's own integer settings are the sizes
the memory checks name, and a dataset's own settings are named only for it."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import Field
from typer.testing import CliRunner

from fedbayes.config.schema import ConfigError, stored_meaning, validate
from fedbayes.data import registry as datasets
from fedbayes.data.dataset import Dataset
from fedbayes.data.registry import DatasetSpec, DataSettings
from fedbayes.models import registry as models
from fedbayes.models.registry import ModelSettings, ModelSpec

RUN = {"model": {"name": "logreg"}, "server": {"clients_per_round": 2}, "algorithm": {"name": "fedavg"}}


def _spec(name: str, loader, **traits) -> DatasetSpec:
    return DatasetSpec(name=name, description="a test dataset", how_to_get="made by the test", loader=loader, locate=lambda data_dir: (True, "test"), **traits)


@pytest.fixture
def registered():
    """Registers specs for one test and removes them after it."""
    names = []

    def register(spec):
        (datasets if isinstance(spec, DatasetSpec) else models).register(spec)
        names.append(spec)
        return spec

    yield register
    for spec in names:
        (datasets if isinstance(spec, DatasetSpec) else models).unregister(spec.name)


def _config(dataset: str, **data):
    return validate({**RUN, "data": {"dataset": dataset, "num_clients": 2, **data}})


# ----- user_data: data.standardize = "auto" ----------------------------------------------------------
def _wide(data_dir, seed) -> Dataset:
    """A table whose two features differ by four orders of magnitude."""
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(50, 2)) * [1.0, 0.1] + [1000.0, 0.0]).astype(np.float32)
    y = (np.arange(50) % 2).astype(np.int32)
    return Dataset("wide", x[:40], y[:40], x[40:], y[40:], 2, "classification")


def test_your_own_registered_data_is_standardised_under_auto(registered):
    from fedbayes.runs.build import prepare_splits

    registered(_spec("my_table", _wide, user_data=True))
    registered(_spec("their_table", _wide))
    mine = prepare_splits(_config("my_table")).dataset
    theirs = prepare_splits(_config("their_table")).dataset
    assert abs(float(mine.x_train[:, 0].mean())) < 1e-3 and abs(float(mine.x_train[:, 0].std()) - 1.0) < 1e-2
    np.testing.assert_array_equal(theirs.x_train, _wide(None, 0).x_train)  # not your own data: as loaded
    # a run stored before data.standardize existed did not scale your own data, and resumes so
    assert validate(stored_meaning({**RUN, "data": {"dataset": "my_table"}})).data.standardize is False
    assert validate(stored_meaning({**RUN, "data": {"dataset": "their_table"}})).data.standardize == "auto"


def test_a_node_without_a_data_file_refuses_your_own_registered_data(registered):
    from fedbayes.flower.nodedata import NodeDataError, accept_run_config

    registered(_spec("my_table", _wide, user_data=True))
    registered(_spec("their_table", _wide))
    with pytest.raises(NodeDataError, match="this node refuses the run's data.dataset = 'my_table': that is data a node holds itself"):
        accept_run_config({"data": {"dataset": "my_table"}}, {})
    raw = {"data": {"dataset": "my_table"}}
    assert accept_run_config(raw, {"data-file": "mine.npz"}) == raw  # it reads no data.path: the config stays as it is
    assert accept_run_config({"data": {"dataset": "their_table"}}, {}) == {"data": {"dataset": "their_table"}}


# ----- generated: the seed decides the data -------------------------------------------------------------
def test_a_generated_dataset_is_loaded_once_per_seed_under_shift(registered):
    from fedbayes.runs.shift import check_configs

    seeds = []

    def images(data_dir, seed) -> Dataset:
        seeds.append(seed)
        rng = np.random.default_rng(seed)
        x = rng.uniform(size=(24, 4, 4)).astype(np.float32)
        y = (np.arange(24) % 2).astype(np.int32)
        return Dataset("noise", x[:16], y[:16], x[16:], y[16:], 2, "classification")

    registered(_spec("generated_noise", images, image=True, generated=True))
    registered(_spec("stored_noise", images, image=True))
    configs = [validate({**_config(name).model_dump(mode="json"), "seed": seed}) for name in ("generated_noise", "stored_noise") for seed in (0, 1)]
    check_configs(configs)
    assert seeds == [0, 1, 0]  # the generated one once per seed, the other once


# ----- task: a regression is compared as one ---------------------------------------------------------------
def _lines(data_dir, seed) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(40, 3)).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
    ids = np.arange(40) % 2  # two clients: a regression is split by its own client ids
    return Dataset("lines", x[:32], y[:32], x[32:], y[32:], 0, "regression", ids[:32], ids[32:])


def test_a_registered_regression_is_compared_as_a_regression(registered, tmp_path, monkeypatch):
    from fedbayes.cli import app
    from fedbayes.runs import plotting
    from fedbayes.runs.compare import is_regression

    registered(_spec("lines", _lines, task="regression", federated="always"))
    assert is_regression(validate({**RUN, "model": {"name": "linear"}, "data": {"dataset": "lines"}}))
    assert not is_regression(_config("digits"))
    tasks = []
    plot = plotting.plot_curves
    monkeypatch.setattr(plotting, "plot_curves", lambda *args, **kwargs: tasks.append(kwargs["task"]) or plot(*args, **kwargs))
    path = tmp_path / "c.toml"
    path.write_text(
        '[base]\nrounds = 1\n[base.data]\ndataset = "lines"\nnum_clients = 2\n[base.model]\nname = "linear"\n[base.client]\nlr = 0.01\n'
        '[base.server]\nclients_per_round = 2\n[variants.fedavg.algorithm]\nname = "fedavg"\n[variants.fedprox]\nalgorithm = { name = "fedprox", mu = 0.1 }\n'
    )
    res = CliRunner().invoke(app, ["compare", str(path), "--out", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    assert tasks and set(tasks) == {"regression"}  # each run's curves and the comparison's plot


# ----- file_based: a comparison names your file ------------------------------------------------------------
class SheetSettings(DataSettings):
    """A sheet of your own."""

    sheet: str = Field("sheet.csv", description="sheet: the file")


def test_a_file_based_dataset_is_described_by_its_file(registered):
    from fedbayes.runs.compare import describe

    own = _config("files", path="some/where/wine.csv")
    assert "wine.csv" in describe("c", {"a": own}) and "files" not in describe("c", {"a": own})
    registered(_spec("sheet", _wide, settings=SheetSettings, file_based=True))
    assert "sheet," in describe("c", {"a": _config("sheet")})  # no data.path: the dataset's name


# ----- the sizes the memory checks name ---------------------------------------------------------------------
class WideSettings(DataSettings):
    """A dataset with a large setting of its own."""

    rows: int = Field(5000, ge=1, description="wide_rows: rows per client")


class UnitsSettings(ModelSettings):
    """A model whose width is its own setting."""

    units: int = Field(8, ge=1, description="units_model: hidden units")


def test_the_sizes_named_are_the_run_s_own(registered, monkeypatch):
    from fedbayes.runs import limits

    registered(_spec("wide_rows", _wide, settings=WideSettings))
    registered(ModelSpec("units_model", "a model sized by units", lambda m, n, v: None, UnitsSettings))
    config = validate({**RUN, "data": {"dataset": "wide_rows"}, "model": {"name": "units_model", "units": 6000}})
    assert limits.size_settings(config)[:2] == ["model.units = 6000", "data.rows = 5000"]
    assert limits.reads(config, "model.units") and not limits.reads(config, "model.hidden") and limits.reads(config, "data.rows")
    assert not limits.reads(_config("digits"), "data.rows") and not limits.reads(_config("digits"), "model.units")
    assert limits.model_sizes(config) == [("model.units", 6000)]
    small = validate({**RUN, "data": {"dataset": "digits"}, "model": {"name": "units_model"}})
    assert limits.size_settings(small) == ["model.units = 8", f"client.batch_size = {small.client.batch_size}"]
    monkeypatch.setattr(limits, "physical_memory", lambda: 1000)
    with pytest.raises(ConfigError, match=r"^config error: model.units: the model has 1,000,000 parameters"):
        limits.check_model(config, lambda: 1_000_000)
    with pytest.raises(ConfigError, match=r"^config error: model.name: the model has 1,000,000 parameters"):
        limits.check_model(_config("digits"), lambda: 1_000_000)  # logreg: no size settings of its own
