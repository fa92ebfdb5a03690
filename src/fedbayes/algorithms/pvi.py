"""PVI: partitioned variational inference with mean-field Gaussian sites (Ashman et al. 2022;
Swaroop et al. 2025 (ADMM and Bayes) Eqs. 4-6; docs/algorithms.md §8).

The global approximation is the prior times one site per client,

    q_g(theta) ∝ p(theta) prod_k t_k(theta),    p = N(0, 1/delta),

with diagonal Gaussian sites ``t_k`` in natural parameters (:class:`~fedbayes.gaussian.DiagGaussian`;
every site starts as the uniform factor, so ``q_g`` starts as the prior). In a round, client ``k``:

1. forms the cavity ``q_{\\k} = q_g / t_k`` (the prior times the other clients' sites), which must be
   a proper density (:func:`~fedbayes.algorithms.sites.checked_cavity`, then every precision > 0);
2. finds its local posterior by variational inference of the tilted distribution (cavity times
   likelihood, Ashman et al. 2022 Eq. 5 / Swaroop et al. 2025 Eq. 5):

       q_k = argmin_{q mean-field}  E_q[l_k(theta)] + KL(q || q_{\\k})

   by reparameterised stochastic gradients (``local_vi = "sgd"``, the default:
   :func:`fedbayes.inference.vi.reparameterised_vi`: ``S`` samples per minibatch, the client's
   optax optimizer, ``E`` epochs through :func:`fedbayes.inference.sgd.run_sgd`, starting from
   ``q_g``), or by natural-gradient steps with the cavity as the prior (``local_vi = "natural"``:
   :func:`fedbayes.inference.vi_natural.natural_diag_vi`, VOGN of Khan et al. 2018 Eqs. 8-10,
   ``P <- (1 - b) P + b (P_c + n_k E_q[diag GGN])``, ``m <- m - b (n_k E_q[grad] + P_c (m - mu_c)) / P``;
   every site an average of GGN diagonals, docs/algorithms.md §8.2);
3. sends the damped natural-parameter difference ``Delta_k = rho (lambda_{q_k} - lambda_{q_g})`` and
   keeps the site ``t_k <- t_k Delta_k`` (``lambda_{t_k} += Delta_k``; Swaroop et al. 2025 Eq. 6).

The server sets ``lambda_{q_g} <- lambda_{q_g} + ServerOpt(sum_k Delta_k)`` over the accepted
clients (:func:`~fedbayes.algorithms.sites.site_server_step`). With the default server optimizer,
plain SGD at lr 1, this is PVI's synchronous update ``q_g = p prod_k t_k`` exactly; another optax
transformation (momentum, Adam) treats ``sum_k Delta_k`` as a step on natural parameters, as FedEP
does (docs/algorithms.md §1.3), and ``q_g`` then no longer equals ``p prod_k t_k``.

**Damping.** ``rho``: by default the adaptive damping of :mod:`fedbayes.algorithms.damping` (the
server chooses it each round from how the global mean moved; it travels in the broadcast), or a
fixed value (Ashman et al. and FedLap use ``1 / K`` under full participation; the fixed default
before the adaptive one was :data:`DEFAULT_RHO` ``= 0.5``). A client's change ``rho (lambda_{q_k} -
lambda_{q_g})`` is its own site's move towards its target, so the damping acts per site and does
not depend on the cohort (docs/results/posterior_defaults.md). With ``rho <= 1 / M`` the new global
precision ``(1 - M rho) Lambda_g + rho sum_k Lambda_{q_k}`` is a convex combination of positive
ones, so it stays positive; with a larger ``rho`` a site can turn improper and the server's guard
(below) may have to act.

**The client optimiser** must be unbiased: with plain SGD the local step reaches the tilted
mean-field optimum and PVI the exact mean-field VI optimum; Adam, restarted every round with
sign-like steps on noisy label-skewed minibatches, settles at a biased point that more rounds do
not move (docs/results/posterior_defaults.md).

**Robustness** (docs/style.md: every improper result has a policy). A client whose cavity is not
proper flags its message (PVI's "skip the client"). ``message_ok`` also rejects a message with
non-finite values or one that on its own would make ``Lambda_g`` non-positive. With
``allow_improper_sites=False`` a message that would give its site a non-positive precision is
rejected too (sites are factors and may be improper, so the default allows them). A rejected
client keeps its old site. Should the aggregated step still leave a coordinate of ``Lambda_g``
non-positive, that coordinate keeps its old value
(:func:`~fedbayes.algorithms.sites.guard_positive`; counted in the server info
``precision_guarded``).

**Evaluation and export.** The point estimate is the mean of ``q_g``; ``server_posterior`` gives
its mean and variance for the marginalised predictive (docs/algorithms.md §13.1) and for
``model.npz``.

State: the server keeps ``q_g`` (2d floats) and the server optimizer's state; a client keeps its site
(2d floats). Messages: ``q_g`` down (with ``init_mean="model"`` also the local mean's start, d
floats: the model's initial parameters in round 1, the global's mean afterwards), ``Delta_k`` up
(2d floats and a flag; with the adaptive damping also the client's loss at the broadcast, 1 float).

**Full covariance** (``covariance = "full"``; docs/algorithms.md §8.5): the sites, cavity, local
posterior and ``q_g`` are dense Gaussians (:class:`~fedbayes.gaussian_full.FullGaussian`, a
``[D, D]`` precision over the raveled parameters). The local step is full-covariance VI
(:func:`fedbayes.inference.vi_full.full_covariance_vi`: ``q_k = N(m, C C^T)`` with a Cholesky
factor ``C``, the reparameterisation gradient of the same local free energy), the cavity the exact
quotient ``q_g / t_k`` (a client whose cavity is not positive definite flags its message), the
message the damped dense difference ``rho (q_k / q_g)``, and the server's product exact in the
dense family (a step that would leave ``Lambda_g`` not positive definite keeps the old ``q_g``
whole). Weights are drawn per minibatch (``estimator`` has no effect: the local reparameterisation
needs independent weights), :data:`FULL_SAMPLES` draws per step by default (:func:`default_samples`). For models of at most
:data:`~fedbayes.algorithms.sites.MAX_FULL_PARAMS` parameters; no robust aggregation or privacy.
Steps: :func:`full_cavity`, :func:`full_client_step`, :func:`full_server_step`.

The steps are pure functions at the top of this module, composed by the thin factory :func:`pvi`:
:func:`cavity` (step 1), the local step (2), :func:`site_update` (3), chained by
:func:`client_step`; :func:`server_step` returns a typed :class:`PVIInfo`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from pydantic import Field, model_validator

from fedbayes import gaussian, gaussian_full, tree
from fedbayes.aggregators import Aggregate
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms import sites
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, stored_setting
from fedbayes.algorithms.sites import (
    BROADCAST_LOSS_TAG,
    GaussianMessage,
    all_positive,
    checked_cavity,
    damped_difference,
    full_message_ok,
    full_personal_moments,
    full_safe_mean,
    gaussian_message_ok,
    personal_moments,
    psd_to_roundoff,
    safe_mean,
    site_server_step,
)
from fedbayes.data.batches import ClientData
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_full import FullGaussian
from fedbayes.hparams import HParams
from fedbayes.inference.base import CavityInference
from fedbayes.inference.sgd import LocalTrainer, broadcast_loss
from fedbayes.inference.vi import ESTIMATORS, PARAMETERISATIONS, reparameterised_vi
from fedbayes.inference.vi_full import NATURAL_STEPS, full_covariance_vi, natural_full_vi
from fedbayes.inference.vi_natural import NATURAL_SAMPLES, natural_diag_vi

PyTree = Any
INIT_MEANS = ("global", "model")
COVARIANCES = ("diagonal", "full")
FULL_VIS = ("natural", "cholesky")
LOCAL_VIS = ("natural", "sgd")  # the diagonal local VI (docs/algorithms.md §8.2)
DEFAULT_LOCAL_VI = "sgd"
FULL_SAMPLES = 8  # the draws per step of the dense local VI by default (docs/results/posterior_full.md)
AUTO = "auto"
NETWORK_INIT_STD = 0.1  # the local std's start on a network under "auto" (docs/algorithms.md §8.2)
STORED_NETWORK_STD = 0.03  # what "auto" gave on a network in a config written before ``network_std`` (2026-11-28 to 2026-11-30)
DEFAULT_RHO = 0.5  # the adaptive damping's start and the fixed default before it (docs/results/posterior_defaults.md)

__all__ = [
    "AUTO",
    "COVARIANCES",
    "FULL_SAMPLES",
    "INIT_MEANS",
    "LOCAL_VIS",
    "NETWORK_INIT_STD",
    "STORED_NETWORK_STD",
    "Broadcast",
    "ClientState",
    "PVIConfig",
    "PVIInfo",
    "ServerState",
    "broadcast",
    "build",
    "cavity",
    "client_step",
    "default_samples",
    "full_cavity",
    "full_client_step",
    "full_server_init",
    "full_server_step",
    "local_start",
    "personal_posterior",
    "pvi",
    "server_init",
    "server_params",
    "server_posterior",
    "server_step",
    "site_update",
    "start_of",
]


# ----- the algorithm ---------------------------------------------------------------------------------


class ServerState(NamedTuple):
    """PVI server state: ``q_g``, the server optimizer's state over it, rounds done, the
    model's initial parameters (``init_mean="model"`` only, else ``None``), and the damping
    (:class:`~fedbayes.algorithms.damping.DampingState`)."""

    q: DiagGaussian
    opt_state: optax.OptState
    round: jax.Array
    anchor: PyTree = None
    damping: damping_policy.DampingState | None = None


class Broadcast(NamedTuple):
    """What clients receive: ``q_g``, with ``init_mean="model"`` the local mean's start, and the
    round's damping ``rho``."""

    q: DiagGaussian
    start: PyTree = None
    damping: jax.Array | float = 1.0


