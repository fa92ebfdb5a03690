"""IVON: the improved variational online Newton optimiser (Shen et al. 2024, "Variational Learning is
Effective for Large Deep Networks", ICML 2024, Algorithm 1), as an optax-style transformation with a
sampling step.

IVON fits a mean-field Gaussian ``q = N(m, diag(sigma^2))`` to the posterior of a model trained on
a per-example loss ``l(theta)`` (a mean over the data) with ``lambda`` the effective sample size
(the number of examples) and the prior ``N(0, I / (lambda delta))``, i.e. it minimises
``lambda E_q[l(theta)] + KL(q || N(0, I / (lambda delta)))``. Its state holds the momentum ``g``, a
per-weight Hessian estimate ``h`` and the step count ``t``; the mean ``m`` is the parameters. One
step (Algorithm 1; ``delta`` may be a pytree, a weight decay per weight):

    sigma   = 1 / sqrt(lambda (h + delta))
    theta   = m + sigma eps,  eps ~ N(0, I)                          (sample)
    g_hat   = grad l_batch(theta)                                    (the caller)
    h_hat   = g_hat eps / sigma                                      (reparameterisation Hessian)
    g      <- beta1 g + (1 - beta1) g_hat
    h      <- beta2 h + (1 - beta2) h_hat + (1 - beta2)^2 (h - h_hat)^2 / (2 (h + delta))
    g_bar   = g / (1 - beta1^t)
    m      <- m - alpha_t (g_bar + delta m) / (h + delta)            (the new h)

The last term of the ``h`` update (Lin et al. 2020, "Handling the Positive-Definite Constraint in
the Bayesian Learning Rule", ICML 2020) keeps ``h + delta`` positive: with
``x = (1 - beta2)(h - h_hat) / (h + delta)`` the new ``h + delta`` is
``(h + delta)(1 - x + x^2 / 2) > 0``. ``h_hat`` is unbiased for ``E_q[diag grad^2 l]`` (Price's
theorem), so the fixed point of the iteration is the mean-field VI optimum:
``E_q[grad l] + delta m = 0`` and ``1 / sigma^2 = lambda (E_q[diag grad^2 l] + delta)``.

With ``num_samples = S > 1`` each step averages ``g_hat`` and ``h_hat`` over ``S`` draws (the
caller evaluates one gradient per draw); ``antithetic`` draws them in pairs ``eps, -eps``. The
pair's ``h_hat = (g(m + sigma eps) - g(m - sigma eps)) eps / (2 sigma)`` cancels the term
``grad l(m) eps / sigma`` of the single-draw estimate, whose variance ``lambda (h + delta)
(grad l(m))^2`` dominates wherever the minibatch gradient at the mean is not small; it is still
unbiased (each draw is marginally ``N(0, I)``). Optional (not part of Algorithm 1): a clip of every
preconditioned step to ``[-clip_radius, clip_radius]``; and ``points``, leaves that are parameters
of the model, not of the posterior (a variational layer's deterministic bias): they are not drawn
(``theta = m`` there) and their ``h`` stays where :func:`init` put it, so their step is the
momentum over ``h + delta``, a preconditioned gradient step.

The interface (key first, pure, jit- and vmap-safe; the mean is the parameters, kept by the
caller as in optax):

* ``init(params, hessian=None) -> IVONState``: ``h`` from ``hessian`` (a pytree like ``params``),
  else ``hess_init`` everywhere; :func:`hessian_from_variance` turns a posterior variance into ``h``;
* ``sample(key, state, params) -> (theta, eps)``: the draws at which to take the gradient (a leading
  axis of size ``num_samples`` on every leaf when ``num_samples > 1``);
* ``update(grads, state, params, eps) -> (updates, state)``: ``grads`` at ``theta`` (same layout);
  ``optax.apply_updates(params, updates)`` is the new mean;
* ``posterior(state, params) -> (mean, variance)`` with ``variance = 1 / (lambda (h + delta))``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["IVON", "IVONState", "hessian_from_variance", "ivon"]


class IVONState(NamedTuple):
    """IVON's state: the momentum ``g`` and the Hessian estimate ``h`` (pytrees like the
    parameters) and the number of steps taken ``count`` (``t``)."""

    momentum: Any
    hessian: Any
    count: jax.Array


class IVON(NamedTuple):
    """IVON's four pure functions (module docstring)."""

    init: Callable[..., IVONState]
    sample: Callable[[jax.Array, IVONState, Any], tuple[Any, Any]]
    update: Callable[[Any, IVONState, Any, Any], tuple[Any, IVONState]]
    posterior: Callable[[IVONState, Any], tuple[Any, Any]]


def _per_leaf(value: Any, params: Any) -> Any:
    """``value`` as a pytree like ``params``: itself if it has their structure, else a scalar
    broadcast to every leaf (in the leaf's dtype)."""
    if jax.tree.structure(value) == jax.tree.structure(params):
        return jax.tree.map(lambda v, p: jnp.asarray(v, p.dtype) * jnp.ones_like(p), value, params)
    return jax.tree.map(lambda p: jnp.full_like(p, value), params)


def hessian_from_variance(variance: Any, ess: float, weight_decay: Any = 0.0) -> Any:
    """The ``h`` at which IVON's posterior variance is ``variance``: ``1 / (lambda variance) - delta``
    (the inverse of ``variance = 1 / (lambda (h + delta))``)."""
    delta = _per_leaf(weight_decay, variance)
    return jax.tree.map(lambda v, d: 1.0 / (ess * v) - d, variance, delta)


