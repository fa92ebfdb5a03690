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

and the residual's growth per round over the same pairs,

    g_hat = ( sum_t |r_t|^2 / sum_t |r_{t-1}|^2 )^(1/2),

and then (a changed damping starts a new window):

* ``rho_hat <`` :data:`REVERSED` (the changes swing back and do not decay: at ``rho <= -1`` the
  oscillation of undamped EP), ``rho_hat >`` :data:`DIVERGING` (the residual grows in its own
  direction), or ``rho_hat < 0`` with ``g_hat >`` :data:`GROWING` (the changes swing back and
  grow; ``rho_hat`` alone hides this when only some directions swing, as on a network whose
  clients' local modes pull apart): ``delta <- max(delta_min, delta * shrink)``. A swing that
  decays (``-1 < rho_hat < 0``, ``g_hat <= GROWING``) is left alone: with coordinates that settle at
  different rates, the best fixed damping overshoots the fastest ones a little (``rho`` near -0.5
  there) to move the slowest at a useful rate, and stochastic local steps keep exciting those fast
  oscillating directions;
* ``rho_hat > 0`` and ``g_hat < 1`` (the changes keep their direction and shrink: too cautious)
  and the clients' loss at the broadcast (below) no higher than when the window began:
  ``delta <- min(delta_max, delta * grow)``. A residual that keeps its direction but does not
  shrink says the iteration is not contracting at this damping, and a longer step along it is no
  remedy: growth waits for a window that shrinks, as a trust region grows its radius only after
  steps that succeed (Nocedal & Wright 2006, "Numerical Optimization", Algorithm 4.1). Growing
  there is what lost a CNN its accuracy (docs/results/posterior_defaults.md, "A CNN, not tuned on");
* otherwise ``delta`` stays: residuals that are only the jitter of stochastic local steps about
  the fixed point are nearly uncorrelated, and give no reason to move it;
* a round whose every message the server rejected (the step would have made the global improper,
  or the local results were not finite) leaves the global where it was and shrinks ``delta`` at once;
* the clients' mean data loss at the broadcast (each client's loss of the global mean on its own
  examples, weighted by its examples, sent with its message: the federated training loss of the
  global mean) rising by more than :data:`LOSS_RISE` from one round to the next means the update
  between them, made at the last round's ``delta``, made the global fit its data worse: that
  ``delta`` is halved at once (unless it has already been lowered since) and becomes the
  ceiling the damping may grow back to; a loss that rose by more than :data:`LOSS_RISE` over a
  window, round by round less, does the same at the window's end. This is the bold driver's own test (Vogl et al. 1988:
  shrink the step when the error rose), on the one quantity the server can see the error by.

A single round's correlation is too noisy to act on (SGD clients on a logistic regression: the
per-round cosine and size ratio of the residuals ranged widely at one damping); so are
per-coordinate signs, with which an Rprop-style damping per parameter decayed to its floor within
60 rounds there. For the same reason every decision waits for a full window: a rule that halved
the damping at once on a single round that swung back and doubled fired mostly on that noise and
held the logistic regressions near the floor (docs/results/posterior_defaults.md). The first
damping is cautious (:data:`INITIAL`): at 0.5 the main job's network lost its accuracy within two
rounds of EP, before any rule could see it coming.

Why the loss as well as the residuals: on a network the global mean contracts steadily while the
damping grows, and then, a round or two after it passes what the network tolerates, swings and
grows, while the logistic regressions reach their fixed points fastest at a damping the network
does not tolerate; before the swing the residuals of the two look alike, and the swing shows in
them only a window later, after the accuracy has gone (docs/results/posterior_defaults.md,
"Self-tuning defaults"). The training loss at the broadcast rises at the first harmful round. It
is exact for deterministic models (every example once, at the broadcast mean); under partial
participation each round's is a different cohort's, so a rise can also be the cohort's, and
:data:`LOSS_RISE` is a large fraction rather than a test of significance.

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

