"""IVON (fedbayes.inference.ivon) against Shen et al. 2024's Algorithm 1 computed by hand, on a
Gaussian posterior, and under jit and vmap."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedbayes.inference.ivon import IVONState, hessian_from_variance, ivon


def _quadratic(a, b):
    """The per-example loss ``0.5 sum a (theta - b)^2`` (its posterior at ``ess`` examples and no
    prior is ``N(b, 1 / (ess a))``) and its gradient."""
    return lambda theta: a * (theta - b)


def test_one_step_equals_algorithm_1_by_hand():
    with jax.enable_x64(True):
        a, b = np.array([0.5, 2.0, 4.0]), np.array([1.0, -1.0, 0.3])
        m0, h0 = np.array([0.2, 0.4, -0.6]), np.array([0.7, 1.5, 3.0])
        ess, delta, alpha, beta1, beta2 = 50.0, 0.1, 0.3, 0.8, 0.95
        opt = ivon(alpha, ess, delta, beta1=beta1, beta2=beta2)
        params = jnp.asarray(m0)
        state = opt.init(params, jnp.asarray(h0))
        theta, eps = opt.sample(jax.random.key(3), state, params)
        grads = _quadratic(jnp.asarray(a), jnp.asarray(b))(theta)
        updates, new = opt.update(grads, state, params, eps)
        # by hand, numpy float64, the equations of Algorithm 1
        e = np.asarray(eps)
        sigma = 1.0 / np.sqrt(ess * (h0 + delta))
        th = m0 + sigma * e
        g_hat = a * (th - b)
        h_hat = g_hat * e / sigma
        g = (1 - beta1) * g_hat
        h = beta2 * h0 + (1 - beta2) * h_hat + 0.5 * (1 - beta2) ** 2 * (h0 - h_hat) ** 2 / (h0 + delta)
        m = m0 - alpha * (g / (1 - beta1) + delta * m0) / (h + delta)
        np.testing.assert_allclose(np.asarray(theta), th, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(new.momentum), g, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(new.hessian), h, rtol=1e-14)
        np.testing.assert_allclose(np.asarray(optax.apply_updates(params, updates)), m, rtol=1e-14)
        assert int(new.count) == 1
        mean, var = opt.posterior(new, optax.apply_updates(params, updates))
        np.testing.assert_allclose(np.asarray(var), 1.0 / (ess * (h + delta)), rtol=1e-14)


def test_points_are_not_drawn_and_keep_their_hessian():
    """``points``: a leaf marked True is the model's own parameter: theta = m there, its h stays at
    its init, and its step is the debiased momentum over h + delta (the other leaf as Algorithm 1)."""
    with jax.enable_x64(True):
        params = {"w": jnp.asarray([0.2, -0.4]), "b": jnp.asarray([0.5])}
        h0 = {"w": jnp.asarray([0.7, 1.5]), "b": jnp.asarray([0.3])}
        opt = ivon(0.2, 40.0, 0.0, beta1=0.9, beta2=0.9, num_samples=4, antithetic=True, points={"w": False, "b": True})
        state = opt.init(params, h0)
        theta, eps = opt.sample(jax.random.key(0), state, params)
        np.testing.assert_array_equal(np.asarray(theta["b"]), np.broadcast_to(np.asarray(params["b"]), (4, 1)))
        assert np.all(np.asarray(eps["b"]) == 0) and np.all(np.std(np.asarray(theta["w"]), axis=0) > 0)
        grads = jax.tree.map(lambda t: 2.0 * t - 1.0, theta)
        updates, new = opt.update(grads, state, params, eps)
        np.testing.assert_array_equal(np.asarray(new.hessian["b"]), np.asarray(h0["b"]))
        assert not np.allclose(np.asarray(new.hessian["w"]), np.asarray(h0["w"]))
        # one step: the debiased momentum is the gradient at the mean itself
        np.testing.assert_allclose(np.asarray(updates["b"]), -0.2 * (2.0 * np.asarray(params["b"]) - 1.0) / np.asarray(h0["b"]), rtol=1e-12)
        # the unmarked leaf is drawn and updated exactly as without points
        plain = ivon(0.2, 40.0, 0.0, beta1=0.9, beta2=0.9, num_samples=4, antithetic=True)
        plain_updates, plain_new = plain.update(grads, plain.init(params, h0), params, eps)
        np.testing.assert_allclose(np.asarray(updates["w"]), np.asarray(plain_updates["w"]), rtol=1e-12)
        np.testing.assert_allclose(np.asarray(new.hessian["w"]), np.asarray(plain_new.hessian["w"]), rtol=1e-12)


def test_hessian_stays_positive_under_a_large_negative_estimate():
    # h_hat far below -delta: without the correction term h + delta would turn negative
    opt = ivon(0.1, 10.0, 0.0, beta2=0.5)
    params = jnp.zeros((1,), jnp.float32)
    state = opt.init(params, jnp.ones((1,), jnp.float32))
    eps = jnp.ones((1,), jnp.float32)
    sigma = 1.0 / np.sqrt(10.0)
    grads = jnp.full((1,), -100.0 * sigma, jnp.float32)  # h_hat = -100
    _, new = opt.update(grads, state, params, eps)
    assert float(new.hessian[0]) > 0.0
    plain = 0.5 * 1.0 + 0.5 * -100.0
    assert plain < 0.0  # the case the correction exists for


@pytest.mark.parametrize("antithetic", [False, True])
def test_gaussian_posterior_is_recovered(antithetic):
    # loss 0.5 a (theta - b)^2 per example at ess examples, prior precision ess * delta:
    # posterior N(a b / (a + delta), 1 / (ess (a + delta))), which IVON's family holds exactly
    a = jnp.asarray([0.1, 1.0, 10.0, 3.0], jnp.float32)
    b = jnp.asarray([2.0, -1.0, 0.5, 0.0], jnp.float32)
    ess, delta = 1000.0, 0.01
    opt = ivon(0.2, ess, delta, beta1=0.9, beta2=0.999, hess_init=1.0, num_samples=2 if antithetic else 1, antithetic=antithetic)
    grad = jax.vmap(_quadratic(a, b)) if antithetic else _quadratic(a, b)
    params = jnp.zeros(4, jnp.float32)
    state = opt.init(params)

    def body(i, carry):
        p, s, total = carry
        theta, eps = opt.sample(jax.random.fold_in(jax.random.key(0), i), s, p)
        updates, s = opt.update(grad(theta), s, p, eps)
        p = optax.apply_updates(p, updates)
        return p, s, total + jnp.where(i >= 6000, p, jnp.zeros_like(p))

    run = jax.jit(lambda p, s: jax.lax.fori_loop(0, 8000, body, (p, s, jnp.zeros_like(p))))
    params, state, total = run(params, state)
    mean, var = opt.posterior(state, params)
    exact_mean, exact_var = a * b / (a + delta), 1.0 / (ess * (a + delta))
    exact_sd = jnp.sqrt(exact_var)
    # the iterate jitters around the mean by about 0.3 sigma (momentum-averaged draws); the
    # average of the last 2000 iterates is within 0.1 sigma, the last iterate within 1 sigma
    np.testing.assert_array_less(np.abs(np.asarray(total / 2000.0 - exact_mean)), 0.1 * np.asarray(exact_sd))
    np.testing.assert_array_less(np.abs(np.asarray(mean - exact_mean)), np.asarray(exact_sd))
    # h averages h_hat = a eps^2 (variance 2 a^2) over ~1 / (1 - beta2) = 1000 steps: ~3% noise; 15% bound
    np.testing.assert_allclose(np.asarray(var), np.asarray(exact_var), rtol=0.15)


def test_antithetic_pair_cancels_the_gradient_at_the_mean():
    # on a quadratic the pair's h_hat is a * mean(eps^2) exactly, whatever m - b is
    with jax.enable_x64(True):
        a, b = jnp.asarray([0.5, 2.0]), jnp.asarray([30.0, -40.0])
        opt = ivon(0.1, 100.0, 0.0, beta2=0.0, num_samples=2, antithetic=True)
        params = jnp.zeros(2)
        state = opt.init(params)
        theta, eps = opt.sample(jax.random.key(1), state, params)
        assert theta.shape == (2, 2)
        np.testing.assert_array_equal(np.asarray(eps[0]), -np.asarray(eps[1]))
        _, new = opt.update(jax.vmap(_quadratic(a, b))(theta), state, params, eps)
        h_hat = a * jnp.mean(jnp.square(eps), axis=0)
        # beta2 = 0: h = h_hat + (h0 - h_hat)^2 / (2 (h0 + delta))
        np.testing.assert_allclose(np.asarray(new.hessian), np.asarray(h_hat + jnp.square(1.0 - h_hat) / 2.0), rtol=1e-12)


def test_hessian_from_variance_inverts_the_posterior():
    params = {"w": jnp.zeros((3, 2), jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    variance = {"w": jnp.full((3, 2), 0.01, jnp.float32), "b": jnp.full(2, 0.5, jnp.float32)}
    delta = {"w": jnp.full((3, 2), 1e-3, jnp.float32), "b": jnp.zeros(2, jnp.float32)}
    opt = ivon(0.1, 200.0, delta)
    state = opt.init(params, hessian_from_variance(variance, 200.0, delta))
    _, var = opt.posterior(state, params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5), var, variance)


def test_jit_vmap_structure_and_dtype():
    traces = []
    opt = ivon(optax.linear_schedule(0.1, 0.01, 100), 100.0, 1e-2, num_samples=2, antithetic=True)
    params = {"dense": {"kernel": jnp.ones((3, 2), jnp.float32), "bias": jnp.zeros(2, jnp.float32)}}

    def step(key, params, state):
        traces.append(1)
        theta, eps = opt.sample(key, state, params)
        grads = jax.vmap(jax.grad(lambda p: sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(p))))(theta)
        updates, state = opt.update(grads, state, params, eps)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step)
    state = opt.init(params)
    p1, s1 = jitted(jax.random.key(0), params, state)
    p2, s2 = jitted(jax.random.key(1), p1, s1)
    assert len(traces) == 1  # the second call does not retrace
    assert isinstance(s2, IVONState) and int(s2.count) == 2 and s2.count.dtype == jnp.int32
    for tree in (p2, s2.momentum, s2.hessian):
        assert jax.tree.structure(tree) == jax.tree.structure(params)
        assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(tree))
    # vmap over clients: each equals its own call
    keys = jax.random.split(jax.random.key(2), 3)
    batched = jax.tree.map(lambda x: jnp.stack([x, 2 * x, 3 * x]), params)
    states = jax.vmap(opt.init)(batched)
    vp, vs = jax.vmap(step)(keys, batched, states)
    for i in range(3):
        one = jax.tree.map(lambda x, i=i: x[i], batched)
        pi, si = step(keys[i], one, opt.init(one))
        jax.tree.map(lambda x, y, i=i: np.testing.assert_allclose(np.asarray(x[i]), np.asarray(y), rtol=1e-6), vp, pi)
        jax.tree.map(lambda x, y, i=i: np.testing.assert_allclose(np.asarray(x[i]), np.asarray(y), rtol=1e-6), vs.hessian, si.hessian)
        assert bool(jnp.all(jnp.isfinite(vs.hessian["dense"]["kernel"])))


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="ess"):
        ivon(0.1, 0.0)
    with pytest.raises(ValueError, match="beta2"):
        ivon(0.1, 1.0, beta2=1.0)
    with pytest.raises(ValueError, match="even"):
        ivon(0.1, 1.0, num_samples=3, antithetic=True)
