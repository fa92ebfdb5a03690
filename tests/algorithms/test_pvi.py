"""PVI (docs/algorithms.md §8): the conjugate and mean-field special cases of §8.3 with exact local
inference, one client with damping 1 equals global VI, the reparameterised local step against the
exact mean-field optimum, the validity policies, the config and a short CLI run."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_federation, logreg_setup, single_client_data
from typer.testing import CliRunner

from fedbayes import gaussian, protocol
from fedbayes.algorithms.pvi import pvi
from fedbayes.algorithms.sites import GaussianMessage
from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.batches import get_batch, num_local_steps
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.sgd import training_info
from fedbayes.inference.vi import VariationalParams, kl_to_cavity, reparameterised_vi, std_of, to_gaussian, var_of
from fedbayes.runs.export import load_model
from fedbayes.runs.folder import read_metrics
from fedbayes.sim.simulator import Simulator

DIM = 3


# ----- Gaussian clients with exact local inference --------------------------------------------------


def gaussian_clients(a_mats, b_vecs) -> Federation:
    """One 'example' per client holding its Gaussian likelihood exp(-theta^T A theta / 2 + b^T theta)."""
    x = np.concatenate([np.asarray(b_vecs), np.asarray(a_mats).reshape(len(a_mats), -1)], axis=1).astype(np.float32)
    return Federation(x, np.zeros(len(a_mats), np.int32), tuple(np.array([k]) for k in range(len(a_mats))))


def exact_local(mean_field: bool, dim: int = DIM, low_precision_clients=()):
    """The exact local step: the tilted distribution cavity x likelihood, N(eta_c + b, diag(Lambda_c) + A),
    projected to mean-field VI's optimum (exact mean, precision diag(Lambda_c) + diag(A)). A full
    Gaussian tilted is mean-field itself when ``A`` is diagonal, so there it is the exact local
    posterior. Clients whose ``b[0]`` is in ``low_precision_clients`` return a tenth of the cavity's
    precision (an approximation worse than the cavity: its site turns improper)."""

    def local(key, start, cavity, data):
        del key, start
        row = data.x[data.order[data.offset]]
        b, a = row[:dim], row[dim:].reshape(dim, dim)
        prec = jnp.diag(cavity.precision) + a
        mean = jnp.linalg.solve(prec, cavity.precision_mean + b)
        lam = jnp.diag(prec) if mean_field else 1.0 / jnp.diag(jnp.linalg.inv(prec))
        for value in low_precision_clients:
            lam = jnp.where(jnp.abs(b[0] - value) < 1e-6, 0.1 * cavity.precision, lam)
        return DiagGaussian(precision_mean=lam * mean, precision=lam), training_info(jnp.zeros(()), 0)

    return local


def _null_trainer():
    return LocalTrainer(lambda p, k, x, y, m: jnp.zeros(()), optax.sgd(0.0), 1, 1)


def _exact_pvi(fed, *, delta, rho, mean_field=True, clients_per_round=None, low=(), **kw):
    algo = pvi(_null_trainer(), optax.sgd(1.0), prior_precision=delta, damping=rho, local=exact_local(mean_field, low_precision_clients=low), **kw)
    sim = Simulator(algo, fed, clients_per_round=clients_per_round or fed.num_clients, seed=0)
    return sim, sim.init(jnp.zeros(DIM, jnp.float32))


def _moments(q):
    lam = np.asarray(q.precision, np.float64)
    return np.asarray(q.precision_mean, np.float64) / lam, lam


def _random_spd(rng, k, dim=DIM, diagonal=False):
    mats = []
    for _ in range(k):
        if diagonal:
            mats.append(np.diag(rng.uniform(0.5, 3.0, dim)))
        else:
            m = rng.normal(size=(dim, dim))
            mats.append(m @ m.T + 0.5 * np.eye(dim))
    return np.stack(mats)


def test_conjugate_linear_regression_product_of_local_posteriors_is_central():
    """§8.3 'conjugate model': Bayesian linear regression with known noise, K clients. With
    full-covariance q the product of the exact local posteriors over the prior's K - 1 extra copies
    is the central posterior for any design (float64 algebra); with designs whose columns are
    orthogonal within each client the local posteriors are mean-field, the same holds through
    fedbayes.gaussian, and one synchronous PVI round with rho = 1 gives the central posterior."""
    rng = np.random.default_rng(0)
    k, n_k, delta, noise = 4, 12, 0.7, 0.5
    theta = rng.normal(size=DIM)
    xs = [rng.normal(size=(n_k, DIM)) for _ in range(k)]
    ys = [x @ theta + noise * rng.normal(size=n_k) for x in xs]

    # Full covariance, a generic design (natural parameters in float64).
    local = [(delta * np.eye(DIM) + x.T @ x / noise**2, x.T @ y / noise**2) for x, y in zip(xs, ys)]
    prod_prec = sum(p for p, _ in local) - (k - 1) * delta * np.eye(DIM)
    prod_eta = sum(e for _, e in local)
    x_all, y_all = np.concatenate(xs), np.concatenate(ys)
    central_prec = delta * np.eye(DIM) + x_all.T @ x_all / noise**2
    np.testing.assert_allclose(prod_prec, central_prec, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.solve(prod_prec, prod_eta), np.linalg.solve(central_prec, x_all.T @ y_all / noise**2), rtol=1e-10)

    # Orthogonal columns within each client: X_k = Q_k diag(s_k), so X_k^T X_k is diagonal.
    xs = [np.linalg.qr(rng.normal(size=(n_k, DIM)))[0] * rng.uniform(1.0, 3.0, DIM) for _ in range(k)]
    ys = [x @ theta + noise * rng.normal(size=n_k) for x in xs]
    a_mats = [x.T @ x / noise**2 for x in xs]
    b_vecs = [x.T @ y / noise**2 for x, y in zip(xs, ys)]
    assert max(np.abs(a - np.diag(np.diag(a))).max() for a in a_mats) < 1e-12
    with jax.enable_x64(True):
        prior = DiagGaussian(precision_mean=jnp.zeros(DIM), precision=jnp.full(DIM, delta))
        posts = [gaussian.product(prior, DiagGaussian(precision_mean=jnp.asarray(b), precision=jnp.asarray(np.diag(a)))) for a, b in zip(a_mats, b_vecs)]
        product = posts[0]
        for p in posts[1:]:
            product = gaussian.product(product, p)
        product = gaussian.quotient(product, gaussian.power(prior, k - 1))
        x_all, y_all = np.concatenate(xs), np.concatenate(ys)
        central_prec = delta * np.eye(DIM) + x_all.T @ x_all / noise**2
        central_mean = np.linalg.solve(central_prec, x_all.T @ y_all / noise**2)
        np.testing.assert_allclose(np.asarray(gaussian.mean(product)), central_mean, rtol=1e-10)
        np.testing.assert_allclose(np.asarray(product.precision), np.diag(central_prec), rtol=1e-12)

    sim, state = _exact_pvi(gaussian_clients(a_mats, b_vecs), delta=delta, rho=1.0, mean_field=False)
    state, info = sim.run_round(state)
    assert len(info.rejected) == 0
    mean, lam = _moments(state.server_state.q)
    # 1e-5: float32 state and messages
    np.testing.assert_allclose(lam, np.diag(central_prec), rtol=1e-5)
    np.testing.assert_allclose(mean, central_mean, rtol=1e-5, atol=1e-5)
    # Every site is its client's likelihood.
    for kk in range(k):
        np.testing.assert_allclose(np.asarray(state.client_states.site.precision[kk]), np.diag(a_mats[kk]), rtol=1e-5)


@pytest.mark.parametrize("k", [1, 4])
def test_mean_field_pvi_converges_to_the_global_mean_field_optimum(k):
    """§8.3 'mean-field fixed point': Gaussian clients with correlated likelihoods; the global
    mean-field VI optimum has the exact posterior mean and precision diag(Lambda_true); damped
    PVI (rho = 1/K) with exact local mean-field VI converges to it (K = 1, rho = 1: in one round)."""
    rng = np.random.default_rng(1)
    a_mats, b_vecs, delta = _random_spd(rng, k), rng.normal(size=(k, DIM)) * 2.0, 0.5
    sim, state = _exact_pvi(gaussian_clients(a_mats, b_vecs), delta=delta, rho=1.0 / k)
    for _ in range(1 if k == 1 else 60):
        state, info = sim.run_round(state)
        assert len(info.rejected) == 0
    true_prec = delta * np.eye(DIM) + a_mats.sum(0)
    mean, lam = _moments(state.server_state.q)
    # 1e-4: float32 sums over 60 rounds of damped updates
    np.testing.assert_allclose(lam, np.diag(true_prec), rtol=1e-4)
    np.testing.assert_allclose(mean, np.linalg.solve(true_prec, b_vecs.sum(0)), rtol=1e-4, atol=1e-4)


# ----- the real local step ----------------------------------------------------------------------------


def _kl_by_hand(mean, std, prior_precision):
    """KL(N(mean, std^2) || N(0, 1/delta)) from the textbook formula (not fedbayes.gaussian)."""
    var = jnp.square(std)
    return 0.5 * jnp.sum(prior_precision * (var + jnp.square(mean)) - 1.0 - jnp.log(prior_precision * var))


def test_one_client_with_damping_one_is_global_vi():
    """§8.3 'single client': K = 1 and rho = 1 is global VI in one round. The reference is
    Bayes-by-backprop on the same objective (written here from scratch: textbook KL, its own
    sampling of the same keys), the same optimizer and the same minibatches; PVI's global after
    one round is its result."""
    fed = digits_federation((200,))
    model, params, trainer = logreg_setup(epochs=2, batch_size=32)
    trainer = trainer._replace(optimizer=optax.adam(0.01))
    delta, samples, init_std = 2.0, 2, 0.05
    # the reference below draws weights (Bayes-by-backprop), so PVI runs that estimator
    algo = pvi(trainer, optax.sgd(1.0), prior_precision=delta, damping=1.0, samples=samples, init_std=init_std, estimator="weights")
    sim = Simulator(algo, fed, clients_per_round=1, seed=4)
    state, info = sim.run_round(sim.init(params))
    assert len(info.rejected) == 0

    data = single_client_data(sim, 0, 0)
    key = protocol.client_key(sim.seed, 0, 0)
    n = float(data.num_examples)

    def elbo(vp, k, x, y, m):
        mean, log_std = vp
        total = 0.0
        for s in range(samples):
            ks = jax.random.fold_in(k, s)
            # One normal draw for every coordinate, sliced into the leaves in flatten order.
            leaves, treedef = jax.tree.flatten(mean)
            flat = jax.random.normal(ks, (sum(m.size for m in leaves),))
            cuts = np.cumsum([m.size for m in leaves])[:-1]
            eps = treedef.unflatten([e.reshape(m.shape) for e, m in zip(jnp.split(flat, cuts), leaves)])
            theta = jax.tree.map(lambda mu, ls, e: mu + jnp.exp(ls) * e, mean, log_std, eps)
            total = total + trainer.loss_fn(theta, ks, x, y, m)
        kl = sum(_kl_by_hand(mu, jnp.exp(ls), delta) for mu, ls in zip(jax.tree.leaves(mean), jax.tree.leaves(log_std)))
        return total / samples + kl / n

    vp = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(lambda p: jnp.full_like(p, np.log(min(init_std, delta**-0.5))), params))
    opt = trainer.optimizer
    opt_state = opt.init(vp)

    @jax.jit
    def step(vp, opt_state, i):
        x, y, m = get_batch(data, i, trainer.batch_size)
        g = jax.grad(elbo)(vp, jax.random.fold_in(key, i), x, y, m)
        u, opt_state = opt.update(g, opt_state, vp)
        return optax.apply_updates(vp, u), opt_state

    for i in range(int(num_local_steps(data.num_examples, trainer.batch_size, trainer.num_epochs))):
        vp, opt_state = step(vp, opt_state, i)
    mean, lam = jax.tree.map(np.asarray, gaussian.mean(state.server_state.q)), state.server_state.q.precision
    # 2e-4: float32, two KL formulas and two sampling code paths that round differently
    for got, want in zip(jax.tree.leaves(mean), jax.tree.leaves(vp[0])):
        np.testing.assert_allclose(got, np.asarray(want), atol=2e-4)
    for got, want in zip(jax.tree.leaves(lam), jax.tree.leaves(vp[1])):
        np.testing.assert_allclose(np.asarray(got), np.exp(-2.0 * np.asarray(want)), rtol=2e-3)
    # The site is the global over the prior.
    site = jax.tree.map(lambda a: np.asarray(a[0]), state.client_states.site.precision)
    for s, g in zip(jax.tree.leaves(site), jax.tree.leaves(lam)):
        np.testing.assert_allclose(s, np.asarray(g) - delta, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_reparameterised_local_step_finds_the_mean_field_optimum(parameterisation):
    """On a linear-Gaussian client (loss 0.5 (x^T theta - y)^2, so A = X^T X, b = X^T y) with a
    diagonal cavity, the local step's result approaches the exact mean-field optimum of the tilted
    objective: mean (Lambda_c + A)^{-1} (eta_c + b), precision Lambda_c + diag(A). This pins the
    objective's scale (mean loss + KL / n_k)."""
    rng = np.random.default_rng(2)
    n = 40
    x = rng.normal(size=(n, DIM)).astype(np.float32) * np.array([1.0, 0.5, 0.3], np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.3 * rng.normal(size=n)).astype(np.float32)

    def loss(theta, key, xb, yb, m):
        per = 0.5 * jnp.square(xb @ theta - yb)
        return jnp.sum(per * m) / jnp.maximum(jnp.sum(m), 1.0)

    trainer = LocalTrainer(loss, optax.adam(optax.cosine_decay_schedule(0.05, 300)), 300, n)  # decay: converge, not hover
    fed = Federation(x, y, (np.arange(n),))
    sim = Simulator(pvi(trainer, optax.sgd(1.0), prior_precision=1.0, damping=1.0), fed, clients_per_round=1, seed=0)
    data = single_client_data(sim, 0, 0)
    cavity = DiagGaussian(precision_mean=jnp.array([0.5, -1.0, 0.0]), precision=jnp.array([2.0, 1.0, 4.0]))
    fit = jax.jit(reparameterised_vi(trainer, samples=16, parameterisation=parameterisation))
    q, info = fit(jax.random.key(0), cavity, cavity, data)
    a = x.T.astype(np.float64) @ x
    prec = np.diag(np.asarray(cavity.precision)) + a
    want_mean = np.linalg.solve(prec, np.asarray(cavity.precision_mean) + x.T @ y)
    mean, lam = _moments(q)
    # Monte-Carlo gradients (16 samples): 0.03 absolute on the mean, 8% on the precision
    np.testing.assert_allclose(mean, want_mean, atol=0.03)
    np.testing.assert_allclose(lam, np.diag(prec), rtol=0.08)
    assert int(info["steps"]) == 300 and float(info["loss"]) > 0