class ClientState(NamedTuple):
    """A client's site ``t_k`` (natural parameters; starts uniform)."""

    site: DiagGaussian


class PVIInfo(NamedTuple):
    """The server step's info.

    Attributes:
      precision_guarded: coordinates of ``Lambda_g`` that kept their old value
        (:func:`~fedbayes.algorithms.sites.guard_positive`).
      damping: the damping ``rho`` this round's clients used.
    """

    precision_guarded: jax.Array
    damping: jax.Array | float


def server_init(params: PyTree, server_optimizer, prior_precision: float, damping: damping_policy.Damping, anchored: bool) -> ServerState:
    """``q_g = p = N(0, 1/delta)`` (every site uniform), and with ``anchored`` (``init_mean="model"``)
    the model's initial parameters."""
    lam = optax.tree.full_like(params, prior_precision)
    q = DiagGaussian(precision_mean=optax.tree.zeros_like(params), precision=lam)
    return ServerState(q, server_optimizer.init(q), jnp.zeros((), jnp.int32), params if anchored else None, damping.init(params))


def server_params(state: ServerState) -> PyTree:
    """The mean of ``q_g`` (0 where ``Lambda_g = 0``)."""
    return safe_mean(state.q, optax.tree.zeros_like(state.q.precision_mean))


