"""Aggregation rules: how the server reduces the round's stacked client messages.

An :data:`Aggregator` is a pure function ``(messages, weights, key) -> Aggregate``: ``messages``
is a pytree whose leaves carry a leading client axis ``[M, ...]``, ``weights[m] >= 0`` the
round's client weights (``n_k`` or 1; zero for padded or rejected clients) and ``key`` a PRNG key
for rules that sample. Its output holds the three reductions that the algorithms' server updates
read (each algorithm reads the one its update rule needs; XLA drops the others):

* ``mean``: ``sum_m w_m x_m / sum_m w_m`` (zeros when every weight is zero): FedAvg, FedPA and
  the burn-in rounds of FedEP;
* ``total``: ``sum_m 1[w_m > 0] x_m``, the unweighted sum over accepted clients: natural-parameter
  updates (EP sites), ADMM and FedDyn sums;
* ``count``: the number of accepted clients.

Rules are composable like optax's gradient transformations: a wrapper takes an aggregator and
returns one (robust rules, clipping, noise), and the algorithms never call
:func:`fedbayes.tree.weighted_mean` themselves. Leaves that are not floating point (a client's
validity flag) are not aggregated: their reductions are zeros of the leaf's shape and dtype.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from fedbayes import tree

PyTree = Any

__all__ = ["Aggregate", "Aggregator", "weighted"]


class Aggregate(NamedTuple):
    """The reductions of one round's messages (see the module docstring)."""

    mean: PyTree
    total: PyTree
    count: jax.Array

    def uniform_mean(self) -> PyTree:
        """``total / count``: the unweighted mean over accepted clients (zeros when none);
        bit for bit :func:`fedbayes.tree.weighted_mean` with the participation mask as weights."""
        nonzero = self.count != 0
        safe = jnp.where(nonzero, self.count, jnp.ones_like(self.count))

        def leaf(t):
            dtype = jnp.result_type(t)
            return jnp.where(nonzero, t / safe.astype(dtype), jnp.zeros((), dtype))

        return jax.tree.map(leaf, self.total)


class Aggregator(Protocol):
    """``(messages, weights, key) -> Aggregate`` (see the module docstring)."""

    def __call__(self, messages: PyTree, weights: jax.Array, key: jax.Array | None) -> Aggregate: ...


def _floating(leaf) -> bool:
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _reduce(fn, messages: PyTree, weights: jax.Array) -> PyTree:
    """``fn`` over the floating leaves of ``messages`` (in one call, so that they share one
    normaliser: per-leaf calls compile to a program whose last bits differ); other leaves reduce to
    zeros."""
    leaves, treedef = jax.tree.flatten(messages)
    floating = [x for x in leaves if _floating(x)]
    reduced = iter(fn(floating, weights))
    return treedef.unflatten([next(reduced) if _floating(x) else jnp.zeros(jnp.shape(x)[1:], jnp.result_type(x)) for x in leaves])


def weighted(messages: PyTree, weights: jax.Array, key: jax.Array | None = None) -> Aggregate:
    """The default rule: the weighted mean, the masked sum and the count (no randomness)."""
    del key
    mask = (weights > 0).astype(jnp.float32)
    return Aggregate(
        mean=_reduce(tree.weighted_mean, messages, weights),
        total=_reduce(tree.weighted_sum, messages, mask),
        count=jnp.sum(mask),
    )