# ----- validity ---------------------------------------------------------------------------------------


def test_site_validity_policies_and_bad_messages():
    """A client whose local posterior is broader than its cavity gets an improper site: accepted by
    default (sites are factors), rejected with ``allow_improper_sites=False`` (keeping its old
    site); a client whose cavity is improper is rejected; a message that would make the global
    precision non-positive is rejected by ``message_ok``."""
    rng = np.random.default_rng(3)
    a_mats, b_vecs = _random_spd(rng, 3, diagonal=True), np.array([[1.0, 0, 0], [2.0, 0, 0], [3.0, 0, 0]])
    fed = gaussian_clients(a_mats, b_vecs)
    for allow, rejected in ((True, []), (False, [1])):
        sim, state = _exact_pvi(fed, delta=1.0, rho=1 / 3, low=(2.0,), allow_improper_sites=allow)
        new, info = sim.run_round(state)
        assert info.rejected.tolist() == rejected
        site = np.asarray(new.client_states.site.precision)
        assert (site[1] < 0).all() if allow else (site[1] == 0).all()
        assert (np.asarray(new.server_state.q.precision) > 0).all()

    # An improper cavity: client 0's site outweighs the global.
    sim, state = _exact_pvi(fed, delta=1.0, rho=1 / 3)
    sites = state.client_states.site
    bad = np.array(sites.precision)  # the client store is host memory, updated in place
    bad[0] = 5.0
    state = state._replace(client_states=state.client_states._replace(site=DiagGaussian(sites.precision_mean, bad)))
    new, info = sim.run_round(state)
    assert info.rejected.tolist() == [0]
    np.testing.assert_array_equal(np.asarray(new.client_states.site.precision[0]), np.full(DIM, 5.0))

    # message_ok: a step that would take Lambda_g below zero, and a NaN.
    q = state.server_state.q
    for lam in (-2.0 * np.ones(DIM), np.full(DIM, np.nan)):
        msg = GaussianMessage(DiagGaussian(jnp.zeros(DIM), jnp.asarray(lam, jnp.float32)), jnp.ones((), jnp.bool_))
        assert not bool(sim.algorithm.message_ok(state.server_state, msg))
    ok = GaussianMessage(DiagGaussian(jnp.zeros(DIM), jnp.full(DIM, -0.5)), jnp.ones((), jnp.bool_))
    assert bool(sim.algorithm.message_ok(state.server_state, ok)) and float(q.precision[0]) == 1.0


