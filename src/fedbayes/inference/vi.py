"""Mean-field Gaussian variational inference of a client's tilted distribution: PVI's local step.

The client fits ``q_k = N(mean, diag(std^2))`` to its tilted distribution (cavity times likelihood;
Ashman et al. 2022, "Partitioned Variational Inference: A Framework for Probabilistic Federated
Learning", Eq. 5; Swaroop et al. 2025 (ADMM and Bayes) Eq. 5) by reparameterised stochastic
gradients (Bayes-by-backprop; Blundell et al. 2015) of

    F(q) = E_q[l_k(theta)] + KL(q || cavity)

(:func:`reparameterised_vi`, a :class:`~fedbayes.inference.base.CavityInference`), with one weight
draw per minibatch (:func:`draw_weights`) or the local reparameterisation of the dense layers
(:func:`local_reparameterisation`). docs/algorithms.md §8.2.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from fedbayes import gaussian
from fedbayes.data.batches import ClientData
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.base import CavityInference
from fedbayes.inference.sgd import LocalTrainer, run_sgd, stiff_step_control
from fedbayes.models.layers import find_layers, layer_of

PyTree = Any
PARAMETERISATIONS = ("log", "softplus")
ESTIMATORS = ("weights", "local")

__all__ = [
    "ESTIMATORS",
    "PARAMETERISATIONS",
    "VariationalParams",
    "check_local_settings",
    "draw_weights",
    "expected_loss",
    "kl_to_cavity",
    "local_reparameterisation",
    "reparameterised_vi",
    "standard_normal_like",
    "std_of",
    "var_of",
    "to_gaussian",
]


class VariationalParams(NamedTuple):
    """The local mean-field Gaussian ``N(mean, diag(std^2))`` as the client optimizer sees it:
    ``mean`` and an unconstrained ``raw_std`` (``std = exp(raw_std)`` or ``softplus(raw_std)``)."""

    mean: PyTree
    raw_std: PyTree


def _std(raw: jax.Array, parameterisation: str) -> jax.Array:
    return jnp.exp(raw) if parameterisation == "log" else jax.nn.softplus(raw)


def _raw_std(std: jax.Array, parameterisation: str) -> jax.Array:
    if parameterisation == "log":
        return jnp.log(std)
    return std + jnp.log(-jnp.expm1(-std))  # softplus^{-1}, stable for small and large std


def _var(raw: jax.Array, parameterisation: str) -> jax.Array:
    """``std^2`` from ``raw_std``: ``exp(2 raw)`` under the log parameterisation, one ``exp`` whose
    derivative is itself times 2. With the local estimator's variances and the KL penalty both in
    this form, PVI's local step is faster than with ``square(exp(raw))`` (docs/results/bench.md,
    "PVI's variances as exp(2 raw_std)")."""
    return jnp.exp(2.0 * raw) if parameterisation == "log" else jnp.square(jax.nn.softplus(raw))


def std_of(vp: VariationalParams, parameterisation: str) -> PyTree:
    """The standard deviations of ``vp``."""
    return jax.tree.map(lambda r: _std(r, parameterisation), vp.raw_std)


def var_of(vp: VariationalParams, parameterisation: str) -> PyTree:
    """The variances ``std^2`` of ``vp`` (:func:`_var`)."""
    return jax.tree.map(lambda r: _var(r, parameterisation), vp.raw_std)


def to_gaussian(vp: VariationalParams, parameterisation: str) -> DiagGaussian:
    """``vp`` in natural parameters: ``Lambda = 1 / std^2``, ``eta = Lambda mean``."""
    return gaussian.from_moments(vp.mean, var_of(vp, parameterisation))


def standard_normal_like(key: jax.Array, tree: PyTree) -> PyTree:
    """``eps ~ N(0, I)`` with ``tree``'s structure, shapes and dtypes, materialised in one pass: one
    ``normal(key, (total size,))`` in the leaves' widest dtype, sliced into the leaves in flatten
    order. One generator call instead of one per leaf: XLA's CPU runtime runs each threefry call
    as several dispatched loops, which made them most of PVI's step (docs/results/bench.md)."""
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [math.prod(jnp.shape(x)) for x in leaves]
    flat = jax.random.normal(key, (sum(sizes),), jnp.result_type(*leaves))
    out, start = [], 0
    for x, size in zip(leaves, sizes):
        out.append(flat[start : start + size].reshape(jnp.shape(x)).astype(jnp.result_type(x)))
        start += size
    return treedef.unflatten(out)


