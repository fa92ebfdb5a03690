"""FedLap (docs/algorithms.md §9) on least-squares clients with exact local solves
(``least_squares.py``), where the target is known in closed form: the MAP of
``sum_k l_k(w) + delta/2 ||w||^2``. FedLap-Cov's tests are in test_fedlap_cov.py.

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
from least_squares import DIM, Problem, flat_params, newton_solver, run_rounds
from typer.testing import CliRunner

from fedbayes import models
from fedbayes.algorithms.fedlap import client_penalty, fedlap
from fedbayes.cli import app
from fedbayes.config import schema as config
from fedbayes.config.schema import ConfigError, validate
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.models import init_params, make_model
from fedbayes.runs.export import load_model
from fedbayes.runs.folder import read_metrics


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