def test_the_guard_keeps_the_global_precision_positive():
    """rho = 1 with three clients that each shrink the precision: every message is acceptable on
    its own, but their sum would make Lambda_g negative; the guard keeps those coordinates (and
    counts them), so the global stays proper. With rho = 1/M the same round needs no guard."""
    rng = np.random.default_rng(4)
    a_mats, b_vecs = _random_spd(rng, 3, diagonal=True), np.array([[1.0, 0, 0], [2.0, 0, 0], [3.0, 0, 0]])
    fed = gaussian_clients(a_mats, b_vecs)
    for rho, guarded in ((1.0, DIM), (1 / 3, 0)):
        sim, state = _exact_pvi(fed, delta=1.0, rho=rho, low=(1.0, 2.0, 3.0))
        new, info = sim.run_round(state)
        assert len(info.rejected) == 0 and info.server["precision_guarded"] == guarded
        lam = np.asarray(new.server_state.q.precision)
        assert (lam > 0).all()
        if guarded:
            np.testing.assert_array_equal(lam, np.ones(DIM))  # 1 + 3 (0.1 - 1) < 0: kept
        else:
            np.testing.assert_allclose(lam, np.full(DIM, 0.1), rtol=1e-6)


def test_init_mean_model_starts_round_one_at_the_model():
    """``init_mean="model"``: the local step starts from the model's initial weights in round 1 and
    from the global's mean afterwards; ``"global"`` starts from the prior's zeros. A local step that
    returns its start (with the global's precision) makes the start visible in the global."""
    fed = gaussian_clients(_random_spd(np.random.default_rng(5), 1, diagonal=True), np.ones((1, DIM)))
    theta0 = jnp.array([0.3, -1.2, 2.0], jnp.float32)

    def echo(key, start, cavity, data):
        return start, training_info(jnp.zeros(()), 0)

    for init_mean, want in (("model", theta0), ("global", jnp.zeros(DIM))):
        algo = pvi(_null_trainer(), optax.sgd(1.0), prior_precision=2.0, damping=1.0, init_mean=init_mean, local=echo)
        sim = Simulator(algo, fed, clients_per_round=1, seed=0)
        state = sim.init(theta0)
        state, _ = sim.run_round(state)
        np.testing.assert_allclose(np.asarray(algo.server_params(state.server_state)), np.asarray(want), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(state.server_state.q.precision), np.full(DIM, 2.0))
        later = algo.broadcast(state.server_state).start
        assert later is None if init_mean == "global" else np.allclose(np.asarray(later), np.asarray(want))


