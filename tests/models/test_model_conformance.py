"""One conformance suite over every model in the registry: each builds on data of the shape its
traits ask for (its task; images for an image model, token ids for a text model), gives one
output per class, and is refused with one line naming the field on data of a mismatched shape."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.dataset import Dataset
from fedbayes.models import registry
from fedbayes.runs.build import DataSpec, build_model, check_model

MODULE = """
import flax.linen as nn

class Net(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(x.reshape((x.shape[0], -1)))
"""
# Small sizes, so that every model builds in a moment (their keys are the model's own settings).
SMALL = {"mlp": {"hidden": [8]}, "resnet18_gn": {"width": 4}, "lstm_nwp": {"width": 8, "embed_dim": 4}}


def _data(task: str, image: bool, tokens: bool, n: int = 6) -> Dataset:
    """A small dataset of ``task``: images ``[8, 8, 1]``, token ids ``[5]`` or features ``[5]``."""
    rng = np.random.default_rng(0)
    if tokens:
        x = rng.integers(1, 12, (2 * n, 5)).astype(np.int32)
    else:
        x = rng.normal(size=(2 * n, 8, 8, 1) if image else (2 * n, 5)).astype(np.float32)
    y = {
        "classification": lambda: rng.integers(0, 3, 2 * n).astype(np.int32),
        "regression": lambda: rng.normal(size=2 * n).astype(np.float32),
        "multilabel": lambda: rng.integers(0, 2, (2 * n, 3)).astype(np.float32),
        "next_word": lambda: rng.integers(0, 12, (2 * n, 5)).astype(np.int32),
    }[task]()
    num_classes = {"classification": 3, "regression": 0, "multilabel": 3, "next_word": 12}[task]
    return Dataset(f"{task}_data", x[:n], y[:n], x[n:], y[n:], num_classes, task)


def _config(spec, task: str, tmp_path):
    model = {"name": spec.name, **SMALL.get(spec.name, {})}
    if spec.imported:
        (tmp_path / "own_net.py").write_text(MODULE)
        model["module"] = f"{tmp_path / 'own_net.py'}:Net"
    dataset = {"regression": "least_squares", "next_word": "stackoverflow_nwp", "multilabel": "stackoverflow_lr"}.get(task, "digits")
    return validate({"data": {"dataset": dataset}, "model": model})


def _mismatch(spec) -> Dataset:
    """Data the model's traits refuse: flat features for an image model, float features for a
    text model, otherwise token sequences (next-word) or, for a next-word model, a classification."""
    if spec.image:
        return _data(spec.tasks[0], image=False, tokens=False)
    if spec.tokens or "next_word" in spec.tasks:
        return _data("classification", image=False, tokens=False)
    return _data("next_word", image=False, tokens=True)


@pytest.mark.parametrize("spec", registry.specs(), ids=lambda s: s.name)
def test_a_model_builds_on_matching_data_and_refuses_a_mismatch(spec, tmp_path):
    task = spec.tasks[0]
    data = _data(task, spec.image, spec.tokens)
    config = _config(spec, task, tmp_path)
    check_model(config, data)
    parts = build_model(config, DataSpec.of(data))
    out = parts.apply_fn(parts.params, jnp.asarray(data.x_test[:2]))
    expected = {"regression": (2,), "next_word": (2, 5, data.num_classes)}.get(task, (2, data.num_classes))
    assert out.shape == expected and bool(jnp.all(jnp.isfinite(out)))
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(parts.params))
    with pytest.raises(ConfigError) as exc:
        check_model(config, _mismatch(spec))
    text = str(exc.value)
    assert "\n" not in text and text.startswith(("config error: model.name: ", "config error: data.dataset: ")), text


@pytest.mark.parametrize("spec", [s for s in registry.specs() if s.variational], ids=lambda s: s.name)
def test_a_model_with_a_variational_version_builds_it(spec, tmp_path):
    data = _data(spec.tasks[0], spec.image, spec.tokens)
    config = _config(spec, spec.tasks[0], tmp_path)
    variational = validate(
        {
            **config.model_dump(mode="json", exclude_none=True),
            "model": {**config.model.model_dump(exclude_none=True), "variational": True},
            "algorithm": {"name": "vbnn"},
        }
    )
    parts = build_model(variational, DataSpec.of(data))
    out = parts.keyed_apply_fn(parts.params, jax.random.key(0), jnp.asarray(data.x_test[:2]))
    assert out.shape == (2, data.num_classes)


def test_models_without_a_variational_version_are_refused_in_one_line():
    for spec in registry.specs():
        if not spec.variational:
            with pytest.raises(ConfigError, match=rf"^config error: model.variational: only .* have a variational version; got '{spec.name}'$"):
                validate({"model": {"name": spec.name, "variational": True}, "algorithm": {"name": "vbnn"}})


def test_the_registry_s_activation_names_are_the_mlp_s():
    from fedbayes.models.mlp import ACTIVATIONS
    from fedbayes.models.tasks import ACTIVATIONS as NAMES

    assert NAMES == tuple(ACTIVATIONS)
