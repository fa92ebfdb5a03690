"""The VBNN's IVON client (fedbayes.algorithms.vbnn.run_ivon, algorithm.method = "ivon"): the
broadcast posterior round-trips through IVON's state, the client learns, and its log-variances
follow the data (spread within a layer), where Bayes-by-backprop with Adam moves them in lockstep."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_vbnn_run

from fedbayes.algorithms.vbnn import IVON_MINIBATCH, IVON_WHOLE_DATA, IVONClient, ivon_init, ivon_settings_for, resolve_client, run_ivon, vbnn
from fedbayes.data.batches import ClientData
from fedbayes.inference import LocalTrainer
from fedbayes.models import init_params, make_model
from fedbayes.models.variational import apply_with_key, split_variational


def _model():
    model = make_model("mlp", 3, variational=True, hidden=(4,))
    return model, init_params(model, jax.random.key(0), (5,))


def test_no_step_returns_the_broadcast_posterior():
    # h0 = 1 / (lambda sigma^2) - delta and back: a client without examples sends what it got
    model, params = _model()
    x = jnp.zeros((4, 5), jnp.float32)
    data = ClientData(x, jnp.zeros(4, jnp.int32), jnp.arange(4, dtype=jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32))
    new, info = run_ivon(jax.random.key(1), params, data, apply_with_key(model), IVONClient(), num_epochs=1, batch_size=2, total_examples=100)
    assert int(info["steps"]) == 0
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=2e-5), new, params)


def test_one_client_moves_every_leaf_and_keeps_the_structure():
    model, params = _model()
    x = jax.random.normal(jax.random.key(2), (16, 5), jnp.float32)
    y = (jnp.arange(16) % 3).astype(jnp.int32)
    data = ClientData(x, y, jnp.arange(16, dtype=jnp.int32), jnp.zeros((), jnp.int32), jnp.asarray(16, jnp.int32))
    run = jax.jit(lambda k, p: run_ivon(k, p, data, apply_with_key(model), IVONClient(), num_epochs=2, batch_size=8, total_examples=16))
    new, info = run(jax.random.key(3), params)
    assert int(info["steps"]) == 4 and np.isfinite(float(info["loss"]))
    assert jax.tree.structure(new) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert not np.allclose(np.asarray(a), np.asarray(b))


def _digits_run(method):
    from fedbayes.evaluation.variational import predictive_metrics

    apply, params, data = digits_vbnn_run(aggregation="cf", method=method)
    metrics = predictive_metrics(apply, params, jax.random.key(9), data.x_test, data.y_test)
    spread = {k: float(np.subtract(*np.quantile(np.asarray(v), [0.95, 0.05]))) for k, v in split_variational(params)[1].items()}
    return metrics, spread


def test_ivon_learns_digits_and_its_variances_spread():
    metrics, spread = _digits_run("ivon")
    assert metrics["accuracy"] > 0.8, metrics
    _, bbb = _digits_run("bbb")
    # the 5-95% spread of every layer's log-variances: the data's curvature per weight under IVON,
    # Adam's equal steps under Bayes-by-backprop (a few hundredths after 4 rounds)
    for name in spread:
        assert spread[name] > 0.2 and spread[name] > 5 * bbb[name], (name, spread, bbb)


def test_ivon_is_the_bayes_variant_only():
    from fedbayes.config.schema import RunConfig

    model, _ = _model()
    trainer = LocalTrainer(None, optax.sgd(0.1), 1, 4)
    with pytest.raises(ValueError, match="method"):
        vbnn(trainer, apply_with_key(model), variant="paper", method="ivon")
    with pytest.raises(ValueError, match="method"):
        vbnn(trainer, apply_with_key(model), total_examples=10, method="adam")
    cfg = RunConfig(algorithm={"name": "vbnn", "method": "ivon"}, model={"name": "mlp", "variational": True})
    assert cfg.algorithm.method == "ivon" and cfg.algorithm.ivon_samples is None  # unset: the batch's default
    assert ivon_settings_for(cfg.algorithm, "client") == IVON_MINIBATCH and ivon_settings_for(cfg.algorithm, "whole") == IVON_WHOLE_DATA
    given = RunConfig(algorithm={"name": "vbnn", "method": "ivon", "ivon_lr": 0.5, "ivon_samples": 4}, model={"name": "mlp", "variational": True})
    assert ivon_settings_for(given.algorithm, "whole") == IVON_WHOLE_DATA._replace(lr=0.5, samples=4)
    with pytest.raises(ValueError, match="algorithm.method"):
        RunConfig(algorithm={"name": "vbnn", "method": "ivon", "variant": "paper"}, model={"name": "mlp", "variational": True})
    with pytest.raises(ValueError, match="ivon_samples"):
        RunConfig(algorithm={"name": "vbnn", "method": "ivon", "ivon_samples": 3}, model={"name": "mlp", "variational": True})


@pytest.mark.parametrize(
    "method, batch, hidden, variant, resolved",
    [
        ("auto", "auto", False, "bayes", ("ivon", "whole")),
        ("auto", "auto", True, "bayes", ("bbb", "client")),
        ("auto", "auto", False, "paper", ("bbb", "client")),
        ("ivon", "auto", True, "bayes", ("ivon", "client")),
        ("ivon", "client", False, "bayes", ("ivon", "client")),
        ("ivon", "whole", True, "bayes", ("ivon", "whole")),
        ("bbb", "whole", False, "bayes", ("bbb", "client")),
    ],
)
def test_auto_client_is_whole_data_ivon_on_a_glm_and_bbb_on_a_network(method, batch, hidden, variant, resolved):
    assert resolve_client(method, batch, hidden, variant) == resolved


def _built(hidden, **algorithm):
    from fedbayes.algorithms.base import BuildContext, FederationInfo
    from fedbayes.algorithms.vbnn import build
    from fedbayes.config.schema import RunConfig

    cfg = RunConfig(algorithm={"name": "vbnn", **algorithm}, model={"name": "mlp", "variational": True, "hidden": list(hidden)})
    model = make_model("mlp", 3, variational=True, hidden=hidden)
    trainer = LocalTrainer(None, optax.sgd(0.05), 1, 32)
    ctx = BuildContext(trainer, optax.sgd(1.0), FederationInfo.from_sizes([12, 70, 41]), 3, keyed_apply_fn=apply_with_key(model), hidden_layers=bool(hidden))
    return build(cfg.algorithm, ctx)


def test_the_whole_data_step_scales_with_the_cohorts_share_of_the_clients():
    from fedbayes.config.schema import RunConfig

    hp = RunConfig(algorithm={"name": "vbnn"}, model={"name": "mlp", "variational": True}).algorithm
    assert ivon_settings_for(hp, "whole", 0.3).lr == pytest.approx(0.3 * IVON_WHOLE_DATA.lr)
    assert ivon_settings_for(hp, "whole", 1.0).lr == IVON_WHOLE_DATA.lr and ivon_settings_for(hp, "client", 0.3).lr == IVON_MINIBATCH.lr
    given = RunConfig(algorithm={"name": "vbnn", "ivon_lr": 0.2}, model={"name": "mlp", "variational": True}).algorithm
    assert ivon_settings_for(given, "whole", 0.3).lr == 0.2  # a given step is the step


def test_the_whole_data_client_steps_once_an_epoch_on_the_largest_clients_batch():
    glm, net = _built(()), _built((4,))
    assert glm.local_batch_size == 70 and glm.local_epochs == 1  # one step a round on every client
    assert net.local_batch_size == 32
    assert _built((), ivon_batch="client").local_batch_size == 32
    assert _built((), method="bbb").local_batch_size == 32


def _client_data(x, y, start, n, batch):
    order = jnp.arange(x.shape[0] + batch, dtype=jnp.int32) % x.shape[0]
    return ClientData(x, y, order, jnp.asarray(start, jnp.int32), jnp.asarray(n, jnp.int32))


def test_one_whole_data_step_a_round_combined_by_cf_is_the_pooled_ivon_step():
    """Module docstring of fedbayes.algorithms.vbnn: with the same draws, three clients' one
    whole-data IVON step each, combined by the bayes CF rule under FVBWA (beta_k = n_k / N), take
    the step of IVON on the pooled data: the same gradient (the means' step times the precision),
    the same bias, and the precision up to the second-order term of IVON's Hessian update."""
    from fedbayes.aggregators.variational import aggregate_params

    model = make_model("mlp", 2, variational=True, hidden=())
    apply = apply_with_key(model)
    sizes = (9, 30, 17)
    n = sum(sizes)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(n, 5)), jnp.float32)
    y = jnp.asarray((np.asarray(x) @ rng.normal(size=5) > 0).astype(np.int32))
    settings = IVON_WHOLE_DATA
    params = ivon_init(init_params(model, jax.random.key(0), (5,)), settings.hess_init, float(n))
    key = jax.random.key(7)  # every client draws what the pooled step draws

    def step(data, batch):
        new, _ = run_ivon(key, params, data, apply, settings, num_epochs=1, batch_size=batch, total_examples=n)
        return new

    starts = np.cumsum((0,) + sizes[:-1])
    messages = [step(_client_data(x, y, s, k, max(sizes)), max(sizes)) for s, k in zip(starts, sizes, strict=True)]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *messages)
    combined = aggregate_params("cf", stacked, jnp.asarray(sizes, jnp.float32) / n)
    pooled = step(_client_data(x, y, 0, n, n), n)
    means, log_vars, det = split_variational(params)
    c_means, c_logv, c_det = split_variational(combined)
    p_means, p_logv, p_det = split_variational(pooled)
    for name in means:
        # (m - m') / var' is alpha * lambda * (g + delta m): the step's gradient, pooled or combined
        grad_c = (np.asarray(means[name]) - np.asarray(c_means[name])) / np.exp(np.asarray(c_logv[name]))
        grad_p = (np.asarray(means[name]) - np.asarray(p_means[name])) / np.exp(np.asarray(p_logv[name]))
        np.testing.assert_allclose(grad_c, grad_p, rtol=2e-3, atol=1e-3 * np.abs(grad_p).max())
        np.testing.assert_allclose(np.asarray(c_logv[name]), np.asarray(p_logv[name]), atol=1e-2)
        assert not np.allclose(np.asarray(c_means[name]), np.asarray(means[name]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6), c_det, p_det)
