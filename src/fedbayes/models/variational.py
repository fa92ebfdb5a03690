"""Variational (Bayes-by-backprop) layers and models of Ozer et al. 2022 (VBNN aggregation) (docs/algorithms.md §12.1).

**Which leaf is which: the naming convention** (docs/design.md, "Families of state"). In a parameter
tree, a dict that holds two sibling leaves ``<name>_mean`` and ``<name>_logvar`` of one shape
carries the mean-field Gaussian ``N(mean, exp(logvar))`` of the weight ``<name>``; every other leaf
(biases, convolutions, a ``_mean`` without its ``_logvar``) is deterministic. The aggregation
rules (:mod:`fedbayes.algorithms.vbnn`), the KL term and the standard-deviation norm find the
variational weights from the tree itself through :func:`split_variational`, never from a list
kept elsewhere. :class:`VariationalDense` names its weight ``kernel``, so its leaves are
``kernel_mean``, ``kernel_logvar`` and (deterministic) ``bias``.

The layer (docs/algorithms.md §12.1, from Ozer et al. 2022 (VBNN aggregation)'s code):

* local reparameterisation: ``o = a mu + b + sqrt(a^2 sigma^2 + 1e-8) * eps``, ``eps ~ N(0, I)``
  drawn per example and output unit from the flax RNG stream ``"noise"``; the noise is there at
  evaluation too (no eval switch);
* ``sigma^2 = exp(clamp(logvar, -8, 8))`` (:data:`LOGVAR_MIN`, :data:`LOGVAR_MAX`);
* initialisation ``mu ~ N(0, 1 / fan_in)``, ``logvar ~ N(-9, 0.001^2)`` (std 0.001, so the clamp
  makes it -8), bias 0; prior ``N(0, 1)`` per weight.

Usage: ``model.apply({"params": p}, x, rngs={"noise": key})``; :func:`apply_with_key` wraps it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedbayes import gaussian
from fedbayes.models.cnn import conv_features
from fedbayes.models.mlp import activation_fn

__all__ = [
    "LOGVAR_MAX",
    "LOGVAR_MIN",
    "LOGVAR_SUFFIX",
    "MEAN_SUFFIX",
    "NOISE",
    "VariationalCNN",
    "VariationalDense",
    "VariationalMLP",
    "apply_with_key",
    "clamped_variance",
    "is_variational",
    "kl_to_prior",
    "merge_variational",
    "split_variational",
    "std_norm",
]

LOGVAR_MIN = -8.0
LOGVAR_MAX = 8.0
MEAN_SUFFIX = "_mean"
LOGVAR_SUFFIX = "_logvar"
NOISE = "noise"  # the flax RNG stream of the reparameterisation noise
_EPS = 1e-8


def clamped_variance(log_var: jax.Array) -> jax.Array:
    """``exp(clamp(log_var, -8, 8))``: the variance every variational computation uses."""
    return jnp.exp(jnp.clip(log_var, LOGVAR_MIN, LOGVAR_MAX))


class VariationalDense(nn.Module):
    """Dense layer with a mean-field Gaussian weight and a deterministic bias (docs/algorithms.md §12.1).

    Parameters: ``kernel_mean`` and ``kernel_logvar`` ``[in, features]``, ``bias [features]``.

    Attributes:
        features: output width.
        logvar_init_mean, logvar_init_std: the initial log-variance's normal distribution
            (-9, 0.001 as Ozer et al. 2022 (VBNN aggregation)'s code).
    """

    features: int
    logvar_init_mean: float = -9.0
    logvar_init_std: float = 0.001

    @nn.compact
    def __call__(self, a: jax.Array) -> jax.Array:
        fan_in = a.shape[-1]
        shape = (fan_in, self.features)
        mean = self.param("kernel" + MEAN_SUFFIX, nn.initializers.variance_scaling(1.0, "fan_in", "normal"), shape, jnp.float32)

        def logvar_init(key, shape, dtype=jnp.float32):
            return self.logvar_init_mean + self.logvar_init_std * jax.random.normal(key, shape, dtype)

        log_var = self.param("kernel" + LOGVAR_SUFFIX, logvar_init, shape, jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        out_mean = a @ mean + bias.reshape((1,) * (a.ndim - 1) + (-1,))
        out_var = jnp.square(a) @ clamped_variance(log_var)
        eps = jax.random.normal(self.make_rng(NOISE), out_mean.shape, out_mean.dtype)
        return out_mean + jnp.sqrt(out_var + _EPS) * eps


class VariationalMLP(nn.Module):
    """:class:`~fedbayes.models.mlp.MLP` with every dense layer variational (same layer names)."""

    num_classes: int
    hidden: Sequence[int] = (200, 100)
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden):
            x = activation_fn(self.activation)(VariationalDense(width, name=f"hidden_{i}")(x))
        return VariationalDense(self.num_classes, name="output")(x)


class VariationalCNN(nn.Module):
    """Ozer et al. 2022 (VBNN aggregation)'s VBNN: :class:`~fedbayes.models.cnn.CNN` with its three dense layers variational
    and its convolutions deterministic (docs/algorithms.md §12.1); attributes as ``CNN``'s."""

    num_classes: int
    padding: str = "SAME"
    conv: str = "patches"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        if x.ndim != 4:
            raise ValueError(f"VariationalCNN expects images [batch, H, W] or [batch, H, W, C]; got shape {x.shape}")
        x = conv_features(x, self.padding, self.conv)
        x = nn.relu(VariationalDense(120, name="dense_0")(x))
        x = nn.relu(VariationalDense(84, name="dense_1")(x))
        return VariationalDense(self.num_classes, name="output")(x)


def apply_with_key(model: nn.Module) -> Callable[[Any, jax.Array, jax.Array], jax.Array]:
    """``(params, key, x) -> logits``: one stochastic forward pass with noise from ``key``."""

    def apply(params: Any, key: jax.Array, x: jax.Array) -> jax.Array:
        return model.apply({"params": params}, x, rngs={NOISE: key})

    return apply


# ----- the naming convention -------------------------------------------------------------------


def _pairs(node: dict) -> list[str]:
    """Weight names ``w`` with both ``w_mean`` and ``w_logvar`` leaves in this dict."""
    names = []
    for key in node:
        if isinstance(key, str) and key.endswith(MEAN_SUFFIX):
            base = key[: -len(MEAN_SUFFIX)]
            partner = base + LOGVAR_SUFFIX
            if partner in node and not isinstance(node[key], dict) and not isinstance(node[partner], dict):
                names.append(base)
    return names


def split_variational(params: Any) -> tuple[dict, dict, Any]:
    """Splits a parameter tree by the naming convention.

    Returns:
        ``(means, log_vars, deterministic)``: ``means`` and ``log_vars`` are flat dicts keyed by
        the weight's path (a tuple of dict keys ending in the weight name, e.g.
        ``("dense_0", "kernel")``), with the same keys; ``deterministic`` is ``params`` with every
        variational leaf replaced by ``None`` (an empty subtree for ``jax.tree`` functions).
        Leaves may carry leading axes (e.g. a client axis).
    """
    means: dict = {}
    log_vars: dict = {}

    def walk(node: Any, path: tuple) -> Any:
        if not isinstance(node, dict) and not hasattr(node, "items"):
            return node
        node = dict(node)
        out = {}
        pairs = set(_pairs(node))
        for key, value in node.items():
            base = None
            if isinstance(key, str) and key.endswith(MEAN_SUFFIX) and key[: -len(MEAN_SUFFIX)] in pairs:
                base = key[: -len(MEAN_SUFFIX)]
                means[(*path, base)] = value
                out[key] = None
            elif isinstance(key, str) and key.endswith(LOGVAR_SUFFIX) and key[: -len(LOGVAR_SUFFIX)] in pairs:
                base = key[: -len(LOGVAR_SUFFIX)]
                log_vars[(*path, base)] = value
                out[key] = None
            else:
                out[key] = walk(value, (*path, key))
        return out

    deterministic = walk(params, ())
    return means, log_vars, deterministic


def merge_variational(means: dict, log_vars: dict, deterministic: Any) -> Any:
    """The inverse of :func:`split_variational`: puts the variational leaves back into the tree."""

    def walk(node: Any, path: tuple) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if value is None and isinstance(key, str) and key.endswith(MEAN_SUFFIX):
                out[key] = means[(*path, key[: -len(MEAN_SUFFIX)])]
            elif value is None and isinstance(key, str) and key.endswith(LOGVAR_SUFFIX):
                out[key] = log_vars[(*path, key[: -len(LOGVAR_SUFFIX)])]
            else:
                out[key] = walk(value, (*path, key))
        return out

    return walk(deterministic, ())


def is_variational(params: Any) -> bool:
    """Whether the tree holds at least one variational weight."""
    return bool(split_variational(params)[0])


def kl_to_prior(params: Any, prior_variance: float = 1.0) -> jax.Array:
    """``sum KL(N(mu, sigma^2) || N(0, prior_variance))`` over the variational weights, in closed
    form (:func:`fedbayes.gaussian.kl`), with ``sigma^2`` clamped as in the forward pass."""
    means, log_vars, _ = split_variational(params)
    if not means:
        return jnp.zeros((), jnp.float32)
    q = gaussian.from_moments(means, {k: clamped_variance(v) for k, v in log_vars.items()})
    prior = gaussian.from_moments(jax.tree.map(jnp.zeros_like, means), prior_variance)
    return gaussian.kl(q, prior)


def std_norm(params: Any, clamp: bool = False) -> jax.Array:
    """The L2 norm of the learned standard deviations over every variational weight.

    ``clamp=False`` (Ozer et al. 2022 (VBNN aggregation)'s Table 4): ``exp(logvar / 2)`` of the stored log-variances; its
    values for CF and AALV lie below the clamp's floor (FMNIST CF 1.40 over 41,640 weights is
    sigma^2 = e^-10, under e^-8), so the paper's norms are of the stored ``logvar``.
    ``clamp=True``: the standard deviations the forward pass uses.
    """
    _, log_vars, _ = split_variational(params)
    var = clamped_variance if clamp else jnp.exp
    total = sum((jnp.sum(var(v)) for v in log_vars.values()), jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)
