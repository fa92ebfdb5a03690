"""FedPA: federated posterior averaging (Al-Shedivat et al., ICLR 2021; Al-Shedivat et al. 2021 (FedPA), blog Al-Shedivat 2021 (blog)).

docs/algorithms.md §6. Under a uniform prior the global posterior is the product of the local ones;
with Gaussian local posteriors ``N(mu_k, Sigma_k)`` its mode minimises
``Q(theta) = sum_k q_k (theta - mu_k)^T Sigma_k^{-1} (theta - mu_k) / 2`` (Al-Shedivat et al. 2021 (FedPA) Prop. 2), whose
gradient is ``sum_k q_k Sigma_k^{-1} (theta - mu_k)``. The server therefore runs FedAvg's loop and
only the client delta changes (Al-Shedivat et al. 2021 (FedPA) Eq. 6):

    g_k = Sigma_hat_k^{-1} (theta - mu_hat_k)        (FedAvg: Sigma_hat_k = I, mu_hat_k = theta_k)

with ``mu_hat_k`` the mean of ``l`` IASG samples (:mod:`fedbayes.inference.iasg`) and the
shrinkage covariance of Al-Shedivat et al. 2021 (FedPA) Thm. 3 (docs/algorithms.md §6.4)

    Sigma_hat = rho_l I + (1 - rho_l) S_l,    rho_l = 1 / (1 + (l - 1) rho),

``S_l`` the unbiased sample covariance. :func:`shrinkage_delta` computes ``g_k`` by the dynamic
programme of Al-Shedivat et al. 2021 (FedPA) App. C (Eqs. 20-28; docs/algorithms.md §6.5) in ``O(l^2 d)`` time and ``O(l d)`` memory.

Burn-in (docs/algorithms.md §6.7): for the first ``burn_in_rounds`` rounds FedPA *is* FedAvg (``g = theta -
theta_last``, bit for bit); afterwards each client returns the shrinkage delta of its samples.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, Union

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from pydantic import Field, field_validator

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, NoInfo, burn_in_setting, finite_message, stateless_client_init
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.algorithms.sites import burn_in_switch
from fedbayes.hparams import HParams
from fedbayes.inference.iasg import epoch_samples
from fedbayes.inference.sgd import LocalTrainer

PyTree = Any
RHO_METHODS = ("oas", "rblw")

__all__ = ["FedPAConfig", "RHO_METHODS", "ServerState", "dense_shrinkage_delta", "fedpa", "shrinkage_delta", "shrinkage_rho"]


def _flatten_samples(samples: PyTree, theta: PyTree) -> tuple[jax.Array, jax.Array, Any]:
    """``[l, d]`` samples, ``[d]`` theta and the function that unflattens a ``[d]`` vector."""
    flat_theta, unravel = ravel_pytree(theta)
    leaves = jax.tree.leaves(samples)
    if not leaves:
        raise ValueError("shrinkage_delta: samples is empty")
    num = leaves[0].shape[0] if leaves[0].ndim else None
    s_leaves, t_leaves = leaves, jax.tree.leaves(theta)
    if jax.tree.structure(samples) != jax.tree.structure(theta):
        raise ValueError("shrinkage_delta: samples and theta must have the same pytree structure")
    for s, t in zip(s_leaves, t_leaves):
        if s.ndim != jnp.ndim(t) + 1 or s.shape[1:] != jnp.shape(t) or s.shape[0] != num:
            raise ValueError(
                f"shrinkage_delta: every samples leaf must be theta's leaf with a leading sample axis of one length; "
                f"got {s.shape} for a theta leaf of shape {jnp.shape(t)}"
            )
    flat = jnp.concatenate([s.reshape(num, -1).astype(flat_theta.dtype) for s in s_leaves], axis=1)
    return flat, flat_theta, unravel


def shrinkage_rho(samples: jax.Array, method: str = "oas") -> jax.Array:
    """FedPA's ``rho`` chosen from the samples by a shrinkage estimator (docs/algorithms.md §6.6, option A).

    Chen, Wiesel, Eldar & Hero (2010) give the shrinkage intensity ``s`` towards a scaled identity
    from the ML covariance ``S^ = Xc^T Xc / l`` in dimension ``p``:

        s_RBLW = min(((l-2)/l tr(S^2) + tr(S)^2) / ((l+2)(tr(S^2) - tr(S)^2 / p)), 1)
        s_OAS  = min(((1-2/p) tr(S^2) + tr(S)^2) / ((l+1-2/p)(tr(S^2) - tr(S)^2 / p)), 1)

    with the traces from the ``l x l`` Gram matrix ``G = Xc Xc^T`` in ``O(l^2 d)``:
    ``tr S = tr G / l``, ``tr S^2 = ||G||_F^2 / l^2``. Al-Shedivat et al. 2021 (FedPA) (end of App. C) suggests reading
    ``s`` as ``rho_l``; so ``rho = (1/s - 1) / (l - 1)`` (``s = 1`` gives ``rho = 0``, FedAvg's
    identity covariance; so does ``l < 2`` or identical samples).

    Args:
      samples: ``[l, d]``.
      method: ``"oas"`` or ``"rblw"``.
    """
    if method not in RHO_METHODS:
        raise ValueError(f"rho method must be one of {', '.join(RHO_METHODS)}; got {method!r}")
    num, dim = samples.shape
    if num < 2:
        return jnp.zeros((), samples.dtype)
    xc = samples - jnp.mean(samples, axis=0, keepdims=True)
    gram = xc @ xc.T
    tr_s = jnp.trace(gram) / num
    tr_s2 = jnp.sum(jnp.square(gram)) / num**2
    spread = tr_s2 - tr_s**2 / dim
    if method == "rblw":
        numer = (num - 2) / num * tr_s2 + tr_s**2
        denom = (num + 2) * spread
    else:
        numer = (1 - 2 / dim) * tr_s2 + tr_s**2
        denom = (num + 1 - 2 / dim) * spread
    s = jnp.where(denom > 0, jnp.minimum(numer / jnp.where(denom > 0, denom, 1.0), 1.0), 1.0)
    s = jnp.maximum(s, jnp.finfo(samples.dtype).tiny)
    return (1.0 / s - 1.0) / (num - 1)


def _shrinkage_solve(x: jax.Array, x0: jax.Array, rho) -> jax.Array:
    """The dynamic programme of Al-Shedivat et al. 2021 (FedPA) App. C.2 (docs/algorithms.md §6.5) on flat arrays ``x [l, d]``, ``x0 [d]``.

    Keeps ``Sigma~_t = I + rho (t-1) S_t`` implicitly through the rank-one updates
    ``Sigma~_t = Sigma~_{t-1} + gamma_t u_t u_t^T`` (``u_t = x_t - xbar_{t-1}``,
    ``gamma_t = rho (t-1)/t``) and their Sherman-Morrison inverses ``v_j = Sigma~_{j-1}^{-1} u_j``
    (stored, ``O(l d)``): ``d_t = Sigma~_t^{-1}(x0 - xbar_t)`` is updated as

        d_t = d_{t-1} - (1/t) [1 + gamma_t (t u.d_{t-1} - u.v) / (1 + gamma_t u.v)] v,

    and ``Sigma_hat_l^{-1} = (1 + (l-1) rho) Sigma~_l^{-1}``. ``1 + gamma c >= 1``: no division is
    ever unsafe. Loops are ``fori_loop``s, so the compiled size does not grow with ``l``.
    """
    num, dim = x.shape
    dtype = x.dtype
    rho = jnp.asarray(rho, dtype)

    def gamma(t):  # t: 1-based sample number
        return rho * (t - 1) / t

    def add_sample(i, carry):  # i: 0-based index of the new sample, t = i + 1
        mean, d, vs, cs = carry
        t = (i + 1).astype(dtype)
        u = x[i] - mean

        def sherman_morrison(j, v):  # v <- Sigma~_j^{-1} ... applied for stored j = 1 .. i-1
            g = gamma((j + 1).astype(dtype))
            return v - (g * jnp.vdot(vs[j], u) / (1 + g * cs[j])) * vs[j]

        v = jax.lax.fori_loop(1, i, sherman_morrison, u)
        c = jnp.vdot(u, v)
        a = jnp.vdot(u, d)
        g = gamma(t)
        d = d - ((1 + g * (t * a - c) / (1 + g * c)) / t) * v
        return mean + (x[i] - mean) / t, d, vs.at[i].set(v), cs.at[i].set(c)

    init = (x[0], x0 - x[0], jnp.zeros((num, dim), dtype), jnp.zeros((num,), dtype))
    _, d, _, _ = jax.lax.fori_loop(1, num, add_sample, init)
    return (1 + (num - 1) * rho) * d


def shrinkage_delta(samples: PyTree, theta: PyTree, rho: float | jax.Array | str = 0.01) -> PyTree:
    """FedPA's client delta ``Sigma_l^{-1} (theta - mean(samples))`` without any ``d x d`` matrix.

    ``Sigma_l = rho_l I + (1 - rho_l) S_l`` with ``rho_l = 1 / (1 + (l - 1) rho)`` and ``S_l`` the
    unbiased sample covariance (Al-Shedivat et al. 2021 (FedPA) Thm. 3, App. C; docs/algorithms.md §6.4-6.5). Computed by the dynamic
    programme of App. C.2 in ``O(l^2 d)`` time and ``O(l d)`` memory; usable under ``jit`` and
    ``vmap``. With one sample or ``rho = 0`` the result is ``theta - mean(samples)``, FedAvg's
    delta.

    Args:
      samples: an array ``[l, d]``, or a pytree whose leaves are ``theta``'s leaves with a leading
        sample axis of length ``l``.
      theta: the broadcast server parameters ``x_0`` (array ``[d]`` or pytree).
      rho: the shrinkage hyperparameter ``rho >= 0`` (a float or a scalar array), or ``"oas"`` /
        ``"rblw"`` to choose it from the samples (:func:`shrinkage_rho`).

    Returns:
      The delta, with ``theta``'s structure and dtype.
    """
    flat, flat_theta, unravel = _flatten_samples(samples, theta)
    if isinstance(rho, str):
        rho = shrinkage_rho(flat, rho)
    return unravel(_shrinkage_solve(flat, flat_theta, rho))


def dense_shrinkage_delta(samples: jax.Array, theta: jax.Array, rho) -> jax.Array:
    """Reference ``O(d^3)`` form of :func:`shrinkage_delta` on arrays ``[l, d]``, ``[d]``: a dense
    solve with ``Sigma_l = rho_l I + (1 - rho_l) cov(samples, ddof=1)`` (docs/algorithms.md §6.10 test 1)."""
    num, dim = samples.shape
    rho_l = 1.0 / (1.0 + (num - 1) * rho)
    cov = jnp.cov(samples, rowvar=False, ddof=1).reshape(dim, dim) if num > 1 else jnp.zeros((dim, dim), samples.dtype)
    sigma = rho_l * jnp.eye(dim, dtype=samples.dtype) + (1 - rho_l) * cov
    return jnp.linalg.solve(sigma, theta - jnp.mean(samples, axis=0))


class ServerState(NamedTuple):
    """FedPA server state: the model, the server optimizer state and the round counter (which
    decides between burn-in and sampling rounds)."""

    params: optax.Params
    opt_state: optax.OptState
    round: jax.Array


class Broadcast(NamedTuple):
    """What clients receive: the model and whether this is a sampling round."""

    params: optax.Params
    sampling: jax.Array


def fedpa(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    *,
    rho: float | str = 0.01,
    burn_in_rounds: int = 0,
    skip_epochs: int = 1,
) -> Algorithm:
    """FedPA on the algorithm interface (docs/algorithms.md §6; Al-Shedivat et al. 2021 (FedPA) Alg. 1 with the practical sampler).

    Clients are stateless. Each runs ``trainer.num_epochs`` epochs of its optimizer; epochs after
    the first ``skip_epochs`` each yield one IASG sample (the epoch's mean iterate, TFF's
    ``fed_pa_schedule``), so ``l = num_epochs - skip_epochs``. In the first ``burn_in_rounds``
    rounds the client returns FedAvg's ``theta - theta_last`` (:func:`~fedbayes.algorithms.sites.burn_in_switch`); afterwards
    :func:`shrinkage_delta` of its samples. The server takes the weighted mean of the deltas
    (``q_k`` from the simulator's weights) and applies ``server_optimizer`` (docs/algorithms.md §6.8).

    Args:
      trainer: local training (loss, client optimizer, epochs ``E``, batch size).
      server_optimizer: any optax transformation on the aggregated delta.
      rho: shrinkage ``rho >= 0`` (Al-Shedivat et al. 2021 (FedPA) Tables 4-6 use 0.01-0.1), or ``"oas"`` / ``"rblw"``.
      burn_in_rounds: rounds run as FedAvg before sampling starts.
      skip_epochs: epochs of every round that yield no sample (``num_mixin_epochs``, default 1).
    """
    if isinstance(rho, str):
        if rho not in RHO_METHODS:
            raise ValueError(f"fedpa: rho must be a number >= 0 or one of {', '.join(RHO_METHODS)}; got {rho!r}")
    elif rho < 0:
        raise ValueError(f"fedpa: rho must be >= 0; got {rho}")
    if burn_in_rounds < 0:
        raise ValueError(f"fedpa: burn_in_rounds must be >= 0; got {burn_in_rounds}")
    num_samples = trainer.num_epochs - skip_epochs
    if skip_epochs < 0 or num_samples < 1:
        raise ValueError(f"fedpa: needs at least one sample per round: local epochs ({trainer.num_epochs}) must exceed skip_epochs ({skip_epochs})")

    def server_init(key, params):
        del key
        return ServerState(params, server_optimizer.init(params), jnp.zeros((), jnp.int32))

    def broadcast(state):
        return Broadcast(state.params, state.round >= burn_in_rounds)

    def client_update(key, message, client_state, data):
        theta = message.params
        samples, last, info = epoch_samples(key, theta, data, trainer, skip_epochs=skip_epochs)
        fedavg_delta = optax.tree.sub(theta, last)
        delta = burn_in_switch(burn_in_rounds, message.sampling, lambda: shrinkage_delta(samples, theta, rho), lambda: fedavg_delta)
        return delta, client_state, info

    def server_update(key, state, aggregate):
        del key
        params, opt_state = apply_server_optimizer(server_optimizer, state.params, state.opt_state, aggregate.mean)
        return ServerState(params, opt_state, state.round + 1), NoInfo()

    return Algorithm(
        name="fedpa",
        server_init=server_init,
        broadcast=broadcast,
        client_init=stateless_client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=finite_message,
        trainer=trainer,
    )


class FedPAConfig(HParams):
    """FedPA (docs/algorithms.md §6): one IASG sample per local epoch after the first ``skip_epochs``."""

    name: Literal["fedpa"]
    rho: Union[float, str] = Field(0.01, description="shrinkage rho >= 0, or 'oas' / 'rblw' to choose it from the samples")
    burn_in_rounds: int = Field(0, ge=0, description="rounds run as FedAvg before sampling")
    skip_epochs: int = Field(1, ge=0, description="epochs per round that yield no sample")

    @field_validator("rho")
    @classmethod
    def _rho(cls, v):
        if isinstance(v, str) and v not in RHO_METHODS or not isinstance(v, str) and not v >= 0:
            raise ValueError(f"must be a number >= 0 or one of {', '.join(repr(m) for m in RHO_METHODS)}; got {v!r}")
        return v


def build(hp: FedPAConfig, ctx: BuildContext) -> Algorithm:
    return fedpa(ctx.trainer, ctx.server_optimizer, rho=hp.rho, burn_in_rounds=hp.burn_in_rounds, skip_epochs=hp.skip_epochs)


def _min_local_epochs(hp: FedPAConfig) -> tuple[int, str]:
    return hp.skip_epochs + 1, f"fedpa takes one sample per epoch after algorithm.skip_epochs ({hp.skip_epochs})"


SPEC = AlgorithmSpec(
    "fedpa", FedPAConfig, build, "posterior averaging: IASG samples, shrinkage covariance",
    bayesian=True, min_local_epochs=_min_local_epochs, burn_in_rounds=burn_in_setting,
)  # fmt: skip
SPECS = (SPEC,)
