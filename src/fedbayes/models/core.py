"""Flax (linen) models and the per-example mean loss that clients minimise (``fedbayes.models``
exposes these names and loads this module on first use).

Every model maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``
(``"linear"``: predictions ``[batch]``). Models are used only through the pure functions
``model.init`` / ``model.apply`` on the ``params`` collection, so parameters are plain pytrees
that the algorithms can add, scale, stack and vmap over.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedbayes.models.cnn import CNN
from fedbayes.models.logreg import LinearRegression, LogisticRegression
from fedbayes.models.mlp import MLP, activation_fn
from fedbayes.models.papers import EmnistCNN, NextWordLSTM, ResNet18GN
from fedbayes.models.tasks import TASKS
from fedbayes.models.variational import VariationalCNN, VariationalMLP, is_variational, split_variational

# The model classes are exported by their own modules (and lazily by the package).
__all__ = ["INIT_COMPILER_OPTIONS", "MODELS", "VARIATIONAL_MODELS", "has_hidden_layers", "init_params", "loss_fn", "make_model"]

MODELS: tuple[str, ...] = ("logreg", "mlp", "cnn", "linear", "emnist_cnn", "resnet18_gn", "lstm_nwp")
# The benchmarks' models (fedbayes.models.papers); make_model passes their keyword attributes on.
_PAPER_MODELS = {"emnist_cnn": EmnistCNN, "resnet18_gn": ResNet18GN, "lstm_nwp": NextWordLSTM}
VARIATIONAL_MODELS: tuple[str, ...] = ("mlp", "cnn")


def make_model(name: str, num_classes: int, *, variational: bool = False, **kwargs: Any) -> nn.Module:
    """Builds a model by name.

    Args:
        name: one of :data:`MODELS`: ``"logreg"`` (:class:`LogisticRegression`), ``"mlp"``
            (:class:`MLP`, accepts ``hidden=(200, 100)`` and ``activation="relu"``), ``"cnn"`` (:class:`CNN`, accepts
            ``padding="SAME"``), ``"linear"`` (:class:`LinearRegression`), or the federated
            benchmarks' ``"emnist_cnn"``, ``"resnet18_gn"`` (accepts ``width``) and
            ``"lstm_nwp"`` (accepts ``embed_dim``, ``hidden``) of :mod:`fedbayes.models.papers`.
        num_classes: number of classes, at least 2. Ignored by ``"linear"``, whose output is one
            scalar per example.
        variational: the model of Ozer et al. 2022 (VBNN aggregation)'s VBNN, with every dense layer variational
            (:class:`~fedbayes.models.variational.VariationalMLP`,
            :class:`~fedbayes.models.variational.VariationalCNN`); ``"mlp"`` and ``"cnn"`` only.
            It needs the ``"noise"`` RNG stream when applied.
        **kwargs: further module attributes; an attribute the model does not have raises
            ``TypeError``.

    Raises:
        ValueError: for an unknown name or, for a classifier, ``num_classes < 2``, or
            ``variational`` with a model that has no variational version.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    if variational and name not in VARIATIONAL_MODELS:
        raise ValueError(f"variational: only {', '.join(VARIATIONAL_MODELS)} have a variational version; got {name!r}")
    if name == "linear":
        return LinearRegression(**kwargs)
    if num_classes < 2:
        raise ValueError(f"model {name!r} needs num_classes >= 2, got {num_classes}")
    if name == "logreg":
        return LogisticRegression(num_classes=num_classes, **kwargs)
    if name in _PAPER_MODELS:
        return _PAPER_MODELS[name](num_classes=num_classes, **kwargs)
    if name == "mlp":
        if "hidden" in kwargs:
            # Module attributes must be hashable; accept any sequence of widths.
            kwargs["hidden"] = tuple(int(h) for h in kwargs["hidden"])
        if "activation" in kwargs:
            activation_fn(kwargs["activation"])  # an unknown name fails here, not at the first call
        return (VariationalMLP if variational else MLP)(num_classes=num_classes, **kwargs)
    return (VariationalCNN if variational else CNN)(num_classes=num_classes, **kwargs)


# The initialiser runs once; LLVM's -O1 compiles it about 3x faster than the default -O2/-O3
# (MLP (200, 100): 0.7 s against 2.3 s on the 2-core development machine, most of a cold
# start-up's build step) and gives bit-identical parameters (tests/models/test_models.py).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _init_impl(model: nn.Module, key: jax.Array, dummy: jax.Array) -> Any:
    return model.init(key, dummy)


# One compiled program for all initialisers (cheaper than compiling each op eagerly), cached
# across calls: linen modules hash and compare by their attributes. Compiler options are only
# allowed on a top-level jit: inside another trace the plain one is used.
_init = jax.jit(_init_impl, static_argnums=0, compiler_options=INIT_COMPILER_OPTIONS)
_init_traced = jax.jit(_init_impl, static_argnums=0)