def broadcast(state: ServerState, anchored: bool) -> Broadcast:
    """``q_g``, the damping and, with ``anchored``, the local mean's start: the model's initial
    parameters in the first round, the mean of ``q_g`` afterwards."""
    if not anchored:
        return Broadcast(state.q, None, state.damping.value)
    first = state.round == 0
    return Broadcast(state.q, jax.tree.map(lambda a, m: jnp.where(first, a, m), state.anchor, server_params(state)), state.damping.value)


def cavity(q: DiagGaussian, site: DiagGaussian) -> tuple[DiagGaussian, jax.Array]:
    """Step 1: ``q_{\\k} = q_g / t_k`` and whether it is proper (the KL to it needs every precision
    > 0; :func:`~fedbayes.algorithms.sites.checked_cavity` first clamps round-off)."""
    c, ok = checked_cavity(gaussian.quotient(q, site), q)
    return c, jnp.logical_and(ok, all_positive(c.precision))


def start_of(message: Broadcast) -> DiagGaussian:
    """Where the local step starts: ``q_g``, or ``q_g``'s precisions about the broadcast start."""
    q = message.q
    return q if message.start is None else DiagGaussian(jax.tree.map(jnp.multiply, q.precision, message.start), q.precision)


def site_update(site: DiagGaussian, q_k: DiagGaussian, q: DiagGaussian, damping: float | jax.Array) -> tuple[DiagGaussian, DiagGaussian]:
    """Step 3: ``Delta_k = rho (lambda_{q_k} - lambda_{q_g})`` and ``t_k <- t_k Delta_k`` (Swaroop et al.
    2025 (ADMM and Bayes) Eq. 6). Returns ``(Delta_k, new_site)``."""
    step = damped_difference(q_k, q, damping)
    return step, gaussian.product(site, step)


def client_step(
    key: jax.Array,
    message: Broadcast,
    cstate: ClientState,
    data: ClientData,
    local: CavityInference,
    trainer: LocalTrainer,
    *,
    adaptive: bool,
    allow_improper_sites: bool = True,
):
    """One PVI client round: :func:`cavity`, the local posterior ``q_k = local(key, start, cavity,
    data)`` (Ashman et al. 2022 Eq. 5), :func:`site_update`. Returns ``(message, client_state,
    info)``; the message is flagged when the cavity is improper or, unless ``allow_improper_sites``,
    the new site is."""
    q = message.q
    cav, ok = cavity(q, cstate.site)
    start = start_of(message)
    fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), gaussian.mean(start), data, trainer) if adaptive else None
    q_k, info = local(key, start, cav, data)
    step, site = site_update(cstate.site, q_k, q, message.damping)
    if not allow_improper_sites:
        ok = jnp.logical_and(ok, all_positive(site.precision))
    return GaussianMessage(step, ok, fit), ClientState(site), info


