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
from fedbayes.aggregators import Aggregate
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms.pvi import Broadcast, ClientState, PVIInfo, cavity, client_step, pvi, server_step, site_update
from fedbayes.algorithms.pvi import broadcast as pvi_broadcast
from fedbayes.algorithms.pvi import server_init as pvi_server_init
from fedbayes.algorithms.sites import GaussianMessage
from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.batches import get_batch, num_local_steps
from fedbayes.data.federation import Federation
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference import LocalTrainer
from fedbayes.inference.sgd import training_info
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


def test_a_stored_automatic_start_without_network_std_meant_the_old_network_std():
    """Written between "auto" (2026-11-28) and ``network_std`` (2026-11-30), "auto" started a
    network's local std at 0.03; a config written since records ``network_std`` and keeps it."""
    from fedbayes.algorithms.pvi import NETWORK_INIT_STD, STORED_NETWORK_STD
    from fedbayes.config.schema import stored_meaning

    old = {"algorithm": {"name": "pvi", "init_mean": "auto", "init_std": "auto", "rho": "adaptive", "estimator": "local"}}
    assert validate(stored_meaning(old)).algorithm.network_std == STORED_NETWORK_STD == 0.03
    written = validate({"algorithm": {"name": "pvi"}}).model_dump(mode="json")
    assert written["algorithm"]["network_std"] == NETWORK_INIT_STD == 0.1
    assert validate(stored_meaning(written)).algorithm.network_std == NETWORK_INIT_STD
    explicit = {"algorithm": {"name": "pvi", "init_mean": "model", "init_std": 0.05, "estimator": "local"}}
    assert "network_std" not in stored_meaning(explicit)["algorithm"]


def test_network_std_sets_the_automatic_start_and_is_refused_where_it_does_nothing():
    from fedbayes.algorithms.pvi import local_start

    assert local_start("auto", "auto", hidden_layers=True, network_std=0.05) == ("model", 0.05)
    assert local_start("auto", "auto", hidden_layers=False, network_std=0.05) == ("global", None)
    assert validate({"algorithm": {"name": "pvi", "network_std": 0.05}}).algorithm.network_std == 0.05
    for init_std in (0.05, "global"):
        with pytest.raises(ConfigError, match="algorithm.network_std"):
            validate({"algorithm": {"name": "pvi", "init_std": init_std, "network_std": 0.05}})


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


# ----- the kernels on numbers worked by hand ----------------------------------------------------------
# q_g = ((2, -4), (5, 9)), a site ((1, 1), (2, 3)), a client likelihood ((1, 1), (2, 2)).

Q = DiagGaussian(precision_mean=jnp.array([2.0, -4.0]), precision=jnp.array([5.0, 9.0]))
SITE = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([2.0, 3.0]))
LIKELIHOOD = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([2.0, 2.0]))


def _exact_tilted(key, start, cavity, data):
    return gaussian.product(cavity, LIKELIHOOD), training_info(jnp.zeros(()), 0)


def test_the_cavity_divides_the_site_out_and_must_be_proper():
    cav, ok = cavity(Q, SITE)
    np.testing.assert_array_equal(np.asarray(cav.precision_mean), [1.0, -5.0])
    np.testing.assert_array_equal(np.asarray(cav.precision), [3.0, 6.0])
    assert bool(ok)
    heavy = DiagGaussian(precision_mean=SITE.precision_mean, precision=jnp.array([5.0, 3.0]))  # a zero cavity precision
    assert not bool(cavity(Q, heavy)[1])


def test_the_site_update_is_the_damped_difference_and_the_site_times_it():
    """rho = 0.5, q_k = ((3, -3), (7, 9)): Delta = 0.5 (q_k - q_g) = ((0.5, 0.5), (1, 0)); the site
    becomes ((1.5, 1.5), (3, 3))."""
    q_k = DiagGaussian(precision_mean=jnp.array([3.0, -3.0]), precision=jnp.array([7.0, 9.0]))
    step, site = site_update(SITE, q_k, Q, 0.5)
    np.testing.assert_array_equal(np.asarray(step.precision_mean), [0.5, 0.5])
    np.testing.assert_array_equal(np.asarray(step.precision), [1.0, 0.0])
    np.testing.assert_array_equal(np.asarray(site.precision_mean), [1.5, 1.5])
    np.testing.assert_array_equal(np.asarray(site.precision), [3.0, 3.0])


