"""Mean-field Gaussian variational inference of a client's tilted distribution by natural-gradient
steps with the diagonal Gauss-Newton matrix: PVI's diagonal local step ``local_vi = "natural"``.

The client fits ``q_k = N(m, diag(1 / P))`` to its tilted distribution, the cavity
``N(mu_c, diag(1 / P_c))`` times its likelihood (Ashman et al. 2022, "Partitioned Variational
Inference: A Framework for Probabilistic Federated Learning", Eq. 5):

    q_k = argmin_q  E_q[l_k(theta)] + KL(q || cavity),   l_k = sum_n -log p(y_n | x_n, theta),

by the variational online Gauss-Newton iteration (VOGN: Khan et al. 2018, "Fast and scalable
Bayesian deep learning by weight-perturbation in Adam", ICML, Eqs. 8-10 without momentum; Osawa
et al. 2019, "Practical deep learning with Bayesian principles", NeurIPS, Eq. 4) with the cavity
as its prior. One step per minibatch ``B_t`` of the client's ``N_k`` examples:

    theta_s = m +- eps_s / sqrt(P),  eps_s ~ N(0, I)                 (antithetic pairs)
    g_hat   = (1/S) sum_s  grad mean_{B_t} l(theta_s)
    h_hat   = (1/S) sum_s  diag GGN of mean_{B_t} l at theta_s      (fedbayes.inference.curvature)
    P      <- (1 - b) P + b (P_c + N_k h_hat)
    m      <- m - b (N_k g_hat + P_c (m - mu_c)) / P                  (the new P)

It is the natural gradient of the objective in ``q``'s natural parameters (Khan & Lin 2017,
"Conjugate-computation variational inference", Eqs. 12-13) with the expected Hessian
``E_q[diag nabla^2 l_k]`` replaced by the expected diagonal GGN. Its fixed point is the
stationarity condition of mean-field VI (Opper & Archambeau 2009, "The variational Gaussian
approximation revisited", Eqs. 11-12, diagonal), ``P = P_c + E_q[diag GGN_k]`` and
``E_q[grad l_k] + P_c (m - mu_c) = 0``: for a generalised linear model with its canonical link
(logistic, softmax, Gaussian regression), where the GGN is the Hessian, the mean-field VI optimum
itself. The site ``P - P_c`` is an average of positive semi-definite GGN diagonals, never
improper; a precision moves by the step ``b`` towards what the data say in each step, where the
reparameterised gradient of ``log sigma`` (:func:`fedbayes.inference.vi.reparameterised_vi`)
moves it by about the learning rate (docs/algorithms.md §8.2).

The result is the average of the iterates ``(m, P)`` of the second half of the steps
(Polyak-Ruppert, as :func:`fedbayes.inference.vi_full.natural_full_vi`): the minibatch and draw
noise of the last iterate averages out, and the averaged precision is still the cavity's plus a
positive semi-definite term.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedbayes import gaussian
from fedbayes.data.batches import ClientData, get_batch, steps_per_epoch
from fedbayes.gaussian import DiagGaussian
from fedbayes.inference.base import CavityInference
from fedbayes.inference.curvature import TASKS as CURVATURE_TASKS
from fedbayes.inference.curvature import batch_diag_ggn
from fedbayes.inference.sgd import LocalTrainer, training_info
from fedbayes.inference.vi import standard_normal_like

PyTree = Any

__all__ = ["NATURAL_MIN_STEPS", "NATURAL_PASSES", "NATURAL_SAMPLES", "NATURAL_STEP", "natural_diag_vi", "natural_step"]

NATURAL_STEP = 0.05  # b: 0.1 left the global mean jittering about the bar on digits 3 vs 8 (docs/results/pvi_natural.md)
NATURAL_PASSES = 5  # passes over the client's data per round ...
NATURAL_MIN_STEPS = 200  # ... and at least this many steps (a small client's pass is a step or two)
NATURAL_SAMPLES = 8  # draws per step: four antithetic pairs (with one pair the mean jittered more)


def natural_step(m: PyTree, p: PyTree, g_hat: PyTree, h_hat: PyTree, cavity_precision: PyTree, cavity_mean: PyTree, n, step_size) -> tuple[PyTree, PyTree]:
    """One natural-gradient step (module docstring): ``P' = (1 - b) P + b (P_c + n h_hat)`` and
    ``m' = m - b (n g_hat + P_c (m - mu_c)) / P'``, with ``g_hat`` and ``h_hat`` the minibatch mean
    loss's expected gradient and GGN diagonal. Returns ``(m', P')``."""
    p_new = jax.tree.map(lambda pi, pc, h: (1.0 - step_size) * pi + step_size * (pc + n * h), p, cavity_precision, h_hat)
    m_new = jax.tree.map(lambda mi, pi, g, pc, mc: mi - step_size * (n * g + pc * (mi - mc)) / pi, m, p_new, g_hat, cavity_precision, cavity_mean)
    return m_new, p_new


