"""Robust aggregation of client messages, for every method (docs/results/privacy_robust.md).

Rules on the aggregator seam (:mod:`fedbayes.aggregators`), so the simulator and a deployment run
the same code through :func:`fedbayes.protocol.server_step`:

* ``"mean"``: the method's own rule (the weighted mean, the masked sum and the count).
* ``"median"``: the coordinate-wise median of the accepted messages, unweighted (a client's
  weight ``n_k`` is its own claim, so a robust rule cannot trust it). Messages are deltas (point
  deltas ``theta - theta_k``, FedPA's deltas, natural-parameter differences ``(Delta eta,
  Delta Lambda)`` of the Gaussian methods), each coordinate taken on its own. ``mean`` is the
  median and ``total`` is ``count * median``: a method that sums (EP's sites) gets ``count``
  copies of the typical client, a method that averages gets the typical client. With ``f < M/2``
  attackers among ``M`` accepted clients every coordinate of the median lies between the honest
  clients' smallest and largest values.
* ``"trimmed_mean"``: per coordinate, drop the ``floor(beta * count)`` largest and smallest
  values of the accepted messages and average the rest (unweighted); ``total = count * mean``.
  With ``f <= floor(beta * count)`` attackers the result lies within the honest values' range.
* ``"norm_bound"``: each message is scaled to a joint L2 norm (all floating leaves together) of
  at most ``B``, then the method's own rule (Sun et al., "Can you really backdoor federated
  learning?", 2019): an attacker's pull on the mean is at most ``B * w_k / sum w``.

And for Gaussian messages (natural-parameter differences ``Delta`` against the broadcast ``q_g``),
with any of the rules: **a bound on one client's share of the global precision**
(``max_precision_share = s``). Per coordinate, a client's ``(Delta eta, Delta Lambda)`` is
scaled by ``min(1, s Lambda_g / Delta Lambda)``: its precision adds at most ``s Lambda_g`` and,
since the factor's own mean ``Delta eta / Delta Lambda`` is kept, it moves the coordinate's
posterior mean at most ``s / (1 + s)`` of the way to its own. A confident outlier (a huge
precision) then weighs as much as a client with ``s`` times the global's information, not
everything. Needs the broadcast's Gaussian, so the rule is called with ``reference=``
(:func:`fedbayes.protocol.server_step` passes ``algorithm.broadcast(server_state)`` to an aggregator
whose ``needs_reference`` is true, :class:`fedbayes.aggregators.Aggregator`). Messages and broadcast are paired by their
:class:`~fedbayes.gaussian.DiagGaussian` nodes, in order.

A method with its own rule (VBNN's ``algorithm.aggregation``) is not wrapped: the config refuses
``server.aggregator`` other than ``"mean"`` for it (:mod:`fedbayes.config.schema`), because its rules
combine full variational parameters non-linearly and a coordinate-wise median of them is a
different method, not a robust version of it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedbayes import aggregators
from fedbayes.aggregators import Aggregate, is_floating
from fedbayes.gaussian import DiagGaussian

PyTree = Any

AGGREGATORS = ("mean", "median", "trimmed_mean", "norm_bound")

__all__ = [
    "AGGREGATORS",
    "RobustAggregator",
    "bound_precision_share",
    "clip_rows",
    "gaussian_nodes",
    "make_aggregator",
    "map_gaussians",
    "row_norms",
]


def _is_gaussian(x) -> bool:
    return isinstance(x, DiagGaussian)


def gaussian_nodes(tree: PyTree) -> list[DiagGaussian]:
    """The :class:`DiagGaussian` nodes of ``tree``, in flattening order."""
    return [x for x in jax.tree.leaves(tree, is_leaf=_is_gaussian) if _is_gaussian(x)]


def map_gaussians(fn, messages: PyTree, reference: PyTree) -> PyTree | None:
    """``messages`` with its ``i``-th Gaussian node ``g`` replaced by ``fn(g, r_i)``, ``r_i`` the
    ``i``-th Gaussian node of ``reference``; ``None`` when the message has no Gaussian node or
    the two have different numbers of them (no pairing)."""
    refs = gaussian_nodes(reference) if reference is not None else []
    leaves, treedef = jax.tree.flatten(messages, is_leaf=_is_gaussian)
    count = sum(1 for x in leaves if _is_gaussian(x))
    if count == 0 or count != len(refs):
        return None
    it = iter(refs)
    return treedef.unflatten([fn(x, next(it)) if _is_gaussian(x) else x for x in leaves])


def row_norms(messages: PyTree) -> jax.Array:
    """``[M]`` joint L2 norms of the stacked messages' rows over all floating leaves."""
    sq = [jnp.sum(jnp.square(x).reshape(x.shape[0], -1), axis=1) for x in jax.tree.leaves(messages) if is_floating(x)]
    return jnp.sqrt(sum(sq))


def clip_rows(messages: PyTree, max_norm: float) -> PyTree:
    """Each row scaled by ``min(1, max_norm / ||row||)`` (joint over the floating leaves): a row
    already within the bound is multiplied by exactly 1 (unchanged bit for bit)."""
    norms = row_norms(messages)
    factor = jnp.minimum(1.0, max_norm / jnp.maximum(norms, 1e-30))

    def leaf(x):
        if not is_floating(x):
            return x
        return x * factor.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)

    return jax.tree.map(leaf, messages)


