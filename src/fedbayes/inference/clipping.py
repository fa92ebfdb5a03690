"""Clipping and rescaling of diagonal curvature and precision vectors (FedEP's client methods).

What this module holds: :func:`clip_by_spread`, FedEP's clipping of a Fisher or precision vector
elementwise to ``[mean - kappa std, mean + kappa std]`` over all its ``d`` coordinates
(docs/algorithms.md §7.6, "Fisher clipping" [I]); :func:`tree_scale_to_norm`, the rescaling of a
vector to the norm of another (the mcmc method's); and :data:`ApplyFn`, the forward-pass type.
The diagonal Fisher itself (labels sampled from the model, Kunstner, Balles & Hennig 2019) is
:mod:`fedbayes.inference.curvature`'s, the one place for diagonal curvature.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]  # (params, x [B, ...]) -> logits [B, C] or outputs [B]


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