def server_step(state: ServerState, aggregate: Aggregate, server_optimizer, damping: damping_policy.Damping) -> tuple[ServerState, PVIInfo]:
    """``lambda_{q_g} <- lambda_{q_g} + ServerOpt(sum_k Delta_k)`` over the accepted clients with the
    positivity guard (:func:`~fedbayes.algorithms.sites.site_server_step`), and the damping's rule."""
    q, opt_state, guarded = site_server_step(server_optimizer, state.q, state.opt_state, aggregate.total.difference)
    info = PVIInfo(precision_guarded=guarded, damping=state.damping.value)  # the damping this round's clients used
    return ServerState(q, opt_state, state.round + 1, state.anchor, damping.update(state.damping, state.q, q, aggregate.mean.loss)), info


def server_posterior(state: ServerState) -> tuple[PyTree, PyTree]:
    """``(mean, variance)`` of ``q_g`` (docs/algorithms.md §13.1)."""
    return server_params(state), gaussian.variance(state.q)


def personal_posterior(state: ServerState, cstate: ClientState, weight) -> tuple[PyTree, PyTree]:
    """Client ``k``'s ``q_g t_k^w`` in moments (docs/algorithms.md §13.8)."""
    return personal_moments(state.q, cstate.site, weight, server_params(state))


# ----- full covariance (docs/algorithms.md §8.5) ------------------------------------------------------


def full_server_init(params: PyTree, server_optimizer, prior_precision: float, damping: damping_policy.Damping, anchored: bool) -> ServerState:
    """:func:`server_init` in the dense family: ``q_g = p = N(0, I / delta)`` with a ``[D, D]`` precision."""
    state = server_init(params, server_optimizer, prior_precision, damping, anchored)
    q = gaussian_full.to_full(state.q)
    return state._replace(q=q, opt_state=server_optimizer.init(q))


def full_server_params(state: ServerState) -> PyTree:
    """The mean of a dense ``q_g`` (0 where it is not proper)."""
    return full_safe_mean(state.q, optax.tree.zeros_like(state.q.precision_mean))


def full_cavity(q: FullGaussian, site: FullGaussian) -> tuple[FullGaussian, jax.Array]:
    """Step 1 with dense factors: ``q_{\\k} = q_g / t_k`` (exact) and whether it is a proper density
    (finite, positive definite: the KL to it needs that). An improper cavity is replaced by ``q_g``
    for the local step, so its numbers stay finite; the message is flagged either way."""
    c = gaussian_full.quotient(q, site)
    ok = tree.all_finite(c) & gaussian_full.is_proper(c)
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), c, q), ok


def full_start_of(message: Broadcast) -> FullGaussian:
    """:func:`start_of` for a dense ``q_g``: ``q_g``, or its precision about the broadcast start."""
    q = message.q
    if message.start is None:
        return q
    flat, unravel = ravel_pytree(message.start)
    return FullGaussian(unravel(q.precision @ flat.astype(q.precision.dtype)), q.precision)


def full_client_step(
    key: jax.Array,
    message: Broadcast,
    cstate: ClientState,
    data: ClientData,
    local: CavityInference,
    trainer: LocalTrainer,
    *,
    adaptive: bool,
    allow_improper_sites: bool = True,
):
    """One PVI client with dense factors: :func:`full_cavity`, the local posterior ``q_k = local(key,
    start, cavity, data)`` (:func:`fedbayes.inference.vi_full.full_covariance_vi`), the damped
    difference ``Delta_k = rho (q_k / q_g)`` and ``t_k <- t_k Delta_k`` (natural parameters, Swaroop
    et al. 2025 (ADMM and Bayes) Eq. 6). Unless ``allow_improper_sites``, a new site that is not
    positive semi-definite to round-off (:func:`~fedbayes.algorithms.sites.psd_to_roundoff`) flags
    the message too. Returns ``(message, client_state, info)``."""
    q = message.q
    cav, ok = full_cavity(q, cstate.site)
    start = full_start_of(message)
    fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), gaussian_full.mean(start), data, trainer) if adaptive else None
    q_k, info = local(key, start, cav, data)
    step = optax.tree.scale(message.damping, gaussian_full.difference(q_k, q))
    site = gaussian_full.product(cstate.site, step)
    if not allow_improper_sites:
        ok = jnp.logical_and(ok, psd_to_roundoff(site.precision, q.precision))
    return GaussianMessage(step, ok, fit), ClientState(site), info


