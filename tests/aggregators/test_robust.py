"""Robust aggregation (fedbayes.aggregators.robust), attacks (fedbayes.sim.scenario), dropouts and stragglers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup
from scipy import stats

from fedbayes import protocol
from fedbayes.aggregators.robust import RobustAggregator
from fedbayes.algorithms.feddyn import feddyn
from fedbayes.algorithms.fedep import fedep
from fedbayes.algorithms.sites import GaussianMessage
from fedbayes.config.schema import ConfigError, validate
from fedbayes.gaussian import DiagGaussian
from fedbayes.sim.scenario import Scenario, attacker_ids, flip_labels, message_attack
from fedbayes.sim.simulator import Simulator


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_median_and_trimmed_mean_of_identical_messages_is_that_message(rule):
    rng = np.random.default_rng(0)
    one = {"a": jnp.asarray(rng.normal(size=(3, 4)) * 1e3, jnp.float32), "b": jnp.asarray(rng.normal(size=5), jnp.float32)}
    msgs = jax.tree.map(lambda x: jnp.stack([x] * 5), one)
    msgs["a"] = msgs["a"].at[4].set(jnp.nan)  # a rejected client (weight 0) must not count
    agg = RobustAggregator(rule, trim_fraction=0.2)(None, msgs, jnp.array([1.0, 3.0, 1.0, 2.0, 0.0]))
    for k in one:
        np.testing.assert_array_equal(np.asarray(agg.mean[k]), np.asarray(one[k]))
    assert float(agg.count) == 4.0


def test_median_and_trimmed_mean_match_numpy_and_scipy():
    x = np.random.default_rng(1).normal(size=(7, 6)).astype(np.float32)
    w = jnp.array([1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    valid = x[np.asarray(w) > 0]
    med = RobustAggregator("median")(None, {"x": jnp.asarray(x)}, w)
    np.testing.assert_allclose(np.asarray(med.mean["x"]), np.median(valid, axis=0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(med.total["x"]), 6 * np.median(valid, axis=0), rtol=1e-6)
    tm = RobustAggregator("trimmed_mean", trim_fraction=0.2)(None, {"x": jnp.asarray(x)}, w)
    np.testing.assert_allclose(np.asarray(tm.mean["x"]), stats.trim_mean(valid, 0.2, axis=0), rtol=1e-5)


def _fedep_setting(m=7, d=40, seed=0):
    """A FedEP server at ``q_g`` (precision 100, mean ~ N(0, 1)) and ``m`` honest natural-parameter
    deltas (precision increases in [0, 5], mean moves of ~0.01 each)."""
    _, _, trainer = logreg_setup()
    alg = fedep(trainer, optax.sgd(1.0), lambda *a: None, total_examples=1000, num_clients=10, damping=1.0, alpha_cov=0.1)
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.normal(size=d), jnp.float32)}
    state = alg.server_init(jax.random.key(0), params)
    lam = rng.uniform(0, 5, size=(m, d))
    eta = (100 + lam) * (np.asarray(state.q.precision_mean["w"]) / 100 + 0.01 * rng.normal(size=(m, d))) - np.asarray(state.q.precision_mean["w"])
    msgs = GaussianMessage(
        DiagGaussian(precision_mean={"w": jnp.asarray(eta, jnp.float32)}, precision={"w": jnp.asarray(lam, jnp.float32)}), jnp.ones(m, jnp.bool_)
    )
    return alg, state, msgs


def _posterior(alg, state):
    mean, var = alg.server_posterior(state)
    return np.asarray(mean["w"]), 1.0 / np.asarray(var["w"])


def test_huge_precision_attackers_swamp_the_mean_but_not_the_robust_rules():
    """f = 2 < M/2 = 3.5 attackers claim precision 1000 Lambda_g around -m_g. Stated distance from
    the honest posterior (the mean rule over the 5 honest clients): every coordinate's precision
    within a factor 2 and its mean within 0.5, where the plain mean moves precisions by a factor
    > 100 and means by about 2 |m_g| (> 1; |m_g| ~ N(0, 1) over 40 coordinates). Measured here:
    log-ratios 0.09 to 0.15, mean shifts 0.25 (median, trimmed mean: coordinate-wise on eta and
    Lambda separately, so the implied mean eta / Lambda is off by up to count * spread(Delta
    Lambda) * |m_g| / Lambda_g) and 0.36 (share bound s = 0.05: each attacker moves a mean at most
    s / (1 + s) of the way to its -m_g, 2 * 0.05 * 2 |m_g| at most)."""
    alg, state, msgs = _fedep_setting()
    attackers = jnp.array([False, True, False, False, True, False, False])
    bad = message_attack("huge_precision")(msgs, attackers, alg.broadcast(state))
    w = jnp.ones(7)
    key = protocol.server_key(0, 0)
    honest, _, _ = protocol.server_step(key, alg, state, msgs, jnp.where(attackers, 0.0, 1.0))
    m_h, lam_h = _posterior(alg, honest)

    def distance(aggregator):
        new, ok, _ = protocol.server_step(key, alg, state, bad, w, aggregator)
        assert bool(jnp.all(ok))  # the attack passes validation: finite, positive precisions
        m, lam = _posterior(alg, new)
        return np.max(np.abs(np.log(lam / lam_h))), np.max(np.abs(m - m_h))

    log_ratio, shift = distance(None)
    assert log_ratio > np.log(100) and shift > 1.0
    for rule in (
        RobustAggregator("median"),
        RobustAggregator("trimmed_mean", trim_fraction=0.3),
        RobustAggregator("mean", max_precision_share=0.05),
        RobustAggregator("norm_bound", norm_bound=100.0, max_precision_share=0.05),
    ):
        log_ratio, shift = distance(rule)
        assert log_ratio < np.log(2) and shift < 0.5, (rule.rule, log_ratio, shift)


def test_precision_share_bound_leaves_honest_messages_unchanged():
    alg, state, msgs = _fedep_setting()
    key = protocol.server_key(0, 0)
    plain, _, _ = protocol.server_step(key, alg, state, msgs, jnp.ones(7))
    bounded, _, _ = protocol.server_step(key, alg, state, msgs, jnp.ones(7), RobustAggregator("mean", max_precision_share=0.1))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(bounded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_message_attacks_touch_only_the_attackers():
    msgs = {"w": jnp.arange(12.0).reshape(3, 4) + 1}
    attackers = jnp.array([False, True, False])
    for kind, row in (("scaled", 10 * msgs["w"][1]), ("sign_flip", -msgs["w"][1])):
        out = message_attack(kind)(msgs, attackers, None)
        np.testing.assert_array_equal(np.asarray(out["w"][1]), np.asarray(row))
        np.testing.assert_array_equal(np.asarray(out["w"])[[0, 2]], np.asarray(msgs["w"])[[0, 2]])
    assert bool(jnp.all(jnp.isnan(message_attack("nan")(msgs, attackers, None)["w"][1])))
    ids = attacker_ids(3, 100, 0.3)
    assert len(ids) == 30 and np.array_equal(ids, attacker_ids(3, 100, 0.3)) and not np.array_equal(ids, attacker_ids(4, 100, 0.3))
    np.testing.assert_array_equal(flip_labels(np.array([0, 1, 9, 3]), np.array([1, 2]), 10), [0, 8, 0, 3])


def _feddyn_sim(seed, dropout=0.0, deadline=None, attack=None, attackers=()):
    _, params, trainer = logreg_setup(epochs=1)
    alg = feddyn(trainer, optax.sgd(1.0), alpha=0.1, num_clients=5)
    sim = Simulator(
        alg, digits_federation(), clients_per_round=4, seed=seed, scenario=Scenario(dropout=dropout, deadline=deadline, attack=attack, attackers=attackers)
    )
    return sim, sim.init(params)


def test_dropout_keeps_dropped_states_and_is_reproducible_by_seed():
    sim, state = _feddyn_sim(seed=0, dropout=0.5)
    runs = []
    for _ in range(2):
        s, info = sim.run_round(state)
        runs.append((s, info))
    (s1, i1), (s2, i2) = runs
    assert len(i1.dropped) > 0 and np.array_equal(i1.dropped, i2.dropped)
    for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    before, after = jax.tree.leaves(state.client_states), jax.tree.leaves(s1.client_states)
    for cid in range(5):
        same = all(np.array_equal(np.asarray(b)[cid], np.asarray(a)[cid]) for b, a in zip(before, after, strict=True))
        assert same == (cid in i1.dropped or cid not in i1.cohort), cid
    assert not i1.clients["accepted"][np.isin(i1.clients["client"], i1.dropped)].any() and len(i1.rejected) == 0
    drops = {tuple(_feddyn_sim(seed=s, dropout=0.5)[0].failed_clients(0, np.arange(4))[0]) for s in range(6)}
    assert len(drops) > 1  # another seed, other failures


def test_deadline_cuts_the_clients_with_too_many_steps():
    sim, state = _feddyn_sim(seed=0, deadline=5)  # batch 16, 1 epoch: sizes 37, 90, 213, 11, 150 -> 3, 6, 14, 1, 10 steps
    _, info = sim.run_round(state)
    expect = [c for c in info.cohort if -(-sim.sizes[c] // 16) > 5]
    assert sorted(info.late.tolist()) == sorted(expect) and len(expect) > 0


def test_nan_attackers_are_rejected_in_the_simulator():
    sim, state = _feddyn_sim(seed=0, attack=message_attack("nan"), attackers=[1, 2])
    _, info = sim.run_round(state)
    assert sorted(info.rejected.tolist()) == sorted(set(info.cohort.tolist()) & {1, 2})


@pytest.mark.parametrize(
    "over,field",
    [
        ({"server": {"aggregator": "mode"}}, "server.aggregator"),
        ({"server": {"aggregator": "norm_bound"}}, "server.norm_bound"),
        ({"server": {"trim_fraction": 0.5}}, "server.trim_fraction"),
        ({"server": {"dropout": 1.0}}, "server.dropout"),
        ({"attack": {"kind": "gaussian"}}, "attack.kind"),
        ({"algorithm": {"name": "vbnn"}, "model": {"variational": True}, "server": {"aggregator": "median"}}, "server.aggregator"),
    ],
)
def test_bad_robust_settings_are_one_line_errors(over, field):
    raw = {"data": {"dataset": "digits"}, **over}
    with pytest.raises(ConfigError) as e:
        validate(raw)
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg
