"""Centralised references (fedbayes.evaluation.reference) and posterior distances
(fedbayes.evaluation.distances), each checked against an independent computation: a closed-form
Hessian of the softmax likelihood, scipy's optimiser, a Monte Carlo ELBO through the model itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize
from jax.flatten_util import ravel_pytree

from fedbayes.evaluation.distances import flat64, kl_diag, relative_l2, variance_ratio
from fedbayes.evaluation.metrics import classification_metrics
from fedbayes.evaluation.reference import (
    affine_logit_difference,
    affine_predictive_metrics,
    diagonal_laplace,
    expected_fisher_laplace,
    full_covariance_vi,
    laplace_covariance,
    laplace_marginals,
    map_estimate,
    mean_field_elbo,
    mean_field_vi,
    negative_log_joint,
    references,
    sep_fixed_point,
)
from fedbayes.models import init_params, make_model

LAMBDA = 0.7


def _problem(n=40, d=3, classes=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d,))
    y = (x @ w + 0.8 * rng.normal(size=n) > 0).astype(np.int32) if classes == 2 else rng.integers(0, classes, n).astype(np.int32)
    model = make_model("logreg", classes)
    params0 = init_params(model, jax.random.key(1), (d,))
    return model, (lambda p, xs: model.apply({"params": p}, xs)), params0, x, y


def _closed_form_hessian(params, x, y):
    """The exact Hessian of the softmax log joint of ``logits = x W + b`` in the flat order of
    ravel_pytree ({bias [C], kernel [d, C]} row-major), from sum_i (diag p_i - p_i p_i^T) (x) [1, x_i]."""
    w = np.asarray(params["dense"]["kernel"], np.float64)
    b = np.asarray(params["dense"]["bias"], np.float64)
    x = np.asarray(x, np.float64)
    logits = x @ w + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    c = w.shape[1]
    n_params = c + w.size
    h = np.zeros((n_params, n_params))
    for xi, pi in zip(x, p, strict=True):
        s = np.diag(pi) - np.outer(pi, pi)
        # d logits_c / d theta: bias block then kernel rows (feature j, class c) -> index c + j*C + c'
        jac = np.zeros((c, n_params))
        jac[:, :c] = np.eye(c)
        for j, xj in enumerate(xi):
            jac[:, c + j * c : c + (j + 1) * c] = xj * np.eye(c)
        h += jac.T @ s @ jac
    return h + LAMBDA * np.eye(n_params)


def test_map_matches_scipy_and_zeroes_the_gradient():
    _, apply_fn, params0, x, y = _problem()
    loss = negative_log_joint(apply_fn, x, y, LAMBDA)
    theta = map_estimate(loss, params0)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(theta))
    assert jax.tree.structure(theta) == jax.tree.structure(params0)
    with jax.enable_x64(True):
        flat0, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), params0))
        f = jax.jit(lambda z: loss(unravel(z)))
        g = jax.jit(jax.grad(lambda z: loss(unravel(z))))
        grad = np.asarray(g(jnp.asarray(flat64(theta))))
        ref = scipy.optimize.minimize(
            lambda z: float(f(jnp.asarray(z))), np.asarray(flat0), jac=lambda z: np.asarray(g(jnp.asarray(z))), method="BFGS", options={"gtol": 1e-10}
        )
    # float32 rounding of the MAP leaves a gradient of order |H| * 1e-7
    assert np.max(np.abs(grad)) < 1e-4
    np.testing.assert_allclose(flat64(theta), ref.x, rtol=1e-5, atol=1e-6)


def test_map_raises_when_newton_cannot_converge():
    _, apply_fn, params0, x, y = _problem()
    loss = negative_log_joint(apply_fn, x, y, LAMBDA)
    with pytest.raises(ValueError, match="did not converge"):
        map_estimate(loss, params0, max_steps=1)


def test_map_takes_the_full_newton_step_where_the_objective_cannot_resolve_the_decrease():
    """At ``w0 = 1``, 2^-45 from the minimum of a quadratic of curvature 2^40 next to a constant
    of 100, the gradient is 0.03 but the decrease left (4e-16) is below the float64 rounding of
    ``f`` (1.4e-14); the last term stands for that rounding: every other point reads one ulp
    higher. Armijo's test rejects every step there; the full Newton step lands on the minimum."""
    offset, curvature = 2.0**-45, 2.0**40

    def loss(params):
        w = params["w"]
        with jax.enable_x64(True):
            centre = jnp.asarray(1.0 - offset, jnp.float64)
            rounding = jnp.where(jnp.all(w == 1.0), 0.0, 2e-14)
            return 100.0 + 0.5 * curvature * jnp.sum(jnp.square(w - centre)) + rounding

    theta = map_estimate(loss, {"w": jnp.ones(3, jnp.float32)})
    np.testing.assert_array_equal(np.asarray(theta["w"]), np.ones(3, np.float32))  # 1 - 2^-45 in float32


