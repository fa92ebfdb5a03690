"""Aggregation rules: how the server reduces the round's stacked client messages.

An :class:`Aggregator` is a pure function ``(key, messages, weights, reference=None) -> Aggregate``:
``key`` a PRNG key for rules that sample (first, as everywhere in fedbayes), ``messages`` a pytree
whose leaves carry a leading client axis ``[M, ...]``, ``weights[m] >= 0`` the round's client
weights (``n_k`` or 1; zero for padded or rejected clients). A rule whose ``needs_reference`` is
true also receives ``reference``, the broadcast the messages were computed against
(:func:`fedbayes.protocol.server_step` passes ``algorithm.broadcast(server_state)``): the ``q_g``
of Gaussian messages for a precision bound or moment coordinates. Its output holds the three
reductions that the algorithms' server updates read (each algorithm reads the one its update rule
needs; XLA drops the others):

* ``mean``: ``sum_m w_m x_m / sum_m w_m`` (zeros when every weight is zero): FedAvg, FedPA and
  the burn-in rounds of FedEP;
* ``total``: ``sum_m 1[w_m > 0] x_m``, the unweighted sum over accepted clients: natural-parameter
  updates (EP sites), ADMM and FedDyn sums;
* ``count``: the number of accepted clients.

Rules are composable like optax's gradient transformations: a wrapper takes an aggregator and
returns one, and the algorithms never call :func:`fedbayes.tree.weighted_mean` themselves. This
package holds every rule: the default :data:`weighted` here, the robust rules
(:mod:`fedbayes.aggregators.robust`), client-level differential privacy with its accountant
(:mod:`fedbayes.aggregators.dp`) and the variational-BNN rules
(:mod:`fedbayes.aggregators.variational`). Leaves that are not floating point (a client's validity
flag) are not aggregated (:func:`is_floating`): their reductions are zeros of the leaf's shape and
dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

from fedbayes import tree

PyTree = Any

__all__ = ["Aggregate", "Aggregator", "Rule", "is_floating", "weighted"]


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
    """``(key, messages, weights, reference=None) -> Aggregate`` (see the module docstring).

    Attributes:
      needs_reference: whether the rule reads ``reference`` (the server then computes and passes
        the broadcast; otherwise it passes nothing).
    """

    needs_reference: bool

    def __call__(self, key: jax.Array | None, messages: PyTree, weights: jax.Array, reference: PyTree = None) -> Aggregate: ...


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rule given as a function ``fn(key, messages, weights) -> Aggregate``, as an
    :class:`Aggregator` that needs no reference."""

    fn: Callable[[jax.Array | None, PyTree, jax.Array], Aggregate]
    needs_reference: bool = dataclasses.field(default=False, init=False)

    def __call__(self, key: jax.Array | None, messages: PyTree, weights: jax.Array, reference: PyTree = None) -> Aggregate:
        del reference
        return self.fn(key, messages, weights)


def is_floating(leaf) -> bool:
    """Whether a message leaf is floating point (aggregated), not a flag or a count (not)."""
    return jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)


def _reduce(fn, messages: PyTree, weights: jax.Array) -> PyTree:
    """``fn`` over the floating leaves of ``messages`` (in one call, so that they share one
    normaliser: per-leaf calls compile to a program whose last bits differ); other leaves reduce to
    zeros."""
    leaves, treedef = jax.tree.flatten(messages)
    floating = [x for x in leaves if is_floating(x)]
    reduced = iter(fn(floating, weights))
    return treedef.unflatten([next(reduced) if is_floating(x) else jnp.zeros(jnp.shape(x)[1:], jnp.result_type(x)) for x in leaves])


def _weighted(key: jax.Array | None, messages: PyTree, weights: jax.Array) -> Aggregate:
    del key
    mask = (weights > 0).astype(jnp.float32)
    return Aggregate(
        mean=_reduce(tree.weighted_mean, messages, weights),
        total=_reduce(tree.weighted_sum, messages, mask),
        count=jnp.sum(mask),
    )


weighted: Aggregator = Rule(_weighted)
"""The default rule: the weighted mean, the masked sum and the count (no randomness)."""
