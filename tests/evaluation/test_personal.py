"""Personalisation's evaluation (fedbayes.evaluation.personal): fine-tuning equals a plain loop of
optimizer steps over the same shuffles, the per-client scores, and the summary over clients."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes.evaluation.personal import client_scores, fine_tune, fine_tune_order, over_clients
from fedbayes.inference import LocalTrainer


def _softmax_loss(p, key, x, y, mask):
    del key
    logp = jax.nn.log_softmax(x @ p["w"] + p["b"][None, :])
    nll = -jnp.take_along_axis(logp, y[:, None], axis=1)[:, 0]
    return jnp.sum(mask * nll) / jnp.maximum(jnp.sum(mask), 1.0)


def test_fine_tune_equals_a_plain_loop_over_the_same_shuffles():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 5)).astype(np.float32)
    y = rng.integers(0, 3, 60).astype(np.int32)
    positions = np.sort(rng.choice(60, size=23, replace=False))  # 23 = 2 full batches of 10 and a partial one
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)) * 0.1, jnp.float32), "b": jnp.zeros(3, jnp.float32)}
    epochs, batch = 3, 10
    trainer = LocalTrainer(_softmax_loss, optax.sgd(0.1, momentum=0.9), epochs, batch)
    tuned = fine_tune(jax.random.key(0), params, jnp.asarray(x), jnp.asarray(y), positions, trainer, np.random.default_rng(7))

    # the plain loop: the same permutations, one optimizer step per (possibly partial) batch
    order_rng = np.random.default_rng(7)
    p, opt_state = params, trainer.optimizer.init(params)
    for _ in range(epochs):
        perm = order_rng.permutation(positions)
        for start in range(0, len(perm), batch):
            idx = perm[start : start + batch]
            grads = jax.grad(_softmax_loss)(p, None, jnp.asarray(x[idx]), jnp.asarray(y[idx]), jnp.ones(len(idx), jnp.float32))
            updates, opt_state = trainer.optimizer.update(grads, opt_state, p)
            p = optax.apply_updates(p, updates)
    # 1e-6: the same float32 steps, the partial batch summed over padded (masked) rows
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), tuned, p)
    assert not np.allclose(tuned["w"], params["w"])  # it moved


def test_fine_tune_order_lays_out_the_epochs_with_a_tail():
    positions = np.arange(10, 17)
    order = fine_tune_order(positions, 2, 4, np.random.default_rng(3))
    assert len(order) >= 2 * 7 + 4
    assert sorted(order[:7]) == list(positions) and sorted(order[7:14]) == list(positions)
    np.testing.assert_array_equal(order, fine_tune_order(positions, 2, 4, np.random.default_rng(3)))  # seeded


def test_client_scores_and_the_worst_tenth_of_clients():
    probs = np.array([[0.9, 0.1], [0.2, 0.8], [1.0, 0.0]])
    s = client_scores(probs, np.array([0, 0, 1]), num_bins=2)
    assert s["accuracy"] == pytest.approx(1 / 3)
    assert s["nll"] == pytest.approx((-math.log(0.9) - math.log(0.2) - math.log(1e-30)) / 3)
    assert 0 <= s["ece"] <= 1
    acc = over_clients([0.9, 0.5, 0.7, 0.8, 0.6, 0.95, 0.85, 0.75, 0.65, 0.55, 0.4], higher_is_better=True)
    assert acc["mean"] == pytest.approx(np.mean([0.9, 0.5, 0.7, 0.8, 0.6, 0.95, 0.85, 0.75, 0.65, 0.55, 0.4]))
    assert acc["worst10"] == pytest.approx((0.4 + 0.5) / 2)  # ceil(0.1 * 11) = 2 clients
    assert over_clients([1.0, 3.0, 2.0], higher_is_better=False)["worst10"] == 3.0  # one client at least: the highest NLL
