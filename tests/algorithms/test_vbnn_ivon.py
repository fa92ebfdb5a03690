"""The VBNN's IVON client (fedbayes.algorithms.vbnn.run_ivon, algorithm.method = "ivon"): the
broadcast posterior round-trips through IVON's state, the client learns, and its log-variances
follow the data (spread within a layer), where Bayes-by-backprop with Adam moves them in lockstep."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import digits_vbnn_run

from fedbayes.algorithms.vbnn import IVONClient, run_ivon, vbnn
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
    assert cfg.algorithm.method == "ivon" and cfg.algorithm.ivon_samples == IVONClient().samples
    with pytest.raises(ValueError, match="algorithm.method"):
        RunConfig(algorithm={"name": "vbnn", "method": "ivon", "variant": "paper"}, model={"name": "mlp", "variational": True})
    with pytest.raises(ValueError, match="ivon_samples"):
        RunConfig(algorithm={"name": "vbnn", "method": "ivon", "ivon_samples": 3}, model={"name": "mlp", "variational": True})