def test_negative_log_joint_rejects_bad_input():
    _, apply_fn, _, x, y = _problem()
    with pytest.raises(ValueError, match="prior_precision"):
        negative_log_joint(apply_fn, x, y, 0.0)
    with pytest.raises(ValueError, match="same length"):
        negative_log_joint(apply_fn, x, y[:-1], 1.0)


@pytest.mark.parametrize("classes", [2, 3])
def test_laplace_variances_match_the_closed_form_hessian(classes):
    _, apply_fn, params0, x, y = _problem(classes=classes)
    loss = negative_log_joint(apply_fn, x, y, LAMBDA)
    theta = map_estimate(loss, params0)
    h = _closed_form_hessian(theta, x, y)
    mean, var = diagonal_laplace(loss, theta)
    np.testing.assert_array_equal(flat64(mean), flat64(theta))
    np.testing.assert_allclose(flat64(var), 1.0 / np.diag(h), rtol=1e-5)
    _, marginal = laplace_marginals(loss, theta)
    np.testing.assert_allclose(flat64(marginal), np.diag(np.linalg.inv(h)), rtol=1e-5)
    np.testing.assert_allclose(laplace_covariance(loss, theta), np.linalg.inv(h), rtol=1e-5, atol=1e-9)
    # the diagonal-precision approximation is never wider than the true marginal
    assert np.all(flat64(var) <= flat64(marginal) * (1 + 1e-6))


def _mc_elbo(apply_fn, mean, var, x, y, key, num=10000):
    """ELBO by Monte Carlo through the model itself (no affine decomposition, no quadrature)."""
    m, unravel = ravel_pytree(jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), mean))
    v = jnp.asarray(flat64(var))
    z = m[None, :] + jnp.sqrt(v)[None, :] * jax.random.normal(key, (num, m.shape[0]), jnp.float64)
    xs = jnp.asarray(x, jnp.float64)

    def loglik(theta):
        logits = apply_fn(unravel(theta), xs)
        return jnp.sum(jax.nn.log_softmax(logits)[jnp.arange(xs.shape[0]), jnp.asarray(y)])

    values = np.asarray(jax.lax.map(loglik, z, batch_size=1000))
    mn, vn = np.asarray(m), np.asarray(v)
    kl = 0.5 * np.sum(LAMBDA * vn + LAMBDA * np.square(mn) - 1 - np.log(LAMBDA) - np.log(vn))
    return float(values.mean() - kl), float(values.std() / np.sqrt(num))


def test_mean_field_vi_is_the_elbo_optimum():
    _, apply_fn, params0, x, y = _problem()
    mean, var = mean_field_vi(apply_fn, params0, x, y, LAMBDA)
    assert jax.tree.structure(var) == jax.tree.structure(params0)
    affine = affine_logit_difference(apply_fn, params0, x)
    with jax.enable_x64(True):
        z = jnp.asarray(np.concatenate([flat64(mean), np.log(flat64(var))]))
        p = z.shape[0] // 2

        def elbo(z):
            return mean_field_elbo(affine, y, LAMBDA, z[:p], z[p:])

        grad = np.asarray(jax.grad(elbo)(z))
        best = float(elbo(z))
        rng = np.random.default_rng(0)
        for _ in range(5):
            assert float(elbo(z + jnp.asarray(0.05 * rng.normal(size=z.shape)))) < best
        mc, stderr = _mc_elbo(apply_fn, mean, var, x, y, jax.random.key(3))
    assert np.max(np.abs(grad)) < 1e-4
    assert abs(mc - best) < 5 * stderr + 1e-6


def test_mean_field_vi_with_a_point_bias_is_its_objectives_optimum():
    """``points``: the bias a point without a prior (a variational layer's deterministic bias).
    Against scipy's L-BFGS on that objective written out independently (Gauss-Hermite on the
    logit difference, the KL over the kernel alone); and not the all-Gaussian optimum."""
    _, apply_fn, params0, x, y = _problem(n=60, d=4, seed=3)
    points = {"dense": {"kernel": False, "bias": True}}
    mean, var = mean_field_vi(apply_fn, params0, x, y, LAMBDA, points=points)
    assert np.all(np.asarray(var["dense"]["bias"]) == 0) and np.all(np.asarray(var["dense"]["kernel"]) > 0)
    flat, unravel = ravel_pytree(params0)
    bias = np.asarray(ravel_pytree({"dense": {"kernel": jnp.zeros_like(params0["dense"]["kernel"]), "bias": jnp.ones_like(params0["dense"]["bias"])}})[0]) > 0
    affine = affine_logit_difference(apply_fn, params0, x)
    a, c = np.asarray(affine.a, np.float64), np.asarray(affine.c, np.float64)
    sign = 2.0 * np.asarray(y, np.float64) - 1.0
    t, w = np.polynomial.hermite_e.hermegauss(60)
    w = w / w.sum()
    p = flat.shape[0]

    def negative_elbo(z):
        m, log_v = z[:p], z[p:]
        v = np.zeros(p)
        v[~bias] = np.exp(log_v)
        g = sign[:, None] * (a @ m + c)[:, None] + np.sqrt(np.square(a) @ v)[:, None] * t[None]
        expected = np.sum(-np.logaddexp(0.0, -g) @ w)
        mk = m[~bias]
        kl = 0.5 * np.sum(LAMBDA * np.exp(log_v) + LAMBDA * mk**2 - 1.0 - np.log(LAMBDA) - log_v)
        return kl - expected

    # stationary (central differences of the independent objective at the returned optimum) ...
    z = np.concatenate([flat64(mean), np.log(np.asarray(var["dense"]["kernel"], np.float64)).ravel()])
    step = 1e-5
    grad = np.array([(negative_elbo(z + step * e) - negative_elbo(z - step * e)) / (2 * step) for e in np.eye(z.shape[0])])
    assert np.max(np.abs(grad)) < 1e-3, grad
    # ... and the minimum scipy finds from zeros
    res = scipy.optimize.minimize(negative_elbo, np.zeros_like(z), method="L-BFGS-B", options={"maxiter": 5000, "gtol": 1e-9, "ftol": 1e-14})
    np.testing.assert_allclose(z, res.x, atol=2e-3)
    assert negative_elbo(z) <= res.fun + 1e-6
    gaussian, _ = mean_field_vi(apply_fn, params0, x, y, LAMBDA)
    assert relative_l2(mean["dense"]["kernel"], gaussian["dense"]["kernel"]) > 1e-3  # the bias's prior and variance move the kernel


def _full_elbo(affine, y, m, scale):
    """The full-covariance ELBO by Gauss-Hermite, written independently: q = N(m, C C^T)."""
    a, c = jnp.asarray(affine.a), jnp.asarray(affine.c)
    sign = 2.0 * jnp.asarray(y, a.dtype) - 1.0
    cov = scale @ scale.T
    mu = sign * (a @ m + c)
    sd = jnp.sqrt(jnp.sum((a @ cov) * a, axis=1))
    t, w = np.polynomial.hermite.hermgauss(80)
    nodes, weights = jnp.asarray(np.sqrt(2.0) * t)[None, :], jnp.asarray(w / np.sqrt(np.pi))[None, :]
    expected = jnp.sum(weights * jax.nn.log_sigmoid(mu[:, None] + sd[:, None] * nodes))
    d = m.shape[0]
    kl = 0.5 * (LAMBDA * jnp.trace(cov) + LAMBDA * m @ m - d - d * jnp.log(LAMBDA) - 2.0 * jnp.sum(jnp.log(jnp.abs(jnp.diagonal(scale)))))
    return expected - kl


