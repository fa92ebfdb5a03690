"""The tasks a model can be built for (no flax here: the config reads them without loading a model)."""

from __future__ import annotations

TASKS: tuple[str, ...] = ("classification", "regression", "multilabel", "next_word")
ACTIVATIONS: tuple[str, ...] = ("relu", "sigmoid", "tanh")  # fedbayes.models.mlp.ACTIVATIONS' names (a test keeps them equal)