def full_server_step(state: ServerState, aggregate: Aggregate, server_optimizer, damping: damping_policy.Damping) -> tuple[ServerState, PVIInfo]:
    """:func:`server_step` with a dense ``q_g`` (:func:`~fedbayes.algorithms.sites.full_server_step`:
    with ``sgd(1)`` the exact product ``q_g = p prod_k t_k``); the damping's rule watches the
    moment-matched diagonal (:func:`~fedbayes.gaussian_full.project_to_diag`)."""
    q, opt_state, guarded = sites.full_server_step(server_optimizer, state.q, state.opt_state, aggregate.total.difference)
    info = PVIInfo(precision_guarded=guarded, damping=state.damping.value)
    moved = damping.update(state.damping, gaussian_full.project_to_diag(state.q), gaussian_full.project_to_diag(q), aggregate.mean.loss)
    return ServerState(q, opt_state, state.round + 1, state.anchor, moved), info


def pvi(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    *,
    prior_precision: float,
    damping: float | damping_policy.Damping,
    samples: int = 1,
    parameterisation: str = "log",
    init_std: float | None = None,
    init_mean: str = "global",
    allow_improper_sites: bool = True,
    local: CavityInference | None = None,
    estimator: str = "local",
    covariance: str = "diagonal",
) -> Algorithm:
    """Synchronous mean-field Gaussian PVI (module docstring; docs/algorithms.md §8): :func:`client_step`
    and :func:`server_step`. The settings' ranges are :class:`PVIConfig`'s.

    Args:
      trainer: the client's loss, optax optimizer (Adam in Ashman et al.), epochs and batch size.
      server_optimizer: optax transformation of ``lambda_{q_g}`` by ``sum_k Delta_k`` (``sgd(1)``:
        PVI exactly).
      prior_precision: ``delta`` of the prior ``N(0, 1/delta)``, on the sum-loss scale.
      damping: ``rho``, a fixed value in (0, 1] or a policy (:func:`fedbayes.algorithms.damping.adaptive`).
      samples, parameterisation, init_std, estimator: the local step's (:func:`fedbayes.inference.vi.reparameterised_vi`).
      init_mean: where the local mean starts: ``"global"``, the mean of ``q_g`` (Ashman et al.);
        ``"model"``, the model's initial parameters in the first round (the prior's zero mean
        is a symmetric start for a network's hidden units) and the mean of ``q_g`` afterwards.
      allow_improper_sites: accept a message whose site would get a non-positive precision.
      local: replaces the local step, any :class:`~fedbayes.inference.base.CavityInference` whose
        ``start`` is a Gaussian (tests plug in exact Gaussian inference).
      covariance: ``"diagonal"`` (mean-field sites) or ``"full"`` (dense sites, cavity, local
        posterior and ``q_g``; module docstring).

    Raises:
      ValueError: for an unknown ``init_mean`` or ``covariance``, a fixed ``damping <= 0`` or a bad local-step setting.
    """
    if init_mean not in INIT_MEANS:
        raise ValueError(f"pvi: init_mean must be one of {', '.join(INIT_MEANS)}; got {init_mean!r}")
    if covariance not in COVARIANCES:
        raise ValueError(f"pvi: covariance must be one of {', '.join(COVARIANCES)}; got {covariance!r}")
    policy = damping if isinstance(damping, damping_policy.Damping) else damping_policy.fixed(damping)
    if covariance == "full":
        if local is None:
            local = full_covariance_vi(trainer, samples=samples, parameterisation=parameterisation, init_std=init_std)
        return _pvi_full(trainer, server_optimizer, local, prior_precision, policy, init_mean == "model", allow_improper_sites)
    if local is None:
        local = reparameterised_vi(trainer, samples=samples, parameterisation=parameterisation, init_std=init_std, estimator=estimator)
    anchored = init_mean == "model"

    def client_update(key, message: Broadcast, cstate: ClientState, data):
        return client_step(key, message, cstate, data, local, trainer, adaptive=policy.adaptive, allow_improper_sites=allow_improper_sites)

    def server_update(key, state, aggregate):
        del key
        return server_step(state, aggregate, server_optimizer, policy)

    return Algorithm(
        name="pvi",
        server_init=lambda key, params: server_init(params, server_optimizer, prior_precision, policy, anchored),
        broadcast=lambda state: broadcast(state, anchored),
        client_init=lambda params: ClientState(gaussian.uniform_like(params)),
        client_update=client_update,
        server_update=server_update,
        server_params=server_params,
        message_ok=lambda state, message: gaussian_message_ok(message, state.q),
        trainer=trainer,
        server_posterior=server_posterior,
        after_rejected_round=lambda state: state._replace(damping=policy.rejected(state.damping)),
        personal_posterior=personal_posterior,
    )


