"""Server optimizers (docs/algorithms.md §1.2): Reddi et al.'s forms against hand-computed recursions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes.algorithms.server_opt import apply_server_optimizer, make_server_optimizer

GRADS = [np.array([0.5, -1.0, 2.0]), np.array([0.1, 0.3, -0.4]), np.array([-0.2, 0.0, 1.5])]


def reference(kind, lr, b1, b2, tau):
    """Reddi et al. 2021 Alg. 2 in numpy, written from the paper with Delta = -g."""
    theta = np.zeros(3)
    m = np.zeros(3)
    v = np.full(3, tau**2)
    out = []
    for g in GRADS:
        delta = -g
        m = b1 * m + (1 - b1) * delta
        if kind == "adam":
            v = b2 * v + (1 - b2) * delta**2
        elif kind == "yogi":
            v = v - (1 - b2) * delta**2 * np.sign(v - delta**2)
        else:
            v = v + delta**2
        theta = theta + lr * m / (np.sqrt(v) + tau)
        out.append(theta.copy())
    return out


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_reddi_forms_match_the_paper(kind):
    lr, b1, b2, tau = 0.3, 0.9, 0.99, 1e-2
    opt = make_server_optimizer(kind, lr, b1=b1, b2=b2, tau=tau)
    params = jnp.zeros(3)
    state = opt.init(params)
    for g, want in zip(GRADS, reference(kind, lr, b1, b2, tau)):
        params, state = apply_server_optimizer(opt, params, state, jnp.asarray(g, jnp.float32))
        np.testing.assert_allclose(params, want, rtol=1e-5, atol=1e-6)


def test_fedavgm_is_heavy_ball_without_dampening():
    opt = make_server_optimizer("momentum", 0.5, momentum=0.9)
    params, state = jnp.zeros(3), None
    state = opt.init(params)
    theta, m = np.zeros(3), np.zeros(3)
    for g in GRADS:
        m = 0.9 * m + g
        theta = theta - 0.5 * m
        params, state = apply_server_optimizer(opt, params, state, jnp.asarray(g, jnp.float32))
        np.testing.assert_allclose(params, theta, rtol=1e-6)


def test_sgd_lr_one_applies_the_pseudo_gradient():
    opt = make_server_optimizer("sgd", 1.0)
    params, _ = apply_server_optimizer(opt, jnp.ones(3), opt.init(jnp.ones(3)), jnp.asarray(GRADS[0], jnp.float32))
    np.testing.assert_allclose(params, 1.0 - GRADS[0], rtol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "yogi", "adagrad"])
def test_optax_variant_is_optax(kind):
    ours = make_server_optimizer(kind, 0.1, tau=1e-3, variant="optax")
    theirs = {
        "adam": optax.adam(0.1, b1=0.9, b2=0.99, eps=1e-3),
        "yogi": optax.yogi(0.1, b1=0.9, b2=0.99, eps=1e-3),
        "adagrad": optax.adagrad(0.1, initial_accumulator_value=0.0, eps=1e-3),
    }[kind]
    p1 = p2 = jnp.zeros(3)
    s1, s2 = ours.init(p1), theirs.init(p2)
    for g in GRADS:
        g = jnp.asarray(g, jnp.float32)
        p1, s1 = apply_server_optimizer(ours, p1, s1, g)
        p2, s2 = apply_server_optimizer(theirs, p2, s2, g)
    np.testing.assert_allclose(p1, p2, rtol=1e-6)


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam", "yogi", "adagrad"])
def test_jit_compiles_once_and_keeps_dtype(kind):
    opt = make_server_optimizer(kind, 0.1)
    params = {"a": jnp.zeros((2, 3), jnp.float32), "b": jnp.zeros((4,), jnp.float32)}
    traces = []  # jit traces its function once per compilation; a cache hit runs the compiled program

    def update(p, s, g):
        traces.append(None)
        return apply_server_optimizer(opt, p, s, g)

    step = jax.jit(update)
    state = opt.init(params)
    g = jax.tree.map(jnp.ones_like, params)
    for _ in range(3):
        params, state = step(params, state, g)
    assert len(traces) == 1
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match="sgd, momentum, adam, yogi, adagrad"):
        make_server_optimizer("lamb")
    with pytest.raises(ValueError, match="reddi, optax"):
        make_server_optimizer("adam", variant="other")