def draw_weights(key: jax.Array, vp: VariationalParams, parameterisation: str) -> PyTree:
    """One reparameterised draw ``theta = mean + std * eps``, ``eps ~ N(0, I)``, with ``eps`` from
    :func:`standard_normal_like` ``(key, mean)``."""
    eps = standard_normal_like(key, vp.mean)
    return jax.tree.map(lambda m, r, e: m + _std(r, parameterisation) * e, vp.mean, vp.raw_std, eps)


def expected_loss(loss_fn: Callable, *, samples: int, parameterisation: str, estimator: str = "weights") -> Callable:
    """``(vp, key, x, y, mask) -> (1/S) sum_s loss_fn(theta_s, k_s, x, y, mask)`` with
    ``theta_s = draw_weights(k_s, vp)`` and ``k_s = fold_in(key, s)``: the minibatch estimate of
    ``E_q[mean loss]`` (the keyed loss of :func:`fedbayes.inference.sgd.run_sgd`).

    ``estimator="local"`` gives the same expectation with :func:`local_reparameterisation`: the
    dense layers' outputs are drawn per example instead of their weights per minibatch.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}; got {estimator!r}")
    if estimator == "local":
        return local_reparameterisation(loss_fn, samples=samples, parameterisation=parameterisation)

    def loss(vp, key, x, y, mask):
        def one(s):
            k = jax.random.fold_in(key, s)
            return loss_fn(draw_weights(k, vp, parameterisation), k, x, y, mask).astype(jnp.float32)

        if samples == 1:
            return one(0)
        return jnp.mean(jax.vmap(one)(jnp.arange(samples)))  # one program for any S

    return loss


def local_reparameterisation(loss_fn: Callable, *, samples: int, parameterisation: str) -> Callable:
    """The local reparameterisation estimate of ``E_q[mean loss]`` (Kingma, Salimans & Welling 2015,
    "Variational Dropout and the Local Reparameterization Trick", Sec. 2.3).

    For a dense layer ``z = a W + b`` with independent ``W_ij ~ N(M_ij, S_ij^2)``,
    ``b_j ~ N(m_j, s_j^2)``, the output given the input ``a`` of one example is Gaussian with
    independent units:

        z_j | a ~ N( (a M + m)_j,  (a^2 S^2 + s^2)_j ),

    so drawing ``z_j = (a M + m)_j + sqrt((a^2 S^2 + s^2)_j) eps_j`` per example and unit is an exact
    draw of the layer's output under **a separate weight draw per example**. The minibatch loss is
    then an unbiased estimate of the same ``E_q[mean loss]`` as :func:`draw_weights`' one shared
    draw, with lower variance (the examples' noise is independent), and it needs ``B x units``
    normals per layer instead of ``units_in x units`` (PVI's cost on a CPU is mostly these normals:
    docs/results/bench.md).

    The dense layers are found by interception (:func:`fedbayes.models.layers.find_layers`: every
    ``flax.linen.Dense`` called once on a ``[batch, features]`` input); their kernel and bias stay at
    the mean and their outputs get the noise. Every other parameter (convolutions, whose shared
    weights make the per-position draws correlated, and anything else) is drawn as
    :func:`draw_weights` draws it. Keys: sample ``s`` splits ``fold_in(key, s)`` into
    ``(k_weights, k_units)``; the other parameters are ``draw_weights(k_weights, ...)``; the dense
    layers' noise is one ``normal(k_units, (sum of their output sizes,))``, sliced in the order
    the model first calls them (one generator call a step: on the CPU each call is a loop of
    dispatches), and ``k_units`` is the loss's key.
    """

    def loss(vp, key, x, y, mask):
        layers, _ = find_layers(lambda p, xx: loss_fn(p, key, xx, y, mask), vp.mean, x)
        # Each dense layer's slice of one normal draw per sample: one generator call per step.
        dense, total = {}, 0
        for path, (layer, shape) in layers.items():
            if layer.kind == "dense":
                dense[path] = (total, shape.shape)
                total += math.prod(shape.shape)
        var_tree = var_of(vp, parameterisation)

        def at(tree, path):
            for name in path:
                tree = tree[name]
            return tree

        def covered(kp, _):
            names = tuple(getattr(k, "key", getattr(k, "name", k)) for k in kp)
            return names[:-1] in dense and names[-1] in ("kernel", "bias")

        cover = jax.tree_util.tree_map_with_path(covered, vp.mean)
        all_covered = all(jax.tree.leaves(cover))

        def one(s):
            k_weights, k_units = jax.random.split(jax.random.fold_in(key, s))
            theta = vp.mean
            if not all_covered:
                drawn = draw_weights(k_weights, vp, parameterisation)
                theta = jax.tree.map(lambda c, m, d: m if c else d, cover, vp.mean, drawn)
            noise = jax.random.normal(k_units, (total,), jnp.float32)

            def interceptor(next_fun, args, kwargs, context):
                out = next_fun(*args, **kwargs)
                layer = layer_of(context, args)
                if layer is None or layer.path not in dense:
                    return out
                start, shape = dense[layer.path]
                node = at(var_tree, layer.path)
                var = jnp.square(args[0]).astype(out.dtype) @ node["kernel"].astype(out.dtype)
                if "bias" in node:
                    var = var + node["bias"].astype(out.dtype)[None, :]
                eps = noise[start : start + math.prod(shape)].reshape(shape).astype(out.dtype)
                # The tiny floor keeps sqrt's gradient finite for an all-zero input without a bias.
                return out + jnp.sqrt(var + jnp.finfo(out.dtype).tiny) * eps

            with nn.intercept_methods(interceptor):
                return loss_fn(theta, k_units, x, y, mask).astype(jnp.float32)

        if samples == 1:
            return one(0)
        return jnp.mean(jax.vmap(one)(jnp.arange(samples)))

    return loss


def kl_to_cavity(cavity: DiagGaussian, parameterisation: str, *, squared_std: bool = False) -> Callable[[VariationalParams], jax.Array]:
    """``vp -> KL(q || cavity)`` for ``q = N(mean, diag(std^2))`` given by ``vp``, the same value as
    ``gaussian.kl(to_gaussian(vp), cavity)`` (docs/algorithms.md §1.1) written in ``q``'s own
    parameters:

        KL = 1/2 sum_i [L_i v_i - 1 - log L_i - log v_i + L_i (mu_i - m_i)^2],   v_i = std_i^2,

    with the cavity's precision ``L`` and mean ``m`` (and ``1 + log L``) computed once, before the
    local steps, and ``log v = 2 raw_std`` read directly under the log parameterisation. Through
    the natural parameters, every step's gradient went through ``1 / std^2``, ``eta / Lambda``
    and a log per coordinate of both trees; this is one ``exp`` per coordinate (its gradient:
    ``L (mu - m)`` and ``L v - 1``): a faster PVI round (docs/results/bench.md).

    ``v`` is computed as the estimator computes it, so that XLA shares the ``exp`` between the
    penalty and the data term: ``exp(2 raw_std)`` (:func:`var_of`, the local estimator's form) by
    default, ``std^2`` with ``squared_std=True`` (:func:`draw_weights` computes ``std``)."""
    cavity = gaussian.to_diag(cavity)
    precision, mean = cavity.precision, gaussian.mean(cavity)
    constant = jax.tree.map(lambda lam: 1.0 + jnp.log(lam), precision)

    def terms(mu, raw, lam, m, c):
        log_var = 2.0 * (raw if parameterisation == "log" else jnp.log(_std(raw, parameterisation)))
        var = jnp.square(_std(raw, parameterisation)) if squared_std else _var(raw, parameterisation)
        return 0.5 * (lam * var - c - log_var + lam * jnp.square(mu - m))

    def kl(vp: VariationalParams) -> jax.Array:
        return optax.tree.sum(jax.tree.map(terms, vp.mean, vp.raw_std, precision, mean, constant))

    return kl


def check_local_settings(samples: int, parameterisation: str, init_std: float | None) -> None:
    """The local VI step's settings shared by the diagonal and dense clients: at least one weight
    draw per step, a known parameterisation, a positive starting standard deviation (or none)."""
    if samples < 1:
        raise ValueError(f"samples must be at least 1, got {samples}")
    if parameterisation not in PARAMETERISATIONS:
        raise ValueError(f"parameterisation must be one of {', '.join(PARAMETERISATIONS)}, got {parameterisation!r}")
    if init_std is not None and not init_std > 0:
        raise ValueError(f"init_std must be > 0 (or None), got {init_std}")


def reparameterised_vi(
    trainer: LocalTrainer,
    *,
    samples: int = 1,
    parameterisation: str = "log",
    init_std: float | None = None,
    estimator: str = "local",
    step_cap: float = 1.0,
) -> CavityInference:
    """The local step of mean-field Gaussian PVI (docs/algorithms.md §8.2): Bayes-by-backprop on the
    tilted objective, per minibatch (mean-loss scale, i.e. the objective divided by ``n_k``)

        F(q) = (1/S) sum_s mean_batch l(theta_s) + KL(q || cavity) / n_k,   theta_s = mu + sigma eps_s,

    minimised over ``(mu, raw_std)`` with ``trainer.optimizer`` for ``trainer.num_epochs`` epochs
    (:func:`fedbayes.inference.sgd.run_sgd`, a fresh key per step). The KL is closed form
    (:func:`fedbayes.gaussian.kl`); the minibatch term is an unbiased estimate of
    ``E_q[l_k] / n_k``.

    Args:
      trainer: the client's loss ``(params, key, x, y, mask) -> mean loss``, optimizer, epochs and
        batch size.
      samples: ``S``, reparameterised samples per minibatch.
      parameterisation: ``"log"`` (``sigma = exp(s)``) or ``"softplus"`` (``sigma = softplus(s)``).
      init_std: if set, the local ``sigma`` starts at ``min(sigma_g, init_std)`` instead of the
        global's ``sigma_g`` (the objective is unchanged; a small start keeps early samples of a
        network near its mean, as Bayes-by-backprop initialisations do).
      estimator: ``"local"`` (the default, as PVI's config: :func:`local_reparameterisation`, the
        same objective with the dense layers' outputs drawn per example) or ``"weights"`` (one
        weight draw per minibatch and sample, Bayes-by-backprop).
      step_cap: the cap of the stiff-step control (``<= 0``: none). The KL term's curvature is
        known before the first step: ``Lambda_c / n_k`` in the mean and ``2 Lambda_c v_0 / n_k`` in
        the log standard deviation at the start ``v_0``. A cavity that has gathered the other
        clients' sites is stiff for a small client (``lr Lambda_c / n_k > 2``), and plain SGD
        diverges there (docs/algorithms.md §8.2); the control scales the step in those coordinates
        only (:func:`~fedbayes.inference.sgd.stiff_step_control`: the local optimum is unchanged,
        and every other coordinate steps as plain SGD).

    Returns:
      ``fit(key, start, cavity, data) -> (q_k, info)`` (a :class:`~fedbayes.inference.base.CavityInference`
      whose ``start`` is a Gaussian, the ``q`` that the mean and standard deviations start from):
      ``start`` and ``cavity`` proper; ``info`` the training info of :func:`run_sgd` (``loss`` = the mean estimate of the
      expected data loss).

    Raises:
      ValueError: for ``samples < 1``, an unknown parameterisation or estimator, or ``init_std <= 0``.
    """
    check_local_settings(samples, parameterisation, init_std)
    local = trainer._replace(loss_fn=expected_loss(trainer.loss_fn, samples=samples, parameterisation=parameterisation, estimator=estimator))

    def fit(key, start: DiagGaussian, cavity: DiagGaussian, data: ClientData):
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        std0 = jax.tree.map(lambda lam: jax.lax.rsqrt(lam), start.precision)
        if init_std is not None:
            std0 = jax.tree.map(lambda s: jnp.minimum(s, jnp.asarray(init_std, s.dtype)), std0)
        vp0 = VariationalParams(gaussian.mean(start), jax.tree.map(lambda s: _raw_std(s, parameterisation), std0))

        kl = kl_to_cavity(cavity, parameterisation, squared_std=estimator == "weights")

        def penalty(vp):
            return (kl(vp) / n).astype(jnp.float32)

        lam = gaussian.to_diag(cavity).precision
        stiffness = VariationalParams(lam, jax.tree.map(lambda c, s: 2.0 * c * jnp.square(s), lam, std0))
        vp, info = run_sgd(key, vp0, data, stiff_step_control(local, stiffness, data.num_examples, step_cap), penalty)
        return to_gaussian(vp, parameterisation), info

    return fit
