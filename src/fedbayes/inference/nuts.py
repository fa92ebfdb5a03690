"""FedEP's moment-matching client: the tilted distribution's mean by NUTS.

Expectation propagation asks each client for the moments of its tilted distribution

    p~_k(theta) ∝ q_{-k}(theta) p(D_k | theta)^c

(Minka 2001, "Expectation propagation for approximate Bayesian inference", Sec. 3; Guo et al.
2023 (FedEP) Eq. 2; ``c`` the local-precision scale, 1 by default). The laplace method puts the
tilted mean at the tilted mode; for a skewed posterior the mode is not the mean, and no amount of
curvature moves it there. Here the mean is estimated, as Vehtari et al. 2020 ("Expectation
propagation as a way of life", Sec. 5) do with Stan: each client samples its tilted distribution by
the No-U-Turn sampler (Hoffman and Gelman 2014; BlackJAX's ``nuts`` after its Stan-style window
adaptation of the step size and a diagonal metric), and ``mu~`` is the draws' mean.

**The precision** is the cavity's plus the likelihood's curvature averaged over the tilted draws,

    Lambda~ = Lambda_{-k} + c E_{p~_k}[ GGN_k(theta) ],   eta~ = Lambda~ mu~,

(``GGN_k`` the dense generalised Gauss-Newton of the client's negative log likelihood, its Hessian
for a GLM with the canonical link), averaged over ``nuts_curvature_draws`` of the draws. It is the
tilted precision exactly when the likelihood is Gaussian in ``theta`` (the curvature is then
constant), and the first term of Stein's expansion of the tilted covariance about the cavity's
otherwise (Opper and Winther 2005, "Expectation consistent approximate inference", Sec. 2). The
inverse of the draws' covariance is not used: a site is the small difference ``Lambda~ -
Lambda_{-k}`` of two large precisions, so a relative error ``e`` in ``Lambda~`` (the sampling
noise and autocorrelation of a thousand draws) becomes an error of ``e Lambda_g`` in every site, and
``K e Lambda_g`` in ``q_g``: on the posterior benchmark's breast-cancer problem with ten clients it
left the variances far too narrow (docs/results/posterior_full.md). The curvature average is
a site's own size, positive semi-definite, and its noise is the site's.

The site update, damping and cavity are FedEP's dense ones
(:func:`fedbayes.algorithms.fedep.full_client_step`). At a fixed point every tilted mean equals the
global mean and ``Lambda_g = p_0 + c sum_k E_{p~_k}[GGN_k]``.

**Geometry.** The sampler runs in whitened coordinates ``theta = m_p + C z`` with ``C C^T =
Lambda_p^{-1}``, ``Lambda_p`` the tilted prior's precision (the cavity plus weight decay) and ``m_p``
its mean, so ``-log q_{-k}`` is ``|z|^2 / 2``: with many clients the cavity holds most of the data and the
tilted distribution is nearly standard normal in ``z``; the softmax's unidentified directions are
pinned by the cavity. (The NUTS reference of ``fedbayes bench posterior`` whitens by the MAP's
Hessian for the same reason.)

**The client's likelihood** is evaluated on all its examples at once: the first laid-out epoch's
positions, padded to the federation's largest client (a static shape, so the cohort's samplers run
under one ``vmap``) and masked. The cost per gradient is ``max_k n_k`` examples; NUTS takes up to
``2^max_doublings`` gradients per draw. This is for small models (the dense messages' bound) and
modest clients.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_full
from fedbayes.data.batches import ClientData
from fedbayes.gaussian_full import FullGaussian
from fedbayes.inference.clipping import ApplyFn
from fedbayes.inference.curvature import TASKS as CURVATURE_TASKS
from fedbayes.inference.curvature import batch_full_ggn
from fedbayes.inference.sgd import LocalTrainer

PyTree = Any

__all__ = ["client_examples", "make_full_nuts_inference"]


def client_examples(data: ClientData, max_examples: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A client's examples ``(x, y, mask)``, padded to ``max_examples`` rows: its first laid-out
    epoch (the positions ``order[offset : offset + n_k]``), in that order; ``mask`` float32 is 1 for
    its ``n_k`` real rows."""
    j = jnp.arange(max_examples)
    pos = data.order[jnp.clip(data.offset + j, 0, data.order.shape[0] - 1)]
    mask = (j < data.num_examples).astype(jnp.float32)
    return data.x[pos], data.y[pos], mask


