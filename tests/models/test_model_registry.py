"""The model registry: its errors, the ``[model]`` table validated against it, and a model
registered from this file that runs from a TOML config through ``fedbayes run``."""

from __future__ import annotations

import tomllib

import flax.linen as nn
import numpy as np
import pytest
from pydantic import Field
from typer.testing import CliRunner

from fedbayes.config.schema import ConfigError, to_toml, validate
from fedbayes.models import registry
from fedbayes.models.registry import ModelSettings, ModelSpec


# ----- a model, added from a test file ----------------------------------------------------------------
class Bottleneck(nn.Module):
    """Features squeezed through ``units`` tanh units, then one logit per class."""

    num_classes: int
    units: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.num_classes)(nn.tanh(nn.Dense(self.units)(x)))


class BottleneckSettings(ModelSettings):
    """The bottleneck's width."""

    units: int = Field(4, ge=1, description="bottleneck: hidden units")


BOTTLENECK = ModelSpec(
    "bottleneck",
    "a one-layer tanh bottleneck",
    lambda m, num_classes, variational: Bottleneck(num_classes=num_classes, units=m.units),
    BottleneckSettings,
)


@pytest.fixture
def bottleneck():
    registry.register(BOTTLENECK)
    yield BOTTLENECK
    registry.unregister(BOTTLENECK.name)


def test_register_get_and_unregister(bottleneck):
    assert registry.get("bottleneck") is bottleneck and registry.names()[-1] == "bottleneck" and bottleneck in registry.specs()
    assert bottleneck not in registry.builtin_specs()
    with pytest.raises(ValueError, match="model 'bottleneck' is already registered"):
        registry.register(bottleneck)
    with pytest.raises(ValueError, match="model 'mlp' is already registered"):
        registry.register(ModelSpec("mlp", "", BOTTLENECK.build))
    with pytest.raises(ValueError, match="expected a ModelSpec"):
        registry.register("bottleneck")
    with pytest.raises(ValueError, match="model 'cnn' is built in and cannot be removed"):
        registry.unregister("cnn")
    registry.unregister("bottleneck")
    with pytest.raises(ValueError, match="unknown model 'bottleneck'; allowed: logreg, mlp"):
        registry.get("bottleneck")
    with pytest.raises(ConfigError, match="^config error: model.name: unknown model 'bottleneck'; allowed: logreg"):
        validate({"model": {"name": "bottleneck"}})
    registry.unregister("bottleneck")  # never registered (any more): no error
    registry.register(bottleneck)


def test_a_spec_is_checked_when_declared():
    with pytest.raises(ValueError, match="tasks must be some of"):
        ModelSpec("x", "", BOTTLENECK.build, tasks=("ranking",))
    with pytest.raises(ValueError, match="'activation' is not a key of its settings"):
        ModelSpec("x", "", BOTTLENECK.build, BottleneckSettings, exclusive=("activation",))
    with pytest.raises(ValueError, match="settings must be an HParams subclass"):
        ModelSpec("x", "", BOTTLENECK.build, settings=dict)


def test_a_registered_model_s_keys_are_validated_flat_in_model(bottleneck):
    config = validate({"model": {"name": "bottleneck", "units": 3}})
    assert config.model.units == 3 and "units = 3" in to_toml(config)
    assert validate({"model": {"name": "bottleneck"}}).model.units == 4  # its default, written out
    with pytest.raises(ConfigError, match=r"^config error: model.units: Input should be greater than or equal to 1"):
        validate({"model": {"name": "bottleneck", "units": 0}})
    with pytest.raises(ConfigError, match=r"^config error: model.units: unknown key; allowed keys here: name, hidden"):
        validate({"model": {"name": "mlp", "units": 3}})
    with pytest.raises(ConfigError, match=r"^config error: model.activation: only the mlp has a choice of activation; got 'tanh' with model 'bottleneck'$"):
        validate({"model": {"name": "bottleneck", "activation": "tanh"}})
    with pytest.raises(ConfigError, match=r"^config error: model.variational: only mlp, cnn have a variational version; got 'bottleneck'$"):
        validate({"model": {"name": "bottleneck", "variational": True}, "algorithm": {"name": "vbnn"}})


def test_a_registered_model_is_checked_by_its_traits(tmp_path):
    from fedbayes.runs.build import check_model, load_data

    image = ModelSpec("image_bottleneck", "needs images", BOTTLENECK.build, BottleneckSettings, image=True)
    registry.register(image)
    try:
        config = validate({"data": {"dataset": "breast_cancer"}, "model": {"name": "image_bottleneck"}})
        with pytest.raises(
            ConfigError,
            match=r"^config error: model.name: 'image_bottleneck' needs image data \[H, W\] or \[H, W, C\]; 'breast_cancer' has features of shape \(30,\); allowed here: logreg, mlp$",
        ):
            check_model(config, load_data(config))
    finally:
        registry.unregister("image_bottleneck")


def test_a_registered_model_runs_from_a_toml_config(bottleneck, tmp_path):
    from fedbayes.cli import app
    from fedbayes.runs.folder import read_metrics

    path = tmp_path / "bottleneck.toml"
    path.write_text(
        """
name = "bottleneck"
rounds = 2
[data]
dataset = "digits"
num_clients = 4
[model]
name = "bottleneck"
units = 6
[server]
clients_per_round = 2
[algorithm]
name = "fedavg"
"""
    )
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in records] == [0, 1, 2] and all(np.isfinite(r["accuracy"]) for r in records)
    stored = tomllib.loads((out / "config.toml").read_text())
    assert stored["model"]["name"] == "bottleneck" and stored["model"]["units"] == 6
    assert validate(stored).model.units == 6  # the run folder's config loads again (resume)
    weights = np.load(out / "model.npz")
    assert len(weights.files) == 4  # two dense layers' kernels and biases
