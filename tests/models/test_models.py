"""Tests for fedbayes.models: shapes, parameter counts, jit/vmap, factory errors, masked loss."""

import functools
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes.models import (
    CNN,
    MLP,
    MODELS,
    LinearRegression,
    LogisticRegression,
    init_params,
    loss_fn,
    make_model,
)

NUM_CLASSES = 10
FEATURE_SHAPES = [(28, 28, 1), (8, 8, 1), (30,)]
IMAGE_SHAPES = [(28, 28, 1), (8, 8, 1)]


def _random_params(model, feature_shape, seed=0):
    """Random parameters with init_params' structure, shapes and dtypes, drawn with NumPy.

    Compiling JAX's initialisers for every distinct shape dominates this file's run time, and
    tests of output shapes, vmap and masking do not need them (init_params is tested below).
    """
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(0.1 * rng.standard_normal(s.shape), s.dtype),
        _param_shapes(model, feature_shape),
    )


@functools.cache
def _model_and_params(name, feature_shape):
    model = make_model(name, NUM_CLASSES)
    return model, _random_params(model, feature_shape)


def _param_shapes(model, feature_shape):
    """Parameter shapes without running the initialisers."""
    return jax.eval_shape(lambda k: init_params(model, k, feature_shape), jax.random.key(0))


def _num_params(params):
    return sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))


def _inputs(seed, feature_shape, batch=5):
    # NumPy, not jax.random: no per-shape compilation.
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((batch, *feature_shape)), jnp.float32)


def _cases():
    """(name, feature_shape) pairs on which each model is defined."""
    for name in MODELS[:4]:  # the benchmarks' models have fixed input kinds: tests/models/test_papers_models.py
        for shape in FEATURE_SHAPES:
            if name == "cnn" and len(shape) != 3:
                continue
            yield name, shape


def test_models_tuple():
    assert MODELS == ("logreg", "mlp", "cnn", "linear", "emnist_cnn", "resnet18_gn", "lstm_nwp")


@pytest.mark.parametrize(("name", "feature_shape"), list(_cases()))
def test_output_shape_and_dtype(name, feature_shape):
    model, params = _model_and_params(name, feature_shape)
    out = model.apply({"params": params}, _inputs(1, feature_shape))
    expected = (5,) if name == "linear" else (5, NUM_CLASSES)
    assert out.shape == expected
    assert out.dtype == jnp.float32
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    assert np.all(np.isfinite(out))


def test_factory_classes():
    assert isinstance(make_model("logreg", 3), LogisticRegression)
    assert isinstance(make_model("mlp", 3), MLP)
    assert isinstance(make_model("cnn", 3), CNN)
    assert isinstance(make_model("linear", 3), LinearRegression)


def test_init_params_is_params_collection_only():
    params = _param_shapes(make_model("logreg", 4), (30,))
    assert set(params) == {"dense"}
    assert params["dense"]["kernel"].shape == (30, 4)
    assert params["dense"]["bias"].shape == (4,)


def test_init_params_structure_and_dtype():
    # The cheapest model to compile: init_params' logic does not depend on the architecture,
    # whose shapes are checked (without running initialisers) in the tests above.
    model = make_model("logreg", NUM_CLASSES)
    params = init_params(model, jax.random.key(0), (8, 8, 1))
    expected = _param_shapes(model, (8, 8, 1))
    assert jax.tree.structure(params) == jax.tree.structure(expected)
    for p, e in zip(jax.tree.leaves(params), jax.tree.leaves(expected), strict=True):
        assert p.shape == e.shape
        assert p.dtype == jnp.float32
        assert np.all(np.isfinite(p))


def test_init_params_accepts_raw_and_typed_keys():
    # The configuration of test_init_params_structure_and_dtype: compiled once for both tests.
    model = make_model("logreg", NUM_CLASSES)
    typed = init_params(model, jax.random.key(0), (8, 8, 1))
    # A raw uint32 key traces too (shapes only: running it would compile a second program).
    raw = jax.eval_shape(lambda k: init_params(model, k, (8, 8, 1)), jax.random.PRNGKey(0))
    assert jax.tree.structure(typed) == jax.tree.structure(raw)
    # Different keys give different initialisations (the key is really used).
    other = init_params(model, jax.random.key(1), (8, 8, 1))
    assert not np.array_equal(typed["dense"]["kernel"], other["dense"]["kernel"])


