"""Client deltas on quadratic objectives: FedAvg, MB-SGD and FedPA with IASG or exact samples.

Shared by the quadratic and least-squares toys (Al-Shedivat et al. 2021 (FedPA) Sec. 3-4, App. A; docs/algorithms.md §6, 15.3, 15.4).
A client's objective is the quadratic

    f(theta) = 1/2 (theta - mu)^T A (theta - mu),   exp(-f) ∝ N(mu, A^{-1}),

so its exact client delta is ``g* = A (theta - mu)`` (Al-Shedivat et al. 2021 (FedPA) Eq. 4 with ``Sigma = A^{-1}``;
docs/algorithms.md §6.10 item 4, the FedPA code's ``compute_exact_delta``).

**Stochastic gradients.** All methods see the same oracle

    g_hat(theta) = A (theta - mu) + xi,   xi ~ N(0, tau A),

the large-sample limit of minibatch noise (its covariance is proportional to the Fisher ``A``).
Mandt et al. (2017) show that the average of ``K`` consecutive constant-step SGD iterates on a
quadratic has covariance ``A^{-1} C A^{-1} / K`` for gradient noise covariance ``C`` (when ``K``
exceeds the chain's mixing time ``1 / (lr lambda_min(A))``). With ``C = tau A`` and
``tau = K`` the IASG samples (Al-Shedivat et al. 2021 (FedPA) Alg. 4; :func:`fedbayes.inference.iasg.iasg`) are thus
approximately draws from the client posterior ``N(mu, A^{-1})``: the noise level is
calibrated to the sampler, ``tau = temperature * steps_per_sample``. (With finite ``K`` the
averages are under-dispersed by about ``1 / (K lr lambda_min)`` in slow directions and mildly
correlated; docs/results/toys.md gives their size on the 2-D toy, which ``tests/toys/test_toys.py`` checks.) This is the noise of a
client holding ``n = K B`` examples, sampled with one IASG sample per epoch of ``K`` minibatch
steps of size ``B`` (TFF's ``fed_pa_schedule``; docs/algorithms.md §6.3). The ``"exact"`` sampler instead draws
from ``N(mu, A^{-1})`` directly (the FedPA code's ``ExactQuadraticSampler``).

Deltas (pseudo-gradients, docs/algorithms.md §0 sign convention):

* FedAvg: ``theta - theta_K`` after ``K`` local SGD steps (Al-Shedivat et al. 2021 (FedPA) Alg. 2);
* MB-SGD: ``lr * mean_j g_hat_j(theta)`` over ``K`` gradients at ``theta`` (the FedPA code's
  ``compute_mb_sgd_delta``);
* FedPA: ``Sigma_l^{-1} (theta - mean(samples))`` with the shrinkage covariance of Al-Shedivat et al. 2021 (FedPA)
  Thm. 3 (:func:`fedbayes.algorithms.fedpa.dense_shrinkage_delta`, equal to the DP of
  :func:`~fedbayes.algorithms.fedpa.shrinkage_delta` to 1e-10; the dense form is used because
  the DP's unrolled loop compiles in O(l^2) time, docs/results/toys.md, and ``d <= 101``
  here).

**One batched solve per compiled program.** With jaxlib 0.10.2 on a 2-core CPU, an XLA program
in which two batched LAPACK calls (e.g. two independent ``jnp.linalg.solve`` under ``vmap``) are
ready at the same time can deadlock: each occupies one of the two intra-op pool threads and then
waits in ``ParallelBatchMap`` for sub-tasks that no free thread can run (observed with gdb in
the least-squares toy; LAPACK fans out only above 2e5 flop per call, so small matrices are
safe). The toys therefore jit every method separately and wait for each result before the next
starts (docs/results/toys.md).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes.algorithms.fedpa import dense_shrinkage_delta
from fedbayes.inference.iasg import iasg

SAMPLERS = ("iasg", "exact")

__all__ = [
    "SAMPLERS",
    "Quadratic",
    "exact_delta",
    "exact_samples",
    "fedavg_delta",
    "fedpa_delta",
    "iasg_samples",
    "make_quadratic",
    "mbsgd_delta",
    "sgd_trajectory",
    "stack_quadratics",
]


class Quadratic(NamedTuple):
    """``f(theta) = 1/2 (theta - mu)^T A (theta - mu)``.

    Attributes:
      hessian: ``A [d, d]`` (symmetric positive definite), the posterior precision.
      optimum: ``mu [d]``, the minimiser and posterior mean.
      hessian_sqrt: a factor ``L`` with ``L L^T = A`` (Cholesky), for the gradient noise.
      cov_sqrt: a factor ``R`` with ``R R^T = A^{-1}``, for exact posterior samples.
    """

    hessian: jax.Array
    optimum: jax.Array
    hessian_sqrt: jax.Array
    cov_sqrt: jax.Array


def make_quadratic(hessian, optimum) -> Quadratic:
    """Builds a :class:`Quadratic` from ``A [d, d]`` and ``mu [d]`` (NumPy float64 factorisations).

    Stacked clients: ``stack_quadratics``.
    """
    hessian = np.asarray(hessian, np.float64)
    cov = np.linalg.inv(hessian)
    return Quadratic(
        jnp.asarray(hessian),
        jnp.asarray(optimum, jnp.float64),
        jnp.asarray(np.linalg.cholesky(hessian)),
        jnp.asarray(np.linalg.cholesky((cov + cov.T) / 2)),
    )


def stack_quadratics(quadratics) -> Quadratic:
    """Stacks clients on a leading axis (for ``vmap`` over clients)."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *quadratics)


