"""Full-covariance Gaussian variational inference of a client's tilted distribution: PVI's local
step with ``covariance = "full"``.

The client fits ``q_k = N(m, C C^T)``, ``C`` lower triangular with a positive diagonal, to its
tilted distribution (a dense cavity times its likelihood; Ashman et al. 2022, "Partitioned
Variational Inference: A Framework for Probabilistic Federated Learning", Eq. 5; Bui et al. 2018,
"Partitioned Variational Inference: A unified framework encompassing federated and continual
learning", Sec. 3) by reparameterised stochastic gradients of

    F(q) = E_q[l_k(theta)] + KL(q || cavity),     theta = m + C eps,  eps ~ N(0, I),

the full-covariance Gaussian VI of Opper & Archambeau 2009 ("The variational Gaussian
approximation revisited", Neural Computation 21(3)) with the Cholesky parameterisation of
Titsias & Lázaro-Gredilla 2014 ("Doubly stochastic variational Bayes for non-conjugate
inference", ICML). At its optimum the precision is the cavity's plus the expected Hessian of the
loss, ``Lambda_q = Lambda_c + E_q[nabla^2 l_k]`` (Opper & Archambeau 2009, Eq. 12), which this
stochastic gradient reaches without forming that Hessian. docs/algorithms.md §8.5.

The parameters are the mean ``m`` (a pytree) and an unconstrained ``[D, D]`` matrix whose strict
lower triangle is ``C``'s and whose diagonal gives ``C_ii = exp(s_ii)`` (``"log"``) or
``softplus(s_ii)``; the upper triangle is unused. The KL to a dense cavity ``N(mu_c, Lambda_c^{-1})``
is closed form in these parameters:

    KL = 1/2 [tr(Lambda_c C C^T) - D + (m - mu_c)^T Lambda_c (m - mu_c) - 2 sum_i log C_ii - log|Lambda_c|].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_full
from fedbayes.data.batches import ClientData, steps_per_epoch
from fedbayes.gaussian_full import FullGaussian
from fedbayes.inference.base import CavityInference
from fedbayes.inference.curvature import TASKS as CURVATURE_TASKS
from fedbayes.inference.curvature import batch_full_ggn, over_client_data
from fedbayes.inference.iasg import epoch_of_sample, epoch_samples
from fedbayes.inference.sgd import LocalTrainer, stiff_step_control, training_info
from fedbayes.inference.vi import check_local_settings

PyTree = Any

__all__ = [
    "NATURAL_STEP",
    "NATURAL_STEPS",
    "FullVariationalParams",
    "expected_loss_full",
    "full_covariance_vi",
    "kl_to_full_cavity",
    "natural_full_vi",
    "scale_of",
    "to_full_gaussian",
]

NATURAL_STEPS = 64  # natural-gradient iterations per round of natural_full_vi (each a pass over the client's data per draw)
NATURAL_STEP = 0.1  # its step size beta: with 0.5 the global mean wandered on digits 3 vs 8 (docs/results/posterior_full.md)


class FullVariationalParams(NamedTuple):
    """The local ``N(mean, C C^T)`` as the client optimizer sees it: ``mean`` (the parameters'
    pytree) and ``raw_scale``, ``[D, D]``, whose lower triangle gives ``C`` (module docstring)."""

    mean: PyTree
    raw_scale: jax.Array


def _positive(raw: jax.Array, parameterisation: str) -> jax.Array:
    return jnp.exp(raw) if parameterisation == "log" else jax.nn.softplus(raw)


def _raw(value: jax.Array, parameterisation: str) -> jax.Array:
    if parameterisation == "log":
        return jnp.log(value)
    return value + jnp.log(-jnp.expm1(-value))  # softplus^{-1}


def scale_of(vp: FullVariationalParams, parameterisation: str) -> jax.Array:
    """``C``: the strict lower triangle of ``raw_scale`` plus the transformed diagonal."""
    raw = vp.raw_scale
    return jnp.tril(raw, -1) + jnp.diag(_positive(jnp.diagonal(raw), parameterisation))


def _raw_scale(scale: jax.Array, parameterisation: str) -> jax.Array:
    return jnp.tril(scale, -1) + jnp.diag(_raw(jnp.diagonal(scale), parameterisation))


def to_full_gaussian(vp: FullVariationalParams, parameterisation: str) -> FullGaussian:
    """``vp`` in natural parameters (:func:`~fedbayes.gaussian_full.from_scale_tril`)."""
    return gaussian_full.from_scale_tril(vp.mean, scale_of(vp, parameterisation))


def kl_to_full_cavity(cavity: FullGaussian, parameterisation: str):
    """``vp -> KL(q || cavity)`` for ``q = N(mean, C C^T)`` (module docstring), the value of
    :func:`fedbayes.gaussian_full.kl` written in ``q``'s own parameters; the cavity's mean, precision
    and log-determinant are computed once, before the local steps. ``cavity`` must be proper."""
    lam = 0.5 * (cavity.precision + cavity.precision.T)
    chol = gaussian_full.cholesky(lam)
    mu_c = gaussian_full.mean(cavity)
    mu_flat, _ = ravel_pytree(mu_c)
    log_det = 2.0 * jnp.sum(jnp.log(jnp.diagonal(chol)))
    d = mu_flat.size

    def kl(vp: FullVariationalParams) -> jax.Array:
        c = scale_of(vp, parameterisation)
        diff = ravel_pytree(vp.mean)[0] - mu_flat
        log_diag = jnp.diagonal(vp.raw_scale) if parameterisation == "log" else jnp.log(jnp.diagonal(c))
        return 0.5 * (jnp.sum(c * (lam @ c)) - d + diff @ (lam @ diff) - 2.0 * jnp.sum(log_diag) - log_det)

    return kl


def expected_loss_full(loss_fn, *, samples: int, parameterisation: str):
    """``(vp, key, x, y, mask) -> (1/S) sum_s loss_fn(theta_s, k_s, x, y, mask)`` with
    ``theta_s = m + C eps_s``, ``eps_s ~ N(0, I)`` from ``k_s = fold_in(key, s)``: the minibatch
    estimate of ``E_q[mean loss]`` (one weight draw per minibatch and sample)."""

    def loss(vp, key, x, y, mask):
        flat, unravel = ravel_pytree(vp.mean)
        c = scale_of(vp, parameterisation)

        def one(s):
            k = jax.random.fold_in(key, s)
            eps = jax.random.normal(k, flat.shape, flat.dtype)
            return loss_fn(unravel(flat + c @ eps), k, x, y, mask).astype(jnp.float32)

        if samples == 1:
            return one(0)
        return jnp.mean(jax.vmap(one)(jnp.arange(samples)))

    return loss


def _tail_average(samples: PyTree, done: jax.Array) -> PyTree:
    """The mean of the epochs ``floor(done / 2) .. done - 1`` of the ring of epoch means
    (:func:`fedbayes.inference.iasg.epoch_of_sample`; all of them with one epoch)."""
    num = jax.tree.leaves(samples)[0].shape[0]
    e = epoch_of_sample(num, done)
    w = ((e >= done // 2) & (e >= 0) & (e < done)).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(w), 1.0)
    return jax.tree.map(lambda s: jnp.tensordot(w.astype(s.dtype), s, axes=1) / count.astype(s.dtype), samples)


def full_covariance_vi(
    trainer: LocalTrainer, *, samples: int = 1, parameterisation: str = "log", init_std: float | None = None, step_cap: float = 1.0
) -> CavityInference:
    """PVI's local step with a dense Gaussian (module docstring; docs/algorithms.md §8.5): per
    minibatch (mean-loss scale, the objective divided by ``n_k``)

        F(q) = (1/S) sum_s mean_batch l(m + C eps_s) + KL(q || cavity) / n_k,

    minimised over ``(m, raw_scale)`` with ``trainer.optimizer`` (the steps of
    :func:`fedbayes.inference.sgd.run_sgd`, a fresh key per step, the same stopping rule), started
    at the broadcast Gaussian ``start`` (``C`` its covariance's Cholesky factor,
    :func:`~fedbayes.gaussian_full.scale_tril`). The result is the Polyak-Ruppert average of the
    iterates of the second half of the epochs run (each epoch's mean iterate,
    :func:`fedbayes.inference.iasg.epoch_samples`; with one epoch, that epoch's), not the last
    iterate: the message's precision ``(C C^T)^{-1}`` is convex in the noise of ``C``, so a noisy
    last iterate overstates it on average, and in the poorly determined directions of a
    correlated posterior that bias compounded over the rounds (the variances shrank round after
    round; docs/results/posterior_full.md).
    Memory: one averaged copy of ``(m, raw_scale)`` per local epoch. The KL's curvature in ``m`` and in
    each column of ``C`` is ``Lambda_c / n_k``, known before the first step: the step is capped per
    row by its Gershgorin bound ``sum_j |Lambda_c,ij| / n_k`` (:func:`~fedbayes.inference.sgd.stiff_step_control`,
    a diagonal preconditioner: the optimum is unchanged), as the dense Laplace client's is.

    Args:
      trainer: the client's loss ``(params, key, x, y, mask) -> mean loss``, optimizer, epochs, batch size.
      samples: ``S``, weight draws per minibatch.
      parameterisation: ``"log"`` (``C_ii = exp(s_ii)``) or ``"softplus"``.
      init_std: if set, each row of the starting ``C`` is scaled so that the marginal standard
        deviation starts at ``min(sigma_g,i, init_std)`` (the correlations kept).
      step_cap: the step control's cap (``<= 0``: none).

    Returns:
      ``fit(key, start, cavity, data) -> (q_k, info)`` with ``start`` and ``cavity`` proper
      :class:`~fedbayes.gaussian_full.FullGaussian`; ``info`` :func:`run_sgd`'s.

    Raises:
      ValueError: for ``samples < 1``, an unknown parameterisation or ``init_std <= 0``.
    """
    check_local_settings(samples, parameterisation, init_std)
    local = trainer._replace(loss_fn=expected_loss_full(trainer.loss_fn, samples=samples, parameterisation=parameterisation))

    def fit(key, start: FullGaussian, cavity: FullGaussian, data: ClientData):
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        c0 = gaussian_full.scale_tril(start)
        if init_std is not None:
            row_std = jnp.sqrt(jnp.sum(jnp.square(c0), axis=1))
            c0 = c0 * jnp.minimum(1.0, jnp.asarray(init_std, c0.dtype) / row_std)[:, None]
        vp0 = FullVariationalParams(gaussian_full.mean(start), _raw_scale(c0, parameterisation))
        kl = kl_to_full_cavity(cavity, parameterisation)

        def penalty(vp):
            return (kl(vp) / n).astype(jnp.float32)

        _, unravel = ravel_pytree(vp0.mean)
        bound = jnp.sum(jnp.abs(cavity.precision), axis=1)
        stiffness = FullVariationalParams(unravel(bound), jnp.broadcast_to(bound[:, None], vp0.raw_scale.shape))
        controlled = stiff_step_control(local, stiffness, data.num_examples, step_cap)
        samples, _, info = epoch_samples(key, vp0, data, controlled, skip_epochs=0, average=True, penalty=penalty)
        vp = _tail_average(samples, info["steps"] // jnp.maximum(steps_per_epoch(data.num_examples, trainer.batch_size), 1))
        return to_full_gaussian(vp, parameterisation), info

    return fit


def natural_full_vi(
    trainer: LocalTrainer, *, apply_fn, task: str = "classification", samples: int = 8, steps: int = NATURAL_STEPS, step_size: float = NATURAL_STEP
) -> CavityInference:
    """PVI's local step with a dense Gaussian by natural-gradient VI: the same objective as
    :func:`full_covariance_vi`, ``F(q) = E_q[l_k(theta)] + KL(q || cavity)`` over ``q = N(m, Lambda^{-1})``,
    solved by the natural-gradient iteration of Khan & Lin 2017 ("Conjugate-computation
    variational inference", Eqs. 12-13; the full-covariance VON of Khan et al. 2018, "Fast and
    scalable Bayesian deep learning by weight-perturbation in Adam", Eqs. 6-7) with the
    generalised Gauss-Newton matrix for the Hessian:

        Lambda <- (1 - beta) Lambda + beta (Lambda_c + E_q[GGN_k(theta)]),
        m      <- m - beta Lambda^{-1} (E_q[grad l_k(theta)] + Lambda_c m - eta_c),

    both expectations estimated by ``S`` draws ``theta_s = m + L^{-T} eps_s`` (``L L^T = Lambda``,
    fresh each iteration; in antithetic pairs ``+-eps``, so that the gradient's part linear in
    ``theta - m`` cancels: exact for a quadratic loss) over one pass of the client's data (sum-loss scale:
    :func:`~fedbayes.inference.curvature.batch_full_ggn` and the gradient of ``trainer.loss_fn``). Its
    fixed point is the stationary point of ``F`` of Opper & Archambeau 2009 (Eqs. 11-12), the
    expected Hessian replaced by the expected GGN (equal for a generalised linear model with its
    canonical link: then the same optimum as :func:`full_covariance_vi`).

    Why beside the Cholesky client: the local precision is an average of positive semi-definite
    estimates added to the cavity's, so it is unbiased in the draws' noise and every site
    ``Lambda - Lambda_c`` is positive semi-definite; the Cholesky client's precision
    ``(C C^T)^{-1}`` is convex in the noise of ``C`` and overstates it, an error that the
    ``K`` sites of a federation add up. The result is the average of the iterates ``(m, Lambda)``
    of the second half of the ``steps`` iterations (Polyak-Ruppert), which averages the draws'
    noise; it starts at ``start`` (the broadcast global, the client's previous local posterior
    times the change since).

    Args:
      trainer: the client's loss ``(params, key, x, y, mask) -> mean loss`` and the batch size of
        the data passes (its optimizer, epochs and tolerance are not used).
      apply_fn: ``(params, x) -> outputs``, for the GGN.
      task: the likelihood (:data:`~fedbayes.inference.curvature.TASKS`).
      samples: ``S``, draws per iteration.
      steps: iterations per call.
      step_size: ``beta`` in (0, 1].

    Returns:
      ``fit(key, start, cavity, data) -> (q_k, info)`` with ``start`` and ``cavity`` proper
      :class:`~fedbayes.gaussian_full.FullGaussian`; ``info`` :func:`~fedbayes.inference.sgd.training_info`'s
      (the mean of the iterations' expected data loss per example; ``steps`` the iterations).

    Raises:
      ValueError: for ``samples < 1``, ``steps < 1``, ``step_size`` outside (0, 1] or a task
        without curvature.
    """
    if samples < 1 or steps < 1:
        raise ValueError(f"natural_full_vi: samples and steps must be >= 1; got {samples} and {steps}")
    if not 0.0 < step_size <= 1.0:
        raise ValueError(f"natural_full_vi: step_size must be in (0, 1]; got {step_size}")
    if task not in CURVATURE_TASKS:
        raise ValueError(f"natural_full_vi: needs the curvature of the likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got {task!r}")

    def moments(key, theta_flat, unravel, data):
        """The sum loss's gradient and GGN at ``theta`` over one pass of the data, and the sum loss."""
        d = theta_flat.size

        def body(carry, step, batch):
            g, h, loss = carry
            x, y, mask = batch
            count = jnp.sum(jnp.clip(mask, 0.0, None)).astype(jnp.float32)

            def sum_loss(flat):
                return trainer.loss_fn(unravel(flat), jax.random.fold_in(key, step), x, y, mask).astype(jnp.float32) * count

            value, grad = jax.value_and_grad(sum_loss)(theta_flat)
            ggn = batch_full_ggn(apply_fn, unravel(theta_flat), x, mask, task=task)
            return g + grad.astype(g.dtype), h + ggn.astype(h.dtype), loss + value

        init = (jnp.zeros_like(theta_flat), jnp.zeros((d, d), theta_flat.dtype), jnp.zeros((), jnp.float32))
        return over_client_data(data, trainer.batch_size, body, init)

    def fit(key, start: FullGaussian, cavity: FullGaussian, data: ClientData):
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        m0, unravel = ravel_pytree(gaussian_full.mean(start))
        eta_c = ravel_pytree(cavity.precision_mean)[0]
        lam_c = 0.5 * (cavity.precision + cavity.precision.T)
        lam0 = 0.5 * (start.precision + start.precision.T)
        first_tail = steps // 2

        def iteration(t, carry):
            m, lam, m_sum, lam_sum, loss_sum = carry
            chol = gaussian_full.cholesky(lam)
            k = jax.random.fold_in(key, t)

            def draw(s, acc):
                g, h, loss = acc
                # antithetic pairs (eps, -eps): the gradient's term linear in the draw cancels
                sign = jnp.where((s % 2 == 1) | (s + 1 < samples), 1.0 - 2.0 * (s % 2), 1.0).astype(m.dtype)
                eps = sign * jax.random.normal(jax.random.fold_in(k, s // 2), m.shape, m.dtype)
                theta = m + gaussian_full.lower_transpose_solve(chol, eps)
                dg, dh, dl = moments(jax.random.fold_in(k, samples + s), theta, unravel, data)
                return g + dg, h + dh, loss + dl

            g, h, loss = jax.lax.fori_loop(0, samples, draw, (jnp.zeros_like(m), jnp.zeros_like(lam), jnp.zeros((), jnp.float32)))
            g, h = g / samples, h / samples
            new_lam = (1.0 - step_size) * lam + step_size * (lam_c + 0.5 * (h + h.T))
            new_m = m - step_size * gaussian_full.cholesky_solve(gaussian_full.cholesky(new_lam), g + lam_c @ m - eta_c)
            tail = (t >= first_tail).astype(m.dtype)
            return new_m, new_lam, m_sum + tail * new_m, lam_sum + tail * new_lam, loss_sum + loss / samples / n

        zero = (jnp.zeros_like(m0), jnp.zeros_like(lam0))
        _, _, m_sum, lam_sum, loss_sum = jax.lax.fori_loop(0, steps, iteration, (m0, lam0, *zero, jnp.zeros((), jnp.float32)))
        count = steps - first_tail
        m, lam = m_sum / count, lam_sum / count
        lam = 0.5 * (lam + lam.T)
        return FullGaussian(precision_mean=unravel(lam @ m), precision=lam), training_info(loss_sum, steps)

    return fit