def make_full_nuts_inference(trainer: LocalTrainer, settings: Any, *, apply_fn: ApplyFn, task: str = "classification", max_examples: int):
    """The moment-matching method with dense messages: ``infer(key, start, cavity, data) ->
    (FullGaussian, info)`` (the module docstring).

    Args:
      trainer: its ``loss_fn`` (the masked mean loss; times the mask's sum, the client's negative
        log likelihood) is the likelihood sampled.
      settings: :class:`~fedbayes.inference.tilted.TiltedSettings` (``scale``, ``weight_decay``,
        ``nuts_warmup``, ``nuts_draws``, ``nuts_target_accept``, ``nuts_max_doublings``,
        ``nuts_curvature_draws``).
      apply_fn: ``(params, x) -> outputs``, for the curvature.
      task: the likelihood's (one of :data:`fedbayes.inference.curvature.TASKS`).
      max_examples: the federation's largest client (the static row count of a client's data).

    ``info``: ``loss`` (the mean negative log likelihood per example over the draws), ``steps`` (the
    sampler's transitions, warm-up included), ``acceptance`` (the mean acceptance probability of the
    kept draws) and ``divergences`` (divergent transitions among them).
    """
    import blackjax  # imported here: only this method samples, and the import takes a second
    from blackjax.adaptation.base import get_filter_adapt_info_fn

    s = settings
    if task not in CURVATURE_TASKS:
        raise ValueError(
            f"the nuts method needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {task!r}"
        )
    every = max(s.nuts_draws // min(s.nuts_curvature_draws, s.nuts_draws), 1)  # the draws whose curvature is averaged: evenly spaced

    def infer(key, start, cavity: FullGaussian, data: ClientData) -> tuple[FullGaussian, dict]:
        n = jnp.maximum(data.num_examples, 1).astype(jnp.float32)
        eta_c, unravel = ravel_pytree(cavity.precision_mean)
        d = eta_c.size
        eye = jnp.eye(d, dtype=cavity.precision.dtype)
        lam_p = cavity.precision + (s.weight_decay * n).astype(eye.dtype) * eye
        tilted_prior = FullGaussian(precision_mean=cavity.precision_mean, precision=0.5 * (lam_p + lam_p.T))
        m_p = ravel_pytree(gaussian_full.mean(tilted_prior))[0]
        # C C^T = Lambda_p^{-1}: theta = m_p + C z makes the tilted prior N(0, I) in z. Factored by
        # gaussian_full (one matrix at a time under vmap); the sampler then differentiates matmuls only.
        scale = gaussian_full.scale_tril(tilted_prior)
        x, y, mask = client_examples(data, max_examples)
        count = jnp.sum(mask)

        def to_theta(z):
            return m_p + scale @ z

        def nll(theta_flat):
            return trainer.loss_fn(unravel(theta_flat), key, x, y, mask) * count

        def logdensity(z):
            return -s.scale * nll(to_theta(z)) - 0.5 * z @ z

        key_warm, key_draw = jax.random.split(key)
        z0 = scale.T @ (tilted_prior.precision @ (ravel_pytree(start)[0].astype(m_p.dtype) - m_p))  # C^{-1} = C^T Lambda_p
        warmup = blackjax.window_adaptation(
            blackjax.nuts, logdensity, target_acceptance_rate=s.nuts_target_accept, max_num_doublings=s.nuts_max_doublings,
            adaptation_info_fn=get_filter_adapt_info_fn(),
        )  # fmt: skip
        (state, params), _ = warmup.run(key_warm, z0, num_steps=s.nuts_warmup)
        kernel = blackjax.nuts(logdensity, **params)  # params: the adapted step size and metric, and max_num_doublings

        def one(state, k):
            state, info = kernel.step(k, state)
            return state, (state.position, state.logdensity, info.acceptance_rate, info.is_divergent)

        _, (zs, logd, accept, divergent) = jax.lax.scan(one, state, jax.random.split(key_draw, s.nuts_draws))
        thetas = jax.vmap(to_theta)(zs)
        mu = jnp.mean(thetas, axis=0)

        def add_curvature(total, theta):
            return total + batch_full_ggn(apply_fn, unravel(theta), x, mask, task=task).astype(total.dtype), None

        picked = thetas[::every][: s.nuts_curvature_draws]
        ggn, _ = jax.lax.scan(add_curvature, jnp.zeros((d, d), eye.dtype), picked)
        ggn = ggn / picked.shape[0]
        lam_hat = cavity.precision + s.scale * (ggn + (s.weight_decay * n).astype(eye.dtype) * eye)
        lam_hat = 0.5 * (lam_hat + lam_hat.T)
        # the draws' likelihood part of the log density, per example: -(logdensity + |z|^2 / 2) / (c n)
        loss = -jnp.mean(logd + 0.5 * jnp.sum(zs * zs, axis=1)) / (s.scale * n)
        info = {
            "loss": loss.astype(jnp.float32),
            "steps": jnp.asarray(s.nuts_warmup + s.nuts_draws, jnp.int32),
            "acceptance": jnp.mean(accept).astype(jnp.float32),
            "divergences": jnp.sum(divergent).astype(jnp.int32),
        }
        return FullGaussian(precision_mean=unravel(lam_hat @ mu), precision=lam_hat), info

    return infer