def test_full_covariance_vi_is_the_elbo_optimum_and_beats_mean_field():
    _, apply_fn, params0, x, y = _problem()
    mean, cov = full_covariance_vi(apply_fn, params0, x, y, LAMBDA)
    assert jax.tree.structure(mean) == jax.tree.structure(params0)
    affine = affine_logit_difference(apply_fn, params0, x)
    with jax.enable_x64(True):
        m, scale = jnp.asarray(flat64(mean)), jnp.asarray(np.linalg.cholesky(cov))
        tril = np.tril_indices(m.shape[0])

        def elbo(z):
            p = m.shape[0]
            return _full_elbo(affine, y, z[:p], jnp.zeros_like(scale).at[tril].set(z[p:]))

        z = jnp.concatenate([m, scale[tril]])
        grad = np.asarray(jax.grad(elbo)(z))
        best = float(elbo(z))
        mf_mean, mf_var = mean_field_vi(apply_fn, params0, x, y, LAMBDA)
        mean_field = float(_full_elbo(affine, y, jnp.asarray(flat64(mf_mean)), jnp.diag(jnp.sqrt(jnp.asarray(flat64(mf_var))))))
    # the mean is float32; the gradient of the float64 ELBO there is at that rounding's scale
    assert np.max(np.abs(grad)) < 1e-4
    assert best > mean_field + 1e-3  # the correlations of a softmax's two classes' weights are worth something
    assert np.abs(cov - np.diag(np.diag(cov))).max() > 0.1 * np.abs(cov).max()


def test_mean_field_vi_variances_lie_between_the_diagonal_laplace_and_the_prior():
    # For a logistic likelihood the MFVI precision is the prior plus the *expected* curvature,
    # so on a well-determined problem it is close to the diagonal Laplace's.
    _, apply_fn, params0, x, y = _problem(n=400)
    refs = references(apply_fn, params0, x, y, LAMBDA)
    median, low, high = variance_ratio(refs.mfvi[1], refs.diag_laplace[1])
    assert 0.8 < median < 1.5 and high < 1 / LAMBDA / np.min(flat64(refs.diag_laplace[1]))
    assert relative_l2(refs.mfvi[0], refs.map) < 0.1
    assert relative_l2(refs.diag_laplace[0], refs.map) == 0.0


def test_references_reject_a_model_that_is_not_affine_or_not_binary():
    _, apply3, params3, x, y3 = _problem(classes=3)
    with pytest.raises(ValueError, match="2 logits"):
        mean_field_vi(apply3, params3, x, y3, LAMBDA)
    mlp = make_model("mlp", 2, hidden=[4])
    params = init_params(mlp, jax.random.key(0), (3,))
    _, _, _, x, y = _problem()
    with pytest.raises(ValueError, match="not affine"):
        mean_field_vi(lambda p, xs: mlp.apply({"params": p}, xs), params, x, y, LAMBDA)


def test_affine_predictive_metrics():
    _, apply_fn, params0, x, y = _problem()
    theta = map_estimate(negative_log_joint(apply_fn, x, y, LAMBDA), params0)
    point = affine_predictive_metrics(apply_fn, theta, None, x, y)
    direct = classification_metrics(apply_fn(theta, jnp.asarray(x)), jnp.asarray(y))
    for k in ("accuracy", "nll", "ece"):
        assert point[k] == pytest.approx(float(direct[k]), rel=1e-5, abs=1e-6)
    # with a variance: the predictive probability against Monte Carlo through the model
    var = jax.tree.map(lambda a: jnp.full_like(a, 0.3), theta)
    exact = affine_predictive_metrics(apply_fn, theta, var, x, y)
    m, unravel = ravel_pytree(theta)
    draws = m[None, :] + jnp.sqrt(0.3) * jax.random.normal(jax.random.key(0), (20000, m.shape[0]))
    probs = jnp.mean(jax.vmap(lambda t: jax.nn.softmax(apply_fn(unravel(t), jnp.asarray(x))))(draws), axis=0)
    mc_nll = float(-jnp.mean(jnp.log(probs[jnp.arange(len(y)), y])))
    assert exact["nll"] == pytest.approx(mc_nll, rel=5e-3)
    assert exact["nll"] > point["nll"] - 1.0  # finite and of the same order
    # a diagonal covariance given in full is the same predictive
    full = affine_predictive_metrics(apply_fn, theta, None, x, y, covariance=0.3 * np.eye(m.shape[0]))
    assert full == pytest.approx(exact, rel=1e-6)  # the variance leaves hold float32(0.3)