def bound_precision_share(difference: DiagGaussian, q: DiagGaussian, share: float) -> DiagGaussian:
    """Per coordinate, scales stacked natural-parameter differences ``(Delta eta, Delta Lambda)`` by
    ``min(1, share * Lambda_g / Delta Lambda)`` (module docstring); rows within the bound are
    unchanged bit for bit."""

    def scale(d_lam, lam_g):
        cap = share * jnp.reshape(jnp.maximum(lam_g, 0.0), (1,) * (d_lam.ndim - jnp.ndim(lam_g)) + jnp.shape(lam_g))
        over = d_lam > cap
        return jnp.where(over, cap / jnp.where(over, d_lam, 1.0), 1.0).astype(d_lam.dtype)

    factors = jax.tree.map(scale, difference.precision, q.precision)
    return DiagGaussian(
        precision_mean=jax.tree.map(lambda e, f: jnp.where(f < 1, e * f, e), difference.precision_mean, factors),
        precision=jax.tree.map(lambda lam, f: jnp.where(f < 1, lam * f, lam), difference.precision, factors),
    )


def _sorted_valid(x: jax.Array, valid: jax.Array) -> jax.Array:
    """``x`` sorted along the client axis with invalid rows (rejected: maybe NaN) moved last."""
    mask = valid.reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.sort(jnp.where(mask, x, jnp.inf), axis=0)


def _median_leaf(x: jax.Array, valid: jax.Array, count: jax.Array) -> jax.Array:
    s = _sorted_valid(x, valid)
    lo = jnp.take(s, jnp.maximum((count - 1) // 2, 0), axis=0)
    hi = jnp.take(s, jnp.maximum(count // 2, 0), axis=0)
    med = jnp.where(lo == hi, lo, 0.5 * lo + 0.5 * hi)  # identical values: exactly that value
    return jnp.where(count > 0, med, jnp.zeros((), x.dtype))


def _trimmed_leaf(beta: float):
    def leaf(x: jax.Array, valid: jax.Array, count: jax.Array) -> jax.Array:
        s = _sorted_valid(x, valid)
        t = jnp.floor(beta * count.astype(jnp.float32)).astype(jnp.int32)
        idx = jnp.arange(x.shape[0]).reshape((-1,) + (1,) * (x.ndim - 1))
        keep = (idx >= t) & (idx < count - t)
        kept = jnp.maximum(count - 2 * t, 1).astype(x.dtype)
        out = jnp.sum(jnp.where(keep, s, jnp.zeros((), x.dtype)), axis=0) / kept
        return jnp.where(count > 0, out, jnp.zeros((), x.dtype))

    return leaf


def _coordinatewise(rule, messages: PyTree, weights: jax.Array) -> Aggregate:
    valid = weights > 0
    count = jnp.sum(valid.astype(jnp.int32))

    def leaf(x):
        if not is_floating(x):
            return jnp.zeros(jnp.shape(x)[1:], jnp.result_type(x))
        return rule(x, valid, count)

    mean = jax.tree.map(leaf, messages)
    countf = count.astype(jnp.float32)
    total = jax.tree.map(lambda m: m * countf.astype(m.dtype) if is_floating(m) else m, mean)
    return Aggregate(mean=mean, total=total, count=countf)


class RobustAggregator:
    """An :class:`~fedbayes.aggregators.Aggregator` (``(key, messages, weights, reference=None) -> Aggregate``)
    made by :func:`make_aggregator`; ``needs_reference`` tells :func:`fedbayes.protocol.server_step` to pass
    the broadcast (only when a precision share bound is set)."""

    def __init__(self, rule: str, *, trim_fraction: float = 0.1, norm_bound: float | None = None, max_precision_share: float | None = None, base=None):
        if rule not in AGGREGATORS:
            raise ValueError(f"server.aggregator must be one of {', '.join(AGGREGATORS)}; got {rule!r}")
        if not 0 <= trim_fraction < 0.5:
            raise ValueError(f"server.trim_fraction must be in [0, 0.5); got {trim_fraction}")
        if rule == "norm_bound" and not (norm_bound is not None and norm_bound > 0):
            raise ValueError(f"server.norm_bound must be > 0 with server.aggregator = 'norm_bound'; got {norm_bound}")
        if max_precision_share is not None and not max_precision_share > 0:
            raise ValueError(f"server.max_precision_share must be > 0 (or unset); got {max_precision_share}")
        self.rule = rule
        self.trim_fraction = trim_fraction
        self.norm_bound = norm_bound
        self.max_precision_share = max_precision_share
        self.base = base or aggregators.weighted
        self.needs_reference = max_precision_share is not None

    def __call__(self, key: jax.Array | None, messages: PyTree, weights: jax.Array, reference: PyTree = None) -> Aggregate:
        if self.max_precision_share is not None:
            share = self.max_precision_share
            bounded = map_gaussians(lambda d, q: bound_precision_share(d, q, share), messages, reference)
            if bounded is None:
                from fedbayes.errors import BadInputError

                raise BadInputError(
                    "config error: server.max_precision_share: this method's messages are not Gaussian (no natural-parameter differences); unset it"
                )
            messages = bounded
        if self.rule == "median":
            return _coordinatewise(_median_leaf, messages, weights)
        if self.rule == "trimmed_mean":
            return _coordinatewise(_trimmed_leaf(self.trim_fraction), messages, weights)
        if self.rule == "norm_bound":
            messages = clip_rows(messages, self.norm_bound)
        return self.base(key, messages, weights)


def make_aggregator(rule: str = "mean", *, trim_fraction: float = 0.1, norm_bound: float | None = None, max_precision_share: float | None = None, base=None):
    """The rule as an aggregator; ``None`` for ``"mean"`` without a precision bound (the method's
    own rule stays). ``base``: the method's own rule (``algorithm.aggregator``)."""
    if rule == "mean" and max_precision_share is None:
        return None
    return RobustAggregator(rule, trim_fraction=trim_fraction, norm_bound=norm_bound, max_precision_share=max_precision_share, base=base)