# ----- config, CLI ------------------------------------------------------------------------------------


def test_config():
    cfg = validate({"algorithm": {"name": "pvi", "delta": 0.5, "rho": 0.2, "samples": 3, "init_std": 0.01, "parameterisation": "softplus"}})
    a = cfg.algorithm
    assert (a.delta, a.rho, a.samples, a.init_std, a.parameterisation, a.init_mean, a.improper_sites) == (0.5, 0.2, 3, 0.01, "softplus", "auto", "allow")
    assert validate({"algorithm": {"name": "pvi"}}).algorithm.init_std == "auto"
    assert validate({"algorithm": {"name": "pvi", "init_std": "global"}}).algorithm.init_std == "global"
    assert a.estimator == "local" and validate({"algorithm": {"name": "pvi", "estimator": "weights"}}).algorithm.estimator == "weights"
    for bad, field in (({"rho": 0.0}, "algorithm.rho"), ({"rho": 1.5}, "algorithm.rho"), ({"delta": 0}, "algorithm.delta"),
                       ({"estimator": "flipout"}, "algorithm.estimator"),
                       ({"samples": 0}, "algorithm.samples"), ({"init_mean": "zero"}, "algorithm.init_mean"),
                       ({"init_std": 0.0}, "algorithm.init_std"), ({"init_std": "model"}, "algorithm.init_std"),
                       ({"damping": 0.1}, "algorithm.damping: unknown key")):  # fmt: skip
        with pytest.raises(ConfigError, match=field):
            validate({"algorithm": {"name": "pvi", **bad}})
    with pytest.raises(ValueError, match="damping"):
        pvi(_null_trainer(), optax.sgd(1.0), prior_precision=1.0, damping=0.0)