def test_an_undamped_client_step_with_exact_inference_makes_the_site_the_likelihood():
    """With rho = 1 and exact local inference the new site is the client's likelihood (PVI's fixed
    point in one step, Ashman et al. 2022 Eq. 5-6), and the message is ``q_k - q_g``."""
    message = Broadcast(Q, None, 1.0)
    msg, new, _ = client_step(jax.random.key(0), message, ClientState(SITE), None, _exact_tilted, _null_trainer(), adaptive=False)
    np.testing.assert_array_equal(np.asarray(new.site.precision_mean), np.asarray(LIKELIHOOD.precision_mean))
    np.testing.assert_array_equal(np.asarray(new.site.precision), np.asarray(LIKELIHOOD.precision))
    np.testing.assert_array_equal(np.asarray(msg.difference.precision), [0.0, -1.0])  # (3 + 2) - 5, (6 + 2) - 9
    assert bool(msg.ok) and msg.loss is None


def test_a_client_step_that_would_make_its_site_improper_is_flagged_only_when_asked():
    """Undamped with exact inference the new site is the likelihood, here of precision -3 in its
    second coordinate: an improper site, flagged only under ``allow_improper_sites=False``."""

    def shrinking(key, start, cavity, data):
        return gaussian.product(cavity, DiagGaussian(precision_mean=jnp.zeros(2), precision=jnp.array([2.0, -3.0]))), training_info(jnp.zeros(()), 0)

    message = Broadcast(Q, None, 1.0)
    for allow in (True, False):
        msg, _, _ = client_step(jax.random.key(0), message, ClientState(SITE), None, shrinking, _null_trainer(), adaptive=False, allow_improper_sites=allow)
        assert bool(msg.ok) == allow


def test_the_server_step_adds_the_total_guards_positivity_and_reports_it():
    opt = optax.sgd(1.0)
    policy = damping_policy.fixed(0.25)
    state = pvi_server_init(jnp.zeros(2), opt, 1.0, policy, anchored=False)._replace(q=Q, opt_state=opt.init(Q))
    total = DiagGaussian(precision_mean=jnp.array([1.0, 1.0]), precision=jnp.array([1.0, -10.0]))
    aggregate = Aggregate(mean=GaussianMessage(total, jnp.ones((), jnp.bool_)), total=GaussianMessage(total, jnp.ones((), jnp.bool_)), count=jnp.ones(()))
    new, info = server_step(state, aggregate, opt, policy)
    np.testing.assert_array_equal(np.asarray(new.q.precision_mean), [3.0, -4.0])
    np.testing.assert_array_equal(np.asarray(new.q.precision), [6.0, 9.0])  # 9 - 10 < 0: kept
    assert isinstance(info, PVIInfo) and int(info.precision_guarded) == 1 and float(info.damping) == 0.25


def test_the_server_starts_at_the_prior_and_the_anchored_broadcast_starts_at_the_model():
    opt = optax.sgd(1.0)
    params = jnp.array([0.5, -0.5])
    state = pvi_server_init(params, opt, 2.0, damping_policy.fixed(0.5), anchored=True)
    np.testing.assert_array_equal(np.asarray(state.q.precision), [2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(state.q.precision_mean), [0.0, 0.0])
    np.testing.assert_array_equal(np.asarray(pvi_broadcast(state, anchored=True).start), np.asarray(params))  # round 1: the model
    later = state._replace(round=jnp.ones((), jnp.int32))
    np.testing.assert_array_equal(np.asarray(pvi_broadcast(later, anchored=True).start), [0.0, 0.0])  # then q_g's mean
    assert pvi_broadcast(state, anchored=False).start is None
