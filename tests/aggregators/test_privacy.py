"""Client-level differential privacy (fedbayes.aggregators.dp): the clip and the noise are the Gaussian
mechanism's, epsilon is dp-accounting's, DP without noise is the method bit for bit, precisions
stay positive, and a run with DP and dropout resumes exactly."""

from __future__ import annotations

import math
import tomllib

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.rdp import RdpAccountant

from fedbayes import aggregators
from fedbayes.aggregators.dp import DPAggregator, epsilon, from_moments, to_moments
from fedbayes.aggregators.robust import row_norms
from fedbayes.config.schema import ConfigError, validate
from fedbayes.gaussian import DiagGaussian
from fedbayes.runs.build import build_experiment
from fedbayes.runs.folder import read_metrics
from fedbayes.runs.loggers import PlainReporter
from fedbayes.runs.loop import run_experiment

CONFIG = """
name = "dp_test"
rounds = 2
checkpoint_every = 2
[data]
dataset = "digits"
num_clients = 6
partition = "iid"
fraction = 0.5
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 32
[server]
clients_per_round = 3
weighting = "uniform"
[algorithm]
name = "{algorithm}"
"""


def _config(algorithm="fedavg", **over):
    raw = tomllib.loads(CONFIG.format(algorithm=algorithm))
    if algorithm == "fedep":
        raw["algorithm"].update(weight_decay=1e-3, scale=100.0)
    for dotted, value in over.items():
        node = raw
        *path, last = dotted.split("__")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return validate(raw)


