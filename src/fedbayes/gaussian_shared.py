"""The natural-parameter algebra of Gaussian factors in a shared basis: their coordinates add.

A structure whose every factor is written in one basis that the factors share (kept beside them,
not in them) is closed under the operations of a federated round as plain arithmetic on the
factors' coordinates: a product of densities adds them, a quotient subtracts them, a power scales
them and damping takes their convex combination (docs/algorithms.md §1.1). The aggregator's
leafwise sum of messages is then the exact product of the clients' factors, as in the diagonal
family. :mod:`fedbayes.gaussian_subspace` (a low-rank core in one basis) and
:mod:`fedbayes.gaussian_kron` (eigenvalues in per-layer Kronecker eigenbases) are such structures;
each passes its own factor type, whatever pytree it is.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp

__all__ = ["damp", "difference", "power", "product", "quotient"]

G = TypeVar("G")
Scalar = Any  # a float or a traced scalar


def product(a: G, b: G) -> G:
    """Product of densities in one basis: the coordinates added."""
    return jax.tree.map(jnp.add, a, b)


def quotient(a: G, b: G) -> G:
    """Quotient ``a / b`` in one basis: the coordinates subtracted (EP's cavity)."""
    return jax.tree.map(jnp.subtract, a, b)


def difference(new: G, old: G) -> G:
    """``new / old``: the factor that turns ``old`` into ``new`` (a message)."""
    return quotient(new, old)


def power(g: G, a: Scalar) -> G:
    """``g^a``: the coordinates scaled."""
    return jax.tree.map(lambda x: a * x, g)


def damp(old: G, new: G, damping: Scalar) -> G:
    """``old^(1 - rho) new^rho``: the convex combination of the coordinates."""
    return jax.tree.map(lambda o, n: (1.0 - damping) * o + damping * n, old, new)
