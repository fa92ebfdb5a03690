"""Variational (Bayes-by-backprop) layers and models for federated variational BNNs (Ozer et al.
2022, "How to Combine Variational Bayesian Networks in Federated Learning"; docs/algorithms.md §12.1).

**Which leaf is which: the naming convention** (docs/design.md, "Families of state"). In a parameter
tree, a dict that holds two sibling leaves ``<name>_mean`` and ``<name>_logvar`` of one shape
carries the mean-field Gaussian ``N(mean, exp(logvar))`` of the weight ``<name>``; every other leaf
(biases, convolutions, a ``_mean`` without its ``_logvar``) is deterministic. The aggregation
rules (:mod:`fedbayes.aggregators.variational`), the KL term and the standard-deviation norm find
the variational weights from the tree itself through :func:`split_variational`, never from a list
kept elsewhere. :class:`VariationalDense` names its weight ``kernel``, so its leaves are
``kernel_mean``, ``kernel_logvar`` and (deterministic) ``bias``.

The layer:

* local reparameterisation: ``o = a mu + b + sqrt(a^2 sigma^2 + 1e-8) * eps``, ``eps ~ N(0, I)``
  drawn per example and output unit from the flax RNG stream ``"noise"``; the noise is there at
  evaluation too (no eval switch);
* ``sigma^2 = exp(logvar)`` (:func:`variance`) with the log-variance clipped to
  [:data:`LOGVAR_MIN`, :data:`LOGVAR_MAX`] = [-30, 20] only as an underflow/overflow guard: a
  variance of ``e^-30`` (a standard deviation of 3e-7) is far below anything the data or the prior
  ask for, so the log-variance gets its gradient everywhere a fit can go;
* initialisation ``mu ~ N(0, 1 / fan_in)``, ``logvar = log(init_variance_ratio / fan_in)``
  (default ratio 0.01: each weight's noise has a tenth of the standard deviation of the initial
  means, ``sigma^2 = 1.3e-5`` for 784 inputs, ``1e-4`` for 100), bias 0; prior ``N(0, 1)`` per weight.

**The published code's layer** (the ``paper`` variant of :func:`fedbayes.algorithms.vbnn.vbnn`,
for reproducing the paper's tables): ``sigma^2 = exp(clamp(logvar, -8, 8))``
(:data:`PAPER_LOGVAR_MIN`, :data:`PAPER_LOGVAR_MAX`) in the forward pass and the KL, and
``logvar ~ N(-9, 0.001^2)``. ``clamp`` has derivative 0 outside [-8, 8], so there every
log-variance starts below the clamp and receives no gradient at all, from the data or the KL; the
variant applies :func:`paper_clamp` to the parameter tree in front of this layer, which is the same
function and the same (zero) gradient as a clamp inside it.

Usage: ``model.apply({"params": p}, x, rngs={"noise": key})``; :func:`apply_with_key` wraps it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedbayes import gaussian
from fedbayes.models.cnn import conv_features
from fedbayes.models.logreg import centred_over_classes
from fedbayes.models.mlp import activation_fn

__all__ = [
    "DEFAULT_INIT_VARIANCE_RATIO",
    "LOGVAR_MAX",
    "LOGVAR_MIN",
    "LOGVAR_SUFFIX",
    "MEAN_SUFFIX",
    "NOISE",
    "PAPER_LOGVAR_INIT",
    "PAPER_LOGVAR_MAX",
    "PAPER_LOGVAR_MIN",
    "VariationalCNN",
    "VariationalDense",
    "VariationalMLP",
    "apply_with_key",
    "clamped_variance",
    "is_variational",
    "kl_to_prior",
    "logvar_quantiles",
    "merge_variational",
    "paper_clamp",
    "paper_init",
    "prior_variances",
    "split_variational",
    "std_norm",
    "variance",
]

LOGVAR_MIN = -30.0  # underflow guard only: no fit gets there (module docstring)
LOGVAR_MAX = 20.0  # overflow guard only
PAPER_LOGVAR_MIN = -8.0  # the published code's clamp
PAPER_LOGVAR_MAX = 8.0
PAPER_LOGVAR_INIT = (-9.0, 0.001)  # the published code's N(mean, std^2) of the initial log-variance
DEFAULT_INIT_VARIANCE_RATIO = 0.01
MEAN_SUFFIX = "_mean"
LOGVAR_SUFFIX = "_logvar"
NOISE = "noise"  # the flax RNG stream of the reparameterisation noise
_EPS = 1e-8


def variance(log_var: jax.Array) -> jax.Array:
    """``exp(log_var)`` behind the guard [-30, 20] (module docstring): the variance of the forward
    pass and the KL."""
    return jnp.exp(jnp.clip(log_var, LOGVAR_MIN, LOGVAR_MAX))


def clamped_variance(log_var: jax.Array) -> jax.Array:
    """``exp(clamp(log_var, -8, 8))``: the variance of the published code's forward pass and KL."""
    return jnp.exp(jnp.clip(log_var, PAPER_LOGVAR_MIN, PAPER_LOGVAR_MAX))