def test_the_automatic_start_depends_on_whether_the_model_is_a_network():
    """``"auto"``: the model's weights and a small std on a network (zeros make hidden units alike,
    the prior's width makes the sampled network predict noise); the global on a GLM, as Ashman et
    al. start it. An explicit setting wins whatever the model."""
    from fedbayes.algorithms.pvi import NETWORK_INIT_STD, local_start

    assert local_start("auto", "auto", hidden_layers=True) == ("model", NETWORK_INIT_STD)
    assert local_start("auto", "auto", hidden_layers=False) == ("global", None)
    for hidden in (True, False):
        assert local_start("global", "global", hidden_layers=hidden) == ("global", None)
        assert local_start("model", 0.1, hidden_layers=hidden) == ("model", 0.1)


def test_a_stored_config_without_the_start_meant_the_global():
    from fedbayes.config.schema import stored_meaning

    old = {"algorithm": {"name": "pvi", "init_mean": "global"}, "server": {"clients_per_round": 4}}
    a = validate(stored_meaning(old)).algorithm
    assert (a.init_mean, a.init_std) == ("global", "global")
    new = {"algorithm": {"name": "pvi", "init_mean": "auto", "init_std": "auto", "rho": "adaptive", "estimator": "local"}}
    a = validate(stored_meaning(new)).algorithm
    assert (a.init_mean, a.init_std) == ("auto", "auto")