def test_clipping_and_noise_are_the_gaussian_mechanism():
    """Rows above C end with norm C (same direction), rows below are untouched; the noise on the
    sum has standard deviation sigma*C per coordinate, and the mean's noise is the sum's / count."""
    rng = np.random.default_rng(0)
    d, clip, sigma = 20_000, 2.0, 1.5
    x = rng.normal(size=(4, d)).astype(np.float32)
    x[0] *= 1e-3 / np.linalg.norm(x[0])  # below the clip
    msgs = {"a": jnp.asarray(x[:, : d // 2]), "b": jnp.asarray(x[:, d // 2 :])}
    weights = jnp.array([1.0, 1.0, 1.0, 0.0])  # the last client rejected
    clipped = DPAggregator(clip, 0.0)(jax.random.key(0), msgs, weights)
    rows = [np.concatenate([x[i, : d // 2], x[i, d // 2 :]]) for i in range(3)]
    expected = sum(r * min(1.0, clip / np.linalg.norm(r)) for r in rows)
    got = np.concatenate([np.asarray(clipped.total["a"]), np.asarray(clipped.total["b"])])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert float(row_norms({"a": jnp.asarray(rows[1][None])})[0]) > clip  # the clip was needed
    noisy = DPAggregator(clip, sigma)(jax.random.key(1), msgs, weights)
    noise = np.concatenate([np.asarray(noisy.total[k] - clipped.total[k]) for k in "ab"])
    assert abs(noise.std() / (sigma * clip) - 1) < 0.03 and abs(noise.mean()) < 4 * sigma * clip / math.sqrt(d)
    mean_noise = np.concatenate([np.asarray(noisy.mean[k] - clipped.mean[k]) for k in "ab"])
    np.testing.assert_allclose(mean_noise, noise / 3, rtol=1e-4, atol=1e-5)
    assert float(noisy.count) == 3.0


@pytest.mark.parametrize("num_clients,per_round,rounds,sigma", [(100, 10, 50, 1.0), (20, 20, 7, 2.0)])
def test_epsilon_is_dp_accountings_own(num_clients, per_round, rounds, sigma):
    event = dp_accounting.GaussianDpEvent(sigma / 2)  # replace-one: the sum's sensitivity is 2C
    if per_round < num_clients:
        event = dp_accounting.SampledWithoutReplacementDpEvent(num_clients, per_round, event)
    acc = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    acc.compose(event, rounds)
    assert epsilon(sigma, num_clients, per_round, rounds, 1e-5) == pytest.approx(acc.get_epsilon(1e-5), rel=1e-12)
    assert epsilon(sigma, num_clients, per_round, 0, 1e-5) == 0.0 and math.isinf(epsilon(0.0, num_clients, per_round, rounds, 1e-5))
    assert epsilon(2 * sigma, num_clients, per_round, rounds, 1e-5) < epsilon(sigma, num_clients, per_round, rounds, 1e-5)


def _run_rounds(config, rounds=2):
    exp = build_experiment(config)
    sim = exp.simulator
    state = sim.init(exp.params)
    for _ in range(rounds):
        state, _ = sim.run_round(state)
    return state


@pytest.mark.parametrize("algorithm", ["fedavg", "fedep"])
def test_dp_without_noise_and_a_large_clip_is_the_method_bit_for_bit(algorithm):
    plain = _run_rounds(_config(algorithm))
    dp = _run_rounds(_config(algorithm, privacy__clip=1e30, privacy__noise_multiplier=0.0))
    for a, b in zip(jax.tree.leaves((plain.server_state, plain.client_states)), jax.tree.leaves((dp.server_state, dp.client_states)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    noisy = _run_rounds(_config(algorithm, privacy__clip=1.0, privacy__noise_multiplier=1.0))
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(plain.server_state), jax.tree.leaves(noisy.server_state), strict=True)
    )


def _gaussian_messages(m=5, d=50, seed=0):
    rng = np.random.default_rng(seed)
    q = DiagGaussian(precision_mean=jnp.asarray(rng.normal(size=d) * 100, jnp.float32), precision=jnp.full((d,), 100.0, jnp.float32))
    delta = DiagGaussian(
        precision_mean=jnp.asarray(rng.normal(size=(m, d)), jnp.float32), precision=jnp.asarray(rng.uniform(-20, 20, size=(m, d)), jnp.float32)
    )
    return delta, q


def test_noisy_precisions_stay_positive_natural_floor_and_moments():
    """Noise far above the precisions: natural coordinates floor the sum at -(1 - rho) Lambda_g;
    moment coordinates are positive by construction."""
    delta, q = _gaussian_messages()
    w = jnp.ones(5)
    agg = DPAggregator(50.0, 100.0, precision_floor=0.5)(jax.random.key(0), delta, w, reference=q)
    assert np.all(np.asarray(q.precision + agg.total.precision) >= 0.5 * np.asarray(q.precision) - 1e-3)
    assert np.any(np.asarray(agg.total.precision) == -50.0)  # the floor acted
    agg = DPAggregator(5.0, 100.0, coordinates="moments")(jax.random.key(0), delta, w, reference=q)
    lam_new = np.asarray(q.precision + agg.total.precision / 5)
    assert np.all(lam_new >= 100 * np.exp(-5.0) * 0.999) and np.all(lam_new <= 100 * np.exp(5.0) * 1.001)


def test_moment_coordinates_invert():
    delta, q = _gaussian_messages(m=1)
    u = to_moments(delta, q)
    back = from_moments(jax.tree.map(lambda a: a[0], u), q)
    np.testing.assert_allclose(np.asarray(back.precision), np.asarray(delta.precision[0]), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.asarray(back.precision_mean), np.asarray(delta.precision_mean[0]), rtol=1e-4, atol=1e-2)


def test_dp_without_reference_is_plain_mechanism_on_point_messages():
    """Point messages (no Gaussian nodes) need no reference and get the plain mechanism."""
    msgs = {"w": jnp.ones((3, 4))}
    agg = DPAggregator(1.0, 0.0)(jax.random.key(0), msgs, jnp.ones(3))
    ref = aggregators.weighted(None, {"w": jnp.ones((3, 4)) * 0.5}, jnp.ones(3))
    np.testing.assert_array_equal(np.asarray(agg.total["w"]), np.asarray(ref.total["w"]))


@pytest.mark.slow
def test_resume_is_exact_with_dp_and_dropout(tmp_path):
    quiet = PlainReporter(lambda s: None)
    cfg = _config("admm", rounds=4, privacy__clip=5.0, privacy__noise_multiplier=0.5, server__dropout=0.3)
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_experiment(cfg, whole, reporter=quiet)
    run_experiment(cfg.model_copy(update={"rounds": 2}), part, reporter=quiet)
    run_experiment(cfg, part, resume=True, reporter=quiet, accept_changes=["rounds"])
    strip = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    a, b = strip(read_metrics(whole / "metrics.jsonl")), strip(read_metrics(part / "metrics.jsonl"))
    assert a == b and a[-1]["epsilon"] > 0 and "dropped" in a[-1]
    with np.load(whole / "model.npz") as f, np.load(part / "model.npz") as g:
        for k in f.files:
            np.testing.assert_array_equal(f[k], g[k])


@pytest.mark.parametrize(
    "over,field",
    [
        ({"privacy__noise_multiplier": 1.0}, "privacy.clip"),
        ({"privacy__clip": 1.0, "server__weighting": "examples"}, "server.weighting"),
        ({"privacy__clip": 1.0, "server__aggregator": "median"}, "server.aggregator"),
        ({"privacy__coordinates": "polar"}, "privacy.coordinates"),
    ],
)
def test_bad_privacy_settings_are_one_line_errors(over, field):
    with pytest.raises(ConfigError) as e:
        _config(**over)
    msg = str(e.value)
    assert "\n" not in msg and field in msg, msg


def test_compare_table_shows_epsilon():
    from fedbayes.runs import report

    summaries = {"dp": {"final": {"accuracy": 0.5, "nll": 1.0, "ece": 0.1, "epsilon": 3.25}}, "plain": {"final": {"accuracy": 0.6, "nll": 1.0, "ece": 0.1}}}
    text = report.markdown(summaries)
    assert "epsilon" in text and "3.25" in text
    assert "epsilon" not in report.markdown({"plain": summaries["plain"]})
