"""Centralised reference posteriors of a model on pooled data, computed in float64.

The yardsticks a federated posterior is measured against (``fedbayes bench posterior``): with the
negative log joint

    L(theta) = sum_i CE(f(theta, x_i), y_i) + (lambda / 2) ||theta||^2,

i.e. a softmax likelihood and the prior N(0, I / lambda) on every parameter (bias included),

* :func:`map_estimate`: the MAP ``theta* = argmin L`` by damped Newton;
* :func:`diagonal_laplace`: ``N(theta*, 1 / diag(H))`` with ``H = nabla^2 L(theta*)``, the fixed
  point of a diagonal Laplace / GGN method (FedLap-Cov, FedEP with Laplace or NGVI clients);
* :func:`laplace_marginals`: ``N(theta*, diag(H^{-1}))``, the marginals of the full Laplace
  approximation (Laplace Redux, Daxberger et al. 2021);
* :func:`mean_field_vi`: the exact optimum of the mean-field Gaussian ELBO for a model that is
  affine in its parameters with two classes (binary logistic regression), the fixed point of PVI
  (Partitioned Variational Inference, Ashman et al. 2022) and of a federated mean-field VBNN;
* :func:`full_covariance_vi`: the optimum of the full-covariance Gaussian ELBO of such a model
  (Opper & Archambeau 2009), the fixed point of PVI with ``covariance = "full"``.

For an affine two-class model the logit difference ``g_i(theta) = f_1 - f_0 = a_i^T theta + c_i``
is Gaussian under a diagonal Gaussian ``q = N(m, diag(v))``: ``g_i ~ N(a_i^T m + c_i,
sum_j a_ij^2 v_j)``. The expected log-likelihood and the predictive ``E_q[sigmoid(g_i)]`` are
then one-dimensional integrals, computed exactly (to float64 rounding) by Gauss-Hermite
quadrature (:func:`affine_predictive_metrics`).

All arithmetic runs under ``jax.enable_x64``; results come back as float32 pytrees shaped like the
parameters. Newton's method on the flat parameter vector (``jax.flatten_util.ravel_pytree``) is
written here rather than taken from optax or jax.scipy: the problems are small (tens to hundreds of
parameters), the exact Hessian is cheap, and Newton reaches float64 rounding in a dozen steps where
the first-order solvers stop at their tolerances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree

from fedbayes.evaluation.metrics import classification_metrics

__all__ = [
    "GAUSS_HERMITE_NODES",
    "AffineLogits",
    "References",
    "affine_logit_difference",
    "affine_predictive_metrics",
    "diagonal_laplace",
    "expected_fisher_laplace",
    "full_covariance_vi",
    "laplace_covariance",
    "laplace_marginals",
    "map_estimate",
    "mean_field_elbo",
    "mean_field_vi",
    "negative_log_joint",
    "references",
]

PyTree = Any
Loss = Callable[[PyTree], jax.Array]

GAUSS_HERMITE_NODES = 80
"""Quadrature nodes for the 1-D Gaussian integrals; 80 nodes integrate log-sigmoid of a Gaussian to
float64 rounding for the logit scales of a standardised logistic regression."""
# The smallest step of the damped full-covariance VI iteration (full_covariance_vi).
MIN_VI_STEP = 1.0 / 64.0


def _to64(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), tree)


def _to32(tree: PyTree) -> PyTree:
    return jax.tree.map(lambda a: jnp.asarray(np.asarray(a), jnp.float32), tree)


def negative_log_joint(apply_fn: Callable[[PyTree, jax.Array], jax.Array], x: Any, y: Any, prior_precision: float) -> Loss:
    """``L(theta) = sum_i CE(apply_fn(theta, x)_i, y_i) + (prior_precision / 2) ||theta||^2``.

    The sum (not the mean) of the softmax cross-entropies over all examples, plus the Gaussian
    prior N(0, I / prior_precision) on every leaf. The features are held in float64 and converted
    when the loss is called, so under ``jax.enable_x64`` with float64 parameters the whole loss is
    float64.

    Args:
        apply_fn: ``apply_fn(params, x) -> logits [n, C]``.
        x: features ``[n, ...]``.
        y: int labels ``[n]``.
        prior_precision: lambda > 0.

    Raises:
        ValueError: for ``prior_precision <= 0`` or ``x`` and ``y`` of different lengths.
    """
    if not prior_precision > 0:
        raise ValueError(f"prior_precision must be > 0, got {prior_precision}")
    x64 = np.asarray(x, np.float64)
    labels = np.asarray(y, np.int64)
    if x64.shape[0] != labels.shape[0]:
        raise ValueError(f"x and y must have the same length, got {x64.shape[0]} and {labels.shape[0]}")

    def loss(params: PyTree) -> jax.Array:
        dtype = jnp.result_type(*jax.tree.leaves(params))
        logits = apply_fn(params, jnp.asarray(x64, dtype))
        nll = jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(labels)))
        sq = sum(jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(params))
        return nll + 0.5 * prior_precision * sq

    return loss


# A decrease ``f`` cannot resolve in float64: a few units of its relative rounding.
_ROUNDING = 16 * float(np.finfo(np.float64).eps)


def _newton(f: Callable[[jax.Array], jax.Array], z0: jax.Array, max_steps: int, tol: float, what: str) -> jax.Array:
    """Damped Newton minimisation of ``f`` on a flat float64 vector (call under x64).

    Levenberg-style damping ``H + mu I`` when the Hessian is not positive definite, then an Armijo
    backtracking line search. Converged when ``max |grad| <= tol * max(1, |f|)``, or when the
    line search can no longer decrease ``f`` and the Newton decrement is at float64 rounding.
    Where the decrement ``g^T (H + mu I)^{-1} g`` (twice the decrease the quadratic model
    predicts; Boyd and Vandenberghe 2004, Section 9.5.1) is below the rounding of ``f`` itself,
    Armijo's test compares rounding errors, so at a positive definite ``H`` the full Newton step
    is taken without it: there the quadratic model is exact to that order, and one such step takes
    the gradient from what ``f`` can no longer resolve to float64 rounding.
    Hand-written: optax has no Newton method and scipy is not a runtime dependency; with the exact
    Hessian of these small problems (a few hundred parameters) it reaches float64 rounding in a
    few steps, which the references need (L-BFGS stops orders of magnitude earlier).
    """
    value_and_grad = jax.jit(jax.value_and_grad(f))
    hessian = jax.jit(jax.hessian(f))
    f_jit = jax.jit(f)
    z, rounded = z0, False
    for _ in range(max_steps):
        value, grad = value_and_grad(z)
        value, grad = float(value), np.asarray(grad)
        if not np.isfinite(value) or not np.all(np.isfinite(grad)):
            raise ValueError(f"{what}: non-finite objective or gradient")
        if np.max(np.abs(grad)) <= tol * max(1.0, abs(value)):
            return z
        h = np.asarray(hessian(z))
        h = 0.5 * (h + h.T)
        mu, scale = 0.0, max(1e-12, float(np.max(np.abs(np.diag(h)))))
        while True:
            try:
                chol = np.linalg.cholesky(h + mu * np.eye(h.shape[0]))
                break
            except np.linalg.LinAlgError:
                mu = max(2.0 * mu, 1e-10 * scale)
        direction = -np.linalg.solve(chol.T, np.linalg.solve(chol, grad))
        decrement = -float(grad @ direction)  # g^T (H + mu I)^{-1} g >= 0
        if mu == 0.0 and decrement <= _ROUNDING * max(1.0, abs(value)):
            if rounded:  # a full step at rounding already taken: the gradient is what f resolves
                return z
            z, rounded = z + direction, True
            continue
        step, accepted = 1.0, False
        while step > 1e-12:
            trial = z + step * direction
            new = float(f_jit(trial))
            if np.isfinite(new) and new <= value - 1e-4 * step * decrement:
                accepted = True
                break
            step *= 0.5
        if not accepted:
            if decrement <= 1e-20 * max(1.0, abs(value)) or decrement <= 1e-24:
                return z
            raise ValueError(f"{what}: line search failed (max |grad| {np.max(np.abs(grad)):.3g})")
        z = trial
    raise ValueError(f"{what}: Newton did not converge in {max_steps} steps (max |grad| {np.max(np.abs(grad)):.3g}, tol {tol})")


def map_estimate(loss: Loss, params0: PyTree, *, max_steps: int = 100, tol: float = 1e-9) -> PyTree:
    """The minimiser of ``loss`` (a MAP estimate for :func:`negative_log_joint`), float32 pytree.

    Damped Newton in float64 on the flat vector from ``ravel_pytree``, started at ``params0``.

    Raises:
        ValueError: if ``max |grad| <= tol * max(1, |loss|)`` is not reached in ``max_steps``.
    """
    with jax.enable_x64(True):
        return _to32(_map64(loss, params0, max_steps, tol))


def _map64(loss: Loss, params0: PyTree, max_steps: int = 100, tol: float = 1e-9) -> PyTree:
    flat0, unravel = ravel_pytree(_to64(params0))
    z = _newton(lambda z: loss(unravel(z)), flat0, max_steps, tol, "map_estimate")
    return unravel(z)


def _hessian64(loss: Loss, params: PyTree) -> tuple[np.ndarray, Callable[[jax.Array], PyTree]]:
    flat, unravel = ravel_pytree(_to64(params))
    h = np.asarray(jax.jit(jax.hessian(lambda z: loss(unravel(z))))(flat))
    return 0.5 * (h + h.T), unravel


def diagonal_laplace(loss: Loss, map_params: PyTree) -> tuple[PyTree, PyTree]:
    """The diagonal-precision Laplace approximation ``N(theta*, 1 / diag(H))`` at ``map_params``.

    ``H`` is the exact Hessian of ``loss`` at ``map_params`` (float64). This is the fixed point of a
    diagonal Laplace/GGN federated method: each site's precision is the diagonal of its share of
    the Hessian, and their product's precision is ``diag(H)``.

    Returns:
        ``(mean, variance)`` float32 pytrees shaped like ``map_params``.

    Raises:
        ValueError: if a diagonal entry of ``H`` is not positive.
    """
    with jax.enable_x64(True):
        h, unravel = _hessian64(loss, map_params)
        diag = np.diag(h)
        if not np.all(diag > 0):
            raise ValueError("diagonal_laplace: the Hessian's diagonal is not positive at map_params")
        return _to32(map_params), _to32(unravel(jnp.asarray(1.0 / diag)))


def laplace_marginals(loss: Loss, map_params: PyTree) -> tuple[PyTree, PyTree]:
    """The marginals ``N(theta*, diag(H^{-1}))`` of the full Laplace approximation at ``map_params``.

    Raises:
        ValueError: if the Hessian is not positive definite.
    """
    with jax.enable_x64(True):
        h, unravel = _hessian64(loss, map_params)
        try:
            chol = np.linalg.cholesky(h)
        except np.linalg.LinAlgError as err:
            raise ValueError("laplace_marginals: the Hessian is not positive definite at map_params") from err
        inv_chol = np.linalg.solve(chol, np.eye(h.shape[0]))
        marginal = np.sum(np.square(inv_chol), axis=0)  # diag(L^-T L^-1)
        return _to32(map_params), _to32(unravel(jnp.asarray(marginal)))


def laplace_covariance(loss: Loss, map_params: PyTree) -> np.ndarray:
    """The full Laplace covariance ``H^{-1}`` at ``map_params``, float64 ``[P, P]`` in the flat
    order of ``ravel_pytree`` (for a predictive that keeps the correlations).

    Raises:
        ValueError: if the Hessian is not positive definite.
    """
    with jax.enable_x64(True):
        h, _ = _hessian64(loss, map_params)
        try:
            inv_chol = np.linalg.solve(np.linalg.cholesky(h), np.eye(h.shape[0]))
        except np.linalg.LinAlgError as err:
            raise ValueError("laplace_covariance: the Hessian is not positive definite at map_params") from err
        return inv_chol.T @ inv_chol


class AffineLogits(NamedTuple):
    """The logit difference of an affine two-class model: ``g = a @ theta_flat + c``.

    Attributes:
        a: ``[n, P]`` float64, the Jacobian of ``f_1 - f_0`` in the flat parameters.
        c: ``[n]`` float64, the offset (``g`` at ``theta = 0``).
        unravel: maps a flat ``[P]`` vector back to the parameter pytree.
    """

    a: np.ndarray
    c: np.ndarray
    unravel: Callable[[jax.Array], PyTree]


def affine_logit_difference(apply_fn: Callable[[PyTree, jax.Array], jax.Array], params0: PyTree, x: Any) -> AffineLogits:
    """Decomposes the logit difference of a two-class model affine in its parameters.

    The Jacobian is taken at ``params0`` and at a second, deterministic point; the model is
    accepted when the two agree and ``g(theta_2) = g(theta_1) + J (theta_2 - theta_1)``.

    Raises:
        ValueError: if the model does not give 2 logits per example or is not affine in its
            parameters.
    """
    with jax.enable_x64(True):
        flat0, unravel = ravel_pytree(_to64(params0))
        x64 = jnp.asarray(np.asarray(x, np.float64))

        def diff(z: jax.Array) -> jax.Array:
            logits = apply_fn(unravel(z), x64)
            if logits.ndim != 2 or logits.shape[1] != 2:
                raise ValueError(f"reference: the model must give 2 logits per example (a 2-class model), got shape {logits.shape}")
            return logits[:, 1] - logits[:, 0]

        jac = jax.jit(jax.jacfwd(diff))
        z1 = flat0
        z2 = flat0 + jnp.asarray(np.random.default_rng(0).normal(size=flat0.shape))
        a1, a2 = np.asarray(jac(z1)), np.asarray(jac(z2))
        g1, g2 = np.asarray(diff(z1)), np.asarray(diff(z2))
        scale = max(1.0, float(np.max(np.abs(a1))))
        pred = g1 + a1 @ np.asarray(z2 - z1)
        if not (np.allclose(a1, a2, atol=1e-9 * scale, rtol=1e-9) and np.allclose(pred, g2, atol=1e-8 * scale * max(1.0, float(np.max(np.abs(g2)))))):
            raise ValueError("reference: the model is not affine in its parameters (exact mean-field VI needs a linear model such as logreg)")
        c = g1 - a1 @ np.asarray(z1)
        return AffineLogits(a=a1, c=c, unravel=unravel)


def _hermite(num_nodes: int) -> tuple[jax.Array, jax.Array]:
    t, w = np.polynomial.hermite.hermgauss(num_nodes)
    # E_{z ~ N(0,1)}[h(z)] = sum_k w_k / sqrt(pi) h(sqrt(2) t_k); shaped [1, K] to broadcast over examples
    return jnp.asarray(np.sqrt(2.0) * t)[None, :], jnp.asarray(w / np.sqrt(np.pi))[None, :]


def _expected_log_sigmoid(mu: jax.Array, sd: jax.Array, nodes: int) -> jax.Array:
    """``E[log sigmoid(g)]`` for ``g ~ N(mu, sd^2)``, elementwise, by Gauss-Hermite."""
    t, w = _hermite(nodes)
    return jnp.sum(w * jax.nn.log_sigmoid(mu[:, None] + sd[:, None] * t), axis=-1)


def mean_field_elbo(
    affine: AffineLogits,
    y: Any,
    prior_precision: float,
    mean: jax.Array,
    log_variance: jax.Array,
    nodes: int = GAUSS_HERMITE_NODES,
    random: np.ndarray | None = None,
) -> jax.Array:
    """The ELBO of ``q = N(mean, diag(exp(log_variance)))`` (flat vectors) for an affine 2-class model.

    ``ELBO = sum_i E_q[log sigmoid(s_i g_i)] - KL(q || N(0, I / lambda))`` with ``s_i = 2 y_i - 1``
    and ``g_i ~ N(a_i^T m + c_i, sum_j a_ij^2 v_j)`` under q; the expectation by Gauss-Hermite.
    With ``random`` (a flat bool mask), only those coordinates are Gaussian: ``log_variance`` holds
    theirs alone, and the others are points with no prior (no variance, no KL term), as a
    variational layer's deterministic bias. Call under ``jax.enable_x64`` for float64.
    """
    a, c = jnp.asarray(affine.a), jnp.asarray(affine.c)
    sign = 2.0 * jnp.asarray(np.asarray(y), a.dtype) - 1.0
    var = jnp.exp(log_variance)
    lam = prior_precision
    if random is None:
        kl_mean = mean
        full_var = var
    else:
        index = np.flatnonzero(random)
        kl_mean = mean[index]
        full_var = jnp.zeros(mean.shape, var.dtype).at[index].set(var)
    mu = sign * (a @ mean + c)
    sd = jnp.sqrt(jnp.square(a) @ full_var)
    expected = jnp.sum(_expected_log_sigmoid(mu, sd, nodes))
    kl = 0.5 * jnp.sum(lam * var + lam * jnp.square(kl_mean) - 1.0 - jnp.log(lam) - log_variance)
    return expected - kl


def mean_field_vi(
    apply_fn: Callable[[PyTree, jax.Array], jax.Array],
    params0: PyTree,
    x: Any,
    y: Any,
    prior_precision: float,
    *,
    max_steps: int = 100,
    tol: float = 1e-9,
    nodes: int = GAUSS_HERMITE_NODES,
    points: PyTree | None = None,
) -> tuple[PyTree, PyTree]:
    """The exact optimum of the mean-field Gaussian ELBO of an affine 2-class model.

    Maximises :func:`mean_field_elbo` over the mean and the log-variance by damped Newton in
    float64, started from the diagonal Laplace approximation at the MAP. ``params0`` fixes the
    parameter structure and starts the MAP search.

    ``points``, a pytree of bools like ``params0``, makes the marked parameters points without a
    prior: they are optimised with the mean (at no variance, with no KL term), and their variance is
    returned as 0. That is the objective of a variational layer whose bias is deterministic and
    carries no prior (the VBNN's, :mod:`fedbayes.models.variational`): its clients' ELBO has no
    term for the bias but the data's, so its optimum is this one, not the all-Gaussian one.

    Returns:
        ``(mean, variance)`` float32 pytrees shaped like ``params0``.

    Raises:
        ValueError: for a model that is not affine in its parameters or not 2-class, or if the
            optimisation does not converge.
    """
    affine = affine_logit_difference(apply_fn, params0, x)
    loss = negative_log_joint(apply_fn, x, y, prior_precision)
    random = None
    if points is not None:
        random = ~np.asarray(ravel_pytree(jax.tree.map(lambda p, b: jnp.full(jnp.shape(p), bool(b)), params0, points))[0], bool)
    with jax.enable_x64(True):
        map64 = _map64(loss, params0, max_steps, tol)
        h, unravel = _hessian64(loss, map64)
        m0, _ = ravel_pytree(map64)
        log_v0 = -np.log(np.diag(h))
        z0 = jnp.concatenate([m0, jnp.asarray(log_v0 if random is None else log_v0[random])])
        p = m0.shape[0]
        z = _newton(lambda z: -mean_field_elbo(affine, y, prior_precision, z[:p], z[p:], nodes, random), z0, max_steps, tol, "mean_field_vi")
        var = jnp.exp(z[p:]) if random is None else jnp.zeros(p, z.dtype).at[np.flatnonzero(random)].set(jnp.exp(z[p:]))
        return _to32(unravel(z[:p])), _to32(unravel(var))


def expected_fisher_laplace(
    apply_fn: Callable[[PyTree, jax.Array], jax.Array],
    map_params: PyTree,
    x: Any,
    prior_precision: float,
    *,
    nodes: int = GAUSS_HERMITE_NODES,
    max_steps: int = 500,
    tol: float = 1e-10,
) -> tuple[PyTree, PyTree]:
    """The fixed point of a diagonal NGVI-Laplace posterior: ``N(theta*, 1 / P)`` with
    ``P = lambda + E_{theta ~ N(theta*, diag(1 / P))}[diag GGN(theta)]``, for an affine 2-class model.

    It is what FedEP's ngvi client targets (Guo et al., "Federated Learning as Variational
    Inference: A Scalable Expectation Propagation Approach", Alg. 5): the mean stays the tilted
    mode (the MAP at the fixed point) and the precision is the Fisher averaged over weights drawn
    from the approximation itself, not taken at the mode as the diagonal Laplace's is. For the
    2-class softmax the GGN is ``sum_i p_i (1 - p_i) a_i a_i^T`` with ``a_i`` the gradient of the
    logit difference ``g_i``, and under ``q`` ``g_i ~ N(a_i^T theta* + c_i, sum_j a_ij^2 / P_j)``,
    so ``E_q[p (1 - p)]`` is a 1-D Gauss-Hermite integral per example; ``P`` is found by the
    fixed-point iteration, started at the diagonal Laplace precision. Averaged over ``q`` the
    curvature ``p (1 - p)`` can fall (a logit near 0 at the mode) or rise (a confident one), so the
    variances can be wider or narrower than the diagonal Laplace's. The sampled-label Fisher of the
    client equals the GGN in expectation.

    Raises:
        ValueError: for a model that is not affine with 2 classes, or no convergence.
    """
    affine = affine_logit_difference(apply_fn, map_params, x)
    with jax.enable_x64(True):
        a = jnp.asarray(affine.a)
        m, _ = ravel_pytree(_to64(map_params))
        mu = a @ m + jnp.asarray(affine.c)
        a2 = a * a
        t, w = _hermite(nodes)

        def update(precision):
            sd = jnp.sqrt(a2 @ (1.0 / precision))
            p = jax.nn.sigmoid(mu[:, None] + sd[:, None] * t)
            curvature = jnp.sum(w * p * (1.0 - p), axis=-1)
            return prior_precision + a2.T @ curvature

        update = jax.jit(update)
        precision = update(jnp.full(m.shape, jnp.inf))  # at the mode: the diagonal GGN Laplace
        for _ in range(max_steps):
            new = update(precision)
            if float(jnp.max(jnp.abs(new - precision) / precision)) < tol:
                return _to32(affine.unravel(m)), _to32(affine.unravel(1.0 / new))
            precision = new
    raise ValueError(f"expected_fisher_laplace: the fixed-point iteration did not converge in {max_steps} steps")


def full_covariance_vi(
    apply_fn: Callable[[PyTree, jax.Array], jax.Array],
    params0: PyTree,
    x: Any,
    y: Any,
    prior_precision: float,
    *,
    max_steps: int = 500,
    tol: float = 1e-10,
    nodes: int = GAUSS_HERMITE_NODES,
) -> tuple[PyTree, np.ndarray]:
    """The optimum of the full-covariance Gaussian ELBO of an affine 2-class model:
    ``q = N(m, Sigma)`` maximising ``sum_i E_q[log sigmoid(s_i g_i)] - KL(q || N(0, I / lambda))``.

    Its stationarity conditions (Opper & Archambeau 2009, "The variational Gaussian approximation
    revisited", Eqs. 11-12) are

        Sigma^{-1} = lambda I + sum_i E_q[sigmoid'(g_i)] a_i a_i^T,
        lambda m = sum_i E_q[s_i sigmoid(-s_i g_i)] a_i,

    with ``g_i ~ N(a_i^T m + c_i, a_i^T Sigma a_i)`` under ``q``, so both expectations are 1-D
    Gauss-Hermite integrals. They are solved by the iteration that sets ``Sigma^{-1}`` from the
    first and takes a Newton step on the mean with that matrix (natural-gradient VI, Khan & Lin
    2017), started from the full Laplace approximation at the MAP, in float64. The unit step can
    swing without converging (it does on digits 3 vs 8), so the step is damped: halved (down to
    :data:`MIN_VI_STEP`) after an iteration whose residual grew, grown by half again (up to 1)
    after one whose residual shrank; a damped natural-gradient step has the same fixed point.

    Returns:
        ``(mean, covariance)``: a float32 pytree shaped like ``params0`` and the ``[P, P]`` float64
        covariance in ``ravel_pytree`` order.

    Raises:
        ValueError: for a model that is not affine with 2 classes, or no convergence.
    """
    affine = affine_logit_difference(apply_fn, params0, x)
    loss = negative_log_joint(apply_fn, x, y, prior_precision)
    with jax.enable_x64(True):
        map64 = _map64(loss, params0)
        h, unravel = _hessian64(loss, map64)
        m, _ = ravel_pytree(map64)
        a, c = jnp.asarray(affine.a), jnp.asarray(affine.c)
        sign = 2.0 * jnp.asarray(np.asarray(y), a.dtype) - 1.0
        t, w = _hermite(nodes)
        eye = jnp.eye(m.shape[0], dtype=a.dtype)

        def update(m, precision):
            cov = jnp.linalg.inv(precision)
            mu = a @ m + c
            sd = jnp.sqrt(jnp.maximum(jnp.sum((a @ cov) * a, axis=1), 0.0))
            g = mu[:, None] + sd[:, None] * t
            p = jax.nn.sigmoid(g)
            curvature = jnp.sum(w * p * (1.0 - p), axis=-1)
            residual = jnp.sum(w * sign[:, None] * jax.nn.sigmoid(-sign[:, None] * g), axis=-1)
            new_precision = prior_precision * eye + (a * curvature[:, None]).T @ a
            new_precision = 0.5 * (new_precision + new_precision.T)
            grad = a.T @ residual - prior_precision * m
            return m + jnp.linalg.solve(new_precision, grad), new_precision

        update = jax.jit(update)
        precision = jnp.asarray(h)
        step, last = 1.0, np.inf
        for _ in range(max_steps):
            new_m, new_precision = update(m, precision)
            change = max(
                float(jnp.max(jnp.abs(new_m - m)) / jnp.maximum(jnp.max(jnp.abs(m)), 1e-12)),
                float(jnp.max(jnp.abs(new_precision - precision)) / jnp.max(jnp.abs(precision))),
            )
            if change < tol:
                cov = np.linalg.inv(np.asarray(new_precision))
                return _to32(unravel(new_m)), 0.5 * (cov + cov.T)
            # a residual that grew: the unit step overshoots (it swings on some problems); halve it
            step = max(step / 2.0, MIN_VI_STEP) if change > last else min(1.0, 1.5 * step)
            last = change
            m, precision = m + step * (new_m - m), precision + step * (new_precision - precision)
    raise ValueError(f"full_covariance_vi: the fixed-point iteration did not converge in {max_steps} steps")


SEP_TILTED = ("laplace", "ngvi")
SEP_POWERS = ("data_fraction", "one_over_k")


def sep_fixed_point(
    apply_fn: Callable[[PyTree, jax.Array], jax.Array],
    params0: PyTree,
    x: Any,
    y: Any,
    parts: Sequence[Any],
    prior_precision: float,
    *,
    tilted: str = "laplace",
    power: str = "data_fraction",
    nodes: int = GAUSS_HERMITE_NODES,
    max_steps: int = 5000,
    tol: float = 1e-10,
) -> tuple[PyTree, PyTree]:
    """The fixed point of stochastic (averaged) EP over a partition of the data, diagonal family,
    for an affine 2-class model: what FedSEP with all clients in every round converges to.

    SEP (Li, Hernandez-Lobato & Turner 2015, "Stochastic Expectation Propagation"; FedSEP: Guo et
    al. 2023 (FedEP) Sec. 2.2.4) keeps one average site ``f`` with ``q = p_0 f^K`` instead of one
    site per factor. Factor ``k`` (client ``k``'s data ``D_k``, ``n_k`` of the ``N`` examples) sees
    the cavity ``c_k = p_0 (q / p_0)^(1 - r_k)``, ``r_k = n_k / N`` (``power="data_fraction"``)
    or ``1 / K`` (``"one_over_k"``), fits its tilted distribution ``c_k p(D_k | theta)`` with a
    diagonal Gaussian ``t_k``, and the server moves ``q`` by ``sum_k (t_k - q)`` in natural
    parameters, so the fixed point is

        q = (1 / K) sum_k t_k(q)        (natural parameters: precision-means and precisions).

    ``t_k`` is, for ``tilted="laplace"``, ``N(m_k, 1 / (Lambda_{c_k} + diag GGN_k(m_k)))`` with
    ``m_k`` the tilted mode; for ``"ngvi"`` the same mean with the precision ``P_k = Lambda_{c_k}
    + E_{N(m_k, 1 / P_k)}[diag GGN_k]`` (:func:`expected_fisher_laplace`'s fixed point, per
    factor). With Gaussian likelihoods ``t_k = c_k p(D_k | theta)`` exactly and the fixed point is
    the posterior; otherwise a factor's cavity removes the *average* site, not its own share, and
    the fixed point differs from EP's (the diagonal Laplace of the pooled data, for Laplace
    factors) by an amount that grows with how unlike the factors are.

    Solved in float64: each tilted mode by Newton (the previous mode as the start; the objective
    is strongly convex once ``Lambda_{c_k} > 0``), the outer map damped like
    :func:`full_covariance_vi`'s (the step halved after an iteration whose change grew, grown by
    half after one whose change shrank), started at the pooled data's diagonal Laplace.

    Args:
        parts: the clients' example indices into ``x`` / ``y`` (a partition).
        tilted: ``"laplace"`` or ``"ngvi"``.
        power: ``"data_fraction"`` or ``"one_over_k"``.

    Returns:
        ``(mean, variance)`` float32 pytrees shaped like ``params0``.

    Raises:
        ValueError: for a model that is not affine with 2 classes, an unknown ``tilted`` or
            ``power``, a cavity with a non-positive precision, or no convergence.
    """
    if tilted not in SEP_TILTED:
        raise ValueError(f"sep_fixed_point: tilted must be one of {', '.join(SEP_TILTED)}; got {tilted!r}")
    if power not in SEP_POWERS:
        raise ValueError(f"sep_fixed_point: power must be one of {', '.join(SEP_POWERS)}; got {power!r}")
    affine = affine_logit_difference(apply_fn, params0, x)
    loss = negative_log_joint(apply_fn, x, y, prior_precision)
    labels = np.asarray(y)
    num, k_clients = len(labels), len(parts)
    with jax.enable_x64(True):
        map64 = _map64(loss, params0)
        h, unravel = _hessian64(loss, map64)
        m, _ = ravel_pytree(map64)
        precision = jnp.asarray(np.diag(h))
        eta = precision * m
        t, w = _hermite(nodes)
        factors = []
        for idx in parts:
            idx = np.asarray(idx, np.int64)
            a = jnp.asarray(affine.a[idx])
            share = len(idx) / num if power == "data_fraction" else 1.0 / k_clients
            factors.append((a, jnp.asarray(affine.c[idx]), jnp.asarray(2.0 * labels[idx] - 1.0), 1.0 - share))

        @jax.jit
        def newton_step(theta, a, c, sign, cav_eta, cav_precision):
            g = a @ theta + c
            p = jax.nn.sigmoid(g)
            grad = -a.T @ (sign * jax.nn.sigmoid(-sign * g)) + cav_precision * theta - cav_eta
            hess = (a * (p * (1.0 - p))[:, None]).T @ a + jnp.diag(cav_precision)
            return theta - jnp.linalg.solve(hess, grad), jnp.max(jnp.abs(grad))

        @jax.jit
        def mode_curvature(theta, a, c):  # diag GGN_k at theta
            p = jax.nn.sigmoid(a @ theta + c)
            return jnp.square(a).T @ (p * (1.0 - p))

        @jax.jit
        def expected_curvature(theta, a, c, site_precision):  # E_{N(theta, 1 / site_precision)}[diag GGN_k]
            sd = jnp.sqrt(jnp.square(a) @ (1.0 / site_precision))
            p = jax.nn.sigmoid((a @ theta + c)[:, None] + sd[:, None] * t)
            return jnp.square(a).T @ jnp.sum(w * p * (1.0 - p), axis=-1)

        def tilted_fit(k, eta, precision, theta):
            a, c, sign, rest = factors[k]
            cav_precision = prior_precision + rest * (precision - prior_precision)
            cav_eta = rest * eta  # the prior's precision-mean is 0
            if not bool(jnp.all(cav_precision > 0)):
                raise ValueError("sep_fixed_point: a cavity has a non-positive precision")
            for _ in range(100):
                theta, gmax = newton_step(theta, a, c, sign, cav_eta, cav_precision)
                if float(gmax) <= 1e-12 * max(1.0, float(jnp.max(jnp.abs(cav_precision * theta)))):
                    break
            else:
                raise ValueError("sep_fixed_point: a tilted mode did not converge in 100 Newton steps")
            site = cav_precision + mode_curvature(theta, a, c)
            if tilted == "ngvi":
                for _ in range(500):
                    new = cav_precision + expected_curvature(theta, a, c, site)
                    done = float(jnp.max(jnp.abs(new - site) / site)) < tol
                    site = new
                    if done:
                        break
                else:
                    raise ValueError("sep_fixed_point: a factor's NGVI precision did not converge")
            return theta, site

        modes = [m] * k_clients
        step, last = 1.0, np.inf
        for _ in range(max_steps):
            fits = [tilted_fit(k, eta, precision, modes[k]) for k in range(k_clients)]
            modes = [theta for theta, _ in fits]
            new_precision = sum(site for _, site in fits) / k_clients
            new_eta = sum(site * theta for theta, site in fits) / k_clients
            change = max(
                float(jnp.max(jnp.abs(new_precision - precision) / precision)),
                float(jnp.max(jnp.abs(new_eta / new_precision - eta / precision)) / max(float(jnp.max(jnp.abs(eta / precision))), 1e-12)),
            )
            if change < tol:
                return _to32(unravel(new_eta / new_precision)), _to32(unravel(1.0 / new_precision))
            step = max(step / 2.0, MIN_VI_STEP) if change > last else min(1.0, 1.5 * step)
            last = change
            eta, precision = eta + step * (new_eta - eta), precision + step * (new_precision - precision)
    raise ValueError(f"sep_fixed_point: the fixed-point iteration did not converge in {max_steps} steps")


class References(NamedTuple):
    """The centralised references of one problem: each a ``(mean, variance)`` pair of pytrees,
    except ``map`` (the MAP pytree); ``ngvi`` is :func:`expected_fisher_laplace` (``None`` where
    the model is not an affine 2-class one); ``full_vi`` is :func:`full_covariance_vi`'s
    ``(mean, covariance)``."""

    map: PyTree
    diag_laplace: tuple[PyTree, PyTree]
    laplace_marginals: tuple[PyTree, PyTree]
    mfvi: tuple[PyTree, PyTree]
    ngvi: tuple[PyTree, PyTree] | None = None
    full_vi: tuple[PyTree, np.ndarray] | None = None


def references(apply_fn: Callable[[PyTree, jax.Array], jax.Array], params0: PyTree, x: Any, y: Any, prior_precision: float) -> References:
    """MAP, diagonal Laplace, full-Laplace marginals, exact mean-field VI, the NGVI fixed point and
    full-covariance VI of one problem.

    The Laplace approximations are taken at the float64 MAP (not its float32 rounding).
    """
    loss = negative_log_joint(apply_fn, x, y, prior_precision)
    with jax.enable_x64(True):
        map64 = _map64(loss, params0)
        diag = diagonal_laplace(loss, map64)
        marginals = laplace_marginals(loss, map64)
    mfvi = mean_field_vi(apply_fn, params0, x, y, prior_precision)
    ngvi = expected_fisher_laplace(apply_fn, map64, x, prior_precision)
    full_vi = full_covariance_vi(apply_fn, params0, x, y, prior_precision)
    return References(map=_to32(map64), diag_laplace=diag, laplace_marginals=marginals, mfvi=mfvi, ngvi=ngvi, full_vi=full_vi)


def affine_predictive_metrics(
    apply_fn: Callable[[PyTree, jax.Array], jax.Array],
    mean: PyTree,
    variance: PyTree | None,
    x: Any,
    y: Any,
    *,
    covariance: np.ndarray | None = None,
    num_bins: int = 15,
    nodes: int = GAUSS_HERMITE_NODES,
) -> dict[str, float]:
    """Exact accuracy, NLL and ECE of the predictive of ``N(mean, diag(variance))`` (affine 2-class).

    ``p(y = 1 | x_i) = E_q[sigmoid(g_i)]`` with ``g_i ~ N(a_i^T m + c_i, sum_j a_ij^2 v_j)``, by
    Gauss-Hermite quadrature in float64 (no Monte Carlo error); ``variance = None`` gives the point
    predictive at ``mean``. ``covariance``: a full ``[P, P]`` covariance in the flat order of
    ``ravel_pytree`` instead of ``variance`` (``g_i``'s variance is then ``a_i^T Sigma a_i``). The metrics are :func:`~fedbayes.evaluation.metrics.classification_metrics`'s
    (ECE a fraction, ``num_bins`` equal-width bins).

    Raises:
        ValueError: for a model that is not affine in its parameters or not 2-class.
    """
    affine = affine_logit_difference(apply_fn, mean, x)
    with jax.enable_x64(True):
        m, _ = ravel_pytree(_to64(mean))
        a, c = jnp.asarray(affine.a), jnp.asarray(affine.c)
        mu = a @ m + c
        if covariance is not None:
            sd = jnp.sqrt(jnp.maximum(jnp.sum((a @ jnp.asarray(np.asarray(covariance, np.float64))) * a, axis=1), 0.0))
        else:
            v = jnp.zeros_like(m) if variance is None else ravel_pytree(_to64(variance))[0]
            sd = jnp.sqrt(jnp.square(a) @ v)
        t, w = _hermite(nodes)
        g = mu[:, None] + sd[:, None] * t
        log_w = jnp.log(w)
        log_p1 = jax.scipy.special.logsumexp(log_w + jax.nn.log_sigmoid(g), axis=-1)
        log_p0 = jax.scipy.special.logsumexp(log_w + jax.nn.log_sigmoid(-g), axis=-1)
        log_probs = jnp.stack([log_p0, log_p1], axis=-1)
        out = classification_metrics(log_probs, jnp.asarray(np.asarray(y, np.int64)), num_bins=num_bins)
        return {k: float(out[k]) for k in ("accuracy", "nll", "ece")}