def test_cli_run_writes_metrics_and_the_posterior(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        'name = "pvi"\nrounds = 3\ncheckpoint_every = 0\n[data]\ndataset = "digits"\nnum_clients = 4\npartition = "iid"\n'
        '[model]\nname = "logreg"\n[client]\noptimizer = "adam"\nlr = 0.02\nbatch_size = 32\n[server]\nclients_per_round = 2\n'
        '[algorithm]\nname = "pvi"\ndelta = 1.0\nsamples = 1\ninit_std = 0.05\nmarginal_samples = 3\n'
    )
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 0, res.output
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in recs] == [0, 1, 2, 3]
    assert sum(r.get("rejected", 0) for r in recs) == 0  # default damping 1/M: proper cavities, no guard needed
    for key in ("accuracy", "nll", "accuracy_marg", "nll_marg", "ece_marg"):
        assert np.isfinite(recs[-1][key]), key
    assert recs[-1]["accuracy"] > 0.5
    model = load_model(out / "model.npz")
    assert set(model) == {"params", "posterior_mean", "posterior_variance"}
    for p, m, v in zip(jax.tree.leaves(model["params"]), jax.tree.leaves(model["posterior_mean"]), jax.tree.leaves(model["posterior_variance"])):
        np.testing.assert_array_equal(p, m)
        assert (v > 0).all() and (v < 1.0).any()  # the prior's variance is 1; data shrinks it
    assert json.loads((out / "summary.json").read_text())["final"]["accuracy"] == recs[-1]["accuracy"]


# ----- the local reparameterisation ---------------------------------------------------------------------


def _vp(params, std, key=None):
    from fedbayes.inference.vi import VariationalParams

    raw = jax.tree.map(lambda p: jnp.full_like(p, np.log(std)), params)
    if key is not None:  # distinct stds per coordinate
        keys = optax.tree.split_key_like(key, params)
        raw = jax.tree.map(lambda k, r: r + 0.5 * jax.random.normal(k, r.shape), keys, raw)
    return VariationalParams(params, raw)


