"""Adaptive damping of Gaussian site updates: the server chooses each round's damping from how the
global posterior moved (public building blocks of FedEP, FedSEP, PVI and FedLap-Cov).

A site method moves every site a fraction ``delta`` (the damping) of the way to its target, so the
global approximation moves by ``delta`` times the sum of the clients' natural-parameter changes.
Too small a ``delta`` is slow; too large a one overshoots, and on a network, where the clients'
local modes differ, the global posterior then swings from round to round instead of settling
(docs/results/posterior_defaults.md, "A network").

The rule is the "bold driver" of backpropagation (Vogl et al. 1988, "Accelerating the convergence
of the back-propagation method"; Battiti 1989, "Accelerated backpropagation learning: two
optimization methods") applied to EP's damping, with its decisions taken on a least-squares
estimate over a few rounds because the local steps are stochastic. Let ``r_t = (m_t - m_{t-1}) /
delta_t`` be round ``t``'s *residual*, the change of the global mean per unit damping. Near a fixed
point a damped iteration moves its error as ``e_{t+1} = rho e_t`` per direction, with ``rho = 1 -
delta (1 - a)`` for the undamped map's slope ``a``, and then ``r_t = rho r_{t-1}``. Over a window of
:data:`WINDOW` rounds at one damping the server estimates

    rho_hat = sum_t <r_t, r_{t-1}> / sum_t |r_{t-1}|^2

and then (a changed damping starts a new window):

* ``rho_hat <`` :data:`REVERSED` (the changes swing back and do not decay: at ``rho <= -1`` the
  oscillation of undamped EP) or ``rho_hat >`` :data:`DIVERGING` (the residual grows):
  ``delta <- max(delta_min, delta * shrink)``. A swing that decays (``-1 < rho < 0``) is left alone:
  with coordinates that settle at different rates, the best fixed damping overshoots the fastest
  ones a little (``rho`` near -0.5 there) to move the slowest at a useful rate, and stochastic
  local steps keep exciting those fast oscillating directions;
* ``rho_hat > 0`` (the changes keep their direction: too cautious): ``delta <- min(delta_max, delta * grow)``;
* otherwise ``delta`` stays: residuals that are only the jitter of stochastic local steps about
  the fixed point are nearly uncorrelated, and give no reason to move it;
* a residual that swung back (``<r_t, r_{t-1}> <`` :data:`SWING` ``|r_{t-1}|^2``) and grew past
  :data:`BLOW_UP` times the last one is acted on at once (the first round of a network's
  collapse, measured: a mean change twice the last one's and against it);
* a round whose every message the server rejected (the step would have made the global improper,
  or the local results were not finite) leaves the global where it was and shrinks ``delta`` at once.

A single round's correlation is too noisy to act on (SGD clients on a logistic regression: the
per-round cosine ranged over [-0.65, 0.78] at one damping); so are per-coordinate signs, with
which an Rprop-style damping per parameter decayed to its floor within 60 rounds there. The
first damping is cautious (:data:`INITIAL`): at 0.5 the main job's network lost its accuracy
within two rounds of EP, before any rule could see it coming.

The clients of round ``t + 1`` use the new ``delta`` (it travels in the broadcast), so every site
and the global stay consistent, ``q_g = p_0 prod_k q_k``, whatever the schedule. A fixed damping
is :func:`fixed`: every method takes either.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedbayes.gaussian import DiagGaussian

PyTree = Any

INITIAL = 0.2  # the first rounds' damping: cautious; it grows while the changes keep their direction
MINIMUM = 0.1  # the paper's 1 / K for ten clients: the floor keeps a run that only jitters moving towards its fixed point
MAXIMUM = 1.0
GROW = 1.25
SHRINK = 0.5
REVERSED = -1.0  # rho_hat below this: the changes swing back and do not decay (an unstable oscillation)
SWING = -0.5  # a single round's rho below this, with a residual grown past BLOW_UP, is a blow-up
DIVERGING = 1.0  # rho_hat above this: the residual grows
WINDOW = 3  # rounds of residuals per decision
BLOW_UP = 1.5  # a residual that swung back and grew past this times the last one is acted on at once
ADAPTIVE = "adaptive"  # the config value that selects :func:`adaptive`

__all__ = [
    "ADAPTIVE", "BLOW_UP", "DIVERGING", "GROW", "INITIAL", "MAXIMUM", "MINIMUM", "REVERSED", "SHRINK", "SWING", "WINDOW",
    "Damping", "DampingState", "adaptive", "fixed", "from_setting", "mean_change",
]  # fmt: skip


class DampingState(NamedTuple):
    """The damping the next round's clients use, and what the rule has seen.

    Attributes:
      value: ``delta``, a float32 scalar.
      last: the previous round's residual ``r_{t-1}`` (:func:`mean_change` over its damping).
      has_last: whether ``last`` holds a residual made at the current damping.
      cross: ``sum <r_t, r_{t-1}>`` over the window so far.
      square: ``sum |r_{t-1}|^2`` over the window so far.
      count: rounds in the window so far.
    """

    value: jax.Array
    last: PyTree
    has_last: jax.Array
    cross: jax.Array
    square: jax.Array
    count: jax.Array


class Damping(NamedTuple):
    """A damping policy: ``init(params) -> DampingState``, ``update(state, old_q, new_q) -> DampingState``
    (pure; ``old_q`` and ``new_q`` the global before and after the round), ``rejected(state) ->
    DampingState`` after a round whose every message the server rejected (the global did not move;
    the method's ``after_rejected_round``), and whether it adapts."""

    init: Any
    update: Any
    rejected: Any
    adaptive: bool


def mean_change(old: DiagGaussian, new: DiagGaussian) -> PyTree:
    """``m' - m``, the change of the mean (0 where either precision is not positive: no information)."""

    def one(eta0, lam0, eta1, lam1):
        ok = jnp.logical_and(lam0 > 0, lam1 > 0)
        return jnp.where(ok, eta1 / jnp.where(ok, lam1, 1.0) - eta0 / jnp.where(ok, lam0, 1.0), 0.0)

    return jax.tree.map(one, old.precision_mean, old.precision, new.precision_mean, new.precision)


def _init(params: PyTree, value: float) -> DampingState:
    zero = jnp.zeros((), jnp.float32)
    return DampingState(jnp.asarray(value, jnp.float32), optax.tree.zeros_like(params), jnp.zeros((), jnp.bool_), zero, zero, jnp.zeros((), jnp.int32))


def from_setting(value: float | str) -> Damping:
    """The policy a config's damping field names: :data:`ADAPTIVE` or a fixed value."""
    return adaptive() if value == ADAPTIVE else fixed(float(value))


def fixed(value: float) -> Damping:
    """A constant damping ``value`` > 0 (the methods check their own range)."""
    if not value > 0:
        raise ValueError(f"damping must be > 0; got {value}")
    return Damping(lambda params: _init(params, value), lambda state, old, new: state, lambda state: state, adaptive=False)


def adaptive(initial: float = INITIAL, minimum: float = MINIMUM, maximum: float = MAXIMUM, grow: float = GROW, shrink: float = SHRINK) -> Damping:
    """The windowed bold-driver damping of the module docstring, starting at ``initial``, kept in
    ``[minimum, maximum]``, multiplied by ``grow`` after a window whose changes kept their direction
    and by ``shrink`` after one whose changes swung back or grew."""
    if not 0 < minimum <= initial <= maximum <= 1:
        raise ValueError(f"adaptive damping needs 0 < minimum <= initial <= maximum <= 1; got {minimum}, {initial}, {maximum}")
    if not (grow >= 1 and 0 < shrink < 1):
        raise ValueError(f"adaptive damping needs grow >= 1 and 0 < shrink < 1; got {grow}, {shrink}")

    def update(state: DampingState, old: DiagGaussian, new: DiagGaussian) -> DampingState:
        r = optax.tree.scale(1.0 / state.value, mean_change(old, new))
        seen = state.has_last.astype(jnp.float32)
        step_cross = seen * optax.tree.vdot(r, state.last)
        step_square = seen * optax.tree.norm(state.last, squared=True)
        cross, square = state.cross + step_cross, state.square + step_square
        count = state.count + state.has_last.astype(jnp.int32)
        rho = cross / jnp.maximum(square, 1e-30)
        size_ratio = jnp.sqrt(optax.tree.norm(r, squared=True) / jnp.maximum(step_square, 1e-30))
        blew_up = state.has_last & (step_cross < SWING * step_square) & (size_ratio > BLOW_UP)
        decide = (count >= WINDOW) | blew_up
        shrunk = jnp.maximum(minimum, state.value * shrink)
        grown = jnp.minimum(maximum, state.value * grow)
        verdict = jnp.where(blew_up | (rho < REVERSED) | (rho > DIVERGING), shrunk, jnp.where(rho > 0, grown, state.value))
        value = jnp.where(decide, verdict, state.value).astype(jnp.float32)
        zero = jnp.zeros((), jnp.float32)
        changed = value != state.value  # a new damping starts a new window, its first residual made at it
        return DampingState(
            value, r, jnp.logical_not(changed), jnp.where(decide, zero, cross), jnp.where(decide, zero, square), jnp.where(decide, 0, count).astype(jnp.int32)
        )

    def rejected(state: DampingState) -> DampingState:
        # every message refused: the damping shrinks at once and the window starts afresh
        zero = jnp.zeros((), jnp.float32)
        value = jnp.maximum(minimum, state.value * shrink).astype(jnp.float32)
        return DampingState(value, state.last, jnp.zeros((), jnp.bool_), zero, zero, jnp.zeros((), jnp.int32))

    return Damping(lambda params: _init(params, initial), update, rejected, adaptive=True)
