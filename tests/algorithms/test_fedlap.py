"""FedLap and FedLap-Cov (docs/algorithms.md §9, §10) on least-squares clients with exact local
solves, where the target is known in closed form: the MAP of ``sum_k l_k(w) + delta/2 ||w||^2``
with ``l_k(w) = 1/2 ||Z_k w - y_k||^2`` (``Z`` the features with a ones column for the bias) is
``(sum_k Z_k^T Z_k + delta I)^{-1} sum_k Z_k^T y_k``.

The rounds here go through the public round protocol (:func:`fedbayes.protocol.server_step`) with
every client in the cohort; the local solve is one Newton step on the client's objective (exact
for a quadratic), in float64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.flatten_util import ravel_pytree
from typer.testing import CliRunner

from fedbayes import gaussian, models, protocol
from fedbayes.algorithms.fedlap import client_penalty, fedlap
from fedbayes.algorithms.fedlap_cov import PrecisionOps, fedlap_cov
from fedbayes.algorithms.fedlap_cov import broadcast as cov_broadcast
from fedbayes.algorithms.fedlap_cov import client_step as cov_client_step
from fedbayes.algorithms.fedlap_cov import server_init as cov_server_init
from fedbayes.algorithms.fedlap_cov import server_step as cov_server_step
from fedbayes.cli import app
from fedbayes.config import schema as config
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.batches import ClientData, get_batch
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.curvature import data_curvature
from fedbayes.inference.sgd import LocalTrainer, training_info
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.runs.export import load_model
from fedbayes.runs.folder import read_metrics

SIZES = (7, 12, 5, 9)
DIM = 3
BATCH = max(SIZES)


def newton_solver(key, start, data, trainer, penalty):
    """The exact minimiser of ``mean loss + penalty`` for a quadratic: one Newton step."""
    x, y, m = get_batch(data, jnp.zeros((), jnp.int32), trainer.batch_size)
    flat, unravel = ravel_pytree(start)

    def f(z):
        p = unravel(z)
        return trainer.loss_fn(p, key, x, y, m) + penalty(p)

    z = flat - jnp.linalg.solve(jax.hessian(f)(flat), jax.grad(f)(flat))
    return unravel(z), training_info(f(z).astype(jnp.float32), 1)


class Problem:
    """A least-squares federation in float64 (build inside ``jax.enable_x64``)."""

    def __init__(self, seed=0, sizes=SIZES, dim=DIM):
        rng = np.random.default_rng(seed)
        self.model = make_model("linear", 1)
        self.apply_fn = lambda p, x: self.model.apply({"params": p}, x)
        self.trainer = LocalTrainer(loss_fn(self.model, "regression"), optax.sgd(0.1), 1, BATCH)
        params = init_params(self.model, jax.random.key(1), (dim,))
        self.params = jax.tree.map(lambda p: jnp.asarray(p, jnp.float64), params)
        true_w = rng.normal(size=dim)
        self.datas, zs, ys = [], [], []
        for k, n in enumerate(sizes):
            x = rng.normal(loc=0.3 * (k - 1.5), scale=0.5 + 0.2 * k, size=(n, dim)) / np.sqrt(n)  # heterogeneous clients
            y = x @ true_w + 0.3 * k + rng.normal(size=n)
            xp = np.zeros((BATCH, dim)), np.zeros(BATCH)
            xp[0][:n], xp[1][:n] = x, y
            order = np.arange(BATCH, dtype=np.int32)
            self.datas.append(ClientData(jnp.asarray(xp[0]), jnp.asarray(xp[1]), jnp.asarray(order), jnp.int32(0), jnp.int32(n)))
            zs.append(np.concatenate([x, np.ones((n, 1))], axis=1))
            ys.append(y)
        self.z, self.y = zs, ys

    def map(self, delta):
        a = sum(z.T @ z for z in self.z) + delta * np.eye(self.z[0].shape[1])
        return np.linalg.solve(a, sum(z.T @ y for z, y in zip(self.z, self.y)))

    def hessians(self):
        return [z.T @ z for z in self.z]


def flat_params(p) -> np.ndarray:
    """The linear model's parameters as ``[kernel..., bias]`` (the order of ``Z``'s columns)."""
    return np.concatenate([np.asarray(p["dense"]["kernel"]).ravel(), np.asarray(p["dense"]["bias"]).ravel()])


def run_rounds(alg, prob: Problem, rounds: int, on_round=None):
    """``rounds`` full-participation rounds through the round protocol; returns the server state,
    the client states and the server parameters after each round."""
    state = alg.server_init(jax.random.key(0), prob.params)
    cstates = [alg.client_init(prob.params) for _ in prob.datas]
    weights = jnp.asarray([float(d.num_examples) for d in prob.datas])
    update = jax.jit(alg.client_update)
    step = jax.jit(lambda s, m, w: protocol.server_step(jax.random.key(2), alg, s, m, w))
    history = []
    for r in range(rounds):
        message = alg.broadcast(state)
        outs = [update(jax.random.key(r), message, c, d) for c, d in zip(cstates, prob.datas)]
        msgs = jax.tree.map(lambda *xs: jnp.stack(xs), *[o[0] for o in outs])
        state, accepted, _ = step(state, msgs, weights)
        assert bool(jnp.all(accepted))
        cstates = [o[1] for o in outs]
        history.append(flat_params(alg.server_params(state)))
        if on_round is not None:
            on_round(state, cstates)
    return state, cstates, history


@pytest.mark.parametrize("delta, rho", [(7.0, 0.5), (20.0, 0.25)])
def test_fedlap_converges_to_the_exact_map(delta, rho):
    # (A delta far below the clients' curvature converges too, but slowly: docs/algorithms.md §9.)
    with jax.enable_x64(True):
        prob = Problem()
        alg = fedlap(prob.trainer, delta=delta, damping=rho, solver=newton_solver)
        _, cstates, history = run_rounds(alg, prob, 100)
        target = prob.map(delta)
        errors = [np.max(np.abs(h - target)) for h in history]
        assert errors[-1] < 1e-8 * max(1.0, np.max(np.abs(target)))
        assert errors[-1] < 1e-3 * errors[0]  # it moved there; round 1 is not the answer
        # The sites at the fixed point: v_k = -grad l_k(w_g) / delta.
        for cs, z, y in zip(cstates, prob.z, prob.y):
            np.testing.assert_allclose(flat_params(cs), -(z.T @ (z @ target - y)) / delta, atol=1e-7)


def test_fedlap_single_client_undamped_is_the_map_in_one_round():
    with jax.enable_x64(True):
        prob = Problem(sizes=(11,))
        alg = fedlap(prob.trainer, delta=2.0, damping=1.0, solver=newton_solver)
        _, _, history = run_rounds(alg, prob, 2)
        np.testing.assert_allclose(history[0], prob.map(2.0), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(history[1], history[0], rtol=1e-10, atol=1e-12)  # a fixed point


def test_fedlap_round_one_is_the_local_map_under_the_prior():
    # v_k = 0, w_g = 0: each client solves l_k + delta/2 ||w||^2; with rho the server sums rho w_k.
    with jax.enable_x64(True):
        prob = Problem()
        delta, rho = 3.0, 0.25
        alg = fedlap(prob.trainer, delta=delta, damping=rho, solver=newton_solver)
        _, _, history = run_rounds(alg, prob, 1)
        local = [np.linalg.solve(z.T @ z + delta * np.eye(DIM + 1), z.T @ y) for z, y in zip(prob.z, prob.y)]
        np.testing.assert_allclose(history[0], rho * sum(local), rtol=1e-10)


def test_fedlap_round_one_starts_from_the_initial_parameters_then_from_w_g():
    prob_params = {"w": jnp.asarray([1.0, -2.0])}
    trainer = LocalTrainer(lambda p, k, x, y, m: 0.0 * jnp.sum(p["w"]), optax.sgd(0.1), 1, 4)
    alg = fedlap(trainer, delta=1.0, damping=0.5)
    state = alg.server_init(jax.random.key(0), prob_params)
    np.testing.assert_array_equal(alg.server_params(state)["w"], [0.0, 0.0])  # the prior mean
    np.testing.assert_array_equal(alg.broadcast(state).start["w"], [1.0, -2.0])
    state = state._replace(params={"w": jnp.asarray([0.5, 0.5])}, round=jnp.int32(1))
    np.testing.assert_array_equal(alg.broadcast(state).start["w"], [0.5, 0.5])


def test_fedlap_penalty_is_the_site_terms_over_n():
    w, anchor, site = {"a": jnp.asarray([1.0, 2.0])}, {"a": jnp.asarray([0.5, -1.0])}, {"a": jnp.asarray([0.25, 0.5])}
    pen = client_penalty(anchor, site, delta=4.0, num_examples=jnp.int32(8))
    expected = 4.0 * (0.25 * 1.0 + 0.5 * 2.0 + 0.5 * (0.5**2 + 3.0**2)) / 8.0
    np.testing.assert_allclose(pen(w), expected, rtol=1e-6)
    extra = client_penalty(anchor, site, delta=4.0, num_examples=jnp.int32(8), extra=lambda p: jnp.sum(p["a"]))
    np.testing.assert_allclose(extra(w), expected + 3.0 / 8.0, rtol=1e-6)


@pytest.mark.parametrize("delta, rho", [(0.0, 0.1), (-1.0, 0.1), (1.0, 0.0), (1.0, 1.5)])
def test_fedlap_rejects_bad_settings(delta, rho):
    with pytest.raises(ValueError, match="fedlap: (delta|rho)"):
        fedlap(LocalTrainer(None, optax.sgd(0.1), 1, 1), delta=delta, damping=rho)


# ---------------------------------------------------------------------------------------------
# FedLap-Cov


def cov_algorithm(prob: Problem, *, delta, rho, curvature=None, init_precision="delta"):
    curvature = curvature or data_curvature(prob.apply_fn, task="regression", batch_size=BATCH)
    return fedlap_cov(prob.trainer, curvature, delta=delta, damping=rho, init_precision=init_precision, solver=newton_solver)


FULL = PrecisionOps(
    matvec=lambda p, x: p @ x,
    solve=lambda p, x: jnp.linalg.solve(p, x),
    scaled_identity=lambda params, c: c * jnp.eye(params.shape[0], dtype=params.dtype),
    at_least=lambda p, c: p,
)


def test_fedlap_cov_full_covariance_exact_hessians_undamped_is_the_map_in_one_round():
    # The same update functions with dense precisions over a flat parameter vector [kernel, bias].
    with jax.enable_x64(True):
        prob = Problem()

        def loss(p, key, x, y, m):
            r = x @ p[:DIM] + p[DIM] - y
            return jnp.sum(m * 0.5 * r**2) / jnp.maximum(jnp.sum(m), 1.0)

        trainer = prob.trainer._replace(loss_fn=loss)

        def hessian(p, data):  # exact Hessian of the sum loss
            x, y, m = get_batch(data, jnp.zeros((), jnp.int32), BATCH)
            return jax.hessian(lambda q: loss(q, None, x, y, m) * jnp.sum(m))(p)

        delta, rho = 1.3, 1.0
        params = jnp.asarray(np.random.default_rng(5).normal(size=DIM + 1))
        state = cov_server_init(params, delta, FULL)
        client = jax.jit(
            lambda m, site, data: cov_client_step(jax.random.key(0), m, site, data, trainer, damping=rho, curvature=hessian, ops=FULL, solver=newton_solver)[2]
        )
        sites = [DiagGaussian(precision_mean=jnp.zeros(DIM + 1), precision=jnp.zeros((DIM + 1, DIM + 1))) for _ in prob.datas]
        for r in range(2):
            message = cov_broadcast(state)
            new_sites = [client(message, site, data) for site, data in zip(sites, prob.datas)]
            total = jax.tree.map(lambda *xs: sum(xs), *[gaussian.difference(n, o) for n, o in zip(new_sites, sites)])
            state, sites = cov_server_step(state, total, delta, FULL), new_sites
            np.testing.assert_allclose(np.asarray(state.params), prob.map(delta), rtol=1e-9, atol=1e-11)  # round 1, and it stays
            np.testing.assert_allclose(np.asarray(state.q.precision), sum(prob.hessians()) + delta * np.eye(DIM + 1), rtol=1e-12)


def test_data_curvature_is_the_exact_diagonal_over_all_minibatches():
    with jax.enable_x64(True):
        prob = Problem()
        for batch_size in (4, BATCH):  # 2-3 minibatches, then one
            curv = data_curvature(prob.apply_fn, task="regression", batch_size=batch_size)
            for data, h in zip(prob.datas, prob.hessians()):
                np.testing.assert_allclose(flat_params(curv(prob.params, data)), np.diag(h), rtol=1e-10)


@pytest.mark.parametrize("rho", [1.0, 0.25])
def test_fedlap_cov_diagonal_ggn_converges_to_the_exact_map_with_valid_precisions(rho):
    delta = 7.0
    with jax.enable_x64(True):
        prob = Problem()
        alg = cov_algorithm(prob, delta=delta, rho=rho)

        def invariants(state, cstates):
            for leaf in jax.tree.leaves(state.q.precision):
                assert np.all(np.asarray(leaf) >= delta)
            for cs in cstates:
                for leaf in jax.tree.leaves(cs.precision):
                    assert np.all(np.asarray(leaf) >= 0)

        state, cstates, history = run_rounds(alg, prob, 80, on_round=invariants)
        target = prob.map(delta)
        assert np.max(np.abs(history[-1] - target)) < 1e-8
        # S_g = delta + sum_k V_k, and at the fixed point V_k = diag(H_k).
        np.testing.assert_allclose(flat_params(state.q.precision), delta + sum(np.diag(h) for h in prob.hessians()), rtol=1e-8)
        mean, var = alg.server_posterior(state)
        np.testing.assert_allclose(flat_params(var), 1.0 / flat_params(state.q.precision))
        np.testing.assert_array_equal(flat_params(mean), history[-1])


def test_fedlap_cov_gets_closer_than_fedlap_in_the_same_rounds():
    # The preconditioning is the point of the method (about 25 times closer here after 10 rounds).
    delta = 7.0
    with jax.enable_x64(True):
        prob = Problem()
        target = prob.map(delta)
        _, _, lap = run_rounds(fedlap(prob.trainer, delta=delta, damping=0.5, solver=newton_solver), prob, 10)
        _, _, cov = run_rounds(cov_algorithm(prob, delta=delta, rho=0.5), prob, 10)
        assert np.max(np.abs(cov[-1] - target)) < 0.1 * np.max(np.abs(lap[-1] - target))


def test_fedlap_cov_with_zero_curvature_is_fedlap():
    # H = 0: V_k = 0, S_g = delta, and v_cov = delta v_lap (docs/algorithms.md §9, §10).
    delta, rho = 3.0, 0.25
    with jax.enable_x64(True):
        prob = Problem()
        zero = lambda p, data: jax.tree.map(jnp.zeros_like, p)  # noqa: E731
        lap_state, lap_sites, lap = run_rounds(fedlap(prob.trainer, delta=delta, damping=rho, solver=newton_solver), prob, 6)
        cov_state, cov_sites, cov = run_rounds(cov_algorithm(prob, delta=delta, rho=rho, curvature=zero), prob, 6)
        for a, b in zip(lap, cov):
            np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-12)
        for ls, cs in zip(lap_sites, cov_sites):
            np.testing.assert_allclose(flat_params(cs.precision_mean), delta * flat_params(ls), rtol=1e-10, atol=1e-12)
            np.testing.assert_array_equal(flat_params(cs.precision), 0.0)
        np.testing.assert_array_equal(flat_params(cov_state.q.precision), delta)


def test_fedlap_cov_zero_initial_precision_is_the_reference_round_one():
    # Round 1 with S_g = 0: no prox term (local least squares), V_k = rho H_k, v_k = rho H_k w_k.
    delta, rho = 2.0, 0.5
    with jax.enable_x64(True):
        prob = Problem()
        alg = cov_algorithm(prob, delta=delta, rho=rho, init_precision="zero")
        state = alg.server_init(jax.random.key(0), prob.params)
        np.testing.assert_array_equal(flat_params(alg.broadcast(state).precision), 0.0)
        state, _, history = run_rounds(alg, prob, 1)
        local = [np.linalg.solve(h, z.T @ y) for h, z, y in zip(prob.hessians(), prob.z, prob.y)]
        hd = [np.diag(h) for h in prob.hessians()]
        s_g = delta + rho * sum(hd)
        np.testing.assert_allclose(history[0], rho * sum(d * w for d, w in zip(hd, local)) / s_g, rtol=1e-9)
        np.testing.assert_allclose(flat_params(alg.broadcast(state).precision), s_g, rtol=1e-12)
        # and the default sends delta in round 1
        default = cov_algorithm(prob, delta=delta, rho=rho)
        np.testing.assert_array_equal(flat_params(default.broadcast(default.server_init(jax.random.key(0), prob.params)).precision), delta)


def test_fedlap_cov_rejects_a_negative_curvature_and_keeps_the_server():
    with jax.enable_x64(True):
        prob = Problem()
        bad = lambda p, data: jax.tree.map(lambda x: -jnp.ones_like(x), p)  # noqa: E731
        alg = cov_algorithm(prob, delta=1.0, rho=0.5, curvature=bad)
        state = alg.server_init(jax.random.key(0), prob.params)
        message = alg.broadcast(state)
        update = jax.jit(alg.client_update)
        msgs = [update(jax.random.key(0), message, alg.client_init(prob.params), d)[0] for d in prob.datas]
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *msgs)
        new, accepted, _ = protocol.server_step(jax.random.key(1), alg, state, stacked, jnp.ones(len(SIZES)))
        assert not np.any(np.asarray(accepted))
        np.testing.assert_array_equal(flat_params(new.q.precision), flat_params(state.q.precision))


def test_fedlap_cov_settings_are_checked():
    with pytest.raises(ValueError, match="fedlap_cov: init_precision must be one of delta, zero"):
        fedlap_cov(LocalTrainer(None, optax.sgd(0.1), 1, 1), lambda p, d: p, delta=1.0, damping=0.5, init_precision="one")
    with pytest.raises(ValueError, match="fedlap_cov: rho"):
        fedlap_cov(LocalTrainer(None, optax.sgd(0.1), 1, 1), lambda p, d: p, delta=1.0, damping=2.0)


# ---------------------------------------------------------------------------------------------
# The MLP's activation, the config sections, and a short run of each method from the CLI


@pytest.mark.parametrize("activation, fn", [("relu", jax.nn.relu), ("sigmoid", jax.nn.sigmoid), ("tanh", jnp.tanh)])
def test_mlp_activation_is_the_hidden_nonlinearity(activation, fn):
    model = make_model("mlp", 3, hidden=(4,), activation=activation)
    params = init_params(model, jax.random.key(0), (5,))
    x = jax.random.normal(jax.random.key(1), (2, 5))
    h = fn(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"][None, :])
    expected = h @ params["output"]["kernel"] + params["output"]["bias"][None, :]
    np.testing.assert_allclose(model.apply({"params": params}, x), expected, rtol=1e-5, atol=1e-6)


def test_mlp_default_activation_is_relu_and_unchanged():
    x = jax.random.normal(jax.random.key(1), (3, 6))
    plain, relu = make_model("mlp", 4, hidden=(5,)), make_model("mlp", 4, hidden=(5,), activation="relu")
    params = init_params(plain, jax.random.key(0), (6,))
    np.testing.assert_array_equal(plain.apply({"params": params}, x), relu.apply({"params": params}, x))
    with pytest.raises(ValueError, match="activation: must be one of relu, sigmoid, tanh; got 'gelu'"):
        make_model("mlp", 4, activation="gelu")


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model": {"activation": "gelu"}}, "model.activation: Input should be 'relu', 'sigmoid' or 'tanh'"),
        ({"model": {"name": "logreg", "activation": "tanh"}}, "model.activation: only the mlp has a choice of activation; got 'tanh' with model 'logreg'"),
        ({"algorithm": {"name": "fedlap", "delta": 0}}, "algorithm.delta: Input should be greater than 0"),
        ({"algorithm": {"name": "fedlap", "rho": 1.5}}, "algorithm.rho: Input should be less than or equal to 1"),
        ({"algorithm": {"name": "fedlap_cov", "init_precision": "one"}}, "algorithm.init_precision: Input should be 'delta' or 'zero'"),
        ({"algorithm": {"name": "fedlap"}, "server": {"optimizer": "adam"}}, "server.optimizer: fedlap's server multiplies the clients' sites exactly"),
        ({"algorithm": {"name": "fedlap_cov"}, "server": {"lr": 0.5}}, "leave server.optimizer = 'sgd' and server.lr = 1; got 'sgd' with lr 0.5"),
    ],
)
def test_bad_settings_give_one_line_naming_the_field(raw, message):
    with pytest.raises(ConfigError) as exc:
        validate(raw)
    text = str(exc.value)
    assert "\n" not in text and message in text, text


def test_config_and_models_agree_on_activations():
    assert config.ACTIVATIONS == tuple(models.ACTIVATIONS)


CLI_CONFIG = """
name = "{name}"
rounds = 2
checkpoint_every = 0
[data]
dataset = "digits"
num_clients = 4
partition = "dirichlet"
[model]
{model}
[client]
optimizer = "adam"
lr = 0.01
batch_size = 64
[server]
clients_per_round = 3
[algorithm]
name = "{name}"
delta = 1.0
"""


MLP_SIGMOID = 'name = "mlp"\nhidden = [8]\nactivation = "sigmoid"'


@pytest.mark.parametrize("name, model", [("fedlap", MLP_SIGMOID), ("fedlap_cov", 'name = "logreg"')], ids=["fedlap", "fedlap_cov"])
def test_a_short_cli_run_writes_metrics_and_the_model(tmp_path, name, model):
    cfg = tmp_path / "c.toml"
    cfg.write_text(CLI_CONFIG.format(name=name, model=model))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["run", str(cfg), "--out", str(out)])
    assert res.exit_code == 0, res.output
    records = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in records] == [0, 1, 2]
    assert all(np.isfinite(r["accuracy"]) and np.isfinite(r["nll"]) for r in records)
    saved = load_model(out / "model.npz")
    layer = "hidden_0" if name == "fedlap" else "dense"
    kernel = saved["params"][layer]["kernel"]
    assert kernel.shape == ((64, 8) if name == "fedlap" else (64, 10)) and np.all(np.isfinite(kernel))
    if name == "fedlap":
        assert set(saved) == {"params"}  # q_g's variance is the fixed 1 / delta: nothing learned to export
        return
    assert "accuracy_marg" in records[-1]
    np.testing.assert_array_equal(saved["posterior_mean"][layer]["kernel"], kernel)
    var = saved["posterior_variance"][layer]["kernel"]
    assert np.all(var > 0) and np.all(var <= 1.0)  # 1 / S_g with S_g >= delta = 1
    assert np.any(var < 1.0)  # the clients' curvature is in it
    # by default the prior precision of the marginalised prediction is the Laplace marginal
    # likelihood's (model.npz keeps q_g as trained, at delta = 1)
    from fedbayes.evaluation.prior_precision import marglik_prior_precision

    chosen = marglik_prior_precision(saved["posterior_mean"], saved["posterior_variance"], 1.0)
    np.testing.assert_allclose(records[-1]["prior_precision_marg"], float(chosen), rtol=1e-5)
