"""Small federations and models shared by the tests."""

from __future__ import annotations

import jax
import numpy as np
import optax
from sklearn.datasets import load_digits

from fedbayes.inference.sgd import LocalTrainer
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.simulate import Federation


def digits_federation(sizes=(37, 90, 213, 11, 150), seed=0) -> Federation:
    """Digits split into clients of the given (unequal) sizes."""
    d = load_digits()
    x = (d.images[..., None] / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    perm = np.random.default_rng(seed).permutation(len(x))[: sum(sizes)]
    parts = np.split(perm, np.cumsum(sizes)[:-1])
    return Federation(x, y, tuple(parts))


def logreg_setup(lr=0.1, epochs=2, batch_size=16, momentum=None):
    """A logistic-regression trainer on digits and its initial parameters."""
    model = make_model("logreg", 10)
    params = init_params(model, jax.random.key(1), (8, 8, 1))
    trainer = LocalTrainer(loss_fn(model, "classification"), optax.sgd(lr, momentum=momentum), epochs, batch_size)
    return model, params, trainer