def _pvi_full(trainer, server_optimizer, local, prior_precision, policy, anchored, allow_improper_sites) -> Algorithm:
    """The :class:`Algorithm` of PVI with dense factors (module docstring)."""

    def client_update(key, message: Broadcast, cstate: ClientState, data):
        return full_client_step(key, message, cstate, data, local, trainer, adaptive=policy.adaptive, allow_improper_sites=allow_improper_sites)

    def server_update(key, state, aggregate):
        del key
        return full_server_step(state, aggregate, server_optimizer, policy)

    def broadcast_full(state: ServerState) -> Broadcast:
        if not anchored:
            return Broadcast(state.q, None, state.damping.value)
        first = state.round == 0
        return Broadcast(state.q, jax.tree.map(lambda a, m: jnp.where(first, a, m), state.anchor, full_server_params(state)), state.damping.value)

    return Algorithm(
        name="pvi",
        server_init=lambda key, params: full_server_init(params, server_optimizer, prior_precision, policy, anchored),
        broadcast=broadcast_full,
        client_init=lambda params: ClientState(gaussian_full.uniform_like(params)),
        client_update=client_update,
        server_update=server_update,
        server_params=full_server_params,
        message_ok=lambda state, message: full_message_ok(message, state.q),
        trainer=trainer,
        server_posterior=lambda state: (full_server_params(state), gaussian_full.variance(state.q)),
        after_rejected_round=lambda state: state._replace(damping=policy.rejected(state.damping)),
        personal_posterior=lambda state, cstate, weight: full_personal_moments(state.q, cstate.site, weight),
        server_precision=lambda state: state.q.precision,
    )


