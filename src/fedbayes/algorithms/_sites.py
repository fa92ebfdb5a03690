"""Gaussian sites: the machinery shared by the methods that keep per-client Gaussian factors.

FedEP, FedSEP and PVI now, FedLap-Cov next: each keeps the global approximation
``q_g ∝ p_0 prod_k q_k`` with diagonal Gaussian sites in natural parameters
(:class:`~fedbayes.gaussian.DiagGaussian`), forms cavities, sends damped natural-parameter
differences and moves sites and the global by optax optimizers (damping as optimisation on
natural parameters; Guo et al., "Federated learning as variational inference: a scalable
expectation propagation approach", ICLR 2023, Sec. 2.2.3). Every step states its policy for an
improper result (docs/style.md): a cavity or site that is not proper enough rejects the client's
message; a global coordinate that an aggregated step would make non-positive keeps its value.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedbayes import tree
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.gaussian import DiagGaussian

PyTree = Any

__all__ = ["all_positive", "checked_cavity", "clip_joint_norm", "guard_positive", "optimizer_step", "safe_mean"]


def checked_cavity(cavity: DiagGaussian, q: DiagGaussian, rtol: float = 1e-5) -> tuple[DiagGaussian, jax.Array]:
    """The cavity with float round-off below zero clamped to 0, and whether it is proper enough to
    serve as a prior: finite, and no precision below ``-rtol * Lambda_g`` (a truly negative cavity
    precision means the site outweighs the global: the client is rejected)."""
    tol_ok = jax.tree.map(lambda c, g: jnp.all(c >= -rtol * jnp.abs(g)), cavity.precision, q.precision)
    ok = jnp.logical_and(tree.all_finite(cavity), jnp.all(jnp.stack(jax.tree.leaves(tol_ok))))
    clamped = DiagGaussian(precision_mean=cavity.precision_mean, precision=jax.tree.map(lambda c: jnp.maximum(c, 0.0), cavity.precision))
    return clamped, ok


def all_positive(precision: PyTree) -> jax.Array:
    """Whether every precision is strictly positive."""
    return jnp.all(jnp.stack([jnp.all(lam > 0) for lam in jax.tree.leaves(precision)]))


def safe_mean(q: DiagGaussian, fallback: PyTree) -> PyTree:
    """``eta / Lambda`` where ``Lambda > 0``, else ``fallback`` (a coordinate without information)."""
    return jax.tree.map(lambda eta, lam, f: jnp.where(lam > 0, eta / jnp.where(lam > 0, lam, 1.0), f), q.precision_mean, q.precision, fallback)


def clip_joint_norm(d: DiagGaussian, max_norm: float | None) -> DiagGaussian:
    """Scales both natural parameters together to a global L2 norm of at most ``max_norm``
    (``None``: no clipping)."""
    if max_norm is None:
        return d
    norm = optax.tree.norm(d)
    return optax.tree.scale(jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30)), d)


def optimizer_step(optimizer: optax.GradientTransformation, value: PyTree, opt_state, increase: PyTree):
    """Moves ``value`` by ``optimizer`` in the direction of ``increase`` (optax descends, so it
    receives ``-increase``); with ``optax.sgd(1)`` this is ``value + increase``."""
    return apply_server_optimizer(optimizer, value, opt_state, optax.tree.scale(-1.0, increase))


def guard_positive(new: DiagGaussian, old: DiagGaussian) -> tuple[DiagGaussian, jax.Array]:
    """``new`` where its precision is positive, ``old`` elsewhere (a momentum overshoot must not
    make the global improper), and the number of coordinates kept."""
    keep = jax.tree.map(lambda lam: lam > 0, new.precision)
    guarded = DiagGaussian(
        precision_mean=jax.tree.map(jnp.where, keep, new.precision_mean, old.precision_mean),
        precision=jax.tree.map(jnp.where, keep, new.precision, old.precision),
    )
    kept = sum(jnp.sum(jnp.logical_not(k).astype(jnp.int32)) for k in jax.tree.leaves(keep))
    return guarded, jnp.asarray(kept, jnp.int32)