def test_distances():
    a = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([2.0])}
    b = {"w": jnp.array([1.0, 2.0]), "b": jnp.array([0.0])}
    assert relative_l2(a, a) == 0.0
    assert relative_l2(a, b) == pytest.approx(2.0 / np.sqrt(5.0))
    assert variance_ratio(a, {"w": jnp.array([1.0, 1.0]), "b": jnp.array([4.0])}) == (1.0, 0.5, 2.0)
    mp, vp, mq, vq = np.array([0.3, -1.0]), np.array([0.5, 2.0]), np.array([0.0, 1.0]), np.array([1.0, 0.25])
    expected = sum(np.log(np.sqrt(vq[i]) / np.sqrt(vp[i])) + (vp[i] + (mp[i] - mq[i]) ** 2) / (2 * vq[i]) - 0.5 for i in range(2))
    assert kl_diag(mp, vp, mq, vq) == pytest.approx(expected)
    assert kl_diag(mp, vp, mp, vp) == 0.0
    with pytest.raises(ValueError, match="structure"):
        relative_l2(a, {"w": jnp.array([1.0, 2.0, 3.0])})
    with pytest.raises(ValueError, match="> 0"):
        kl_diag(mp, np.zeros(2), mq, vq)


def test_expected_fisher_laplace_is_the_fixed_point_of_the_curvature_averaged_over_itself():
    """FedEP's ngvi target: P = lambda + E_{N(theta*, 1/P)}[diag H(theta)] (the softmax Hessian is
    its GGN), checked by Monte Carlo through the closed-form Hessian at drawn weights; centred at
    the MAP, with variances that differ from the diagonal Laplace's (the curvature at the mode)."""
    model, apply_fn, params0, x, y = _problem(n=30, d=2)
    loss = negative_log_joint(apply_fn, x, y, LAMBDA)
    theta = map_estimate(loss, params0)
    mean, var = expected_fisher_laplace(apply_fn, theta, x, LAMBDA)
    assert relative_l2(mean, theta) < 1e-6
    _, lap_var = diagonal_laplace(loss, theta)
    v, v_lap = flat64(var), flat64(lap_var)
    assert np.max(np.abs(v / v_lap - 1)) > 0.01
    flat, unravel = ravel_pytree(theta)
    rng = np.random.default_rng(0)
    draws = np.asarray(flat, np.float64) + rng.normal(size=(4000, flat.size)) * np.sqrt(v)
    curvature = np.mean([np.diag(_closed_form_hessian(unravel(jnp.asarray(d, jnp.float32)), x, y)) for d in draws], axis=0)
    np.testing.assert_allclose(1.0 / v, curvature, rtol=0.03)  # the helper's Hessian includes the prior LAMBDA I


def test_full_covariance_vi_converges_where_the_unit_step_swings(monkeypatch):
    """Digits 3 vs 8, standardised (the posterior benchmark's problem): the undamped
    natural-gradient iteration swings without converging (MIN_VI_STEP = 1 keeps every step at 1);
    the damped one reaches the ELBO's stationary point."""
    from fedbayes.data.sklearn_data import load_digits
    from fedbayes.evaluation import reference

    d = load_digits()
    pick = np.isin(d.y_train, (3, 8))
    x = d.x_train[pick].reshape(int(pick.sum()), -1).astype(np.float64)
    keep = x.std(axis=0) > 0
    x = ((x[:, keep] - x.mean(axis=0)[keep]) / x.std(axis=0)[keep]).astype(np.float32)
    y = (d.y_train[pick] == 8).astype(np.int32)
    model = make_model("logreg", 2)
    params0 = jax.tree.map(jnp.zeros_like, init_params(model, jax.random.key(0), (x.shape[1],)))
    apply_fn = lambda p, xs: model.apply({"params": p}, xs)  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(reference, "MIN_VI_STEP", 1.0)
        with pytest.raises(ValueError, match="did not converge"):
            full_covariance_vi(apply_fn, params0, x, y, 1.0, max_steps=200)
    mean, cov = full_covariance_vi(apply_fn, params0, x, y, 1.0)
    affine = affine_logit_difference(apply_fn, params0, x)
    with jax.enable_x64(True):
        a, c = jnp.asarray(affine.a), jnp.asarray(affine.c)
        mu, sd = a @ jnp.asarray(flat64(mean)) + c, jnp.sqrt(jnp.sum((a @ jnp.asarray(cov)) * a, axis=1))
        t, w = np.polynomial.hermite.hermgauss(80)
        g = mu[:, None] + sd[:, None] * jnp.asarray(np.sqrt(2.0) * t)[None, :]
        s = 2.0 * jnp.asarray(y, jnp.float64)[:, None] - 1.0
        residual = jnp.sum(jnp.asarray(w / np.sqrt(np.pi))[None, :] * s * jax.nn.sigmoid(-s * g), axis=-1)
        data_term = np.asarray(a.T @ residual)
    grad = data_term - flat64(mean)  # the mean's stationarity condition (prior precision 1)
    assert np.max(np.abs(grad)) < 1e-3 * np.max(np.abs(data_term))