def init_params(model: nn.Module, key: jax.Array, feature_shape: Sequence[int]) -> Any:
    """Initial parameters of ``model``: the ``params`` collection, float32.

    Args:
        model: a module from :func:`make_model`.
        key: a PRNG key (typed ``jax.random.key`` or raw ``jax.random.PRNGKey``).
        feature_shape: shape of one example, e.g. ``(28, 28, 1)`` or ``(30,)``.

    Returns:
        The parameter pytree, initialised from a dummy float32 batch of one example.
    """
    dummy = jnp.zeros((1, *feature_shape), jnp.float32)
    init = _init_traced if isinstance(dummy, jax.core.Tracer) else _init
    params = init(model, key, dummy)["params"]
    return jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)


def has_hidden_layers(params: Any) -> bool:
    """Whether a model with parameters ``params`` is a network rather than a generalised linear
    model: more than one weight array (a parameter of rank 2 or more: a dense kernel, a
    convolution's filters; a variational weight's mean and log-variance count once). A logistic or linear regression has one kernel and a bias; an MLP,
    a CNN or an LSTM has several. Methods whose good start differs between the two read it
    (:attr:`fedbayes.algorithms.base.BuildContext.hidden_layers`)."""
    if is_variational(params):  # a variational weight's mean and log-variance are one weight
        means, _, det = split_variational(params)
        params = (means, det)
    return sum(1 for leaf in jax.tree.leaves(params) if jnp.ndim(leaf) >= 2) > 1


LossFn = Callable[[Any, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def loss_fn(model: nn.Module, task: str) -> LossFn:
    """The masked mean per-example loss, the objective ``\\bar\\ell_k`` of docs/algorithms.md §0.

    Returns ``f(params, key, x, y, mask)`` (``key`` is ignored: these models are deterministic; it is
    there for stochastic losses, see :class:`fedbayes.inference.LocalTrainer`) with ``x`` float32 ``[batch, *feature_shape]``, ``mask``
    float32 ``[batch]`` (1 for a real example, 0 for padding) and

        f = sum_i mask_i * l_i / max(sum_i mask_i, 1),

    where ``l_i = -log softmax(model(x_i))[y_i]`` for ``task="classification"`` (``y`` int
    labels ``[batch]``) and ``l_i = 0.5 (model(x_i) - y_i)^2`` for ``task="regression"`` (``y``
    float32 ``[batch]``). For ``task="multilabel"`` (``y`` 0/1 ``[batch, L]``) ``l_i`` is the
    sigmoid cross-entropy averaged over the ``L`` labels (Keras' ``BinaryCrossentropy``, as in
    Reddi et al. 2021's tag prediction). For ``task="next_word"`` (``y`` int token ids
    ``[batch, T]``, 0 = padding) the loss is the softmax cross-entropy averaged over the
    batch's non-padding tokens (Keras' masked loss), ``sum_{i,t} mask_i v_it l_it / sum mask_i v_it``.
    A model with a ``training_apply(params, key, x)`` method (dropout, random crops:
    :mod:`fedbayes.models.papers`) trains through it with the step's key. Padded examples contribute exactly zero to the loss and its gradient
    (their labels may be anything, even out of range; their features must be finite). A batch
    that is all padding has loss 0.

    Raises:
        ValueError: for a task not in :data:`TASKS`.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")

    def per_example(out: jax.Array, y: jax.Array, valid: jax.Array) -> jax.Array:
        if task == "classification":
            # Padded labels may be out of range; a safe label keeps the loss finite there.
            labels = jnp.where(valid, y, jnp.zeros_like(y))
            return optax.softmax_cross_entropy_with_integer_labels(out, labels)
        return 0.5 * jnp.square(out - y)

    training_apply = getattr(model, "training_apply", None)

    def forward(params: Any, key: jax.Array, x: jax.Array) -> jax.Array:
        return model.apply({"params": params}, x) if training_apply is None else training_apply(params, key, x)

    if task == "multilabel":

        def multilabel(params: Any, key: jax.Array, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
            per = jnp.mean(optax.sigmoid_binary_cross_entropy(forward(params, key, x), y), axis=-1)
            return jnp.sum(jnp.where(mask > 0, per, 0.0) * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        return multilabel

    if task == "next_word":

        def next_word(params: Any, key: jax.Array, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
            weight = mask[:, None] * (y != 0).astype(mask.dtype)  # padding targets (id 0) carry no loss
            per = optax.softmax_cross_entropy_with_integer_labels(forward(params, key, x), jnp.where(weight > 0, y, 0))
            return jnp.sum(jnp.where(weight > 0, per, 0.0) * weight) / jnp.maximum(jnp.sum(weight), 1.0)

        return next_word

    def loss(params: Any, key: jax.Array, x: jax.Array, y: jax.Array, mask: jax.Array) -> jax.Array:
        out = forward(params, key, x)
        valid = mask > 0
        per = jnp.where(valid, per_example(out, y, valid), jnp.zeros((), out.dtype))
        return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss
