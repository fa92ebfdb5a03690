"""fedbayes.inference.curvature against brute-force references (float64).

References: squares of per-example ``vmap(grad)`` (Fisher flavours, with the same labels) and the
explicit ``J^T H J`` from ``jax.jacfwd`` (GGN).
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedbayes.inference import curvature as cv
from fedbayes.models import init_params, make_model
from fedbayes.models.layers import find_layers

RTOL = 1e-5
MODELS = {
    "logreg": ("logreg", (5,), {}),
    "mlp": ("mlp", (6,), {"hidden": (7, 5)}),
    "cnn": ("cnn", (8, 8, 1), {}),
    "cnn_valid": ("cnn", (16, 16, 2), {"padding": "VALID"}),
    "linear": ("linear", (4,), {}),
}
NUM_CLASSES = 3


# How far the parameters move from the initialisation: the unpadded CNN's logits saturate at 0.3
# (softmax probabilities 1 - 1e-16, a GGN of 1e-33 that no float64 reference resolves).
NOISE = {"cnn_valid": 0.05}


def _setup(name, batch, seed, noise=None):
    noise = NOISE.get(name, 0.3) if noise is None else noise
    model_name, feature_shape, kwargs = MODELS[name]
    model = make_model(model_name, NUM_CLASSES, **kwargs)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), init_params(model, jax.random.key(seed), feature_shape))
    # move away from the initialisation so that every layer carries signal
    params = jax.tree.map(lambda a, k: a + noise * jax.random.normal(k, a.shape, a.dtype), params, _keys_like(jax.random.key(seed + 1), params))
    apply = lambda p, x: model.apply({"params": p}, x)
    task = "regression" if model_name == "linear" else "classification"
    x = jax.random.normal(jax.random.key(seed + 2), (batch, *feature_shape), jnp.float64)
    if task == "classification":
        y = jax.random.randint(jax.random.key(seed + 3), (batch,), 0, NUM_CLASSES)
    else:
        y = jax.random.normal(jax.random.key(seed + 3), (batch,), jnp.float64)
    return apply, params, x, y, task


def _keys_like(key, tree):
    leaves, treedef = jax.tree.flatten(tree)
    return jax.tree.unflatten(treedef, list(jax.random.split(key, len(leaves))))


def _loss_one(apply, task):
    def loss(p, xn, yn):
        out = apply(p, xn[None])[0]
        if task == "classification":
            return -jax.nn.log_softmax(out)[yn]
        return 0.5 * jnp.square(out - yn)

    return loss


def _ref_squares(apply, params, x, y, mask, task):
    grads = jax.vmap(jax.grad(_loss_one(apply, task)), in_axes=(None, 0, 0))(params, x, y)
    return jax.tree.map(lambda g: jnp.einsum("b...,b->...", jnp.square(g), mask), grads)


def _ref_ggn(apply, params, x, mask, task):
    jac = jax.vmap(lambda xn: jax.jacfwd(lambda q: apply(q, xn[None])[0])(params))(x)
    out = apply(params, x)
    if task == "classification":
        p = jax.nn.softmax(out)
        h = jax.vmap(lambda q: jnp.diag(q) - jnp.outer(q, q))(p)
        return jax.tree.map(lambda j: jnp.einsum("bc...,bcd,bd...,b->...", j, h, j, mask), jac)
    return jax.tree.map(lambda j: jnp.einsum("b...,b...,b->...", j, j, mask), jac)


def _assert_close(got, ref, rtol=RTOL):
    assert jax.tree.structure(got) == jax.tree.structure(ref)
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype, path
        scale = float(jnp.max(jnp.abs(r)))
        assert scale > 0, f"reference is zero at {path}: the test would not check anything"
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= rtol * scale, f"{path}: max error {err:.3g} against scale {scale:.3g}"


BATCH = 5  # fixed shapes: one compilation per model and function, hypothesis varies masks and values
masks = st.lists(st.booleans(), min_size=BATCH, max_size=BATCH).filter(any)


@functools.cache
def _compiled(name):
    """Jitted engine and references for one model (compiled once, reused by every example)."""
    apply, _, _, _, task = _setup(name, BATCH, 0)
    return {
        "empirical": jax.jit(lambda p, x, y, m: cv.diag_empirical_fisher(apply, p, x, y, m, task=task)),
        "ggn": jax.jit(lambda p, x, m: cv.diag_ggn(apply, p, x, None, m, task=task)),
        "ref_squares": jax.jit(lambda p, x, y, m: _ref_squares(apply, p, x, y, m, task)),
        "ref_ggn": jax.jit(lambda p, x, m: _ref_ggn(apply, p, x, m, task)),
    }


# The CNNs' float64 references cost seconds a call (jacfwd over ~20k parameters): they get one
# fixed partial mask each (seed 3: the SAME CNN at seed 0 saturates to a GGN of 1e-73, below what
# float64 resolves), the small models hypothesis' masks and values.
SMALL = [n for n in MODELS if not n.startswith("cnn")]
CNN_CASES = [pytest.param(n, [True, False, True, True, True], 3, id=n) for n in MODELS if n.startswith("cnn")]


@pytest.mark.parametrize("name", SMALL)
@settings(max_examples=4, deadline=None)
@given(valid=masks, seed=st.integers(0, 1000))
def test_empirical_fisher_equals_per_example_squares(name, valid, seed):
    _check_empirical(name, valid, seed)


@pytest.mark.parametrize("name, valid, seed", CNN_CASES)
def test_empirical_fisher_equals_per_example_squares_cnn(name, valid, seed):
    _check_empirical(name, valid, seed)


def _check_empirical(name, valid, seed):
    with jax.enable_x64(True):
        _, params, x, y, _ = _setup(name, BATCH, seed)
        mask = jnp.asarray(valid, jnp.float64)
        f = _compiled(name)
        _assert_close(f["empirical"](params, x, y, mask), f["ref_squares"](params, x, y, mask))


@pytest.mark.parametrize("name", SMALL)
@settings(max_examples=4, deadline=None)
@given(valid=masks, seed=st.integers(0, 1000))
def test_ggn_equals_explicit_jt_h_j(name, valid, seed):
    _check_ggn(name, valid, seed)


@pytest.mark.parametrize("name, valid, seed", CNN_CASES)
def test_ggn_equals_explicit_jt_h_j_cnn(name, valid, seed):
    _check_ggn(name, valid, seed)


def _check_ggn(name, valid, seed):
    with jax.enable_x64(True):
        _, params, x, _, _ = _setup(name, BATCH, seed)
        mask = jnp.asarray(valid, jnp.float64)
        f = _compiled(name)
        _assert_close(f["ggn"](params, x, mask), f["ref_ggn"](params, x, mask))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("num_samples", [1, 3])
def test_sampled_fisher_equals_squares_at_the_sampled_labels(name, num_samples):
    """The same labels the engine draws (``categorical(key, logits, shape=(S, B))``; regression:
    ``y~ = f + N(0, 1)``) give the brute-force reference."""
    with jax.enable_x64(True):
        apply, params, x, _, task = _setup(name, 5, 7)
        mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 1.0])
        key = jax.random.key(11)
        got = cv.diag_fisher(apply, params, x, None, mask, key=key, num_samples=num_samples, task=task)
        out = apply(params, x)
        if task == "classification":
            labels = jax.random.categorical(key, out, axis=-1, shape=(num_samples, x.shape[0]))
        else:
            labels = out[None] + jax.random.normal(key, (num_samples,) + out.shape, out.dtype)
        refs = [_ref_squares(apply, params, x, labels[s], mask, task) for s in range(num_samples)]
        ref = jax.tree.map(lambda *r: sum(r) / num_samples, *refs)
        _assert_close(got, ref)


@pytest.mark.parametrize("name", ["logreg", "mlp", "cnn"])
def test_fisher_mean_over_label_samples_approaches_ggn(name):
    """With 2000 labels per example the Monte Carlo mean is within 6% (relative, in the max norm
    of each leaf) of the exact GGN; a single sample is not (so the tolerance is not vacuous).
    At the initialisation (``noise=0``) the predictions are far from one-hot."""
    with jax.enable_x64(True):
        apply, params, x, y, _ = _setup(name, 4, 3, noise=0.0)
        mask = jnp.ones((4,), jnp.float64)
        ggn = cv.diag_ggn(apply, params, x, y, mask)
        many = cv.diag_fisher(apply, params, x, y, mask, key=jax.random.key(5), num_samples=2000)
        one = cv.diag_fisher(apply, params, x, y, mask, key=jax.random.key(5), num_samples=1)

        def rel(a, b):
            return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

        assert rel(many, ggn) < 0.06
        assert rel(one, ggn) > 0.06


@pytest.mark.parametrize("name", ["mlp", "cnn", "linear"])
@pytest.mark.parametrize("flavour", cv.FLAVOURS)
@pytest.mark.parametrize("batch_size", [3])
def test_sum_over_minibatches_equals_full_batch(name, flavour, batch_size):
    """Partial last batch (10 = 3 + 3 + 3 + 1) and masked examples included. The Fisher's labels
    differ between layouts, so it is compared at one label per example with a key per chunk
    reproduced by hand."""
    with jax.enable_x64(True):
        apply, params, x, y, task = _setup(name, 10, 1)
        mask = jnp.asarray([1, 1, 0, 1, 1, 1, 0, 1, 1, 1], jnp.float64)
        if flavour == "fisher":
            key = jax.random.key(3)
            chunked = cv.diag_fisher(apply, params, x, y, mask, key=key, task=task, batch_size=batch_size)
            num = -(-10 // batch_size)
            keys = jax.random.split(key, num)
            parts = []
            for i in range(num):
                sl = slice(i * batch_size, (i + 1) * batch_size)
                xb, mb = x[sl], mask[sl]
                pad = batch_size - xb.shape[0]
                xb = jnp.concatenate([xb, jnp.zeros((pad,) + xb.shape[1:])])
                mb = jnp.concatenate([mb, jnp.zeros((pad,))])
                parts.append(cv.batch_diag_fisher(apply, params, xb, y[:batch_size], mb, key=keys[i], task=task))
            whole = jax.tree.map(lambda *p: sum(p), *parts)
        else:
            fn = cv.diag_ggn if flavour == "ggn" else cv.diag_empirical_fisher
            chunked = fn(apply, params, x, y, mask, task=task, batch_size=batch_size)
            whole = fn(apply, params, x, y, mask, task=task)
        _assert_close(chunked, whole, rtol=1e-12)


class _SharedAndOther(nn.Module):
    """A layer called twice (shared) and a parameter outside Dense/Conv: the fallback path."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.normal(1.0), (x.shape[-1],))
        shared = nn.Dense(x.shape[-1], name="shared")
        h = jnp.tanh(shared(x * scale[None, :]))
        h = jnp.tanh(shared(h))
        return nn.Dense(NUM_CLASSES, name="out")(h)


@pytest.mark.parametrize("flavour", ["ggn", "empirical"])
def test_unknown_and_shared_layers_fall_back_exactly(flavour):
    with jax.enable_x64(True):
        model = _SharedAndOther()
        x = jax.random.normal(jax.random.key(0), (5, 4), jnp.float64)
        params = jax.tree.map(lambda a: a.astype(jnp.float64), model.init(jax.random.key(1), x)["params"])
        apply = lambda p, xx: model.apply({"params": p}, xx)
        y = jnp.asarray([0, 1, 2, 1, 0])
        mask = jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0])
        layers, _ = find_layers(apply, params, x)
        assert set(layers) == {("out",)}  # the shared layer and `scale` take the fallback
        if flavour == "ggn":
            got, ref = cv.diag_ggn(apply, params, x, y, mask), _ref_ggn(apply, params, x, mask, "classification")
        else:
            got, ref = cv.diag_empirical_fisher(apply, params, x, y, mask), _ref_squares(apply, params, x, y, mask, "classification")
        _assert_close(got, ref)


def test_model_outputs_unchanged_by_the_intercepted_pass():
    """Eagerly (op by op) bitwise; compiled within float32 rounding."""
    model = make_model("cnn", 10)
    params = init_params(model, jax.random.key(0), (28, 28, 1))
    apply = lambda p, x: model.apply({"params": p}, x)
    x = jax.random.normal(jax.random.key(1), (6, 28, 28, 1))
    layers, _ = find_layers(apply, params, x)
    pert = {path: jnp.zeros(s.shape, s.dtype) for path, (_, s) in layers.items()}
    out, inputs = jax.jit(cv.instrumented_forward(apply, params, x, layers))(pert)
    # exact zeros are added; compiled, XLA may fuse the two programs differently (float32 rounding)
    np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(apply)(params, x)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(cv.instrumented_forward(apply, params, x, layers)(pert)[0]), np.asarray(apply(params, x)))
    assert set(inputs) == set(layers) and len(layers) == 5


def test_all_padding_batch_is_zero_and_float32_works():
    model = make_model("mlp", 10)
    params = init_params(model, jax.random.key(0), (12,))
    apply = lambda p, x: model.apply({"params": p}, x)
    x = jax.random.normal(jax.random.key(1), (4, 12))
    y = jnp.zeros((4,), jnp.int32)
    zero = jax.jit(lambda m: cv.diag_ggn(apply, params, x, y, m))(jnp.zeros((4,)))
    assert all(float(jnp.max(jnp.abs(leaf))) == 0.0 for leaf in jax.tree.leaves(zero))
    some = cv.diag_fisher(apply, params, x, y, jnp.ones((4,)), key=jax.random.key(0))
    assert all(leaf.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(leaf))) for leaf in jax.tree.leaves(some))


def test_bad_arguments_raise_naming_the_field():
    model = make_model("logreg", 3)
    params = init_params(model, jax.random.key(0), (2,))
    apply = lambda p, x: model.apply({"params": p}, x)
    x, y = jnp.zeros((2, 2)), jnp.zeros((2,), jnp.int32)
    with pytest.raises(ValueError, match="flavour"):
        cv.batch_curvature("hessian", apply, params, x, y, jnp.ones(2))
    with pytest.raises(ValueError, match="key"):
        cv.batch_curvature("fisher", apply, params, x, y, jnp.ones(2))
    with pytest.raises(ValueError, match="num_samples"):
        cv.diag_fisher(apply, params, x, y, key=jax.random.key(0), num_samples=0)
    with pytest.raises(ValueError, match="task"):
        cv.diag_ggn(apply, params, x, task="ranking")
    with pytest.raises(ValueError, match="batch_size"):
        cv.diag_ggn(apply, params, x, batch_size=0)


def _penalty_only(lam, eta, lr, epochs=3, n=10, momentum=None):
    """SG-MCMC moments on F = (theta^T Lambda theta / 2 - eta^T theta) / n with a zero loss."""
    from fedbayes.data.batches import ClientData
    from fedbayes.gaussian import DiagGaussian
    from fedbayes.inference.sgd import LocalTrainer, stiff_step_control
    from fedbayes.inference.tilted import sgmcmc_moments

    trainer = LocalTrainer(lambda p, k, x, y, m: 0.0 * jnp.sum(p["w"]), optax.sgd(lr, momentum=momentum), epochs, 5)
    data = ClientData(jnp.zeros((n, 1)), jnp.zeros((n,)), jnp.tile(jnp.arange(n, dtype=jnp.int32), epochs), jnp.int32(0), jnp.int32(n))
    prior = DiagGaussian(precision_mean={"w": eta}, precision={"w": lam})
    start = {"w": jnp.zeros_like(lam)}
    key = jax.random.key(0)
    plain = sgmcmc_moments(key, start, prior, data, trainer)[0]["w"]
    controlled = sgmcmc_moments(key, start, prior, data, stiff_step_control(trainer, prior.precision, data.num_examples))[0]["w"]
    return plain, controlled


def test_stiff_step_control_keeps_the_mode_and_sgd_where_not_stiff():
    eta = jnp.asarray([1.0, 2.0])
    # lr h = 0.1 * [1, 5] / 10 <= 1: bitwise SGD
    plain, controlled = _penalty_only(jnp.asarray([1.0, 5.0]), eta, lr=0.1)
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(controlled))
    # lr h = 0.1 * [1, 1000] / 10 = [0.01, 10]: plain SGD blows up in the stiff coordinate, the
    # controlled sampler reaches its mode eta / Lambda there (and is SGD in the other)
    lam = jnp.asarray([1.0, 1000.0])
    plain, controlled = _penalty_only(lam, eta, lr=0.1, epochs=3)
    assert abs(float(plain[1])) > 100  # the mode is 0.002
    np.testing.assert_allclose(float(controlled[1]), 2.0 / 1000.0, rtol=1e-5)
    np.testing.assert_allclose(float(controlled[0]), float(plain[0]), rtol=1e-6)
    # heavy ball (the paper's sampler, momentum 0.9) at lr h = 10 > 2 (1 + beta): same picture
    plain, controlled = _penalty_only(lam, eta, lr=0.1, epochs=6, momentum=0.9)
    assert abs(float(plain[1])) > 100  # the mode is 0.002
    np.testing.assert_allclose(float(controlled[1]), 2.0 / 1000.0, rtol=0.1)  # heavy ball converges slower


class _TemperedOutput(nn.Module):
    """An output layer whose output is scaled afterwards by a learnt temperature."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(4, name="hidden")(x))
        out = nn.Dense(NUM_CLASSES, name="output")(h)
        return out * jnp.exp(self.param("temperature", nn.initializers.normal(0.5), ()))


class _SharedLast(nn.Module):
    """A last layer called twice: no Kronecker form (the per-example Jacobians instead)."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(NUM_CLASSES, name="hidden")(x)
        shared = nn.Dense(NUM_CLASSES, name="shared")
        return shared(jnp.tanh(shared(h)))


def _module_setup(module):
    x = jax.random.normal(jax.random.key(0), (BATCH, 4), jnp.float64)
    params = jax.tree.map(lambda a: a.astype(jnp.float64), module.init(jax.random.key(1), x)["params"])
    return (lambda p, xx: module.apply({"params": p}, xx)), params, x, jnp.asarray([0, 1, 2, 1, 0]), "classification"


@pytest.mark.parametrize("name", ["mlp", "cnn", "linear", "tempered", "shared_last"])
def test_block_ggn_is_the_last_layer_block_of_the_ggn_and_the_diagonal_elsewhere(name):
    """:func:`batch_block_ggn`'s dense block (the Kronecker form for a Dense last layer, whatever
    follows it) equals the per-example Jacobians' dense GGN of the last layer, and its diagonal the
    diagonal GGN of the other layers; :func:`data_block_ggn` sums it over minibatches."""
    from fedbayes import gaussian_block

    with jax.enable_x64(True):
        if name == "tempered":
            apply, params, x, y, task = _module_setup(_TemperedOutput())
        elif name == "shared_last":
            apply, params, x, y, task = _module_setup(_SharedLast())
        else:
            apply, params, x, y, task = _setup(name, BATCH, 3)
        mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 1.0], jnp.float64)
        got = cv.batch_block_ggn(apply, params, x, y, mask, task=task)
        key = gaussian_block.last_layer_key(params)
        assert got.key == key == {"tempered": "output", "shared_last": "shared"}.get(name, key)
        others, last = gaussian_block.split(params, key)
        dense = cv.batch_full_ggn(lambda t, xs: apply(gaussian_block.join(others, t, key), xs), last, x, mask, task=task)
        scale = float(jnp.max(jnp.abs(dense)))
        assert scale > 0
        np.testing.assert_allclose(np.asarray(got.dense), np.asarray(dense), rtol=0, atol=1e-8 * scale)
        if jax.tree.leaves(others):
            _assert_close(got.diagonal, gaussian_block.split(cv.batch_diag_ggn(apply, params, x, y, mask, task=task), key)[0], rtol=1e-10)


@pytest.mark.parametrize("name", ["mlp", "linear", "logreg"])
def test_ggn_matmat_and_the_subspace_pass_equal_the_dense_ggn(name):
    """:func:`batch_ggn_matmat` is the dense GGN times the vectors (padding masked out), and
    :func:`data_subspace_ggn` sums ``(diag G, G B)`` over a client's minibatches."""
    from jax.flatten_util import ravel_pytree

    from fedbayes.data.batches import ClientData

    with jax.enable_x64(True):
        apply, params, x, y, task = _setup(name, BATCH, 4)
        dim = ravel_pytree(params)[0].size
        vectors = jax.random.normal(jax.random.key(5), (dim, 3), jnp.float64)
        mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 1.0], jnp.float64)
        dense = np.asarray(cv.batch_full_ggn(apply, params, x, mask, task=task))
        scale = np.abs(dense).max()
        assert scale > 0
        np.testing.assert_allclose(
            np.asarray(cv.batch_ggn_matmat(apply, params, x, mask, vectors, task=task)), dense @ np.asarray(vectors), atol=1e-9 * scale * dim
        )
        # a client of the batch's 4 real examples, in minibatches of 2 (the padded one left out)
        real = np.asarray([0, 2, 3, 4])
        data = ClientData(x[real], y[real], jnp.arange(len(real), dtype=jnp.int32), jnp.int32(0), jnp.int32(len(real)))
        diag, product = cv.data_subspace_ggn(apply, params, data, vectors, batch_size=2, task=task)
        np.testing.assert_allclose(np.asarray(product), dense @ np.asarray(vectors), atol=1e-9 * scale * dim)
        np.testing.assert_allclose(np.asarray(ravel_pytree(diag)[0]), np.diag(dense), rtol=1e-8, atol=1e-12 * scale)


class _SmallConv(nn.Module):
    """A conv layer (3 filters of 2 x 2 over 2 channels) and two dense layers: small enough for the
    dense GGN (190 parameters; the library's CNN has 20,791)."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Conv(3, (2, 2), name="conv")(x.reshape(x.shape[0], 4, 4, 2)))
        h = jnp.tanh(nn.Dense(5, name="hidden")(h.reshape(h.shape[0], -1)))
        return nn.Dense(NUM_CLASSES, name="output")(h)


@pytest.mark.parametrize("name", ["mlp", "small_conv", "logreg", "linear"])
def test_kron_pass_is_the_dense_ggn_in_the_factors_eigenbases(name):
    """:func:`batch_kron_ggn`: in the identity bases the diagonal GGN; in the eigenbases of its
    own Kronecker factors ``diag(U^T G U)`` of the dense GGN (dense and conv layers), the factors
    the inputs' (or patches') masked second moments; :func:`data_kron_ggn` sums them over
    minibatches."""
    from jax.flatten_util import ravel_pytree

    from fedbayes import gaussian_kron
    from fedbayes.data.batches import ClientData

    with jax.enable_x64(True):
        if name == "small_conv":
            module = _SmallConv()
            x = jax.random.normal(jax.random.key(0), (BATCH, 32), jnp.float64)
            params = jax.tree.map(lambda a: a.astype(jnp.float64), module.init(jax.random.key(1), x)["params"])
            apply, y, task = (lambda p, xx: module.apply({"params": p}, xx)), jnp.asarray([0, 1, 2, 1, 0]), "classification"
        else:
            apply, params, x, y, task = _setup(name, BATCH, 6)
        mask = jnp.asarray([1.0, 0.0, 1.0, 1.0, 1.0], jnp.float64)
        identity = gaussian_kron.identity_bases(params)
        diag, factors = cv.batch_kron_ggn(apply, params, x, y, mask, identity, task=task)
        _assert_close(diag, cv.batch_diag_ggn(apply, params, x, y, mask, task=task), rtol=1e-10)
        bases = gaussian_kron.bases_from_factors(factors)
        moved = [b for b in jax.tree.leaves(bases, is_leaf=lambda b: isinstance(b, gaussian_kron.KronBasis)) if b.left is not None]
        assert moved and all(np.abs(np.abs(np.asarray(b.left)) - np.eye(b.left.shape[0])).max() > 0.05 for b in moved if b.left.shape[0] > 1)
        rotated, _ = cv.batch_kron_ggn(apply, params, x, y, mask, bases, task=task)
        dense = np.asarray(cv.batch_full_ggn(apply, params, x, mask, task=task))
        u = np.asarray(gaussian_kron.dense_rotation(params, bases))
        scale = np.abs(dense).max()
        np.testing.assert_allclose(np.asarray(ravel_pytree(rotated)[0]), np.diag(u.T @ dense @ u), rtol=1e-8, atol=1e-10 * scale)
        if name != "small_conv":  # a first dense layer's input factor is sum_n m_n x_n x_n^T
            first = next(iter(params))
            kernel = factors[first]["kernel"] if "kernel" in factors[first] else factors[first]
            xm = np.asarray(x).reshape(BATCH, -1) * np.sqrt(np.asarray(mask))[:, None]
            np.testing.assert_allclose(np.asarray(kernel.left), xm.T @ xm, rtol=1e-10)
        # a client's pass over minibatches sums the batches (the padded example left out)
        real = np.asarray([0, 2, 3, 4])
        data = ClientData(x[real], y[real], jnp.arange(len(real), dtype=jnp.int32), jnp.int32(0), jnp.int32(len(real)))
        summed, summed_factors = cv.data_kron_ggn(apply, params, data, bases, batch_size=2, task=task)
        _assert_close(summed, rotated, rtol=1e-8)
        _assert_close(summed_factors, factors, rtol=1e-8)