def test_local_reparameterisation_is_unbiased_for_the_expected_loss_and_has_lower_variance():
    """A linear model (one flax Dense) under squared error has E_q[loss] in closed form:
    0.5 ((x M + m - y)^2 + x^2 S^2 + s^2) per example. Both estimators' Monte-Carlo means match it;
    the local one (independent draws per example) has the smaller spread (about half)."""
    from fedbayes.inference.vi import expected_loss, std_of
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("linear", 1)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=16), jnp.float32)
    mask = jnp.ones(16).at[-3:].set(0.0)  # padding counts nowhere
    params = init_params(model, jax.random.key(1), (4,))
    vp = _vp(params, 0.3, jax.random.key(2))
    lf = loss_fn(model, "regression")
    std = std_of(vp, "log")
    z = model.apply({"params": params}, x)
    var = jnp.square(x) @ jnp.square(std["dense"]["kernel"])[:, 0] + jnp.square(std["dense"]["bias"][0])
    want = float(jnp.sum(mask * 0.5 * (jnp.square(z - y) + var)) / jnp.sum(mask))
    keys = jax.random.split(jax.random.key(3), 20000)
    draws = {}
    for est in ("weights", "local"):
        f = expected_loss(lf, samples=1, parameterisation="log", estimator=est)
        draws[est] = np.asarray(jax.jit(jax.vmap(lambda k: f(vp, k, x, y, mask)))(keys))  # noqa: B023
        se = draws[est].std() / np.sqrt(len(keys))
        assert abs(draws[est].mean() - want) < 4 * se, (est, draws[est].mean(), want, se)
    assert draws["local"].std() < 0.7 * draws["weights"].std()  # about half here
    with pytest.raises(ValueError, match="estimator must be one of weights, local"):
        expected_loss(lf, samples=1, parameterisation="log", estimator="flipout")


def test_local_reparameterisation_on_an_mlp_matches_weight_draws_in_expectation():
    """No closed form through a ReLU, but both estimators are unbiased for the same E_q[loss] and
    its gradient: their Monte-Carlo means agree. With every std at zero both are the plain loss."""
    from fedbayes.inference.vi import expected_loss
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("mlp", 3, hidden=(8,))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(12, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 12), jnp.int32)
    mask = jnp.ones(12)
    params = init_params(model, jax.random.key(4), (5,))
    lf = loss_fn(model, "classification")
    vp = _vp(params, 0.4, jax.random.key(5))
    keys = jax.random.split(jax.random.key(6), 8000)
    est = {}
    for name in ("weights", "local"):
        f = expected_loss(lf, samples=2, parameterisation="log", estimator=name)
        vals, grads = jax.jit(jax.vmap(lambda k: jax.value_and_grad(f)(vp, k, x, y, mask)))(keys)  # noqa: B023
        est[name] = (np.asarray(vals), np.concatenate([np.asarray(g).reshape(len(keys), -1) for g in jax.tree.leaves(grads.mean)], axis=1))
    (vw, gw), (vl, gl) = est["weights"], est["local"]
    se = np.sqrt(vw.var() / len(vw) + vl.var() / len(vl))
    assert abs(vw.mean() - vl.mean()) < 4 * se
    gse = np.sqrt(gw.var(axis=0) / len(gw) + gl.var(axis=0) / len(gl))
    assert np.mean(np.abs(gw.mean(0) - gl.mean(0)) < 4 * gse + 1e-6) > 0.98  # every coordinate, up to a few 4-sigma misses
    exact = float(lf(params, None, x, y, mask))
    tiny = _vp(params, 1e-30)
    for name in ("weights", "local"):
        f = expected_loss(lf, samples=1, parameterisation="log", estimator=name)
        np.testing.assert_allclose(float(f(tiny, jax.random.key(0), x, y, mask)), exact, rtol=1e-6)


