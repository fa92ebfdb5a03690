"""FedEP / FedSEP: special cases of docs/algorithms.md §7.11 with exact tilted inference, the robust server, the
four client methods, the Fisher, and marginalised predictions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup

from fedbayes import gaussian
from fedbayes.aggregators import Aggregate
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms.fedep import (
    Broadcast,
    ClientState,
    EPStart,
    FedEPInfo,
    ServerState,
    burn_in_server_step,
    ep_start,
    fedep,
    fedep_cavity,
    fedsep,
    fedsep_cavity,
    first_site,
    model_q,
    prior_like,
    server_step,
    site_step,
    tilted_step,
)
from fedbayes.algorithms.sites import GaussianMessage
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.federation import Federation
from fedbayes.evaluation.evaluators import make_evaluator, make_marginal_evaluator
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.clipping import clip_by_spread
from fedbayes.inference.curvature import diag_fisher
from fedbayes.inference.sgd import training_info
from fedbayes.inference.tilted import TiltedSettings, make_tilted_inference
from fedbayes.sim.simulator import Simulator

# Guo et al. 2023 (FedEP) Fig. 1 / docs/algorithms.md §15.1: two Gaussian clients in 2-D.
MEANS = np.array([[7.0, -10.6], [0.2, 2.24]])
COVS = np.array([[[11.0, -5.3], [-5.3, 3.5]], [[5.0, 4.9], [4.9, 5.5]]])
DIM = 2


def gaussian_federation(means, covs) -> Federation:
    """One 'example' per client holding its Gaussian likelihood (mean, precision matrix)."""
    precs = np.linalg.inv(covs)
    x = np.concatenate([means, precs.reshape(len(means), -1)], axis=1).astype(np.float32)
    y = np.zeros(len(means), np.int32)
    return Federation(x, y, tuple(np.array([k]) for k in range(len(means))))


def exact_inference(dim, bad_clients=()):
    """Exact tilted moments: cavity (diagonal) times the client's full Gaussian, projected to the
    diagonal family by moment matching (docs/algorithms.md §7.11 test 2). Clients whose mean's first coordinate
    is in ``bad_clients`` return a NaN / negative-precision approximation."""

    def infer(key, start, cavity, data):
        row = data.x[data.order[data.offset]]
        mu, prec = row[:dim], row[dim:].reshape(dim, dim)
        full_prec = jnp.diag(cavity.precision) + prec
        cov = jnp.linalg.inv(full_prec)
        mean = cov @ (cavity.precision_mean + prec @ mu)
        out = gaussian.project_full_to_diag(mean, cov)
        for value, kind in bad_clients:
            hit = jnp.abs(mu[0] - value) < 1e-6
            bad = jnp.full_like(out.precision, jnp.nan) if kind == "nan" else -jnp.abs(out.precision)
            out = DiagGaussian(precision_mean=out.precision_mean, precision=jnp.where(hit, bad, out.precision))
        return out, training_info(jnp.zeros(()), 0)

    return infer


def _null_trainer(epochs=1):
    return LocalTrainer(lambda p, k, x, y, m: jnp.zeros(()), optax.sgd(0.0), epochs, 1)


def _ep(ctor, fed, *, damping=1.0, lr=1.0, init="uniform", clients_per_round=None, bad=(), **kw):
    algo = ctor(
        _null_trainer(), optax.sgd(lr), exact_inference(DIM, bad), total_examples=int(sum(fed.sizes)), num_clients=fed.num_clients,
        damping=damping, alpha_cov=1.0, init=init, **kw,
    )  # fmt: skip
    sim = Simulator(algo, fed, clients_per_round=clients_per_round or fed.num_clients, seed=0)
    return algo, sim, sim.init(jnp.zeros(DIM, jnp.float32))


def _mean(state):
    return np.asarray(state.server_state.q.precision_mean / state.server_state.q.precision)


def _diag_projection(mean, cov):
    return DiagGaussian(precision_mean=np.asarray(mean) / np.diag(cov), precision=1.0 / np.diag(cov))


def test_first_round_from_uniform_is_fedpa_posterior_averaging():
    _, sim, state = _ep(fedep, gaussian_federation(MEANS, COVS))
    state, info = sim.run_round(state)
    assert len(info.rejected) == 0
    projections = [_diag_projection(m, c) for m, c in zip(MEANS, COVS)]
    product = gaussian.product(*projections)
    np.testing.assert_allclose(state.server_state.q.precision, product.precision, rtol=1e-5)
    np.testing.assert_allclose(_mean(state), [2.3250, -5.6067], atol=1e-3)  # docs/algorithms.md §7.11 test 2


def test_ten_undamped_steps_reach_the_toy_value_and_sites_are_ep_sites():
    _, sim, state = _ep(fedep, gaussian_federation(MEANS, COVS))
    for _ in range(10):
        prev = state
        state, _ = sim.run_round(state)
    np.testing.assert_allclose(_mean(state), [-4.7631, -3.6106], atol=2e-3)  # docs/algorithms.md §7.11 test 4
    # delta = 1 with plain SGD at lr 1 is the undamped EP update: site_k = tilted_k / cavity_k and
    # q_g = q_g_old * prod_k (tilted_k / q_g_old), computed here by hand from the previous state.
    q = prev.server_state.q
    sites = prev.client_states.site
    tilted = []
    for k in range(2):
        site = DiagGaussian(precision_mean=sites.precision_mean[k], precision=sites.precision[k])
        cavity = gaussian.quotient(q, site)
        full = np.diag(np.asarray(cavity.precision)) + np.linalg.inv(COVS[k])
        cov = np.linalg.inv(full)
        mean = cov @ (np.asarray(cavity.precision_mean) + np.linalg.inv(COVS[k]) @ MEANS[k])
        t = _diag_projection(mean, cov)
        tilted.append(t)
        np.testing.assert_allclose(state.client_states.site.precision[k], np.asarray(t.precision) - np.asarray(cavity.precision), rtol=1e-4)
    want = q.precision + sum(np.asarray(t.precision) - q.precision for t in tilted)
    np.testing.assert_allclose(state.server_state.q.precision, want, rtol=1e-4)


def test_exact_ep_converges_on_random_gaussian_clients():
    rng = np.random.default_rng(3)
    means = rng.normal(size=(4, DIM)) * 3
    covs = []
    for _ in range(4):
        a = rng.normal(size=(DIM, DIM))
        covs.append(a @ a.T + 0.5 * np.eye(DIM))
    covs = np.array(covs)
    _, sim, state = _ep(fedep, gaussian_federation(means, covs))
    for _ in range(60):
        state, _ = sim.run_round(state)
    precs = np.linalg.inv(covs)
    exact = np.linalg.solve(precs.sum(0), np.einsum("kij,kj->i", precs, means))
    np.testing.assert_allclose(_mean(state), exact, atol=1e-3)


def test_invariant_global_minus_sites_under_partial_participation():
    # docs/algorithms.md §7.11 test 7: SGD on both sides, same lr, no momentum: eta_g - sum_k eta_k stays 0.
    rng = np.random.default_rng(0)
    means = rng.normal(size=(3, DIM))
    covs = np.array([np.eye(DIM) * s for s in (1.0, 2.0, 0.5)])
    _, sim, state = _ep(fedep, gaussian_federation(means, covs), damping=0.5, lr=0.7, clients_per_round=2)
    for _ in range(5):
        state, _ = sim.run_round(state)
        for field in ("precision_mean", "precision"):
            g = np.asarray(getattr(state.server_state.q, field))
            s = np.asarray(getattr(state.client_states.site, field)).sum(0)
            np.testing.assert_allclose(g - s, 0.0, atol=1e-4)
    assert float(np.abs(state.server_state.q.precision).min()) > 0


def test_damping_zero_like_small_step_moves_little():
    fed = gaussian_federation(MEANS, COVS)
    _, sim_small, s_small = _ep(fedep, fed, damping=1e-6, init="benchmark")
    start = np.asarray(s_small.server_state.q.precision).copy()
    s_small, _ = sim_small.run_round(s_small)
    np.testing.assert_allclose(s_small.server_state.q.precision, start, rtol=1e-4)


def test_rejected_messages_leave_state_unchanged():
    fed = gaussian_federation(np.concatenate([MEANS, [[1.5, 1.5]]]), np.concatenate([COVS, [np.eye(2)]]))
    _, sim, state = _ep(fedep, fed, bad=((1.5, "nan"),))
    before = jax.tree.map(np.copy, state.client_states)
    new, info = sim.run_round(state)
    assert info.rejected.tolist() == [2]
    np.testing.assert_array_equal(new.client_states.site.precision[2], before.site.precision[2])
    assert not bool(new.client_states.initialized[2]) and bool(new.client_states.initialized[0])
    # The server applied the two good clients only: the product of their projections.
    product = gaussian.product(*[_diag_projection(m, c) for m, c in zip(MEANS, COVS)])
    np.testing.assert_allclose(new.server_state.q.precision, product.precision, rtol=1e-5)
    # A negative tilted precision (the global precision would turn non-positive) is rejected too.
    _, sim2, state2 = _ep(fedep, fed, bad=((1.5, "negative"),))
    new2, info2 = sim2.run_round(state2)
    assert info2.rejected.tolist() == [2]
    np.testing.assert_allclose(new2.server_state.q.precision, product.precision, rtol=1e-5)
    # fail_fast raises instead.
    algo = sim2.algorithm
    strict = Simulator(algo, fed, clients_per_round=3, seed=0, fail_fast=True)
    with pytest.raises(RuntimeError, match=r"clients \[2\]"):
        strict.run_round(strict.init(jnp.zeros(DIM, jnp.float32)))


def test_fedsep_with_one_client_equals_fedep():
    fed = digits_federation(sizes=(120,))
    model, params, trainer = logreg_setup(lr=0.05, epochs=3, momentum=0.9)
    settings = TiltedSettings(scale=50.0, weight_decay=1e-3)
    inference = make_tilted_inference("identity", trainer, settings)
    kw = dict(total_examples=120, num_clients=1, damping=0.5, alpha_cov=settings.alpha_cov, burn_in_rounds=1)
    states = []
    for ctor in (fedep, fedsep):
        sim = Simulator(ctor(trainer, optax.sgd(1.0), inference, **kw), fed, clients_per_round=1, seed=2)
        state = sim.init(params)
        for _ in range(4):
            state, info = sim.run_round(state)
            assert len(info.rejected) == 0
        states.append(state.server_state.q)
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fedep_equals_fedsep_in_the_first_round_after_benchmark_init():
    # docs/algorithms.md §7.11 test 5: with q_k = q_g^{n_k/N} the two cavities coincide.
    fed = digits_federation(sizes=(50, 80, 30))
    model, params, trainer = logreg_setup(lr=0.05, epochs=2)
    settings = TiltedSettings(scale=50.0, weight_decay=1e-3)
    inference = make_tilted_inference("identity", trainer, settings)
    kw = dict(total_examples=160, num_clients=3, damping=1 / 3, alpha_cov=settings.alpha_cov, burn_in_rounds=1)
    qs = []
    for ctor in (fedep, fedsep):
        sim = Simulator(ctor(trainer, optax.sgd(0.5, momentum=0.9), inference, **kw), fed, clients_per_round=3, seed=0)
        state = sim.init(params)
        for _ in range(2):
            state, _ = sim.run_round(state)
        qs.append(state.server_state.q)
    for a, b in zip(jax.tree.leaves(qs[0]), jax.tree.leaves(qs[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("init", ["benchmark", "uniform"])
def test_stateful_sites_agree_across_layouts_and_in_place_updates(init):
    # Two devices (conftest): the vmap layout (a GPU's) and the sequential one (a CPU's) must give
    # the same sites, also when the store is updated in place; a constant per-client leaf
    # (`initialized`) must come back split by client in both.
    fed = digits_federation()
    model, params, trainer = logreg_setup(lr=0.05, epochs=2)
    settings = TiltedSettings(scale=50.0, weight_decay=1e-3)
    inference = make_tilted_inference("identity", trainer, settings)
    algo = fedep(trainer, optax.sgd(1.0), inference, total_examples=int(sum(fed.sizes)), num_clients=5, damping=1 / 3, alpha_cov=settings.alpha_cov, init=init)
    assert len(jax.devices()) == 2
    finals = []
    for layout, donate in (("sequential", False), ("vmap", False), ("vmap", True), ("sequential", True)):
        sim = Simulator(algo, fed, clients_per_round=3, seed=2, layout=layout)
        state = sim.init(params)
        for _ in range(3):
            state, info = sim.run_round(state, donate=donate)
            assert len(info.rejected) == 0
        finals.append(state)
    assert np.asarray(finals[0].client_states.initialized).sum() >= 3
    for other in finals[1:]:
        np.testing.assert_array_equal(other.client_states.initialized, finals[0].client_states.initialized)
        for a, b in zip(jax.tree.leaves(other.client_states.site), jax.tree.leaves(finals[0].client_states.site)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["identity", "mcmc", "laplace", "ngvi"])
def test_each_method_runs_and_sharpens_the_posterior(method):
    fed = digits_federation()
    model, params, trainer = logreg_setup(lr=0.05, epochs=3, momentum=0.9)
    settings = TiltedSettings(scale=50.0, weight_decay=1e-3, laplace_epochs=1, ngvi_epochs=1, ngvi_samples=1)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    inference = make_tilted_inference(method, trainer, settings, apply_fn=apply_fn)
    n = int(sum(fed.sizes))
    algo = fedep(
        trainer, optax.sgd(1.0), inference, total_examples=n, num_clients=5, damping=1 / 3, alpha_cov=settings.alpha_cov, burn_in_rounds=1,
        allow_improper_sites=method == "mcmc",
    )  # fmt: skip
    sim = Simulator(algo, fed, clients_per_round=3, seed=1)
    state = sim.init(params)
    evaluate = make_evaluator(apply_fn, fed.x, fed.y)
    acc0 = evaluate(sim.server_params(state))["accuracy"]
    for _ in range(3):
        state, info = sim.run_round(state)
    assert len(info.rejected) == 0
    mean, var = algo.server_posterior(state.server_state)
    assert all(bool(jnp.all(v > 0)) and bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(var))
    assert evaluate(mean)["accuracy"] > acc0 + 0.2
    # The sites of the sampled clients are proper, the others untouched.
    init = np.asarray(state.client_states.initialized)
    assert init.sum() >= 3
    lam = np.asarray(jax.tree.leaves(state.client_states.site.precision)[0])
    assert np.all(lam[~init] == 0) and np.all(lam[init] != 0)
    if method != "mcmc":
        assert np.all(lam[init] > 0)
    else:
        # The rescaled MCMC precision moves cavity precision around: some site entries go negative,
        # which the default policy would reject.
        assert np.any(lam[init] < 0)
        strict = fedep(
            trainer, optax.sgd(1.0), inference, total_examples=n, num_clients=5, damping=1 / 3, alpha_cov=settings.alpha_cov, burn_in_rounds=1
        )  # fmt: skip
        sim = Simulator(strict, fed, clients_per_round=3, seed=1)
        state = sim.init(params)
        rejected = sum(len(sim.run_round(state)[1].rejected) for state in [sim.run_round(state)[0]])
        assert rejected > 0


def test_sampled_label_fisher_matches_its_expectation():
    # Softmax regression: E_y~p[(d log p(y) / d W_ic)^2] = x_i^2 p_c (1 - p_c).
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(3, 4)) * 0.5, jnp.float32)
    x1 = jnp.asarray(rng.normal(size=3), jnp.float32)
    apply_fn = lambda p, x: x @ p  # noqa: E731  (no flax layer: the engine's exact fallback path)
    reps = 20000
    xs = jnp.tile(x1[None], (reps, 1))
    f = diag_fisher(apply_fn, w, xs, None, jnp.ones(reps), key=jax.random.key(0)) / reps
    p = jax.nn.softmax(x1 @ w)
    want = jnp.square(x1)[:, None] * (p * (1 - p))[None, :]
    np.testing.assert_allclose(f, want, rtol=0.06, atol=1e-4)
    # Padding rows do not count.
    f2 = diag_fisher(apply_fn, w, jnp.concatenate([xs, 100 * xs[:50]]), None, jnp.concatenate([jnp.ones(reps), jnp.zeros(50)]), key=jax.random.key(0)) / reps
    np.testing.assert_allclose(f2, want, rtol=0.06, atol=1e-4)


def test_clip_by_spread():
    values = {"a": jnp.array([0.0, 1.0, 2.0, 3.0]), "b": jnp.array([100.0])}
    out = clip_by_spread(values, 1.0)
    flat = np.array([0.0, 1.0, 2.0, 3.0, 100.0])
    lo, hi = flat.mean() - flat.std(), flat.mean() + flat.std()
    np.testing.assert_allclose(out["b"], [hi], rtol=1e-6)
    np.testing.assert_allclose(out["a"], np.clip(flat[:4], lo, hi), rtol=1e-6)
    assert clip_by_spread(values, 0.0) is values


def test_marginal_prediction_with_zero_variance_equals_point():
    fed = digits_federation()
    model, params, _ = logreg_setup()
    params = jax.tree.map(lambda p: p + 0.3, params)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    point = make_evaluator(apply_fn, fed.x, fed.y, batch_size=200)(params)
    marg = make_marginal_evaluator(apply_fn, fed.x, fed.y, num_samples=1, batch_size=200)
    zero = jax.tree.map(jnp.zeros_like, params)
    got = marg(jax.random.key(0), params, zero)
    for k in ("accuracy", "nll", "ece"):
        np.testing.assert_allclose(got[k], point[k], rtol=1e-5, atol=1e-6)
    # With variance, 10 samples give a different (smoothed) predictive.
    noisy = make_marginal_evaluator(apply_fn, fed.x, fed.y, num_samples=10, batch_size=200)(
        jax.random.key(1), params, jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    )
    assert abs(noisy["nll"] - point["nll"]) > 1e-3


def test_linearised_predictive():
    """The GLM predictive (``predictive="linearised"``): equal to the point prediction at zero
    variance; equal to the sampled network's for a model linear in its weights (logistic
    regression: f(x; m + d) = f(x; m) + J d); and, on an MLP whose first layer's weights from an
    input that is zero on the evaluation set have a huge variance, unaffected by that variance,
    while the sampled network is not (it only sees the variance through the nonzero inputs here,
    so the two differ by the other layers' nonlinearity alone)."""
    fed = digits_federation()
    model, params, _ = logreg_setup()
    params = jax.tree.map(lambda p: p + 0.3, params)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    point = make_evaluator(apply_fn, fed.x, fed.y, batch_size=200)(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    lin = make_marginal_evaluator(apply_fn, fed.x, fed.y, num_samples=3, batch_size=200, predictive="linearised")
    got = lin(jax.random.key(0), params, zero)
    for k in ("accuracy", "nll", "ece"):
        np.testing.assert_allclose(got[k], point[k], rtol=1e-5, atol=1e-6)
    var = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    sampled = make_marginal_evaluator(apply_fn, fed.x, fed.y, num_samples=5, batch_size=200)(jax.random.key(1), params, var)
    linear = make_marginal_evaluator(apply_fn, fed.x, fed.y, num_samples=5, batch_size=200, predictive="linearised")(jax.random.key(1), params, var)
    for k in ("accuracy", "nll", "ece"):
        np.testing.assert_allclose(linear[k], sampled[k], rtol=1e-4, atol=1e-5)
    assert abs(sampled["nll"] - point["nll"]) > 1e-3  # the variance does matter

    # An MLP with a dead ReLU unit (bias -10, incoming weights 0 at the mean) whose incoming
    # weights have variance 1e4, as a Laplace posterior leaves a unit the data never switch on:
    # the linearised predictive is unaffected (the unit's Jacobian is zero), the sampled network
    # switches the unit on at random and its predictions fall apart.
    from fedbayes.models import init_params, make_model

    mlp = make_model("mlp", 10, hidden=(16,))
    p = init_params(mlp, jax.random.key(3), fed.x.shape[1:])
    p["hidden_0"]["kernel"] = p["hidden_0"]["kernel"].at[:, 0].set(0.0)
    p["hidden_0"]["bias"] = p["hidden_0"]["bias"].at[0].set(-10.0)
    p["output"]["kernel"] = p["output"]["kernel"].at[0].set(0.0).at[0, 0].set(1.0)  # the unit votes for class 0
    mlp_apply = lambda q, xs: mlp.apply({"params": q}, xs)  # noqa: E731
    tiny = jax.tree.map(lambda a: jnp.full_like(a, 1e-8), p)
    huge = {**tiny, "hidden_0": {**tiny["hidden_0"], "kernel": tiny["hidden_0"]["kernel"].at[:, 0].set(1e4)}}
    got = {}
    for predictive in ("sample", "linearised"):
        ev = make_marginal_evaluator(mlp_apply, fed.x, fed.y, num_samples=4, batch_size=200, predictive=predictive)
        got[predictive] = ev(jax.random.key(5), p, tiny), ev(jax.random.key(5), p, huge)
    small, large = got["linearised"]
    for k in ("accuracy", "nll", "ece"):
        np.testing.assert_allclose(large[k], small[k], rtol=1e-5, atol=1e-6)
    small, large = got["sample"]
    assert large["nll"] > small["nll"] + 0.1 and large["ece"] > small["ece"] + 0.1, (small, large)
    with pytest.raises(ValueError, match="predictive must be one of sample, linearised"):
        make_marginal_evaluator(apply_fn, fed.x, fed.y, predictive="laplace")
    assert validate({"algorithm": {"name": "fedlap_cov", "predictive": "linearised"}}).evaluation.predictive == "linearised"
    with pytest.raises(ConfigError, match="predictive"):
        validate({"algorithm": {"name": "fedep", "predictive": "glm"}})


def test_config_fedep_and_fedsep():
    cfg = validate({"algorithm": {"name": "fedsep", "method": "laplace", "sep_power": "one_over_k"}, "client": {"epochs": 2}})
    assert cfg.algorithm.method == "laplace" and cfg.algorithm.sep_power == "one_over_k"
    with pytest.raises(ConfigError, match=r"algorithm.method.*identity.*mcmc.*laplace.*ngvi"):
        validate({"algorithm": {"name": "fedep", "method": "exact"}})
    with pytest.raises(ConfigError, match=r"client.epochs: the mcmc method"):
        validate({"algorithm": {"name": "fedep", "method": "mcmc", "preset": "paper"}, "client": {"epochs": 1}})
    with pytest.raises(ConfigError, match=r"algorithm.initial_precision: the identity method's precision is alpha_cov"):
        validate({"algorithm": {"name": "fedep", "method": "identity", "preset": "posterior"}})
    identity = validate({"algorithm": {"name": "fedep", "method": "identity"}}).algorithm  # the paper's heuristics by default
    assert (identity.preset, identity.scale, identity.weight_decay, identity.clip_ratio) == ("paper", 500.0, 1e-4, 2.0)
    with pytest.raises(ConfigError, match=r"algorithm.sep_power: unknown key"):
        validate({"algorithm": {"name": "fedep", "sep_power": "one_over_k"}})
    with pytest.raises(ConfigError, match=r"algorithm.damping"):
        validate({"algorithm": {"name": "fedep", "damping": 0.0}})


# ----- the kernels on numbers worked by hand ----------------------------------------------------------
# Two coordinates, prior p_0 = (0, 1) (delta = 1), q_g = (eta, Lambda) = ((2, -4), (5, 9)): the
# likelihood part q_g / p_0 is ((2, -4), (4, 8)). Powers of 1/4 and 3/4 are exact in binary.

Q = DiagGaussian(precision_mean=jnp.array([2.0, -4.0]), precision=jnp.array([5.0, 9.0]))
PRIOR = prior_like(jnp.zeros(2), 1.0)


def _broadcast(q=Q, anchor=None, damping=1.0):
    return Broadcast(q, jnp.ones((), jnp.bool_), anchor, damping)


def _start(uniform=False, keeps_anchor=False, alpha_cov=0.5, prior_precision=1.0, total=8.0):
    return EPStart(uniform, alpha_cov, prior_precision, total, keeps_anchor)


def test_fedsep_cavity_takes_the_power_of_the_likelihoods_not_of_the_prior():
    """``p_0 (q_g / p_0)^(3/4)`` = ((1.5, -3), (1 + 3, 1 + 6))."""
    cavity = fedsep_cavity(Q, PRIOR, 0.75)
    np.testing.assert_array_equal(np.asarray(cavity.precision_mean), [1.5, -3.0])
    np.testing.assert_array_equal(np.asarray(cavity.precision), [4.0, 7.0])


def test_a_first_site_is_its_share_of_the_likelihoods_and_site_times_cavity_is_the_global():
    """Share 1/4: site ((0.5, -1), (1, 2)), cavity p_0 (q_g / p_0)^(3/4) = ((1.5, -3), (4, 7)); their
    product is ``q_g`` exactly. Uniform init: a flat site and the cavity ``q_g``."""
    site, cavity = first_site(_broadcast(), PRIOR, jnp.float32(0.25), jnp.float32(0.75), _start(), exact_late_sites=False)
    np.testing.assert_array_equal(np.asarray(site.precision_mean), [0.5, -1.0])
    np.testing.assert_array_equal(np.asarray(site.precision), [1.0, 2.0])
    both = gaussian.product(site, cavity)
    np.testing.assert_array_equal(np.asarray(both.precision_mean), np.asarray(Q.precision_mean))
    np.testing.assert_array_equal(np.asarray(both.precision), np.asarray(Q.precision))
    site, cavity = first_site(_broadcast(), PRIOR, jnp.float32(0.25), jnp.float32(0.75), _start(uniform=True), exact_late_sites=False)
    np.testing.assert_array_equal(np.asarray(site.precision), 0.0)
    np.testing.assert_array_equal(np.asarray(cavity.precision), np.asarray(Q.precision))


def test_a_late_first_site_takes_its_share_of_the_ep_start():
    """``exact_late_sites``: the share of the EP start's likelihoods, whatever ``q_g`` is now. The
    start from theta = (1, -2) with alpha_cov N = 0.5 * 8 = 4 and delta = 1 is Lambda = 5,
    eta = (5, -10): likelihoods ((5, -10), (4, 4)); a quarter of them is ((1.25, -2.5), (1, 1))."""
    theta = jnp.array([1.0, -2.0])
    start = _start(keeps_anchor=True)
    q0, anchor = ep_start(theta, start)
    np.testing.assert_array_equal(np.asarray(q0.precision), [5.0, 5.0])
    np.testing.assert_array_equal(np.asarray(q0.precision_mean), [5.0, -10.0])
    assert anchor is theta
    site, cavity = first_site(_broadcast(anchor=theta), PRIOR, jnp.float32(0.25), jnp.float32(0.75), start, exact_late_sites=True)
    np.testing.assert_array_equal(np.asarray(site.precision_mean), [1.25, -2.5])
    np.testing.assert_array_equal(np.asarray(site.precision), [1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(cavity.precision), [4.0, 8.0])  # q_g / site


def test_fedep_cavity_divides_an_initialised_site_out_of_the_global():
    site = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([2.0, 3.0]))
    cstate = ClientState(site, (), jnp.ones((), jnp.bool_))
    got_site, cavity = fedep_cavity(_broadcast(), cstate, PRIOR, jnp.float32(0.25), jnp.float32(0.75), _start(), False)
    np.testing.assert_array_equal(np.asarray(got_site.precision), [2.0, 3.0])
    np.testing.assert_array_equal(np.asarray(cavity.precision_mean), [1.0, -5.0])
    np.testing.assert_array_equal(np.asarray(cavity.precision), [3.0, 6.0])


def test_the_tilted_step_sends_the_damped_difference_of_the_exact_tilted():
    """With exact inference (cavity times a Gaussian likelihood ((1, 1), (2, 2))) the step is
    ``delta (cavity * likelihood - q_g)`` = 0.5 (((2.5, -2), (6, 9)) - ((2, -4), (5, 9))); a
    negative cavity precision flags the message."""
    likelihood = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([2.0, 2.0]))

    def exact(key, start, cavity, data):
        return gaussian.product(cavity, likelihood), {}

    cavity = DiagGaussian(precision_mean=jnp.array([1.5, -3.0]), precision=jnp.array([4.0, 7.0]))
    step, ok, loss, _ = tilted_step(jax.random.key(0), _broadcast(damping=0.5), cavity, None, exact, None, uniform=False, adaptive=False, delta_clip=None)
    np.testing.assert_array_equal(np.asarray(step.precision_mean), [0.25, 1.0])  # 0.5 ((2.5, -2) - (2, -4))
    np.testing.assert_array_equal(np.asarray(step.precision), [0.5, 0.0])
    assert bool(ok) and loss is None
    bad = DiagGaussian(precision_mean=cavity.precision_mean, precision=jnp.array([-1.0, 7.0]))
    _, ok, _, _ = tilted_step(jax.random.key(0), _broadcast(), bad, None, exact, None, uniform=False, adaptive=False, delta_clip=None)
    assert not bool(ok)


def test_the_site_step_adds_the_update_and_flags_an_improper_site():
    site = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([2.0, 3.0]))
    opt = optax.sgd(1.0)
    step = DiagGaussian(precision_mean=jnp.array([0.5, -1.0]), precision=jnp.array([1.0, -1.0]))
    new, proper = site_step(site, opt.init(site), step, Q, opt)
    np.testing.assert_array_equal(np.asarray(new.site.precision_mean), [1.5, 0.0])
    np.testing.assert_array_equal(np.asarray(new.site.precision), [3.0, 2.0])
    assert bool(new.initialized) and bool(proper)
    _, proper = site_step(site, opt.init(site), DiagGaussian(precision_mean=step.precision_mean, precision=jnp.array([1.0, -4.0])), Q, opt)
    assert not bool(proper)  # 3 - 4 = -1, far below round-off of Lambda_g = 9


