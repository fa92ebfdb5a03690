"""The adaptive damping (fedbayes.algorithms.damping): the change it measures against the Gaussians'
KL, its rule step by step, a problem that oscillates at a fixed damping of 0.5 and converges under
the adaptive one, a round with every message rejected, and a logistic regression reaching the same
fixed point as a fixed damping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup

from fedbayes.algorithms import damping
from fedbayes.algorithms.pvi import pvi
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.sgd import training_info
from fedbayes.sim.simulator import Simulator


def _gaussian(mean, precision) -> DiagGaussian:
    mean, precision = jnp.asarray(mean, jnp.float32), jnp.asarray(precision, jnp.float32)
    return DiagGaussian(precision_mean=mean * precision, precision=precision)


def test_mean_change_ignores_coordinates_without_information():
    old, new = _gaussian([1.0, 2.0], [1.0, 0.0]), _gaussian([1.5, 7.0], [4.0, 3.0])
    np.testing.assert_allclose(np.asarray(damping.mean_change(old, new)), [0.5, 0.0])


def test_adaptive_rule_step_by_step():
    """Decisions every ``WINDOW`` residual pairs on the least-squares ``rho_hat`` and ``g_hat``."""
    assert (damping.WINDOW, damping.REVERSED, damping.DIVERGING, damping.GROWING) == (3, -1.0, 1.0, 1.25)  # the sequence is written for these
    policy = damping.adaptive(initial=0.2, minimum=0.01, maximum=1.0, grow=1.25, shrink=0.5)
    mean = [0.0]

    def move(t, residual):  # a round that moved the global's mean (precision 1) by delta * residual
        step = float(t.value) * residual
        out = policy.update(t, _gaussian(mean, [1.0]), _gaussian([mean[0] + step], [1.0]))
        mean[0] += step
        return out

    t = policy.init(jnp.zeros(1))
    for r in (5.0, 2.5, 1.25):
        t = move(t, r)
        assert float(t.value) == pytest.approx(0.2)
    t = move(t, 0.625)  # the window is full: rho_hat = 0.5 > 0, too cautious
    assert float(t.value) == pytest.approx(0.25)
    for r in (1.0, -0.8, 0.8):  # a new window: a swing, and a single round decides nothing
        t = move(t, r)
        assert float(t.value) == pytest.approx(0.25)
    t = move(t, -0.8)  # rho_hat = -2.08 / 2.28 = -0.91, g_hat 0.92: a swing that does not grow is kept
    assert float(t.value) == pytest.approx(0.25)
    for r in (1.1, -1.21):  # a kept damping goes on with its last residual: a swing that grows 10% a round ...
        t = move(t, r)
        assert float(t.value) == pytest.approx(0.25)
    t = move(t, 1.331)  # ... rho_hat = -3.82 / 3.31 = -1.15 < -1: unstable
    assert float(t.value) == pytest.approx(0.125)
    for r in (1.0, 1.1, 1.21):  # a residual that grows 10% a round in its own direction ...
        t = move(t, r)
        assert float(t.value) == pytest.approx(0.125)
    t = move(t, 1.331)  # ... rho_hat = 1.1 > 1: diverging
    assert float(t.value) == pytest.approx(0.0625)


def test_a_swing_that_grows_in_some_directions_shrinks_the_damping():
    """One direction swings back and grows 1.5x a round while another keeps a steady pull: the
    window's rho_hat is -0.84 (a "decaying" swing to rho_hat alone) but the residual grows (g_hat
    1.39 > GROWING): the damping is halved. A swing that decays 0.8x a round beside a weaker pull
    (rho_hat -0.59, g_hat 0.83) is left alone."""
    assert damping.GROWING == 1.25

    def run(factor, steady):
        policy = damping.adaptive(initial=0.2, minimum=0.01)
        t, mean = policy.init(jnp.zeros(2)), np.zeros(2)
        for k in range(damping.WINDOW + 1):  # the first round has no predecessor; the next ones fill the window
            step = float(t.value) * np.array([factor**k * (-1) ** k, steady])
            t = policy.update(t, _gaussian(mean, [1.0, 1.0]), _gaussian(mean + step, [1.0, 1.0]))
            mean = mean + step
        return float(t.value)

    assert run(1.5, 1.0) == pytest.approx(0.1)
    assert run(0.8, 0.3) == pytest.approx(0.2)


def test_residuals_that_keep_their_direction_grow_the_damping_only_while_they_shrink():
    """A residual that turns 0.5 rad a round keeps its direction (rho_hat = f cos 0.5 > 0): shrinking
    (f = 0.95, g_hat 0.95) the damping is too cautious and grows; growing (f = 1.05, g_hat 1.05,
    rho_hat 0.92, neither a swing nor past DIVERGING) it is held: a larger damping would move the
    global further along a change that is getting larger (the CNN of posterior_defaults.md)."""

    def run(factor):
        policy = damping.adaptive(initial=0.2, minimum=0.01)
        t, mean = policy.init(jnp.zeros(2)), np.zeros(2)
        for k in range(damping.WINDOW + 1):
            step = float(t.value) * factor**k * np.array([np.cos(0.5 * k), np.sin(0.5 * k)])
            t = policy.update(t, _gaussian(mean, [1.0, 1.0]), _gaussian(mean + step, [1.0, 1.0]))
            mean = mean + step
        return float(t.value)

    assert run(0.95) == pytest.approx(0.25)
    assert run(1.05) == pytest.approx(0.2)


def test_a_rise_of_the_loss_at_the_broadcast_halves_the_damping_that_made_it_and_caps_it():
    """The loss at round t's broadcast measures round t-1's update: a rise past LOSS_RISE halves
    the damping that update used (not again once lowered) and caps any later growth there."""
    assert damping.LOSS_RISE == 0.2
    policy = damping.adaptive(initial=0.4, minimum=0.05)
    t = policy.init(jnp.zeros(1))
    g = _gaussian([0.0], [1.0])
    t = policy.update(t, g, g, 1.0)
    t = policy.update(t, g, g, 1.15)  # +15%: kept
    assert float(t.value) == pytest.approx(0.4)
    t = policy.update(t, g, g, 1.5)  # +30%: the 0.4 behind it is halved and becomes the ceiling
    assert (float(t.value), float(t.ceiling)) == (pytest.approx(0.2), pytest.approx(0.2))
    t = policy.update(t, g, g, 2.0)  # rose again, but measures the update still made at 0.4: not halved twice
    assert float(t.value) == pytest.approx(0.2)
    t = policy.update(t, g, g, 0.5)
    assert float(t.value) == pytest.approx(0.2)
    for k in range(60):  # a steady contraction grows the damping, but only to the ceiling
        t = policy.update(t, _gaussian([0.0], [1.0]), _gaussian([float(t.value) * 0.8**k], [1.0]), 0.5)
    assert float(t.value) == pytest.approx(0.2)
    unmeasured = policy.init(jnp.zeros(1))
    for loss in (None, 0.0, float("nan")):  # not measured: no decision on the loss
        unmeasured = policy.update(unmeasured, g, g, loss)
    assert float(unmeasured.value) == pytest.approx(0.4) and float(unmeasured.ceiling) == 1.0


def test_a_window_whose_loss_rose_does_not_grow_and_one_that_rose_past_loss_rise_halves():
    """Residuals that keep their direction would grow the damping, but not while the loss at the
    broadcast is higher than when the window began; 8% a round (each below LOSS_RISE) adds up to
    more than LOSS_RISE over a window: halved and capped at the window's end."""
    policy = damping.adaptive(initial=0.2, minimum=0.01)

    def run(losses):
        t, mean = policy.init(jnp.zeros(1)), 0.0
        for k, loss in enumerate(losses):
            step = float(t.value) * 0.9**k  # a steady contraction: rho_hat 0.9
            t = policy.update(t, _gaussian([mean], [1.0]), _gaussian([mean + step], [1.0]), loss)
            mean += step
        return t

    assert float(run([1.0, 0.9, 0.8, 0.7]).value) == pytest.approx(0.25)  # the loss falls: grown
    assert float(run([1.0, 1.01, 1.0, 1.02]).value) == pytest.approx(0.2)  # it rose a little: kept
    t = run([1.0, 1.08, 1.17, 1.26])  # 26% over the window, at most 8% a round
    assert (float(t.value), float(t.ceiling)) == (pytest.approx(0.1), pytest.approx(0.1))


