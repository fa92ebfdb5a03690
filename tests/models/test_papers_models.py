"""The federated benchmarks' models (fedbayes.models.papers): parameter counts against the papers
(shapes only, ``jax.eval_shape``), preprocessing, and the multi-label and next-word losses."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.models.papers import central_crop, per_image_standardization, random_crop_flip


def _count(model, shape):
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, *shape), jnp.float32)))
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))


@pytest.mark.parametrize(
    "name, classes, shape, paper",
    [
        ("emnist_cnn", 62, (28, 28, 1), 1.2e6),  # Al-Shedivat et al. 2021 / Guo et al. 2023: "1.2M"
        ("resnet18_gn", 100, (32, 32, 3), 11.2e6),  # Guo et al. 2023: "11.2M"
        ("lstm_nwp", 10_004, (20,), 4_050_748),  # Reddi et al. 2021's count for the StackOverflow LSTM
        ("logreg", 500, (10_000,), 5.0e6),  # Guo et al. 2023: "5.0M"
    ],
)
def test_parameter_counts_match_the_papers(name, classes, shape, paper):
    count = _count(make_model(name, classes), shape)
    assert abs(count - paper) / paper < 0.01, count


def test_exact_counts():
    assert _count(make_model("emnist_cnn", 62), (28, 28, 1)) == 1_206_590
    assert _count(make_model("resnet18_gn", 100), (32, 32, 3)) == 11_227_812


def test_preprocessing_matches_tensorflows_definitions():
    x = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 32, 32, 3)).astype(np.float32))
    crop = central_crop(x, 24)
    np.testing.assert_array_equal(crop, x[:, 4:28, 4:28])
    z = per_image_standardization(crop)
    np.testing.assert_allclose(np.mean(np.asarray(z), axis=(1, 2, 3)), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.std(np.asarray(z), axis=(1, 2, 3)), 1.0, rtol=1e-4)
    flat = per_image_standardization(jnp.ones((1, 4, 4, 3)))  # std 0: divided by 1/sqrt(48), not 0
    assert np.all(np.isfinite(flat)) and np.all(flat == 0)
    rand = random_crop_flip(jax.random.key(1), x, 24)
    assert rand.shape == (2, 24, 24, 3)
    # each random crop is a 24x24 window of its image, possibly mirrored
    img = np.asarray(x[0])
    windows = [img[i : i + 24, j : j + 24] for i in range(9) for j in range(9)]
    r = np.asarray(rand[0])
    assert any(np.array_equal(r, w) or np.array_equal(r, w[:, ::-1]) for w in windows)


def test_resnet_trains_on_random_crops_and_evaluates_on_central_ones():
    model = make_model("resnet18_gn", 5, width=4)
    params = init_params(model, jax.random.key(0), (32, 32, 3))
    x = jnp.asarray(np.random.default_rng(1).integers(0, 256, (3, 32, 32, 3)).astype(np.float32))
    np.testing.assert_allclose(model.apply({"params": params}, x), model.apply({"params": params}, central_crop(x, 24)), rtol=1e-6)
    a = model.training_apply(params, jax.random.key(1), x)
    b = model.training_apply(params, jax.random.key(2), x)
    assert a.shape == (3, 5) and not np.allclose(a, b)


def test_emnist_cnn_drops_out_only_in_training():
    model = make_model("emnist_cnn", 62)
    params = init_params(model, jax.random.key(0), (28, 28, 1))
    x = jnp.asarray(np.random.default_rng(2).random((2, 28, 28, 1), dtype=np.float32))
    det = model.apply({"params": params}, x)
    assert not np.allclose(model.training_apply(params, jax.random.key(3), x), det)
    loss = loss_fn(model, "classification")
    y, m = jnp.array([1, 2]), jnp.ones(2)
    assert loss(params, jax.random.key(3), x, y, m) != loss(params, jax.random.key(4), x, y, m)


def test_multilabel_loss_is_the_mean_sigmoid_cross_entropy():
    model = make_model("logreg", 3)
    params = init_params(model, jax.random.key(0), (4,))
    x = jnp.asarray(np.random.default_rng(3).random((5, 4), dtype=np.float32))
    y = jnp.asarray(np.random.default_rng(4).integers(0, 2, (5, 3)).astype(np.float32))
    mask = jnp.array([1.0, 1.0, 1.0, 0.0, 0.0])
    z = np.asarray(model.apply({"params": params}, x), np.float64)
    p = 1 / (1 + np.exp(-z))
    bce = -(np.asarray(y) * np.log(p) + (1 - np.asarray(y)) * np.log(1 - p)).mean(axis=1)
    np.testing.assert_allclose(loss_fn(model, "multilabel")(params, None, x, y, mask), bce[:3].mean(), rtol=1e-5)


def test_next_word_loss_ignores_padding_targets():
    model = make_model("lstm_nwp", 7, hidden=6, embed_dim=4)
    params = init_params(model, jax.random.key(0), (5,))
    x = jnp.array([[4, 1, 2, 0, 0], [4, 3, 3, 3, 3]], jnp.int32)
    y = jnp.array([[1, 2, 5, 0, 0], [3, 3, 3, 3, 3]], jnp.int32)
    logits = np.asarray(model.apply({"params": params}, x), np.float64)
    assert logits.shape == (2, 5, 7)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(y)[..., None], -1)[..., 0]
    real = np.asarray(y) != 0
    want = ce[real].mean()  # over the 8 non-padding target tokens
    np.testing.assert_allclose(loss_fn(model, "next_word")(params, None, x, y, jnp.ones(2)), want, rtol=1e-5)
    only_first = loss_fn(model, "next_word")(params, None, x, y, jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(only_first, ce[0, :3].mean(), rtol=1e-5)