class VariationalDense(nn.Module):
    """Dense layer with a mean-field Gaussian weight and a deterministic bias (docs/algorithms.md §12.1).

    Parameters: ``kernel_mean`` and ``kernel_logvar`` ``[in, features]``, ``bias [features]``.

    Attributes:
        features: output width.
        init_variance_ratio: the initial variance of every weight is ``init_variance_ratio /
            fan_in``, this fraction of the initial means' variance (module docstring).
        centred: start the means centred over the outputs
            (:func:`fedbayes.models.logreg.centred_over_classes`): the output layer of a linear
            model, whose softmax cannot tell a shift common to every logit.
    """

    features: int
    init_variance_ratio: float = DEFAULT_INIT_VARIANCE_RATIO
    centred: bool = False

    @nn.compact
    def __call__(self, a: jax.Array) -> jax.Array:
        fan_in = a.shape[-1]
        shape = (fan_in, self.features)
        mean_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")
        mean = self.param("kernel" + MEAN_SUFFIX, centred_over_classes(mean_init) if self.centred else mean_init, shape, jnp.float32)

        def logvar_init(key, shape, dtype=jnp.float32):
            del key  # a constant: the means break the symmetry
            return jnp.full(shape, math.log(self.init_variance_ratio / fan_in), dtype)

        log_var = self.param("kernel" + LOGVAR_SUFFIX, logvar_init, shape, jnp.float32)
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
        out_mean = a @ mean + bias.reshape((1,) * (a.ndim - 1) + (-1,))
        out_var = jnp.square(a) @ variance(log_var)
        eps = jax.random.normal(self.make_rng(NOISE), out_mean.shape, out_mean.dtype)
        return out_mean + jnp.sqrt(out_var + _EPS) * eps


class VariationalMLP(nn.Module):
    """:class:`~fedbayes.models.mlp.MLP` with every dense layer variational (same layer names).
    Without hidden layers (a linear model) the output layer's means start centred over the
    classes, as :class:`~fedbayes.models.logreg.LogisticRegression`'s weights."""

    num_classes: int
    hidden: Sequence[int] = (200, 100)
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden):
            x = activation_fn(self.activation)(VariationalDense(width, name=f"hidden_{i}")(x))
        return VariationalDense(self.num_classes, name="output", centred=not self.hidden)(x)


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


def prior_variances(means: dict, prior_variance: float | str = 1.0) -> dict:
    """The prior's variance per variational weight: ``prior_variance`` everywhere (a number), or
    ``"fan_in"``: ``1 / fan_in`` for a kernel ``[..., fan_in, out]``, the variance of the means'
    initialisation (the function-space scale of a standard-initialised network)."""
    if prior_variance == "fan_in":
        return {k: jnp.full_like(v, 1.0 / v.shape[-2]) for k, v in means.items()}
    if isinstance(prior_variance, str) or not prior_variance > 0:
        raise ValueError(f"prior_variance must be > 0 or 'fan_in', got {prior_variance!r}")
    return {k: jnp.full_like(v, prior_variance) for k, v in means.items()}


def kl_to_prior(params: Any, prior_variance: float | str = 1.0) -> jax.Array:
    """``sum KL(N(mu, sigma^2) || N(0, s^2))`` over the variational weights, in closed form
    (:func:`fedbayes.gaussian.kl`), with ``sigma^2 = exp(logvar)`` behind the guard
    (:func:`variance`), as in the forward pass, and ``s^2`` from :func:`prior_variances`. Its
    derivative in a log-variance is ``(sigma^2 / s^2 - 1) / 2``, non-zero wherever
    ``sigma^2 != s^2``."""
    means, log_vars, _ = split_variational(params)
    if not means:
        return jnp.zeros((), jnp.float32)
    q = gaussian.from_moments(means, {k: variance(v) for k, v in log_vars.items()})
    prior = gaussian.from_moments(jax.tree.map(jnp.zeros_like, means), prior_variances(means, prior_variance))
    return gaussian.kl(q, prior)


def paper_clamp(params: Any) -> Any:
    """The tree with every log-variance clamped to [-8, 8], the published code's clamp (module
    docstring); the gradient through it is 0 outside the interval, as the code's."""
    means, log_vars, det = split_variational(params)
    return merge_variational(means, {k: jnp.clip(v, PAPER_LOGVAR_MIN, PAPER_LOGVAR_MAX) for k, v in log_vars.items()}, det)


def paper_init(key: jax.Array, params: Any) -> Any:
    """The tree with every log-variance redrawn from the published code's ``N(-9, 0.001^2)``
    (weight ``i`` in the order of :func:`split_variational` from ``fold_in(key, i)``)."""
    means, log_vars, det = split_variational(params)
    mean, std = PAPER_LOGVAR_INIT
    new = {k: mean + std * jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype) for i, (k, v) in enumerate(log_vars.items())}
    return merge_variational(means, new, det)


def logvar_quantiles(params: Any, qs: tuple[float, ...] = (0.0, 0.05, 0.5, 0.95, 1.0)) -> tuple[float, ...]:
    """Quantiles of all stored log-variances together (default: min, 5%, median, 95%, max)."""
    _, log_vars, _ = split_variational(params)
    if not log_vars:
        raise ValueError("logvar_quantiles: the tree has no variational weights")
    flat = jnp.concatenate([jnp.ravel(v) for v in log_vars.values()])
    return tuple(float(x) for x in jnp.quantile(flat, jnp.asarray(qs)))


def std_norm(params: Any, clamp: bool = False) -> jax.Array:
    """The L2 norm of the learned standard deviations over every variational weight.

    ``clamp=False`` (Ozer et al. 2022 (VBNN aggregation)'s Table 4): ``exp(logvar / 2)`` of the stored log-variances; its
    values for CF and AALV lie below the clamp's floor (FMNIST CF 1.40 over 41,640 weights is
    sigma^2 = e^-10, under e^-8), so the paper's norms are of the stored ``logvar``.
    ``clamp=True``: the standard deviations the published code's forward pass uses (clamped to
    [-8, 8]).
    """
    _, log_vars, _ = split_variational(params)
    var = clamped_variance if clamp else jnp.exp
    total = sum((jnp.sum(var(v)) for v in log_vars.values()), jnp.zeros((), jnp.float32))
    return jnp.sqrt(total)