def test_adaptive_rule_climbs_to_its_maximum_on_a_contraction():
    policy = damping.adaptive(initial=0.2, maximum=0.9)
    t, mean = policy.init(jnp.zeros(1)), 0.0
    for k in range(40):  # each residual 0.8 times the last
        step = float(t.value) * 0.8**k
        t = policy.update(t, _gaussian([mean], [1.0]), _gaussian([mean + step], [1.0]))
        mean += step
    assert float(t.value) == pytest.approx(0.9)


def test_rejected_round_shrinks_and_forgets_the_last_change():
    policy = damping.adaptive(initial=0.5, minimum=0.1)
    state = policy.rejected(policy.init(jnp.zeros(3)))
    assert float(state.value) == 0.25 and not bool(state.has_last) and int(state.count) == 0
    fixed = damping.fixed(0.3)
    assert float(fixed.rejected(fixed.init(jnp.zeros(3))).value) == pytest.approx(0.3)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="minimum <= initial <= maximum"):
        damping.adaptive(initial=0.01, minimum=0.02)
    with pytest.raises(ValueError, match="grow >= 1"):
        damping.adaptive(grow=0.9)
    with pytest.raises(ValueError, match="damping must be > 0"):
        damping.fixed(0.0)
    assert damping.from_setting("adaptive").adaptive and not damping.from_setting(0.3).adaptive