class PVIConfig(HParams):
    """PVI (docs/algorithms.md §8): mean-field Gaussian sites, damped synchronous updates, a
    reparameterised VI local step with the client optimizer (``client.optimizer``, ``client.lr``,
    ``client.epochs``, ``client.batch_size``; keep ``client.weight_decay = 0``: the prior is the
    regulariser, and decay would also shrink the local log-standard-deviations), or with
    ``local_vi = "natural"`` natural-gradient steps with the Gauss-Newton curvature (only
    ``client.batch_size`` and the laid-out epochs are used)."""

    name: Literal["pvi"]
    delta: float = Field(1.0, gt=0, description="prior precision: p(theta) = N(0, 1/delta), on the sum-loss scale")
    rho: Annotated[float, Field(gt=0, le=1)] | Literal["adaptive"] = Field(
        damping_policy.ADAPTIVE,
        description="damping of the site updates: adaptive (the default: starts at 0.5, grown while the global posterior contracts, shrunk "
        "when it swings back or grows) or a fixed value in (0, 1] (1 / clients_per_round is Ashman et al.'s); use a plain SGD client: Adam's "
        "local optimum is biased",
    )
    samples: int | None = Field(
        None,
        ge=1,
        description=f"S, reparameterised weight samples per minibatch of the local VI; default 1, or {FULL_SAMPLES} with covariance = 'full' "
        "(the dense message's precision is biased up by the local step's noise, and that bias accumulates over rounds)",
    )
    estimator: Literal[ESTIMATORS] = Field(  # type: ignore[valid-type]
        "local",
        description="local VI gradient: local (dense outputs drawn per example, the default: lower variance, faster on a CPU) or weights "
        "(one weight draw per minibatch, Ashman et al.'s); the same objective",
    )
    parameterisation: Literal[PARAMETERISATIONS] = Field("log", description="local standard deviation as exp(s) (log) or softplus(s)")  # type: ignore[valid-type]
    init_std: Annotated[float, Field(gt=0)] | Literal["auto", "global"] = Field(
        AUTO,
        description="start the local std at min(global std, init_std), or at the global std (global); auto (the default): "
        "network_std on a network, the global std on a generalised linear model",
    )
    network_std: float = Field(
        NETWORK_INIT_STD,
        gt=0,
        description="init_std = auto on a network: the local std starts at min(global std, network_std); its local mean's pull to the "
        "cavity grows as 1 / network_std^2, so a smaller one slows a network's training",
    )
    init_mean: Literal[INIT_MEANS + (AUTO,)] = Field(  # type: ignore[valid-type]
        AUTO,
        description="local mean's start: global (mean of q_g), model (the model's init in round 1), or auto (the default): model on a "
        "network, global on a generalised linear model",
    )
    improper_sites: Literal["allow", "reject"] = Field("allow", description="a message that gives its site a non-positive precision: allow or reject")
    covariance: Literal[COVARIANCES] = Field(  # type: ignore[valid-type]
        "diagonal",
        description="the Gaussian family of the sites, cavity, local posterior and q_g: diagonal (default, mean-field) or full, a dense "
        f"[D, D] precision over all D parameters with full-covariance local VI (weights drawn per minibatch; for models up to "
        f"{sites.MAX_FULL_PARAMS} parameters, e.g. model.name = 'logreg'; no robust aggregation or privacy)",
    )
    full_vi: Literal[FULL_VIS] = Field(  # type: ignore[valid-type]
        "natural",
        description="the local VI with covariance = 'full': natural (the default: natural-gradient steps whose precision is the cavity's plus "
        "the expected Gauss-Newton matrix under q) or cholesky (reparameterised gradients of a Cholesky factor)",
    )

    natural_steps: int = Field(
        NATURAL_STEPS, ge=2, description="natural-gradient iterations per client and round of the natural dense client (each a pass per draw)"
    )
    local_vi: Literal[LOCAL_VIS] = Field(  # type: ignore[valid-type]
        DEFAULT_LOCAL_VI,
        description="the local VI with covariance = 'diagonal': natural (natural-gradient steps whose precision is the cavity's plus the "
        "expected diagonal Gauss-Newton matrix under q, VOGN with the cavity as prior) or sgd (reparameterised gradients of the mean and "
        "log standard deviation with the client optimizer)",
    )

    @model_validator(mode="after")
    def _full_vi_needs_full(self):
        if self.network_std != NETWORK_INIT_STD and self.init_std != AUTO:
            raise ValueError(
                f"algorithm.network_std: sets where init_std = 'auto' starts a network's local std; with init_std {self.init_std!r} it has no "
                "effect: drop it, or set init_std to the value you want"
            )
        if self.full_vi != "natural" and self.covariance != "full":
            raise ValueError(
                f"algorithm.full_vi: {self.full_vi!r} is a dense local VI; set covariance = 'full' or drop full_vi; got covariance {self.covariance!r}"
            )
        if self.natural_steps != NATURAL_STEPS and (self.covariance != "full" or self.full_vi != "natural"):
            raise ValueError(
                f"algorithm.natural_steps: sets the natural dense client's iterations; it needs covariance = 'full' and full_vi = 'natural'; "
                f"got covariance {self.covariance!r}, full_vi {self.full_vi!r}"
            )
        if self.local_vi != DEFAULT_LOCAL_VI and self.covariance != "diagonal":
            raise ValueError(
                f"algorithm.local_vi: chooses the diagonal local VI; with covariance = 'full' the local VI is full_vi; got local_vi {self.local_vi!r}"
            )
        if self.local_vi == "natural" and self.covariance == "diagonal":
            for key, default in (("estimator", "local"), ("parameterisation", "log")):
                if getattr(self, key) != default:
                    raise ValueError(
                        f"algorithm.{key}: a setting of the sgd local VI, which the natural one has no use for; set local_vi = 'sgd' or drop {key}; "
                        f"got {getattr(self, key)!r}"
                    )
        return self


def default_samples(hp: PVIConfig) -> int:
    """``samples`` if set, else 1, :data:`~fedbayes.inference.vi_natural.NATURAL_SAMPLES` (four
    antithetic pairs) with the natural diagonal client, or :data:`FULL_SAMPLES` with
    ``covariance = "full"``: the dense message's precision ``(C C^T)^{-1}`` is convex in the noise
    of the local step's Cholesky factor, and with one draw per step the variances stayed far below
    the optimum's, where eight draws reach it (docs/results/posterior_full.md)."""
    if hp.samples is not None:
        return hp.samples
    if hp.covariance == "full":
        return FULL_SAMPLES
    return NATURAL_SAMPLES if hp.local_vi == "natural" else 1


def local_start(init_mean: str, init_std: float | str, hidden_layers: bool, network_std: float = NETWORK_INIT_STD) -> tuple[str, float | None]:
    """The local step's start, ``(init_mean, init_std)`` as :func:`pvi` takes them, from the
    settings, where ``"auto"`` depends on the model (docs/algorithms.md §8.2). On a network
    (``hidden_layers``): the model's initial weights and a standard deviation of at most
    ``network_std`` (:data:`NETWORK_INIT_STD` by default), since zeros make every hidden unit alike
    and weights drawn with the prior's width make the sampled network predict noise. The local
    standard deviations barely move within a round, so the global's precision settles near
    ``1 / network_std^2`` and the cavity pulls the local mean with about that precision: a much
    smaller start holds every round's step near the cavity (docs/results/posterior_defaults.md,
    "PVI's start on a network"). On a generalised linear model: the
    global, as Ashman et al. (2022) start it; a small first standard deviation there makes the
    first sites far too precise for the local SGD to undo (docs/results/posterior_defaults.md)."""
    mean = ("model" if hidden_layers else "global") if init_mean == AUTO else init_mean
    if init_std == AUTO:
        return mean, network_std if hidden_layers else None
    return mean, None if init_std == "global" else float(init_std)


