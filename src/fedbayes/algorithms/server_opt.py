"""Server optimizers: optax transformations applied to the aggregated pseudo-gradient.

The server receives ``g = sum_k q_k (theta - theta_k)`` (docs/algorithms.md §0: pseudo-gradient,
descent direction) and applies ``theta <- theta + ServerOpt(g)`` (Reddi et al. 2021, Alg. 2;
docs/algorithms.md §1.2). With ``sgd`` at lr 1 this is plain weighted model averaging (FedAvg).

Names: ``sgd`` (FedAvg), ``momentum`` (FedAvgM, heavy ball without dampening,
``m_t = beta m_{t-1} + g_t``), and the adaptive ``adam`` / ``yogi`` / ``adagrad`` in two forms:

* ``variant="reddi"`` (default): Reddi et al.'s form, which optax does not provide: moments
  without bias correction, ``v_{-1} = tau^2`` and the step ``lr * m_t / (sqrt(v_t) + tau)``,
  with ``m_t = b1 m_{t-1} + (1 - b1) g_t`` and

  - FedAdam:    ``v_t = b2 v_{t-1} + (1 - b2) g_t^2``
  - FedYogi:    ``v_t = v_{t-1} - (1 - b2) g_t^2 sign(v_{t-1} - g_t^2)``
  - FedAdagrad: ``v_t = v_{t-1} + g_t^2``

  (``g = -Delta`` flips the sign of ``m`` and leaves ``v`` unchanged, so minimising with ``g`` is
  Reddi's ascent with ``Delta``.)
* ``variant="optax"``: optax's own ``adam`` / ``yogi`` / ``adagrad`` with ``eps = tau`` (the FedEP
  code's choice for adagrad: ``initial_accumulator_value = 0``; docs/algorithms.md §1.2, implementation variant).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi", "adagrad")
VARIANTS = ("reddi", "optax")


class ReddiState(NamedTuple):
    """First and second moments of the Reddi et al. server optimizers."""

    mu: optax.Updates
    nu: optax.Updates


def scale_by_reddi(kind: str, b1: float = 0.9, b2: float = 0.99, tau: float = 1e-3):
    """Reddi et al. (2021) Alg. 2 direction ``m_t / (sqrt(v_t) + tau)`` (no learning rate).

    Args:
      kind: ``"adam"``, ``"yogi"`` or ``"adagrad"``.
      b1: first-moment decay (docs/algorithms.md §1.2 default 0.9).
      b2: second-moment decay (0.99); unused by adagrad.
      tau: adaptivity constant; ``v`` starts at ``tau^2``.
    """
    if kind not in ("adam", "yogi", "adagrad"):
        raise ValueError(f"kind must be one of adam, yogi, adagrad; got {kind!r}")

    def init_fn(params):
        return ReddiState(
            mu=optax.tree.zeros_like(params),
            nu=optax.tree.full_like(params, tau**2),
        )

    def update_fn(updates, state, params=None):
        del params
        mu = optax.tree.update_moment(updates, state.mu, b1, 1)
        g2 = jax.tree.map(jnp.square, updates)
        if kind == "adam":
            nu = jax.tree.map(lambda v, s: b2 * v + (1 - b2) * s, state.nu, g2)
        elif kind == "yogi":
            nu = jax.tree.map(lambda v, s: v - (1 - b2) * s * jnp.sign(v - s), state.nu, g2)
        else:
            nu = jax.tree.map(jnp.add, state.nu, g2)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + tau), mu, nu)
        return direction, ReddiState(mu=mu, nu=nu)

    return optax.GradientTransformation(init_fn, update_fn)


def make_server_optimizer(
    name: str = "sgd",
    lr: float = 1.0,
    *,
    momentum: float = 0.9,
    b1: float = 0.9,
    b2: float = 0.99,
    tau: float = 1e-3,
    variant: str = "reddi",
) -> optax.GradientTransformation:
    """Builds a server optimizer by name (see the module docstring)."""
    if name not in SERVER_OPTIMIZERS:
        raise ValueError(f"server optimizer must be one of {', '.join(SERVER_OPTIMIZERS)}; got {name!r}")
    if variant not in VARIANTS:
        raise ValueError(f"server optimizer variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=momentum)
    if variant == "reddi":
        return optax.chain(scale_by_reddi(name, b1, b2, tau), optax.scale_by_learning_rate(lr))
    if name == "adam":
        return optax.adam(lr, b1=b1, b2=b2, eps=tau)
    if name == "yogi":
        return optax.yogi(lr, b1=b1, b2=b2, eps=tau)
    return optax.adagrad(lr, initial_accumulator_value=0.0, eps=tau)


def apply_server_optimizer(optimizer, params, opt_state, pseudo_gradient):
    """One server step: ``theta <- theta + ServerOpt(g)``; returns ``(params, opt_state)``."""
    updates, opt_state = optimizer.update(pseudo_gradient, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
