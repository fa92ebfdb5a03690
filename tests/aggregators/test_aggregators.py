"""The aggregator seam (fedbayes.aggregators): the default rule, ``Aggregate.uniform_mean``, the
``reference`` handshake with :func:`fedbayes.protocol.server_step`, and every rule of the package
under ``jit``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes import aggregators, protocol, tree
from fedbayes.aggregators import Aggregate, Rule, is_floating, weighted
from fedbayes.aggregators.dp import DPAggregator
from fedbayes.aggregators.robust import RobustAggregator
from fedbayes.aggregators.variational import RULES, variational_rule
from fedbayes.algorithms.base import Algorithm, finite_message, stateless_client_init
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.sgd import LocalTrainer


def _messages(seed=0, m=5):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (m, 3, 2)), "b": jax.random.normal(k2, (m, 4)), "flag": jnp.ones((m,), jnp.bool_)}


def test_the_default_rule_is_the_weighted_mean_the_masked_sum_and_the_count():
    msgs = _messages()
    w = jnp.array([1.0, 3.0, 0.0, 2.0, 0.5])
    agg = weighted(None, msgs, w)
    x = np.asarray(msgs["w"], np.float64)
    wn = np.asarray(w, np.float64)
    np.testing.assert_allclose(agg.mean["w"], np.einsum("m,mij->ij", wn, x) / wn.sum(), rtol=1e-6)
    np.testing.assert_allclose(agg.total["w"], x[wn > 0].sum(axis=0), rtol=1e-6)
    assert float(agg.count) == 4.0
    # Leaves that are not floating point are not aggregated: zeros of the leaf's shape and dtype.
    assert agg.mean["flag"].dtype == jnp.bool_ and not bool(agg.mean["flag"]) and not bool(agg.total["flag"])
    assert is_floating(msgs["w"]) and not is_floating(msgs["flag"])


def test_every_weight_zero_gives_zeros_not_nan():
    msgs = _messages()
    agg = weighted(None, msgs, jnp.zeros(5))
    assert float(agg.count) == 0.0
    for leaf in jax.tree.leaves((agg.mean, agg.total, agg.uniform_mean())):
        assert not bool(jnp.any(leaf))


@pytest.mark.parametrize("weights", [[1.0, 3.0, 0.0, 2.0, 0.5], [0.0] * 5, [2.0] * 5, [0.0, 0.0, 7.0, 0.0, 0.0]])
def test_uniform_mean_is_bit_for_bit_the_weighted_mean_with_the_participation_mask(weights):
    msgs = _messages(1)
    floats = {k: v for k, v in msgs.items() if is_floating(v)}
    w = jnp.asarray(weights)
    got = jax.jit(lambda m, w: weighted(None, m, w).uniform_mean())(floats, w)
    want = jax.jit(lambda m, w: tree.weighted_mean(m, (w > 0).astype(jnp.float32)))(floats, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@dataclasses.dataclass
class _Recording:
    """A rule that records what it received (and otherwise is the default)."""

    needs_reference: bool
    seen: list = dataclasses.field(default_factory=list)

    def __call__(self, key, messages, weights, reference=None):
        self.seen.append(reference)
        return weighted(key, messages, weights)


def _point_algorithm():
    return Algorithm(
        name="toy",
        server_init=lambda key, params: params,
        broadcast=lambda state: {"reference": state},
        client_init=stateless_client_init,
        client_update=None,
        server_update=lambda key, state, aggregate: (jax.tree.map(jnp.add, state, aggregate.mean), {}),
        server_params=lambda state: state,
        message_ok=finite_message,
        trainer=LocalTrainer(loss_fn=None, optimizer=None, num_epochs=1, batch_size=1),
    )


@pytest.mark.parametrize("needs", [True, False])
def test_the_server_passes_the_broadcast_only_to_a_rule_that_needs_it(needs):
    alg = _point_algorithm()
    state = jnp.arange(3.0)
    rule = _Recording(needs)
    new, ok, info = protocol.server_step(protocol.server_key(0, 0), alg, state, jnp.ones((2, 3)), jnp.ones(2), rule)
    assert bool(jnp.all(ok)) and int(info["num_accepted"]) == 2
    np.testing.assert_array_equal(np.asarray(new), np.arange(3.0) + 1.0)
    if needs:
        np.testing.assert_array_equal(np.asarray(rule.seen[0]["reference"]), np.arange(3.0))
    else:
        assert rule.seen == [None]


def test_a_rule_from_a_function_needs_no_reference_and_takes_the_key_first():
    seen = []

    def fn(key, messages, weights):
        seen.append(key)
        return weighted(key, messages, weights)

    rule = Rule(fn)
    assert rule.needs_reference is False and weighted.needs_reference is False
    rule("k", _messages(), jnp.ones(5), reference="ignored")
    assert seen == ["k"]


def _gaussian_messages(m=4, seed=2):
    k1, k2 = jax.random.split(jax.random.key(seed))
    diff = DiagGaussian(jax.random.normal(k1, (m, 6)), jnp.abs(jax.random.normal(k2, (m, 6))))
    q = DiagGaussian(jnp.ones(6), jnp.full(6, 4.0))
    return diff, q


def _variational_messages(m=4, seed=3):
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    return {
        "layer": {
            "kernel_mean": jax.random.normal(k1, (m, 3, 2)),
            "kernel_logvar": -jnp.abs(jax.random.normal(k2, (m, 3, 2))),
            "bias": jax.random.normal(k3, (m, 2)),
        }
    }


def _every_rule():
    """``name -> (rule, messages, reference)`` for every rule of the package."""
    diff, q = _gaussian_messages()
    out = {
        "weighted": (weighted, _messages(), None),
        "median": (RobustAggregator("median"), _messages(), None),
        "trimmed_mean": (RobustAggregator("trimmed_mean", trim_fraction=0.2), _messages(), None),
        "norm_bound": (RobustAggregator("norm_bound", norm_bound=1.0), _messages(), None),
        "precision_share": (RobustAggregator("mean", max_precision_share=0.5), diff, q),
        "dp": (DPAggregator(1.0, 0.5), _messages(), None),
        "dp_moments": (DPAggregator(5.0, 0.1, coordinates="moments"), diff, q),
    }
    out.update({f"vbnn_{r}": (variational_rule(r, population=20), _variational_messages(), None) for r in RULES})
    return out


@pytest.mark.parametrize("name", sorted(_every_rule()))
def test_every_rule_is_an_aggregator_and_runs_under_jit(name):
    rule, msgs, reference = _every_rule()[name]
    assert isinstance(rule.needs_reference, bool)
    extra = {"reference": reference} if rule.needs_reference else {}
    w = jnp.array([1.0, 2.0, 0.0, 1.5, 1.0])[: jax.tree.leaves(msgs)[0].shape[0]]
    agg = jax.jit(lambda k, m, w, e: rule(k, m, w, **e))(jax.random.key(0), msgs, w, extra)
    assert isinstance(agg, Aggregate)
    for part in (agg.mean, agg.total):
        assert jax.tree.structure(part) == jax.tree.structure(msgs)
        for a, x in zip(jax.tree.leaves(part), jax.tree.leaves(msgs)):
            assert a.shape == x.shape[1:] and a.dtype == x.dtype
            if is_floating(a):
                assert bool(jnp.all(jnp.isfinite(a)))
    # The same call twice compiles once and gives the same bits (rules are pure functions of the key).
    again = jax.jit(lambda k, m, w, e: rule(k, m, w, **e))(jax.random.key(0), msgs, w, extra)
    for a, b in zip(jax.tree.leaves(agg), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_package_exports_every_rule_seam():
    assert {"Aggregate", "Aggregator", "Rule", "is_floating", "weighted"} <= set(aggregators.__all__)
