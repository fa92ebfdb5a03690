"""The type aliases and Protocols that the package's interfaces share.

Everything here is for annotations: a pytree is any nest of arrays (``Any`` to a type checker, as
in optax and blackjax), a PRNG key is a typed ``jax.Array`` (``jax.random.key``), and an ``info``
output is a dict of scalar arrays with a fixed structure per function (blackjax's ``(state, info)``
habit).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

__all__ = ["ApplyFn", "Info", "KeyedApplyFn", "PRNGKey", "PyTree"]

PyTree = Any
PRNGKey = jax.Array
Info = dict[str, jax.Array]


class ApplyFn(Protocol):
    """A deterministic model's forward pass: ``(params, x) -> outputs`` (logits or predictions)."""

    def __call__(self, params: PyTree, x: jax.Array) -> jax.Array: ...


class KeyedApplyFn(Protocol):
    """One stochastic forward pass of a variational model: ``(params, key, x) -> outputs``, the
    weights drawn with ``key`` (:func:`fedbayes.models.variational.apply_with_key`)."""

    def __call__(self, params: PyTree, key: PRNGKey, x: jax.Array) -> jax.Array: ...