def ivon(
    learning_rate: optax.ScalarOrSchedule,
    ess: float,
    weight_decay: Any = 0.0,
    *,
    beta1: float = 0.9,
    beta2: float = 0.99999,
    hess_init: float = 1.0,
    num_samples: int = 1,
    antithetic: bool = False,
    clip_radius: float | None = None,
    points: Any = None,
) -> IVON:
    """IVON (Shen et al. 2024, Algorithm 1; module docstring).

    Args:
        learning_rate: ``alpha``, a number or an optax schedule of the step count.
        ess: ``lambda``, the effective sample size (the number of examples the loss averages).
        weight_decay: ``delta``, a number or a pytree like the parameters: the prior is
            ``N(0, 1 / (lambda delta))`` per weight (``delta`` 0: no prior on that weight).
        beta1: the momentum's decay.
        beta2: the Hessian estimate's decay.
        hess_init: ``h`` at :func:`init` when no ``hessian`` is given (``h + delta`` must be > 0).
        num_samples: draws per step ``S``; leaves of ``theta``, ``eps`` and ``grads`` carry a
            leading axis of size ``S`` when ``S > 1``.
        antithetic: draw ``eps`` in pairs ``(eps, -eps)`` (``S`` must be even).
        clip_radius: clip every preconditioned step ``(g_bar + delta m) / (h + delta)``
            elementwise to this radius (``None``: no clip, as Algorithm 1).
        points: ``None`` (every leaf is drawn, as Algorithm 1) or a pytree of bools like the
            parameters: the leaves marked True are points, neither drawn nor given a Hessian
            update (module docstring).

    Raises:
        ValueError: for ``ess <= 0``, betas outside [0, 1), ``num_samples < 1``, an odd
            ``num_samples`` with ``antithetic`` or ``clip_radius <= 0``.
    """
    if not ess > 0:
        raise ValueError(f"ess (lambda) must be > 0, got {ess}")
    for name, beta in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {beta}")
    if num_samples < 1 or (antithetic and num_samples % 2):
        raise ValueError(f"num_samples must be >= 1 (and even with antithetic), got {num_samples}")
    if clip_radius is not None and not clip_radius > 0:
        raise ValueError(f"clip_radius must be > 0 or None, got {clip_radius}")
    schedule = learning_rate if callable(learning_rate) else (lambda count: learning_rate)
    stacked = num_samples > 1

    def std(state: IVONState, params: Any) -> Any:
        delta = _per_leaf(weight_decay, params)
        return jax.tree.map(lambda h, d: jax.lax.rsqrt(ess * (h + d)), state.hessian, delta)

    def init(params: Any, hessian: Any = None) -> IVONState:
        h = _per_leaf(hess_init if hessian is None else hessian, params)
        return IVONState(momentum=jax.tree.map(jnp.zeros_like, params), hessian=h, count=jnp.zeros((), jnp.int32))

    def sample(key: jax.Array, state: IVONState, params: Any) -> tuple[Any, Any]:
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(key, len(leaves))
        draws = num_samples // 2 if antithetic else num_samples

        def draw(k, p):
            eps = jax.random.normal(k, (draws, *p.shape), p.dtype)
            if antithetic:
                eps = jnp.concatenate([eps, -eps], axis=0)
            return eps if stacked else eps[0]

        eps = jax.tree.unflatten(treedef, [draw(k, p) for k, p in zip(keys, leaves, strict=True)])
        if points is not None:
            eps = jax.tree.map(lambda e, point: jnp.zeros_like(e) if point else e, eps, points)
        lead = (lambda x: x[None]) if stacked else (lambda x: x)
        theta = jax.tree.map(lambda p, s, e: lead(p) + lead(s) * e, params, std(state, params), eps)
        return theta, eps

    def update(grads: Any, state: IVONState, params: Any, eps: Any) -> tuple[Any, IVONState]:
        delta = _per_leaf(weight_decay, params)
        sigma = std(state, params)
        mean_over = (lambda x: jnp.mean(x, axis=0)) if stacked else (lambda x: x)
        g_hat = jax.tree.map(mean_over, grads)
        h_hat = jax.tree.map(lambda g, e, s: mean_over(g * e) / s, grads, eps, sigma)
        momentum = jax.tree.map(lambda g, gh: beta1 * g + (1.0 - beta1) * gh, state.momentum, g_hat)
        hessian = jax.tree.map(
            lambda h, hh, d: beta2 * h + (1.0 - beta2) * hh + 0.5 * (1.0 - beta2) ** 2 * jnp.square(h - hh) / (h + d),
            state.hessian, h_hat, delta,
        )  # fmt: skip
        if points is not None:
            hessian = jax.tree.map(lambda new, old, point: old if point else new, hessian, state.hessian, points)
        count = state.count + 1
        alpha = schedule(state.count)

        def step(g, h, d, m):
            debias = 1.0 - jnp.power(jnp.asarray(beta1, g.dtype), count.astype(g.dtype))
            direction = (g / debias + d * m) / (h + d)
            if clip_radius is not None:
                direction = jnp.clip(direction, -clip_radius, clip_radius)
            return (-jnp.asarray(alpha, direction.dtype) * direction).astype(m.dtype)

        updates = jax.tree.map(step, momentum, hessian, delta, params)
        return updates, IVONState(momentum=momentum, hessian=hessian, count=count)

    def posterior(state: IVONState, params: Any) -> tuple[Any, Any]:
        delta = _per_leaf(weight_decay, params)
        return params, jax.tree.map(lambda h, d: 1.0 / (ess * (h + d)), state.hessian, delta)

    return IVON(init=init, sample=sample, update=update, posterior=posterior)
