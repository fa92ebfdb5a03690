"""FedEP's moment-matching client: the tilted distribution's mean and covariance by NUTS.

Expectation propagation asks each client for the moments of its tilted distribution

    p^_k(theta) ∝ q_{-k}(theta) p(D_k | theta)^c

(Minka 2001, "Expectation propagation for approximate Bayesian inference", Sec. 3; Guo et al.
2023 (FedEP) Eq. 2; ``c`` the local-precision scale, 1 by default). The laplace method approximates
them at the tilted mode; for a skewed posterior the mode is not the mean, and no amount of
curvature fixes that. Here the moments are estimated, as Vehtari et al. 2020 ("Expectation
propagation as a way of life", Sec. 5) do with Stan: each client samples its tilted distribution by
the No-U-Turn sampler (Hoffman and Gelman 2014; BlackJAX's ``nuts`` with its Stan-style window
adaptation of the step size and a diagonal metric), then

    mu^ = mean of the draws,   Lambda^ = (S - D - 2) / (S - 1) * Cov(draws)^{-1},

the factor making the inverse of the sample covariance of ``S`` draws in ``D`` dimensions an
unbiased estimate of the precision (the mean of an inverse Wishart; Vehtari et al. 2020, Sec. 5.2),
and ``eta^ = Lambda^ mu^``. The site update, damping and cavity are FedEP's dense ones
(:func:`fedbayes.algorithms.fedep.full_client_step`).

**Geometry.** The sampler runs in whitened coordinates ``z = L^T (theta - m_p)`` with ``L L^T =
Lambda_p`` the tilted prior's precision (the cavity plus weight decay) and ``m_p`` its mean, so
``-log q_{-k}`` is ``|z|^2 / 2``: with many clients the cavity holds most of the data and the
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

from fedbayes.data.batches import ClientData
from fedbayes.gaussian_full import FullGaussian, cholesky
from fedbayes.inference.sgd import LocalTrainer

PyTree = Any

__all__ = ["client_examples", "make_full_nuts_inference", "precision_from_draws"]


def client_examples(data: ClientData, max_examples: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A client's examples ``(x, y, mask)``, padded to ``max_examples`` rows: its first laid-out
    epoch (the positions ``order[offset : offset + n_k]``), in that order; ``mask`` float32 is 1 for
    its ``n_k`` real rows."""
    j = jnp.arange(max_examples)
    pos = data.order[jnp.clip(data.offset + j, 0, data.order.shape[0] - 1)]
    mask = (j < data.num_examples).astype(jnp.float32)
    return data.x[pos], data.y[pos], mask


def precision_from_draws(draws: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(mean, precision)`` of draws ``[S, D]``: the sample mean and ``(S - D - 2) / (S - 1)`` times
    the inverse of the unbiased sample covariance, an unbiased estimate of the precision for
    independent Gaussian draws (the mean of the inverse Wishart; needs ``S > D + 2``)."""
    s, d = draws.shape
    mean = jnp.mean(draws, axis=0)
    centred = draws - mean[None, :]
    cov = centred.T @ centred / (s - 1)
    eye = jnp.eye(d, dtype=draws.dtype)
    chol = cholesky(0.5 * (cov + cov.T))
    inv_chol = jax.scipy.linalg.solve_triangular(chol, eye, lower=True)
    precision = (s - d - 2) / (s - 1) * (inv_chol.T @ inv_chol)
    return mean, 0.5 * (precision + precision.T)


def make_full_nuts_inference(trainer: LocalTrainer, settings: Any, *, max_examples: int):
    """The moment-matching method with dense messages: ``infer(key, start, cavity, data) ->
    (FullGaussian, info)`` (the module docstring).

    Args:
      trainer: its ``loss_fn`` (the masked mean loss; times the mask's sum, the client's negative
        log likelihood) is the likelihood sampled.
      settings: :class:`~fedbayes.inference.tilted.TiltedSettings` (``scale``, ``weight_decay``,
        ``nuts_warmup``, ``nuts_draws``, ``nuts_target_accept``, ``nuts_max_doublings``).
      max_examples: the federation's largest client (the static row count of a client's data).

    ``info``: ``loss`` (the mean negative log likelihood per example over the draws), ``steps`` (the
    sampler's transitions, warm-up included), ``acceptance`` (the mean acceptance probability of the
    kept draws) and ``divergences`` (divergent transitions among them).
    """
    import blackjax  # imported here: only this method samples, and the import takes a second
    from blackjax.adaptation.base import get_filter_adapt_info_fn

    s = settings
    if s.nuts_draws <= 2:
        raise ValueError(f"algorithm.nuts_draws: the precision estimate needs more draws than parameters + 2; got {s.nuts_draws}")

    def infer(key, start, cavity: FullGaussian, data: ClientData) -> tuple[FullGaussian, dict]:
        n = jnp.maximum(data.num_examples, 1).astype(jnp.float32)
        eta_c, unravel = ravel_pytree(cavity.precision_mean)
        d = eta_c.size
        if s.nuts_draws <= d + 2:
            raise ValueError(f"algorithm.nuts_draws: the precision estimate of {d} parameters needs more than {d + 2} draws; got {s.nuts_draws}")
        eye = jnp.eye(d, dtype=cavity.precision.dtype)
        lam_p = cavity.precision + (s.weight_decay * n).astype(eye.dtype) * eye
        chol = cholesky(0.5 * (lam_p + lam_p.T))  # L L^T = Lambda_p
        m_p = jax.scipy.linalg.cho_solve((chol, True), eta_c)
        x, y, mask = client_examples(data, max_examples)
        count = jnp.sum(mask)

        def to_theta(z):
            return m_p + jax.scipy.linalg.solve_triangular(chol.T, z, lower=False)  # theta = m_p + L^{-T} z

        def nll(theta_flat):
            return trainer.loss_fn(unravel(theta_flat), key, x, y, mask) * count

        def logdensity(z):
            return -s.scale * nll(to_theta(z)) - 0.5 * z @ z

        key_warm, key_draw = jax.random.split(key)
        z0 = chol.T @ (ravel_pytree(start)[0].astype(m_p.dtype) - m_p)
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
        mu, lam_hat = precision_from_draws(thetas)
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
