"""Convolutions as patches plus a dot (fedbayes.models.conv) against XLA's convolution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.models import init_params, make_model
from fedbayes.models.conv import patch_conv


def _xla_conv(x, k, padding):
    return jax.lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=("NHWC", "HWIO", "NHWC"))


@given(
    st.integers(1, 3),  # batch
    st.integers(3, 9),  # height
    st.integers(3, 9),  # width
    st.integers(1, 3),  # in channels
    st.integers(1, 4),  # features
    st.sampled_from([(1, 1), (2, 3), (3, 3), (5, 5), (3, 2)]),
    st.sampled_from(["SAME", "VALID"]),
    st.integers(0, 2**16),
)
def test_patch_conv_equals_xla(batch, height, width, cin, features, window, padding, seed):
    kh, kw = window
    if padding == "VALID" and (kh > height or kw > width):
        return
    kx, kk = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (batch, height, width, cin))
    k = jax.random.normal(kk, (kh, kw, cin, features))
    want = _xla_conv(x, k, padding)
    got = patch_conv(x, k, padding)
    assert got.shape == want.shape
    # float32 reassociation of a sum of at most 75 products of unit-scale terms.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_patch_conv_gradients_equal_xla():
    kx, kk = jax.random.split(jax.random.key(1))
    x = jax.random.normal(kx, (4, 8, 8, 2))
    k = jax.random.normal(kk, (5, 5, 2, 3))
    for padding in ("SAME", "VALID"):
        f = lambda x, k, conv: jnp.sum(jnp.sin(conv(x, k, padding)))  # noqa: E731
        got = jax.grad(f, argnums=(0, 1))(x, k, patch_conv)
        want = jax.grad(f, argnums=(0, 1))(x, k, _xla_conv)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_patch_conv_rejects_bad_input():
    x = jnp.zeros((1, 4, 4, 2))
    with pytest.raises(ValueError, match="padding"):
        patch_conv(x, jnp.zeros((3, 3, 2, 1)), "FULL")
    with pytest.raises(ValueError, match="input channels"):
        patch_conv(x, jnp.zeros((3, 3, 1, 1)), "SAME")
    with pytest.raises(ValueError, match="at least"):
        patch_conv(x, jnp.zeros((5, 5, 2, 1)), "VALID")


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
def test_cnn_patches_same_parameters_and_outputs_as_nn_conv(padding):
    patches = make_model("cnn", 10, padding=padding)
    xla = make_model("cnn", 10, padding=padding, conv="xla")
    p1 = init_params(patches, jax.random.key(0), (28, 28, 1))
    p2 = init_params(xla, jax.random.key(0), (28, 28, 1))
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    x = jax.random.normal(jax.random.key(2), (3, 28, 28, 1))
    np.testing.assert_allclose(patches.apply({"params": p1}, x), xla.apply({"params": p1}, x), rtol=1e-5, atol=1e-5)


def test_cnn_rejects_unknown_conv():
    with pytest.raises(ValueError, match="conv must be one of"):
        init_params(make_model("cnn", 10, conv="fft"), jax.random.key(0), (8, 8, 1))