def build(hp: PVIConfig, ctx: BuildContext) -> Algorithm:
    local = None
    if hp.covariance == "full":
        sites.check_full_size(ctx.num_params)
        if hp.full_vi == "natural":
            local = natural_full_vi(ctx.trainer, apply_fn=ctx.apply_fn, task=ctx.task, samples=default_samples(hp), steps=hp.natural_steps)
    init_mean, init_std = local_start(hp.init_mean, hp.init_std, ctx.hidden_layers, hp.network_std)
    if hp.covariance == "diagonal" and hp.local_vi == "natural":
        if ctx.hidden_layers:  # its mean diverged where the drawn weights' GGN vanishes (docs/results/pvi_natural.md)
            raise ValueError(
                "algorithm.local_vi: 'natural' is for generalised linear models (model.name = 'logreg'); on a network its local mean diverged "
                "(Fashion-MNIST MLP: accuracy 0.10, 39 of 40 messages rejected; docs/results/pvi_natural.md); use local_vi = 'sgd'"
            )
        local = natural_diag_vi(ctx.trainer, apply_fn=ctx.apply_fn, task=ctx.task, samples=default_samples(hp), init_std=init_std)
    return pvi(
        ctx.trainer, ctx.server_optimizer, prior_precision=hp.delta, damping=damping_policy.from_setting(hp.rho),
        samples=default_samples(hp), parameterisation=hp.parameterisation, init_std=init_std, init_mean=init_mean,
        allow_improper_sites=hp.improper_sites == "allow", estimator=hp.estimator, covariance=hp.covariance, local=local,
    )  # fmt: skip


def _stored_meaning(table: dict, stored: dict) -> dict:
    """A config written before ``rho`` had a value of its own meant ``1 / clients_per_round``; one
    written before ``estimator`` existed drew weights (the default until 2026-11-27 stored the key);
    one written before ``init_std`` and ``init_mean`` had ``"auto"`` started at the global; one written
    before ``full_vi`` or ``local_vi`` used the Cholesky dense client or the SGD diagonal one; one
    written before ``network_std`` started a network's local std at :data:`STORED_NETWORK_STD`."""
    if "rho" not in table:
        table["rho"] = 1.0 / stored_setting(stored, "server", "clients_per_round", 10)
    table.setdefault("estimator", "weights")
    # before "auto" (2026-11-28): no init_std meant the global's, and init_mean was always written
    table.setdefault("init_std", "global")
    table.setdefault("init_mean", "global")
    if table["init_std"] == AUTO:  # before network_std (2026-11-30) "auto" gave 0.03 on a network
        table.setdefault("network_std", STORED_NETWORK_STD)
    if table.get("covariance") == "full":  # before full_vi (2026-11-29) the dense local VI was the Cholesky one
        table.setdefault("full_vi", "cholesky")
    elif table.get("covariance", "diagonal") == "diagonal":  # before local_vi (2026-11-29) the diagonal local VI was SGD's
        table.setdefault("local_vi", "sgd")
    return table


SPEC = AlgorithmSpec(
    "pvi", PVIConfig, build, "partitioned variational inference: mean-field Gaussian sites, reparameterised local VI",
    bayesian=True,
    # its posterior's width comes from the prior and the local steps, not a scale
    calibration_advice="set algorithm.init_std (e.g. 0.1) or give the local steps more room (client.epochs, client.lr); see docs/algorithms.md §8.2",
    # a network's local VI from the prior's zero mean and unit standard deviation learns nothing
    divergence_hint="a local step started nearer the model (algorithm.init_mean = 'model' and a smaller algorithm.init_std; 'auto' gives 'model' "
    f"and {NETWORK_INIT_STD} on a network; docs/algorithms.md §8.2)",
    default_predictive="sample",  # a variational posterior over the weights themselves
    local_budget="converged",  # the tilted mean-field optimum, each round
    stored_meaning=_stored_meaning,
    # a dense precision is no vector of coordinates: a robust rule's per-coordinate statistics, a precision cap and DP's clip and noise have no meaning for it
    settings_aggregator_policy=lambda hp: ("own", sites.FULL_AGGREGATOR_NOTE) if hp.covariance == "full" else None,
)  # fmt: skip
SPECS = (SPEC,)