@pytest.mark.parametrize("tilted", ["laplace", "ngvi"])
def test_sep_fixed_point_of_one_factor_or_identical_factors_is_the_pooled_one(tilted):
    """One factor: the cavity is the prior and SEP's fixed point is the pooled tilted fit itself
    (the diagonal Laplace, or the expected-Fisher Laplace). K identical factors: the average site
    is each factor's own, so SEP is EP, whose fixed point is the same fit of the pooled data."""
    model, apply_fn, params0, x, y = _problem(n=30, d=2)
    xs, ys = np.concatenate([x] * 3), np.concatenate([y] * 3)
    for data, parts in (((x, y), [np.arange(30)]), ((xs, ys), [np.arange(30) + 30 * k for k in range(3)])):
        loss = negative_log_joint(apply_fn, *data, LAMBDA)
        theta = map_estimate(loss, params0)
        want = diagonal_laplace(loss, theta) if tilted == "laplace" else expected_fisher_laplace(apply_fn, theta, data[0], LAMBDA)
        got = sep_fixed_point(apply_fn, params0, *data, parts, LAMBDA, tilted=tilted)
        assert relative_l2(got[0], want[0]) < 1e-5
        np.testing.assert_allclose(flat64(got[1]), flat64(want[1]), rtol=1e-5)


def test_sep_fixed_point_solves_its_equations_and_is_not_ep_on_unlike_factors():
    """Three label-skewed factors: at the returned q, each factor's Laplace fit of its tilted
    distribution, with the cavity p_0 (q / p_0)^(1 - n_k / N) and the mode found by scipy and the
    Hessian in closed form, averages back to q in natural parameters; and q is not EP's fixed
    point (the pooled diagonal Laplace), which a cavity that removed each factor's own share
    would reach."""
    model, apply_fn, params0, x, y = _problem(n=60, d=2, seed=3)
    order = np.argsort(y + 0.3 * np.random.default_rng(0).normal(size=len(y)))
    parts = [order[:12], order[12:36], order[36:]]
    mean, var = sep_fixed_point(apply_fn, params0, x, y, parts, LAMBDA)
    m, unravel = ravel_pytree(mean)
    m, precision = np.asarray(m, np.float64), 1.0 / flat64(var)
    eta = precision * m
    sites_eta, sites_precision = [], []
    for idx in parts:
        rest = 1.0 - len(idx) / len(y)
        cav_precision, cav_eta = LAMBDA + rest * (precision - LAMBDA), rest * eta
        data_loss = negative_log_joint(apply_fn, x[idx], y[idx], 1.0)

        def tilted(z, data_loss=data_loss, cav_precision=cav_precision, cav_eta=cav_eta):
            with jax.enable_x64(True):
                value = float(data_loss(unravel(jnp.asarray(z)))) - 0.5 * float(np.sum(np.square(z)))  # drop the helper's unit prior
            return value + 0.5 * np.sum(cav_precision * z * z) - cav_eta @ z

        mode = scipy.optimize.minimize(tilted, m, method="BFGS", options={"gtol": 1e-10}).x
        curvature = np.diag(_closed_form_hessian(unravel(jnp.asarray(mode, jnp.float32)), x[idx], y[idx])) - LAMBDA
        sites_precision.append(cav_precision + curvature)
        sites_eta.append((cav_precision + curvature) * mode)
    np.testing.assert_allclose(np.mean(sites_precision, axis=0), precision, rtol=1e-4)
    np.testing.assert_allclose(np.mean(sites_eta, axis=0) / np.mean(sites_precision, axis=0), m, rtol=1e-3, atol=1e-4)
    loss = negative_log_joint(apply_fn, x, y, LAMBDA)
    ep_mean, _ = diagonal_laplace(loss, map_estimate(loss, params0))
    assert relative_l2(mean, ep_mean) > 0.02


def test_sep_fixed_point_rejects_unknown_settings():
    model, apply_fn, params0, x, y = _problem(n=20, d=2)
    with pytest.raises(ValueError, match="tilted must be one of laplace, ngvi"):
        sep_fixed_point(apply_fn, params0, x, y, [np.arange(20)], LAMBDA, tilted="nuts")
    with pytest.raises(ValueError, match="power must be one of"):
        sep_fixed_point(apply_fn, params0, x, y, [np.arange(20)], LAMBDA, power="half")
