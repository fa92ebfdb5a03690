"""Diagonal Fisher information with labels sampled from the model, and FedEP's Fisher clipping.

The Laplace and NGVI client methods of FedEP (Guo et al. 2023 (FedEP) Sec. 2.2.2, Eq. 4 and Alg. 5; docs/algorithms.md §7.6)
need the diagonal of the Fisher information of the likelihood at some parameters. Following
Kunstner, Balles & Hennig (2019) the labels are **sampled from the model**, not taken from the
data ("true Fisher", not the empirical Fisher):

    F(theta) = mean_i [ (grad_theta log p(y~_i | x_i, theta))^2 ],   y~_i ~ p(. | x_i, theta),

with per-example gradients (``vmap`` of ``grad``), averaged over the valid examples of a batch.

Clipping (docs/algorithms.md §7.6, "Fisher clipping" [I]): every Fisher or precision vector is clipped
elementwise to ``[mean - kappa std, mean + kappa std]`` over all its ``d`` coordinates.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]  # (params, x [B, ...]) -> logits [B, C] or outputs [B]


def sampled_log_likelihood(apply_fn: ApplyFn, task: str) -> Callable[..., jax.Array]:
    """``f(params, key, x) -> log p(y~ | x, params)`` for one example with ``y~`` drawn from the
    model: categorical over ``softmax(logits)`` (classification) or ``N(f(x), 1)`` (regression).
    The draw is made at the same parameters and held fixed (``stop_gradient``)."""
    if task not in ("classification", "regression"):
        raise ValueError(f"task must be classification or regression; got {task!r}")

    def loglik(params, key, x):
        out = apply_fn(params, x[None])[0]
        if task == "classification":
            label = jax.random.categorical(key, jax.lax.stop_gradient(out))
            return jax.nn.log_softmax(out)[label]
        target = jax.lax.stop_gradient(out) + jax.random.normal(key, jnp.shape(out), out.dtype)
        return -0.5 * jnp.sum(jnp.square(target - out))

    return loglik


def batch_fisher(loglik: Callable[..., jax.Array], params: PyTree, key: jax.Array, x: jax.Array, mask: jax.Array) -> PyTree:
    """The mean over valid examples of squared per-example gradients of ``loglik``.

    Args:
      loglik: from :func:`sampled_log_likelihood`.
      params: where the Fisher is evaluated.
      key: one key per batch (split per example).
      x: ``[B, ...]`` features.
      mask: ``[B]`` float, 1 for a real example.

    Returns:
      A pytree like ``params`` (zero for an all-padding batch).
    """
    keys = jax.random.split(key, x.shape[0])
    grads = jax.vmap(jax.grad(loglik), in_axes=(None, 0, 0))(params, keys, x)
    count = jnp.maximum(jnp.sum(mask), 1.0)

    def reduce(g):
        m = mask.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)
        return jnp.sum(jnp.square(g) * m, axis=0) / count.astype(g.dtype)

    return jax.tree.map(reduce, grads)


def clip_by_spread(values: PyTree, kappa: float) -> PyTree:
    """Clips every coordinate to ``[mean - kappa std, mean + kappa std]`` of all coordinates.

    Mean and standard deviation are taken over the whole pytree (all ``d`` coordinates), as FedEP's
    reference code does (docs/algorithms.md §7.6, clip ratio ``kappa = 2``). ``kappa <= 0`` disables clipping.
    """
    if kappa <= 0:
        return values
    leaves = jax.tree.leaves(values)
    count = sum(leaf.size for leaf in leaves)
    mean = sum(jnp.sum(leaf) for leaf in leaves) / count
    var = sum(jnp.sum(jnp.square(leaf - mean)) for leaf in leaves) / count
    std = jnp.sqrt(var)
    return jax.tree.map(lambda v: jnp.clip(v, mean - kappa * std, mean + kappa * std).astype(v.dtype), values)


def tree_scale_to_norm(values: PyTree, reference: PyTree) -> PyTree:
    """``values * ||reference||_2 / ||values||_2`` (the MCMC method's rescaling, docs/algorithms.md §7.6 M.3)."""
    norm_v = optax.tree.norm(values)
    norm_r = optax.tree.norm(reference)
    return optax.tree.scale(norm_r / jnp.maximum(norm_v, jnp.finfo(jnp.float32).tiny), values)