INITIAL = 0.2  # the first rounds' damping: cautious; it grows while the changes keep their direction and shrink
MINIMUM = 0.1  # the paper's 1 / K for ten clients: the floor keeps a run that only jitters moving towards its fixed point
MAXIMUM = 1.0
GROW = 1.25
SHRINK = 0.5
REVERSED = -1.0  # rho_hat below this: the changes swing back and do not decay (an unstable oscillation)
DIVERGING = 1.0  # rho_hat above this: the residual grows
GROWING = 1.25  # g_hat above this with rho_hat < 0: a swing that grows (25% a round over the window; less is the local steps' noise)
LOSS_RISE = 0.2  # the cohort's loss at the broadcast rising by more than this fraction in a round: the last damping was too large
WINDOW = 3  # rounds of residuals per decision
ADAPTIVE = "adaptive"  # the config value that selects :func:`adaptive`

__all__ = [
    "ADAPTIVE", "DIVERGING", "GROW", "GROWING", "INITIAL", "LOSS_RISE", "MAXIMUM", "MINIMUM", "REVERSED", "SHRINK", "WINDOW",
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
      ahead: ``sum |r_t|^2`` over the window so far (the same pairs as ``square``).
      fit: the cohort's mean loss at the last round's broadcast (0: none seen yet).
      previous: the damping of the last round, whose update the next round's loss measures.
      ceiling: the most the damping may grow to: :data:`MAXIMUM` until a round's loss rose.
      window_fit: the cohort's loss when the current window began (0: none).
    """

    value: jax.Array
    last: PyTree
    has_last: jax.Array
    cross: jax.Array
    square: jax.Array
    count: jax.Array
    ahead: jax.Array
    fit: jax.Array
    previous: jax.Array
    ceiling: jax.Array
    window_fit: jax.Array


class Damping(NamedTuple):
    """A damping policy: ``init(params) -> DampingState``, ``update(state, old_q, new_q, loss=None) ->
    DampingState`` (pure; ``old_q`` and ``new_q`` the global before and after the round, ``loss`` the
    cohort's mean loss at the round's broadcast, 0 or ``None`` when not measured), ``rejected(state) ->
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


def _init(params: PyTree, value: float, ceiling: float) -> DampingState:
    zero = jnp.zeros((), jnp.float32)
    v = jnp.asarray(value, jnp.float32)
    return DampingState(
        v, optax.tree.zeros_like(params), jnp.zeros((), jnp.bool_), zero, zero, jnp.zeros((), jnp.int32), zero, zero, v, jnp.asarray(ceiling, jnp.float32), zero
    )


def from_setting(value: float | str) -> Damping:
    """The policy a config's damping field names: :data:`ADAPTIVE` or a fixed value."""
    return adaptive() if value == ADAPTIVE else fixed(float(value))


def fixed(value: float) -> Damping:
    """A constant damping ``value`` > 0 (the methods check their own range)."""
    if not value > 0:
        raise ValueError(f"damping must be > 0; got {value}")
    return Damping(lambda params: _init(params, value, value), lambda state, old, new, loss=None: state, lambda state: state, adaptive=False)


def adaptive(initial: float = INITIAL, minimum: float = MINIMUM, maximum: float = MAXIMUM, grow: float = GROW, shrink: float = SHRINK) -> Damping:
    """The windowed bold-driver damping of the module docstring, starting at ``initial``, kept in
    ``[minimum, maximum]``, multiplied by ``grow`` after a window whose changes kept their direction
    and shrank, and by ``shrink`` after one whose changes swung back or grew."""
    if not 0 < minimum <= initial <= maximum <= 1:
        raise ValueError(f"adaptive damping needs 0 < minimum <= initial <= maximum <= 1; got {minimum}, {initial}, {maximum}")
    if not (grow >= 1 and 0 < shrink < 1):
        raise ValueError(f"adaptive damping needs grow >= 1 and 0 < shrink < 1; got {grow}, {shrink}")

    def update(state: DampingState, old: DiagGaussian, new: DiagGaussian, loss: jax.Array | None = None) -> DampingState:
        r = optax.tree.scale(1.0 / state.value, mean_change(old, new))
        seen = state.has_last.astype(jnp.float32)
        step_cross = seen * optax.tree.vdot(r, state.last)
        step_square = seen * optax.tree.norm(state.last, squared=True)
        step_ahead = seen * optax.tree.norm(r, squared=True)
        cross, square, ahead = state.cross + step_cross, state.square + step_square, state.ahead + step_ahead
        count = state.count + state.has_last.astype(jnp.int32)
        rho = cross / jnp.maximum(square, 1e-30)
        growth = jnp.sqrt(ahead / jnp.maximum(square, 1e-30))
        decide = count >= WINDOW
        loss = jnp.zeros((), jnp.float32) if loss is None else jnp.asarray(loss, jnp.float32)
        measured = jnp.isfinite(loss) & (loss > 0)
        # Over the window: a loss that rose at all forbids growth, one that rose past LOSS_RISE halves.
        window_known = measured & (state.window_fit > 0)
        window_worse = window_known & (loss > state.window_fit)
        window_rose = window_known & (loss > (1.0 + LOSS_RISE) * state.window_fit)
        shrunk = jnp.maximum(minimum, state.value * shrink)
        grown = jnp.minimum(state.ceiling, state.value * grow)
        unstable = (rho < REVERSED) | (rho > DIVERGING) | ((rho < 0) & (growth > GROWING)) | window_rose
        cautious = (rho > 0) & (growth < 1.0) & jnp.logical_not(window_worse)
        verdict = jnp.where(unstable, shrunk, jnp.where(cautious, jnp.maximum(grown, state.value), state.value))
        value = jnp.where(decide, verdict, state.value)
        window_cap = jnp.where(decide & window_rose, shrunk, state.ceiling)
        # The loss at this round's broadcast measures the last round's update, made at `previous`:
        # a rise past LOSS_RISE halves that damping (unless it has been lowered since) and caps it.
        rose = measured & (state.fit > 0) & (loss > (1.0 + LOSS_RISE) * state.fit)
        after_rise = jnp.where(state.value < state.previous, state.value, jnp.maximum(minimum, state.previous * shrink))
        value = jnp.where(rose, jnp.minimum(value, after_rise), value).astype(jnp.float32)
        ceiling = jnp.minimum(window_cap, jnp.where(rose, jnp.minimum(state.ceiling, after_rise), state.ceiling)).astype(jnp.float32)
        decide = decide | rose
        zero = jnp.zeros((), jnp.float32)
        changed = value != state.value  # a new damping starts a new window, its first residual made at it
        return DampingState(
            value,
            r,
            jnp.logical_not(changed),
            jnp.where(decide, zero, cross),
            jnp.where(decide, zero, square),
            jnp.where(decide, 0, count).astype(jnp.int32),
            jnp.where(decide, zero, ahead),
            jnp.where(measured, loss, state.fit).astype(jnp.float32),
            state.value,
            ceiling,
            jnp.where(decide | (state.window_fit <= 0), jnp.where(measured, loss, 0.0), state.window_fit).astype(jnp.float32),
        )

    def rejected(state: DampingState) -> DampingState:
        # every message refused: the damping shrinks at once and the window starts afresh
        zero = jnp.zeros((), jnp.float32)
        value = jnp.maximum(minimum, state.value * shrink).astype(jnp.float32)
        return DampingState(
            value, state.last, jnp.zeros((), jnp.bool_), zero, zero, jnp.zeros((), jnp.int32), zero, state.fit, state.previous, state.ceiling, zero
        )

    return Damping(lambda params: _init(params, initial, maximum), update, rejected, adaptive=True)