def natural_diag_vi(
    trainer: LocalTrainer,
    *,
    apply_fn,
    task: str = "classification",
    samples: int = NATURAL_SAMPLES,
    step_size: float = NATURAL_STEP,
    passes: int = NATURAL_PASSES,
    min_steps: int = NATURAL_MIN_STEPS,
    init_std: float | None = None,
) -> CavityInference:
    """PVI's diagonal local step by natural-gradient VI with the GGN (module docstring).

    Runs ``max(passes * ceil(n_k / B), min_steps)`` steps of :func:`natural_step`, one per
    minibatch of ``trainer.batch_size`` (in the order of the client's laid-out epochs, cycling
    through the ``trainer.num_epochs`` of them), from ``start``: its mean, and its precision, or
    with ``init_std`` at least ``1 / init_std^2`` (a network's first draws near its mean). Each
    step draws ``samples`` weights in antithetic pairs ``m +- eps / sqrt(P)`` (the gradient's part
    linear in the draw cancels: exact for a quadratic loss), takes the mean loss's gradient
    (``trainer.loss_fn``) and its GGN diagonal (:func:`~fedbayes.inference.curvature.batch_diag_ggn`,
    divided by the batch's weight) at each, and averages them. The trainer's optimizer, tolerance
    and step cap are not used.

    Args:
      trainer: the client's loss ``(params, key, x, y, mask) -> mean loss`` (the negative
        log-likelihood per example), batch size and laid-out epochs.
      apply_fn: ``(params, x) -> outputs``, for the GGN.
      task: the likelihood (:data:`~fedbayes.inference.curvature.TASKS`).
      samples: ``S`` draws per step (an odd last one is drawn alone).
      step_size: ``b`` in (0, 1].
      passes: passes over the client's data per call.
      min_steps: the fewest steps per call.
      init_std: if set, the local standard deviation starts at ``min(sigma_start, init_std)``.

    Returns:
      ``fit(key, start, cavity, data) -> (q_k, info)`` with ``start`` and ``cavity`` proper
      :class:`~fedbayes.gaussian.DiagGaussian`; ``info`` :func:`~fedbayes.inference.sgd.training_info`'s
      (the mean over steps of the minibatch's expected mean loss; ``steps`` the steps).

    Raises:
      ValueError: for ``samples < 1``, ``passes < 1``, ``min_steps < 0``, ``step_size`` outside
        (0, 1], ``init_std <= 0`` or a task without curvature.
    """
    if samples < 1 or passes < 1 or min_steps < 0:
        raise ValueError(f"natural_diag_vi: samples and passes must be >= 1 and min_steps >= 0; got {samples}, {passes} and {min_steps}")
    if not 0.0 < step_size <= 1.0:
        raise ValueError(f"natural_diag_vi: step_size must be in (0, 1]; got {step_size}")
    if init_std is not None and not init_std > 0:
        raise ValueError(f"natural_diag_vi: init_std must be > 0 (or None); got {init_std}")
    if task not in CURVATURE_TASKS:
        raise ValueError(f"natural_diag_vi: needs the curvature of the likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got {task!r}")
    batch_size = trainer.batch_size

    def moments(key, m, p, x, y, mask):
        """The expected mean loss, its gradient and GGN diagonal on one minibatch, over ``S`` draws."""
        pairs = (samples + 1) // 2
        eps = standard_normal_like(jax.random.fold_in(key, 0), jax.tree.map(lambda a: jnp.zeros((pairs,) + a.shape, a.dtype), m))
        weight = jnp.maximum(jnp.sum(jnp.clip(mask, 0.0, None)), 1.0)

        def one(s):
            sign = jnp.where(s % 2 == 1, -1.0, 1.0)  # pairs (eps, -eps); an odd last draw alone
            theta = jax.tree.map(lambda mi, pi, e: mi + sign.astype(mi.dtype) * e[s // 2] * jax.lax.rsqrt(pi), m, p, eps)
            loss, grad = jax.value_and_grad(trainer.loss_fn)(theta, jax.random.fold_in(key, 1 + s), x, y, mask)
            ggn = batch_diag_ggn(apply_fn, theta, x, y, mask, task=task)
            return loss.astype(jnp.float32), grad, jax.tree.map(lambda h: h / weight.astype(h.dtype), ggn)

        loss, grad, ggn = jax.vmap(one)(jnp.arange(samples))
        mean = lambda t: jax.tree.map(lambda a: jnp.mean(a, axis=0), t)  # noqa: E731
        return jnp.mean(loss), mean(grad), mean(ggn)

    def fit(key, start: DiagGaussian, cavity: DiagGaussian, data: ClientData):
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        cavity = gaussian.to_diag(cavity)
        p_c, mu_c = cavity.precision, gaussian.mean(cavity)
        m0, p0 = gaussian.mean(start), start.precision
        if init_std is not None:
            p0 = jax.tree.map(lambda p: jnp.maximum(p, jnp.asarray(1.0 / init_std**2, p.dtype)), p0)
        spe = jnp.maximum(steps_per_epoch(data.num_examples, batch_size), 1)
        total = jnp.maximum(passes * spe, min_steps)
        laid_out = jnp.maximum(trainer.num_epochs * spe, 1)
        first_tail = total // 2

        def step(t, carry):
            m, p, m_sum, p_sum, loss_sum = carry
            x, y, mask = get_batch(data, t % laid_out, batch_size)
            loss, g, h = moments(jax.random.fold_in(key, t), m, p, x, y, mask)
            m, p = natural_step(m, p, g, h, p_c, mu_c, n.astype(jnp.float32), step_size)
            tail = (t >= first_tail).astype(jnp.float32)
            m_sum = jax.tree.map(lambda a, b: a + tail.astype(b.dtype) * b, m_sum, m)
            p_sum = jax.tree.map(lambda a, b: a + tail.astype(b.dtype) * b, p_sum, p)
            return m, p, m_sum, p_sum, loss_sum + loss

        zeros = jax.tree.map(jnp.zeros_like, m0)
        init = (m0, p0, zeros, jax.tree.map(jnp.zeros_like, p0), jnp.zeros((), jnp.float32))
        _, _, m_sum, p_sum, loss_sum = jax.lax.fori_loop(0, total, step, init)
        count = (total - first_tail).astype(jnp.float32)
        m = jax.tree.map(lambda a: a / count.astype(a.dtype), m_sum)
        p = jax.tree.map(lambda a: a / count.astype(a.dtype), p_sum)
        return DiagGaussian(precision_mean=jax.tree.map(jnp.multiply, p, m), precision=p), training_info(loss_sum, total)

    return fit