@pytest.mark.parametrize("estimator", ["weights", "local"])
def test_local_estimator_finds_the_mean_field_optimum_of_a_flax_linear_model(estimator):
    """The local step on a flax linear regression (kernel and bias: under ``estimator="local"`` all
    of it is drawn in output space) reaches the exact mean-field optimum of its tilted objective
    with either estimator."""
    from fedbayes.models import init_params, loss_fn, make_model

    rng = np.random.default_rng(2)
    n = 40
    x = (rng.normal(size=(n, DIM)) * np.array([1.0, 0.5, 0.3])).astype(np.float32)
    y = (x @ np.array([1.0, -2.0, 0.5]) + 0.7 + 0.3 * rng.normal(size=n)).astype(np.float32)
    model = make_model("linear", 1)
    params = init_params(model, jax.random.key(0), (DIM,))
    # The bias's std starts 9x above its optimum and moves slowest: 2000 steps.
    trainer = LocalTrainer(loss_fn(model, "regression"), optax.adam(optax.cosine_decay_schedule(0.05, 2000)), 2000, n)
    fed = Federation(x, y, (np.arange(n),))
    sim = Simulator(pvi(trainer, optax.sgd(1.0), prior_precision=1.0, damping=1.0, estimator=estimator), fed, clients_per_round=1, seed=0)
    data = single_client_data(sim, 0, 0)
    lam_c = {"dense": {"kernel": jnp.array([[2.0], [1.0], [4.0]]), "bias": jnp.array([0.5])}}
    eta_c = {"dense": {"kernel": jnp.array([[0.5], [-1.0], [0.0]]), "bias": jnp.array([0.2])}}
    assert jax.tree.structure(lam_c) == jax.tree.structure(params)
    cavity = DiagGaussian(precision_mean=eta_c, precision=lam_c)
    fit = jax.jit(reparameterised_vi(trainer, samples=16, parameterisation="log", estimator=estimator))
    q, info = fit(jax.random.key(0), cavity, cavity, data)
    xt = np.concatenate([x, np.ones((n, 1), np.float32)], axis=1).astype(np.float64)  # (kernel, bias)
    lam = np.concatenate([np.asarray(lam_c["dense"]["kernel"])[:, 0], np.asarray(lam_c["dense"]["bias"])])
    eta = np.concatenate([np.asarray(eta_c["dense"]["kernel"])[:, 0], np.asarray(eta_c["dense"]["bias"])])
    prec = np.diag(lam) + xt.T @ xt
    want_mean = np.linalg.solve(prec, eta + xt.T @ y)
    got_lam = np.concatenate([np.asarray(q.precision["dense"]["kernel"])[:, 0], np.asarray(q.precision["dense"]["bias"])])
    got_mean = np.concatenate([np.asarray(q.precision_mean["dense"]["kernel"])[:, 0], np.asarray(q.precision_mean["dense"]["bias"])]) / got_lam
    np.testing.assert_allclose(got_mean, want_mean, atol=0.03)
    np.testing.assert_allclose(got_lam, np.diag(prec), rtol=0.08)
    assert int(info["steps"]) == 2000


@pytest.mark.parametrize("squared_std", [False, True])
@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_the_kl_penalty_in_q_s_own_parameters_equals_the_natural_parameter_kl(parameterisation, squared_std):
    """``kl_to_cavity`` (the local step's penalty) against ``gaussian.kl`` through the natural
    parameters: the same value and gradient, across scales of the standard deviations and cavities."""
    rng = np.random.default_rng(3)
    for spread in (0.1, 1.0, 3.0):
        mean = {"k": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32), "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
        raw = jax.tree.map(lambda m: jnp.asarray(spread * rng.normal(size=m.shape) - 1.0, jnp.float32), mean)
        vp = VariationalParams(mean, raw)
        cavity = gaussian.from_moments(
            jax.tree.map(lambda m: m + jnp.asarray(rng.normal(size=m.shape), jnp.float32), mean),
            jax.tree.map(lambda m: jnp.asarray(np.exp(spread * rng.normal(size=m.shape)), jnp.float32), mean),
        )
        fast = kl_to_cavity(cavity, parameterisation, squared_std=squared_std)
        slow = lambda v: gaussian.kl(to_gaussian(v, parameterisation), cavity)  # noqa: E731
        np.testing.assert_allclose(float(fast(vp)), float(slow(vp)), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(jax.grad(fast)(vp)), jax.tree.leaves(jax.grad(slow)(vp))):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
        assert float(kl_to_cavity(to_gaussian(vp, parameterisation), parameterisation)(vp)) == pytest.approx(0.0, abs=1e-4)  # KL(q || q) = 0


@pytest.mark.parametrize("parameterisation", ["log", "softplus"])
def test_the_variances_are_the_squared_standard_deviations(parameterisation):
    """``var_of`` (``exp(2 raw)`` under the log parameterisation, what the local estimator, the KL
    penalty and ``to_gaussian`` read) is ``std_of`` squared, value and gradient, from tiny to large
    standard deviations."""
    raw = {"k": jnp.linspace(-12.0, 4.0, 33, dtype=jnp.float32)}
    vp = VariationalParams({"k": jnp.zeros(33, jnp.float32)}, raw)
    np.testing.assert_allclose(np.asarray(var_of(vp, parameterisation)["k"]), np.square(np.asarray(std_of(vp, parameterisation)["k"])), rtol=1e-6)
    fast = jax.grad(lambda r: jnp.sum(var_of(VariationalParams(vp.mean, r), parameterisation)["k"]))(raw)["k"]
    slow = jax.grad(lambda r: jnp.sum(jnp.square(std_of(VariationalParams(vp.mean, r), parameterisation)["k"])))(raw)["k"]
    np.testing.assert_allclose(np.asarray(fast), np.asarray(slow), rtol=1e-5)