# ----- a problem built to oscillate at damping 0.5 ------------------------------------------------

TARGET = 2.0
SLOPE = -3.0  # the local step maps a global mean m to TARGET + SLOPE (m - TARGET): it overshoots


def _overshooting_local(key, start, cavity, data):
    """A local step whose result overshoots: mean ``TARGET + SLOPE (m_g - TARGET)`` at the global's
    precision, so the damped update is ``m <- m + rho (SLOPE - 1)(m - TARGET)``: at rho = 0.5 the
    error flips sign with the same size every round, at rho <= 1/4 it contracts."""
    del key, cavity, data
    m = start.precision_mean / start.precision
    mean = TARGET + SLOPE * (m - TARGET)
    return DiagGaussian(precision_mean=start.precision * mean, precision=start.precision), training_info(jnp.zeros(()), 0)


def _overshooting_run(rho, rounds=40):
    fed = Federation(np.zeros((1, 1), np.float32), np.zeros(1, np.int32), (np.array([0]),))
    trainer = LocalTrainer(lambda p, k, x, y, m: jnp.zeros(()), optax.sgd(0.0), 1, 1)
    algo = pvi(trainer, optax.sgd(1.0), prior_precision=1.0, damping=rho, local=_overshooting_local)
    sim = Simulator(algo, fed, clients_per_round=1, seed=0)
    state = sim.init(jnp.zeros(1, jnp.float32))
    means, values = [], []
    for _ in range(rounds):
        values.append(float(state.server_state.damping.value))
        state, _ = sim.run_round(state)
        q = state.server_state.q
        means.append(float(q.precision_mean[0] / q.precision[0]))
    return np.asarray(means), np.asarray(values)


def test_fixed_damping_half_oscillates_where_the_adaptive_one_converges():
    fixed_means, _ = _overshooting_run(0.5)
    err = np.abs(fixed_means - TARGET)
    assert err[-1] == pytest.approx(err[0], rel=1e-5)  # the error keeps its size ...
    assert np.all(np.sign(fixed_means[1:] - TARGET) != np.sign(fixed_means[:-1] - TARGET))  # ... and flips every round

    means, values = _overshooting_run(damping.adaptive())
    assert abs(means[-1] - TARGET) < 1e-4 * abs(means[0] - TARGET)
    assert np.mean(values >= 0.5) < 0.2  # rarely where the iteration does not contract (rho = 1 - 4 delta <= -1)


# ----- a GLM: the adaptive damping reaches the fixed damping's fixed point ------------------------


@pytest.mark.slow
def test_adaptive_damping_is_as_fast_as_the_best_fixed_one_on_a_logistic_regression():
    """FedLap-Cov on digits (5 clients, SGD clients): the fixed point is the MAP whatever the damping;
    0.5 is the best fixed damping measured on such problems (docs/results/posterior_defaults.md).
    After 100 rounds the adaptive damping is at least as close to the fixed point (fixed 0.5 after
    400 rounds) as the fixed damping is."""
    from fedbayes.algorithms.fedlap_cov import fedlap_cov
    from fedbayes.inference.curvature import data_curvature

    model, params, trainer = logreg_setup(lr=0.1, epochs=5, batch_size=16)
    fed = digits_federation()
    curvature = data_curvature(lambda p, x: model.apply({"params": p}, x), batch_size=16)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])

    def run(rho, rounds, keep=()):
        sim = Simulator(fedlap_cov(trainer, curvature, delta=1.0, damping=rho), fed, clients_per_round=fed.num_clients, seed=0)
        state, kept = sim.init(params), {}
        for r in range(1, rounds + 1):
            state, _ = sim.run_round(state)
            if r in keep:
                kept[r] = flat(state.server_state.params)
        return flat(state.server_state.params), kept

    fixed_point, kept = run(0.5, 400, keep=(100,))
    adaptive, _ = run(damping.adaptive(), 100)
    distance = lambda m: np.linalg.norm(m - fixed_point) / np.linalg.norm(fixed_point)
    assert distance(adaptive) <= distance(kept[100]), (distance(adaptive), distance(kept[100]))