def test_the_server_step_adds_the_total_and_keeps_a_coordinate_it_would_make_improper():
    """``q_g + total`` with ``sgd(1)``; the second precision would be 9 - 10 < 0, so that coordinate
    keeps its old value and the info counts it, with the damping the clients used."""
    opt = optax.sgd(1.0)
    policy = damping_policy.fixed(0.5)
    state = ServerState(Q, opt.init(jnp.zeros(2)), opt.init(Q), jnp.zeros((), jnp.int32), None, policy.init(jnp.zeros(2)))
    total = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([1.0, -10.0]))
    aggregate = Aggregate(mean=GaussianMessage(total, jnp.ones((), jnp.bool_)), total=GaussianMessage(total, jnp.ones((), jnp.bool_)), count=jnp.ones(()))
    new, info = server_step(state, aggregate, opt, policy)
    np.testing.assert_array_equal(np.asarray(new.q.precision_mean), [3.0, -4.0])
    np.testing.assert_array_equal(np.asarray(new.q.precision), [6.0, 9.0])
    assert isinstance(info, FedEPInfo) and int(info.precision_guarded) == 1 and float(info.damping) == 0.5
    assert int(new.round) == 1


def test_the_last_burn_in_round_starts_ep_at_the_model():
    """After the last burn-in round ``q_g`` is :func:`ep_start` of the FedAvg model: theta = (1, -2)
    minus the mean delta (0, -1) is (1, -1), so ``Lambda = 5``, ``eta = (5, -5)``; before it, ``(theta, 1)``."""
    opt = optax.sgd(1.0)
    policy = damping_policy.fixed(0.5)
    theta = jnp.array([1.0, -2.0])
    state = ServerState(model_q(theta), opt.init(theta), opt.init(model_q(theta)), jnp.zeros((), jnp.int32), None, policy.init(theta))
    delta = DiagGaussian(precision_mean=jnp.array([0.0, -1.0]), precision=jnp.zeros(2))
    aggregate = Aggregate(mean=GaussianMessage(delta, jnp.ones((), jnp.bool_)), total=GaussianMessage(delta, jnp.ones((), jnp.bool_)), count=jnp.ones(()))
    done, info = burn_in_server_step(state, aggregate, opt, _start(), burn_in_rounds=1)
    np.testing.assert_array_equal(np.asarray(done.q.precision), [5.0, 5.0])
    np.testing.assert_array_equal(np.asarray(done.q.precision_mean), [5.0, -5.0])
    assert int(info.precision_guarded) == 0
    early, _ = burn_in_server_step(state, aggregate, opt, _start(), burn_in_rounds=2)
    np.testing.assert_array_equal(np.asarray(early.q.precision_mean), [1.0, -1.0])
    np.testing.assert_array_equal(np.asarray(early.q.precision), [1.0, 1.0])
