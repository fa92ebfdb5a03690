"""Flax (linen) models and the per-example mean loss that clients minimise.

Every model maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``
(``"linear"``: predictions ``[batch]``). Models are used only through the pure functions
``model.init`` / ``model.apply`` on the ``params`` collection, so parameters are plain pytrees
that the algorithms can add, scale, stack and vmap over.

The names below are loaded on first use (PEP 562), so that the model registry
(:mod:`fedbayes.models.registry`), which a config's validation reads, loads no flax: the
functions live in :mod:`fedbayes.models.core`, the modules in their own files.
"""

from __future__ import annotations

import importlib

from fedbayes.models.tasks import TASKS

__all__ = [
    "ACTIVATIONS",
    "CNN",
    "EmnistCNN",
    "MLP",
    "NextWordLSTM",
    "ResNet18GN",
    "MODELS",
    "TASKS",
    "VARIATIONAL_MODELS",
    "VariationalCNN",
    "VariationalMLP",
    "LinearRegression",
    "LogisticRegression",
    "has_hidden_layers",
    "init_params",
    "loss_fn",
    "make_model",
]

# Where each lazily loaded name lives (full module paths, so the layering test can follow them).
_LAZY = {
    **dict.fromkeys(
        ("MODELS", "VARIATIONAL_MODELS", "INIT_COMPILER_OPTIONS", "has_hidden_layers", "init_params", "loss_fn", "make_model"), "fedbayes.models.core"
    ),
    **dict.fromkeys(("ACTIVATIONS", "MLP", "activation_fn"), "fedbayes.models.mlp"),
    "CNN": "fedbayes.models.cnn",
    **dict.fromkeys(("EmnistCNN", "NextWordLSTM", "ResNet18GN"), "fedbayes.models.papers"),
    **dict.fromkeys(("LinearRegression", "LogisticRegression"), "fedbayes.models.logreg"),
    **dict.fromkeys(("VariationalCNN", "VariationalMLP"), "fedbayes.models.variational"),
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fedbayes.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