_INIT_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from fedbayes.models import init_params, make_model
model = make_model("mlp", 10, hidden=(16,))
fast = init_params(model, jax.random.key(3), (8, 8, 1))
default = jax.jit(lambda k: model.init(k, jnp.zeros((1, 8, 8, 1), jnp.float32)))(jax.random.key(3))["params"]
for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(default), strict=True):
    np.testing.assert_array_equal(a, b)
print("ok")
"""


def test_init_params_fast_compile_is_bit_identical_to_default_compile():
    # init_params compiles at LLVM -O1 for a faster start-up; the parameters must be exactly what
    # the default compile gives (every experiment's starting point). In a process of its own: the
    # suite compiles with XLA's optimisations off (tests/conftest.py), a user's run does not.
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", _INIT_CHECK], capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_mlp_parameter_count_seed_001():
    params = _model_and_params("mlp", (784,))[1]
    assert _num_params(params) == 784 * 200 + 200 + 200 * 100 + 100 + 100 * 10 + 10
    # Image inputs are flattened: the same count on 28x28x1.
    assert _num_params(_model_and_params("mlp", (28, 28, 1))[1]) == _num_params(params)


def test_mlp_custom_hidden():
    model = make_model("mlp", 4, hidden=[16, 8, 6])
    assert model.hidden == (16, 8, 6)
    params = _param_shapes(model, (30,))
    assert [params[f"hidden_{i}"]["kernel"].shape for i in range(3)] == [(30, 16), (16, 8), (8, 6)]
    assert params["output"]["kernel"].shape == (6, 4)


def test_linear_models_parameter_count():
    assert _num_params(_model_and_params("logreg", (28, 28, 1))[1]) == 784 * 10 + 10
    assert _num_params(_model_and_params("linear", (30,))[1]) == 30 + 1


def _lenet_count(in_channels, flat):
    conv = 5 * 5 * in_channels * 6 + 6 + 5 * 5 * 6 * 16 + 16
    return conv + flat * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10


def test_cnn_valid_padding_is_the_paper_network():
    # Ozer et al. 2022 (VBNN aggregation) App.: linear layers of 400, 120, 84 on 32x32x3 with unpadded 5x5 convolutions.
    # Shapes only (jax.eval_shape): no need to run the initialisers.
    model = make_model("cnn", 10, padding="VALID")
    params = _param_shapes(model, (32, 32, 3))
    assert params["dense_0"]["kernel"].shape == (400, 120)
    assert _num_params(params) == _lenet_count(3, 400) == 62006
    params = _param_shapes(model, (28, 28, 1))
    assert params["dense_0"]["kernel"].shape == (16 * 4 * 4, 120)


@pytest.mark.parametrize(("feature_shape", "side"), [((28, 28, 1), 7), ((8, 8, 1), 2)])
def test_cnn_same_padding_shapes(feature_shape, side):
    params = _model_and_params("cnn", feature_shape)[1]
    assert params["conv_0"]["kernel"].shape == (5, 5, 1, 6)
    assert params["conv_1"]["kernel"].shape == (5, 5, 6, 16)
    assert params["dense_0"]["kernel"].shape == (16 * side * side, 120)
    assert params["dense_1"]["kernel"].shape == (120, 84)
    assert params["output"]["kernel"].shape == (84, 10)
    assert _num_params(params) == _lenet_count(1, 16 * side * side)


def test_cnn_accepts_images_without_channel_axis():
    model, params = _model_and_params("cnn", (8, 8, 1))
    x = _inputs(2, (8, 8))
    np.testing.assert_array_equal(model.apply({"params": params}, x), model.apply({"params": params}, x[..., None]))


def test_cnn_rejects_flat_inputs(key):
    with pytest.raises(ValueError, match="images"):
        _param_shapes(make_model("cnn", 10), (30,))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_jit_and_vmap_over_stacked_params(name):
    feature_shape = (8, 8, 1)
    model = make_model(name, NUM_CLASSES)
    members = [_random_params(model, feature_shape, seed) for seed in range(3)]
    stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *members)
    x = _inputs(4, feature_shape)

    def apply(params, x):
        return model.apply({"params": params}, x)

    batched = jax.jit(jax.vmap(apply, in_axes=(0, None)))(stacked, x)
    assert batched.shape == (3, 5, NUM_CLASSES)
    for i, params in enumerate(members):
        # Batched and unbatched convolutions/matmuls may use different XLA kernels.
        np.testing.assert_allclose(batched[i], apply(params, x), rtol=1e-5, atol=1e-6)
    # The members differ, so a broadcast bug (same output for all) would fail here.
    assert not np.allclose(batched[0], batched[1])


def test_make_model_errors():
    with pytest.raises(ValueError, match="logreg, mlp, cnn, linear"):
        make_model("resnet", 10)
    with pytest.raises(ValueError, match="num_classes"):
        make_model("logreg", 1)
    with pytest.raises(TypeError):
        make_model("logreg", 10, hidden=(5,))


# ------------------------------------------------------------------------------------------------
# loss_fn
# ------------------------------------------------------------------------------------------------

LOSS_CASES = [
    ("logreg", "classification", (30,)),
    ("mlp", "classification", (30,)),
    ("cnn", "classification", (8, 8, 1)),
    ("linear", "regression", (30,)),
]


def _batch(seed, task, feature_shape, batch=6):
    x = _inputs(seed, feature_shape, batch)
    rng = np.random.default_rng(seed + 1000)
    if task == "classification":
        y = jnp.asarray(rng.integers(0, NUM_CLASSES, batch), jnp.int32)
    else:
        y = jnp.asarray(rng.standard_normal(batch), jnp.float32)
    return x, y


@pytest.mark.parametrize(("name", "task", "feature_shape"), LOSS_CASES)
def test_loss_all_ones_mask_is_plain_mean(name, task, feature_shape):
    model, params = _model_and_params(name, feature_shape)
    x, y = _batch(5, task, feature_shape)
    out = model.apply({"params": params}, x)
    if task == "classification":
        expected = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(out, y))
    else:
        expected = jnp.mean(0.5 * (out - y) ** 2)
    loss = loss_fn(model, task)(params, jax.random.key(0), x, y, jnp.ones((6,), jnp.float32))
    # float32 sum-then-divide vs mean: a few ulps.
    np.testing.assert_allclose(loss, expected, rtol=1e-6)


@pytest.mark.parametrize(("name", "task", "feature_shape"), LOSS_CASES)
def test_loss_mask_ignores_padding(name, task, feature_shape):
    model, params = _model_and_params(name, feature_shape)
    keyed = loss_fn(model, task)
    f = jax.jit(jax.value_and_grad(lambda p, x, y, m: keyed(p, jax.random.key(0), x, y, m)))
    x, y = _batch(6, task, feature_shape)
    mask = jnp.array([1, 1, 0, 1, 1, 0], jnp.float32)
    valid = np.flatnonzero(np.asarray(mask))

    loss, grad = f(params, x, y, mask)
    # Different finite features and arbitrary (even out-of-range) labels in the padded rows.
    x2 = x.at[2].set(100.0).at[5].set(-3.0)
    y2 = y.at[2].set(99).at[5].set(-1) if task == "classification" else y.at[2].set(1e3)
    loss2, grad2 = f(params, x2, y2, mask)
    np.testing.assert_array_equal(loss2, loss)
    jax.tree.map(np.testing.assert_array_equal, grad2, grad)
    # The mask really selects rows: masking out a different row changes the loss.
    other = f(params, x, y, jnp.array([0, 1, 1, 1, 1, 0], jnp.float32))[0]
    assert not np.isclose(other, loss)

    # Equals the plain mean over the valid rows alone. Masking is model-independent, so the
    # costly compilation of the CNN's gradient for a second batch size is skipped.
    if name == "cnn":
        return
    loss3, grad3 = f(params, x[valid], y[valid], jnp.ones((valid.size,), jnp.float32))
    # Different batch size: different summation order in float32.
    np.testing.assert_allclose(loss3, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), grad3, grad)


def test_loss_all_padding_is_zero():
    model, params = _model_and_params("logreg", (30,))
    x, y = _batch(7, "classification", (30,))
    value, grad = jax.jit(jax.value_and_grad(loss_fn(model, "classification")))(params, jax.random.key(0), x, y, jnp.zeros((6,), jnp.float32))
    assert value == 0.0
    assert all(np.all(g == 0) for g in jax.tree.leaves(grad))


def test_loss_regression_golden_number():
    # Hand-computed: a model with w = 0, b = 0 predicts 0; loss = 0.5 * mean(y^2) over valid rows.
    model = make_model("linear", 0)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _param_shapes(model, (3,)))
    x = jnp.ones((3, 3), jnp.float32)
    y = jnp.array([1.0, 2.0, 50.0], jnp.float32)
    loss = loss_fn(model, "regression")(params, jax.random.key(0), x, y, jnp.array([1.0, 1.0, 0.0], jnp.float32))
    assert loss == pytest.approx(0.5 * (1.0 + 4.0) / 2)


def test_loss_fn_unknown_task():
    with pytest.raises(ValueError, match="classification, regression"):
        loss_fn(make_model("logreg", 3), "ranking")


def test_modules_are_flax_modules():
    assert all(isinstance(make_model(n, 3), nn.Module) for n in MODELS)


def test_a_network_has_hidden_layers_and_a_glm_has_not():
    from fedbayes.models import has_hidden_layers

    for name, shape, hidden in (("logreg", (8, 8, 1), False), ("linear", (5,), False), ("mlp", (8, 8, 1), True), ("cnn", (8, 8, 1), True)):
        model = make_model(name, 10)
        assert has_hidden_layers(init_params(model, jax.random.key(0), shape)) is hidden, name
    # a variational weight's mean and log-variance are one weight: the linear VBNN is a GLM
    for hidden_sizes, hidden in (((), False), ((4,), True)):
        model = make_model("mlp", 3, variational=True, hidden=hidden_sizes)
        assert has_hidden_layers(init_params(model, jax.random.key(0), (5,))) is hidden, hidden_sizes


def test_a_linear_softmax_starts_centred_over_its_classes():
    """The logits' common shift, which no data determine, starts at its posterior mean (0): the
    weights of each input sum to 0 over the classes; a network's output layer keeps its draws."""
    from fedbayes.models.logreg import centred_over_classes

    kernel = init_params(make_model("logreg", 4), jax.random.key(0), (6,))["dense"]["kernel"]
    np.testing.assert_allclose(np.asarray(kernel).sum(axis=-1), 0.0, atol=1e-6)
    assert float(np.std(np.asarray(kernel))) > 0.1  # still random, of the LeCun scale
    linear_vbnn = init_params(make_model("mlp", 4, variational=True, hidden=()), jax.random.key(0), (6,))
    np.testing.assert_allclose(np.asarray(linear_vbnn["output"]["kernel_mean"]).sum(axis=-1), 0.0, atol=1e-6)
    network = init_params(make_model("mlp", 4, variational=True, hidden=(5,)), jax.random.key(0), (6,))
    assert float(np.abs(np.asarray(network["output"]["kernel_mean"]).sum(axis=-1)).max()) > 1e-3
    base = jax.nn.initializers.normal(1.0)
    draw, centred = base(jax.random.key(1), (3, 2)), centred_over_classes(base)(jax.random.key(1), (3, 2))
    np.testing.assert_allclose(centred, draw - draw.mean(axis=-1, keepdims=True), rtol=1e-6)