def exact_delta(q: Quadratic, theta: jax.Array) -> jax.Array:
    """``g* = A (theta - mu)``, the delta of an exact local posterior (Al-Shedivat et al. 2021 (FedPA) Eq. 4)."""
    return q.hessian @ (theta - q.optimum)


def _noisy_grad(q: Quadratic, noise_scale):
    """``(theta, eps) -> A (theta - mu) + sqrt(tau) L eps``: noise covariance ``tau A``."""
    scale = jnp.sqrt(jnp.asarray(noise_scale, q.optimum.dtype))

    def grad_fn(theta, eps):
        return q.hessian @ (theta - q.optimum) + scale * (q.hessian_sqrt @ eps)

    return grad_fn


def _noise_batches(key: jax.Array, dim: int, dtype):
    # One standard-normal draw per optimiser step, a pure function of (key, step).
    return lambda step: (jax.random.normal(jax.random.fold_in(key, step), (dim,), dtype),)


def sgd_trajectory(key: jax.Array, q: Quadratic, theta: jax.Array, *, lr, num_steps: int, noise_scale) -> jax.Array:
    """Every iterate ``theta_1..theta_K`` of ``K`` plain SGD steps from ``theta``: ``[K, d]``.

    Runs :func:`fedbayes.inference.iasg.iasg` with one step per "sample" and no averaging,
    i.e. records the raw SGD chain (``optax.sgd(lr)``).
    """
    dim = theta.shape[-1]
    samples, _ = iasg(
        theta,
        _noise_batches(key, dim, theta.dtype),
        _noisy_grad(q, noise_scale),
        optax.sgd(lr),
        burn_in_steps=0,
        steps_per_sample=1,
        num_samples=num_steps,
        average=False,
    )
    return samples


def fedavg_delta(key: jax.Array, q: Quadratic, theta: jax.Array, *, lr, num_steps: int, noise_scale) -> jax.Array:
    """FedAvg's client delta ``theta - theta_K`` after ``K`` local SGD steps (Al-Shedivat et al. 2021 (FedPA) Alg. 2)."""
    return theta - sgd_trajectory(key, q, theta, lr=lr, num_steps=num_steps, noise_scale=noise_scale)[-1]


def mbsgd_delta(key: jax.Array, q: Quadratic, theta: jax.Array, *, lr, num_grads: int, noise_scale) -> jax.Array:
    """MB-SGD's client delta: ``lr`` times the mean of ``num_grads`` stochastic gradients at ``theta``."""
    eps = jax.random.normal(key, (num_grads, theta.shape[-1]), theta.dtype)
    grads = jax.vmap(lambda e: _noisy_grad(q, noise_scale)(theta, e))(eps)
    return lr * jnp.mean(grads, axis=0)


def iasg_samples(
    key: jax.Array,
    q: Quadratic,
    theta: jax.Array,
    *,
    lr,
    burn_in_steps: int,
    steps_per_sample: int,
    num_samples: int,
    noise_scale,
) -> jax.Array:
    """``num_samples`` IASG samples ``[l, d]`` started at ``theta`` (Al-Shedivat et al. 2021 (FedPA) Alg. 4; optax SGD)."""
    samples, _ = iasg(
        theta,
        _noise_batches(key, theta.shape[-1], theta.dtype),
        _noisy_grad(q, noise_scale),
        optax.sgd(lr),
        burn_in_steps=burn_in_steps,
        steps_per_sample=steps_per_sample,
        num_samples=num_samples,
    )
    return samples


def exact_samples(key: jax.Array, q: Quadratic, num_samples: int) -> jax.Array:
    """``num_samples`` exact draws ``[l, d]`` from the client posterior ``N(mu, A^{-1})``."""
    eps = jax.random.normal(key, (num_samples, q.optimum.shape[-1]), q.optimum.dtype)
    return q.optimum[None, :] + eps @ q.cov_sqrt.T


def fedpa_delta(samples: jax.Array, theta: jax.Array, rho) -> jax.Array:
    """FedPA's delta ``Sigma_l^{-1} (theta - mean(samples))``, ``Sigma_l = rho_l I + (1 - rho_l) S_l``.

    ``rho_l = 1 / (1 + (l - 1) rho)`` (Al-Shedivat et al. 2021 (FedPA) Thm. 3; docs/algorithms.md §6.4), via
    :func:`fedbayes.algorithms.fedpa.dense_shrinkage_delta`.
    """
    return dense_shrinkage_delta(samples, theta, rho)
