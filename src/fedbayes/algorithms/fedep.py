"""FedEP and FedSEP: federated expectation propagation (Guo et al., ICLR 2023; Guo et al. 2023 (FedEP)).

docs/algorithms.md §7. The global approximation is ``q_g ∝ p_0 prod_k q_k`` with diagonal Gaussian sites
``q_k`` in natural parameters (:mod:`fedbayes.gaussian`). In a round, client ``k``:

1. forms the cavity ``q_{-k} = q_g / q_k`` (FedEP) or ``q_g^{1 - n_k/N}`` (FedSEP; or ``1 - 1/K``),
2. approximates its tilted distribution ``p(D_k | theta) q_{-k}`` by ``q^_{\\k}``
   (:mod:`fedbayes.inference.tilted`: identity / mcmc / laplace / ngvi),
3. sends the damped update ``delta * Delta_k`` with ``Delta_k = q^_{\\k} / q_g`` (natural-parameter
   difference; optionally clipped to a joint global norm ``G`` first; ``delta`` is the damping,
   :func:`~fedbayes.algorithms.sites.damped_difference`),
4. FedEP only: updates its site, ``(eta_k, Lambda_k) <- (eta_k, Lambda_k) + ClientOpt(delta Delta_k)``.

The server sets ``(eta_g, Lambda_g) <- (eta_g, Lambda_g) + ServerOpt(sum_k delta Delta_k)``: damping
as adaptive optimisation on natural parameters (Guo et al. 2023 (FedEP) Sec. 2.2.3, App. A.1; docs/algorithms.md §1.3, 7.7). With
``delta = 1`` and plain SGD at lr 1 this is undamped EP: ``q_k <- q^_{\\k} / q_{-k}``,
``q_g <- q_g prod_k (q^_{\\k} / q_g)``. Optax transformations descend, so they receive ``-sum``
(:func:`~fedbayes.algorithms.sites.site_server_step`).

**Burn-in** (docs/algorithms.md §7.3, benchmark semantics): the first ``burn_in_rounds`` rounds are FedAvg with
the server optimizer (:func:`~fedbayes.algorithms.sites.burn_in_switch`, shared with FedPA); the model is kept as ``q_g = (theta, 1)`` so that ``mean(q_g) = theta``.
Then ``q_g`` becomes ``N(theta_burn, 1 / (alpha_cov N))`` (times the prior) and the
natural-parameter optimizer starts fresh. A client's site starts as ``q_g^{n_k / N}`` when the client
is first sampled after burn-in (``Lambda_k = alpha_cov n_k``, ``mu_k = mu_g``): for every client
sampled in the first EP round this is exactly the benchmark initialisation; for a client first
sampled later it is (``exact_late_sites``, the posterior preset) its share of the EP start's
``q_g / p_0``, computed from the EP start's model that the broadcast carries, so that ``q_g = p_0
prod_k q_k`` holds exactly under partial participation, or (the paper preset) FedSEP's estimate of
its share of that round's ``q_g``; neither needs a ``K x d`` initial write. The prior ``p_0`` stays
one factor of ``q_g``: the sites share ``q_g / p_0``, and FedSEP's cavity is
``p_0 (q_g / p_0)^(1 - n_k/N)``. ``init="uniform"`` is the paper's initialisation instead: uniform global
and sites (times the prior), with the sampler starting from the burn-in model where ``Lambda_g = 0``.

**Robustness** (docs/algorithms.md §7.10): a client whose cavity is improper (a negative precision) or whose new
site precision would be non-positive (unless ``allow_improper_sites``) flags its message;
:func:`~fedbayes.algorithms.sites.gaussian_message_ok` also rejects a message
with non-finite values or one that would make ``Lambda_g + delta Delta Lambda_k`` non-positive. The
simulator gives a rejected client weight zero and keeps its old site; ``fail_fast`` raises. Should
the aggregated optimizer step still leave a coordinate of ``Lambda_g`` non-positive (momentum
overshoot), that coordinate keeps its old value.

Clients of FedSEP keep no state; clients of FedEP keep their site and their site-optimizer state.

The steps are pure functions at the top of this module, composed by the thin factories
:func:`fedep` and :func:`fedsep` (blackjax's split): step 1 is :func:`fedep_cavity` (with
:func:`first_site`) or :func:`fedsep_cavity`, steps 2-3 :func:`tilted_step`, step 4 :func:`site_step`;
:func:`fedep_client_step` and :func:`fedsep_client_step` chain them; the server is
:func:`server_step` (:func:`burn_in_client_step` and :func:`burn_in_server_step` during burn-in),
each returning a typed :class:`FedEPInfo`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from pydantic import Field, model_validator

from fedbayes import gaussian, gaussian_block, gaussian_full, gaussian_kron, gaussian_subspace, tree
from fedbayes.aggregators import Aggregate
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms import sites
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, burn_in_setting, stateless_client_init
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.algorithms.sites import (
    BROADCAST_LOSS_TAG,
    GaussianMessage,
    burn_in_switch,
    checked_cavity,
    clip_joint_norm,
    damped_difference,
    full_message_ok,
    full_personal_moments,
    full_safe_mean,
    gaussian_message_ok,
    non_negative_to_roundoff,
    optimizer_step,
    personal_moments,
    psd_to_roundoff,
    safe_mean,
    site_server_step,
)
from fedbayes.data.batches import ClientData
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_kron import KronFrame, KronGaussian
from fedbayes.gaussian_subspace import SubspaceGaussian, SubspacePrecision
from fedbayes.inference.base import CavityInference
from fedbayes.inference.nuts import make_full_nuts_inference
from fedbayes.inference.sgd import LocalTrainer, broadcast_loss, run_sgd
from fedbayes.inference.tilted import (
    METHODS,
    TiltedSettings,
    make_full_laplace_inference,
    make_full_ngvi_inference,
    make_shared_basis_laplace_inference,
    make_tilted_inference,
)
from fedbayes.inference.vi_full import NATURAL_STEPS

PyTree = Any
INITS = ("benchmark", "uniform")
COVARIANCES = ("diagonal", "full", "last_layer", "kron", "low_rank")
DENSE_FAMILIES = {"full": gaussian_full, "last_layer": gaussian_block}  # the algebra of a structured covariance
MAX_FULL_PARAMS = sites.MAX_FULL_PARAMS
DEFAULT_BASIS_ROUNDS = sites.DEFAULT_BASIS_ROUNDS
DEFAULT_RANK = sites.DEFAULT_RANK
SEP_POWERS = ("data_fraction", "one_over_k")

__all__ = [
    "COVARIANCES",
    "DEFAULT_BASIS_ROUNDS",
    "DEFAULT_DAMPING",
    "DEFAULT_RANK",
    "MAX_FULL_PARAMS",
    "INITS",
    "PAPER_SETTINGS",
    "PRESETS",
    "SEP_POWERS",
    "Broadcast",
    "ClientState",
    "EPConfig",
    "EPStart",
    "FedEPConfig",
    "FedEPInfo",
    "FedSEPConfig",
    "ServerState",
    "broadcast",
    "burn_in_client_step",
    "burn_in_server_step",
    "ep_start",
    "fedep",
    "fedep_cavity",
    "fedep_client_step",
    "fedep_full",
    "fedep_shared_basis",
    "fedsep_full",
    "fedsep_full_client_step",
    "full_tilted_step",
    "SharedBasis",
    "shared_basis_client_step",
    "shared_basis_server_step",
    "full_client_step",
    "full_posterior_moments",
    "full_server_step",
    "fedsep",
    "fedsep_cavity",
    "fedsep_client_step",
    "first_site",
    "model_q",
    "personal_posterior",
    "posterior_moments",
    "prior_like",
    "server_init",
    "server_step",
    "site_step",
    "tilted_step",
]


class ServerState(NamedTuple):
    """FedEP/FedSEP server state.

    Attributes:
      q: the global approximation ``q_g`` (during burn-in ``(theta, 1)``).
      fedavg_opt_state: the server optimizer's state over ``theta`` during burn-in.
      opt_state: the natural-parameter optimizer's state (fresh at the end of burn-in).
      round: rounds done.
      anchor: ``init="uniform"``: the sampler's start where ``Lambda_g = 0``; FedEP with
        ``exact_late_sites``: the EP start's model; else ``None``.
      damping: the damping the next EP round's clients use and what its rule compares with
        (:class:`~fedbayes.algorithms.damping.DampingState`; kept through burn-in).
      basis: ``covariance = "kron"``: the layers' Kronecker eigenbases and the mean they were fixed
        about (:class:`~fedbayes.gaussian_kron.KronFrame`); ``None`` (no leaf) otherwise.
    """

    q: DiagGaussian
    fedavg_opt_state: optax.OptState
    opt_state: optax.OptState
    round: jax.Array
    anchor: PyTree = None
    damping: damping_policy.DampingState | None = None
    basis: KronFrame | None = None


class Broadcast(NamedTuple):
    """What clients receive: ``q_g``, whether this is an EP round, the uniform-init anchor, the
    round's damping ``delta``, and with ``covariance = "kron"`` the bases and whether they are fixed
    (``None``, no leaf, otherwise)."""

    q: DiagGaussian
    ep: jax.Array
    anchor: PyTree = None
    damping: jax.Array | float = 1.0
    basis: KronFrame | None = None
    basis_fixed: jax.Array | None = None


class ClientState(NamedTuple):
    """A FedEP site, its optimizer state, whether it has been initialised, and with ``covariance =
    "kron"`` whether its eigenvalues are in the fixed bases (1) or still in the identity bases of
    the basis rounds (0: moved when the client next takes part, :func:`fedbayes.gaussian_kron.move`);
    ``None`` (no leaf) otherwise."""

    site: DiagGaussian
    opt_state: optax.OptState
    initialized: jax.Array
    fixed: jax.Array | None = None


class FedEPInfo(NamedTuple):
    """The server step's info (FedEP and FedSEP).

    Attributes:
      precision_guarded: coordinates of ``Lambda_g`` that kept their old value
        (:func:`~fedbayes.algorithms.sites.guard_positive`; 0 in burn-in rounds).
      damping: the damping ``delta`` this round's clients used.
    """

    precision_guarded: jax.Array
    damping: jax.Array | float


class EPStart(NamedTuple):
    """Where EP starts (docs/algorithms.md §7.3), static.

    Attributes:
      uniform: ``init="uniform"``: uniform global and sites times the prior; else the benchmark
        start ``q_g = N(theta, 1 / (alpha_cov N))`` times the prior.
      alpha_cov: per-example precision of the benchmark start.
      prior_precision: ``delta`` of the prior ``p_0 = N(0, 1 / delta)`` (0: none).
      total_examples: ``N``.
      keeps_anchor: the broadcast carries the EP start's model (``init="uniform"``, or FedEP's
        ``exact_late_sites``).
    """

    uniform: bool
    alpha_cov: float
    prior_precision: float
    total_examples: float
    keeps_anchor: bool


def prior_like(theta: PyTree, prior_precision: float) -> DiagGaussian:
    """The prior ``p_0 = N(0, 1 / delta)`` in natural parameters, ``(0, delta)``."""
    return DiagGaussian(precision_mean=optax.tree.zeros_like(theta), precision=optax.tree.full_like(theta, prior_precision))


def model_q(theta: PyTree) -> DiagGaussian:
    """The burn-in model as ``q_g = (theta, 1)``, so that ``mean(q_g) = theta``."""
    return DiagGaussian(precision_mean=theta, precision=optax.tree.ones_like(theta))


def ep_start(theta: PyTree, start: EPStart) -> tuple[DiagGaussian, PyTree]:
    """``q_g`` at the start of EP from the model ``theta`` and the anchor the broadcast carries:
    ``(0, delta)`` with anchor ``theta`` (uniform), or ``Lambda_g = alpha_cov N + delta``,
    ``eta_g = Lambda_g theta`` (benchmark; docs/algorithms.md §7.3)."""
    if start.uniform:
        lam = optax.tree.full_like(theta, start.prior_precision)
        return DiagGaussian(precision_mean=optax.tree.zeros_like(theta), precision=lam), theta
    lam = optax.tree.full_like(theta, start.alpha_cov * start.total_examples + start.prior_precision)
    return DiagGaussian(precision_mean=jax.tree.map(jnp.multiply, lam, theta), precision=lam), (theta if start.keeps_anchor else None)


# ----- the cavities -------------------------------------------------------------------------------


def first_site(
    message: Broadcast, prior: DiagGaussian, share: jax.Array, rest: jax.Array, start: EPStart, exact_late_sites: bool, family=gaussian, promote=None
):
    """``(site, cavity)`` of a FedEP client sampled for the first time: uniform (``init="uniform"``),
    else its share ``(q / p_0)^(n_k / N)`` of the likelihoods, with ``q`` the EP start's global
    (``exact_late_sites``: ``q_g = p_0 prod_k q_k`` stays exact for a client first sampled late) or
    the current ``q_g`` (the paper's; the cavity is then ``p_0 (q_g / p_0)^(1 - n_k/N)``, bitwise
    the paper's ``q_g^(1 - n_k/N)`` without a prior). The prior stays one factor of ``q_g``.
    ``family``: the algebra of the factors, :mod:`fedbayes.gaussian` or the dense
    :mod:`fedbayes.gaussian_full` (which promotes the diagonal prior and EP start exactly);
    ``promote`` maps the diagonal EP start into a family that does not (the Kronecker one's)."""
    q = message.q
    if start.uniform:
        return family.uniform_like(q.precision_mean), q
    if exact_late_sites:
        begin = ep_start(message.anchor, start)[0]
        site = family.power(family.quotient(promote(begin) if promote else begin, prior), share)
        return site, family.quotient(q, site)
    likelihoods = family.quotient(q, prior)
    return family.power(likelihoods, share), family.product(prior, family.power(likelihoods, rest))


def fedep_cavity(message: Broadcast, cstate: ClientState, prior: DiagGaussian, share, rest, start: EPStart, exact_late_sites: bool):
    """FedEP's ``(site, cavity)``: ``(t_k, q_g / t_k)`` for an initialised site, else
    :func:`first_site` (Guo et al. 2023 (FedEP) Alg. 1)."""
    q = message.q
    # lax.cond, not a select: a client run on its own (the sequential layout) computes only the
    # branch it takes; under vmap this is a select again.
    return jax.lax.cond(
        cstate.initialized, lambda: (cstate.site, gaussian.quotient(q, cstate.site)), lambda: first_site(message, prior, share, rest, start, exact_late_sites)
    )


def fedsep_cavity(q: DiagGaussian, prior: DiagGaussian, power) -> DiagGaussian:
    """FedSEP's cavity ``p_0 (q_g / p_0)^power``: the power acts on the shared site ``f^K``, not on
    the prior (Guo et al. 2023 (FedEP) Sec. 2.2.4), ``power`` = ``1 - n_k/N`` or ``1 - 1/K``."""
    return gaussian.product(prior, gaussian.power(gaussian.quotient(q, prior), power))


# ----- the client steps ---------------------------------------------------------------------------


def burn_in_client_step(key: jax.Array, message: Broadcast, data: ClientData, trainer: LocalTrainer, adaptive: bool):
    """A burn-in round's client: FedAvg from ``theta = eta_g`` (``Lambda_g = 1``); the message is
    ``(theta - theta_k, 0)``. Returns ``(message, info)``."""
    theta = message.q.precision_mean  # Lambda = 1 during burn-in
    last, info = run_sgd(key, theta, data, trainer)
    step = DiagGaussian(precision_mean=optax.tree.sub(theta, last), precision=optax.tree.zeros_like(theta))
    return GaussianMessage(step, jnp.ones((), jnp.bool_), jnp.zeros((), jnp.float32) if adaptive else None), info


def tilted_step(
    key: jax.Array,
    message: Broadcast,
    cavity: DiagGaussian,
    data: ClientData,
    inference: CavityInference,
    trainer: LocalTrainer,
    *,
    uniform: bool,
    adaptive: bool,
    delta_clip: float | None,
):
    """Steps 2-3 of an EP round: the tilted approximation ``q^_{\\k}`` of ``p(D_k | theta) q_{-k}``
    started at ``mean(q_g)`` (the anchor where ``Lambda_g = 0`` under ``init="uniform"``) and the
    damped update ``delta clip(q^_{\\k} / q_g)`` (:func:`~fedbayes.algorithms.sites.damped_difference`).

    Returns ``(step, cavity_ok, loss, info)``: ``cavity_ok`` whether the cavity was proper enough
    (:func:`~fedbayes.algorithms.sites.checked_cavity`), ``loss`` the client's loss at the broadcast
    for the adaptive damping (``None`` for a fixed one).
    """
    q = message.q
    cavity, cavity_ok = checked_cavity(cavity, q)
    start = safe_mean(q, message.anchor if uniform else q.precision_mean)
    fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), start, data, trainer) if adaptive else None
    tilted, info = inference(key, start, cavity, data)
    return damped_difference(tilted, q, message.damping, delta_clip), cavity_ok, fit, info


def site_step(site: DiagGaussian, opt_state, step: DiagGaussian, q: DiagGaussian, site_optimizer: optax.GradientTransformation):
    """Step 4 (FedEP): ``(eta_k, Lambda_k) <- (eta_k, Lambda_k) + ClientOpt(delta Delta_k)``. Returns
    ``(client_state, proper)``, ``proper`` false where a site precision turned negative beyond
    round-off (:func:`~fedbayes.algorithms.sites.non_negative_to_roundoff`): a zero is a flat factor,
    not an improper one."""
    new_site, opt_state = optimizer_step(site_optimizer, site, opt_state, step)
    return ClientState(new_site, opt_state, jnp.ones((), jnp.bool_)), non_negative_to_roundoff(new_site.precision, q.precision)


def fedep_client_step(
    key: jax.Array,
    message: Broadcast,
    cstate: ClientState,
    data: ClientData,
    inference: CavityInference,
    trainer: LocalTrainer,
    *,
    start: EPStart,
    site_optimizer: optax.GradientTransformation,
    adaptive: bool,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
):
    """One FedEP client in an EP round: :func:`fedep_cavity`, :func:`tilted_step`, :func:`site_step`.
    Returns ``(message, client_state, info)``."""
    n = data.num_examples.astype(jnp.float32)
    total = start.total_examples
    prior = prior_like(message.q.precision_mean, start.prior_precision)
    share, rest = n / total, (total - n) / total  # rest is exactly 0 when one client holds all the data
    site, cavity = fedep_cavity(message, cstate, prior, share, rest, start, exact_late_sites)
    step, cavity_ok, fit, info = tilted_step(key, message, cavity, data, inference, trainer, uniform=start.uniform, adaptive=adaptive, delta_clip=delta_clip)
    new_state, proper = site_step(site, cstate.opt_state, step, message.q, site_optimizer)
    return GaussianMessage(step, cavity_ok if allow_improper_sites else jnp.logical_and(cavity_ok, proper), fit), new_state, info


def fedsep_client_step(
    key: jax.Array,
    message: Broadcast,
    data: ClientData,
    inference: CavityInference,
    trainer: LocalTrainer,
    *,
    start: EPStart,
    num_clients: int,
    sep_power: str,
    adaptive: bool,
    delta_clip: float | None = None,
):
    """One FedSEP client in an EP round: :func:`fedsep_cavity` with the power ``1 - n_k/N``
    (``sep_power="data_fraction"``) or ``1 - 1/K`` (``"one_over_k"``), then :func:`tilted_step`.
    Returns ``(message, info)``."""
    n = data.num_examples.astype(jnp.float32)
    total = start.total_examples
    prior = prior_like(message.q.precision_mean, start.prior_precision)
    power = (total - n) / total if sep_power == "data_fraction" else (num_clients - 1.0) / num_clients
    step, cavity_ok, fit, info = tilted_step(
        key, message, fedsep_cavity(message.q, prior, power), data, inference, trainer, uniform=start.uniform, adaptive=adaptive, delta_clip=delta_clip
    )
    return GaussianMessage(step, cavity_ok, fit), info


# ----- the server ---------------------------------------------------------------------------------


def server_init(params: PyTree, server_optimizer, damping: damping_policy.Damping, start: EPStart, burn_in_rounds: int) -> ServerState:
    """``q_g = (theta, 1)`` before a burn-in, else :func:`ep_start`; both optimizers' states fresh."""
    if burn_in_rounds > 0:
        q, anchor = model_q(params), (params if start.keeps_anchor else None)
    else:
        q, anchor = ep_start(params, start)
    return ServerState(q, server_optimizer.init(params), server_optimizer.init(q), jnp.zeros((), jnp.int32), anchor, damping.init(params))


def broadcast(state: ServerState, burn_in_rounds: int) -> Broadcast:
    return Broadcast(state.q, state.round >= burn_in_rounds, state.anchor, state.damping.value)


def burn_in_server_step(state: ServerState, aggregate: Aggregate, server_optimizer, start: EPStart, burn_in_rounds: int) -> tuple[ServerState, FedEPInfo]:
    """A burn-in round's server: FedAvg on ``theta`` with the server optimizer; after the last one,
    ``q_g`` becomes :func:`ep_start` of the model and the natural-parameter optimizer starts fresh."""
    g = aggregate.mean.difference.precision_mean
    theta, fopt = apply_server_optimizer(server_optimizer, state.q.precision_mean, state.fedavg_opt_state, g)
    done = state.round + 1 >= burn_in_rounds
    q_ep, _ = ep_start(theta, start)
    q = jax.tree.map(lambda a, b: jnp.where(done, a, b), q_ep, model_q(theta))
    anchor = theta if start.keeps_anchor else None
    info = FedEPInfo(precision_guarded=jnp.zeros((), jnp.int32), damping=state.damping.value)
    return ServerState(q, fopt, server_optimizer.init(q), state.round + 1, anchor, state.damping), info


def server_step(state: ServerState, aggregate: Aggregate, server_optimizer, damping: damping_policy.Damping) -> tuple[ServerState, FedEPInfo]:
    """An EP round's server: ``(eta_g, Lambda_g) <- (eta_g, Lambda_g) + ServerOpt(sum_k delta Delta_k)``
    with the positivity guard (:func:`~fedbayes.algorithms.sites.site_server_step`; Guo et al. 2023
    (FedEP) Sec. 2.2.3), and the damping's rule."""
    q, opt_state, guarded = site_server_step(server_optimizer, state.q, state.opt_state, aggregate.total.difference)
    info = FedEPInfo(precision_guarded=guarded, damping=state.damping.value)  # the damping this round's clients used
    return ServerState(
        q, state.fedavg_opt_state, opt_state, state.round + 1, state.anchor, damping.update(state.damping, state.q, q, aggregate.mean.loss)
    ), info


def posterior_moments(state: ServerState, burn_in_rounds: int) -> tuple[PyTree, PyTree]:
    """``(mean, variance)`` of ``q_g`` for marginalised predictions (docs/algorithms.md §7.7, 13.1); during
    burn-in the model is a point estimate (variance 0)."""
    q = state.q
    in_ep = state.round >= burn_in_rounds
    mean = safe_mean(q, q.precision_mean)
    var = jax.tree.map(lambda lam: jnp.where(jnp.logical_and(in_ep, lam > 0), 1.0 / jnp.where(lam > 0, lam, 1.0), 0.0), q.precision)
    return mean, var


def personal_posterior(state: ServerState, cstate: ClientState, weight, burn_in_rounds: int) -> tuple[PyTree, PyTree]:
    """Client ``k``'s ``q_g t_k^w`` in moments (docs/algorithms.md §13.8); a site not yet initialised
    is uniform, so ``q_k = q_g``; during burn-in ``q_g`` is the model (variance 0)."""
    mean, variance = personal_moments(state.q, cstate.site, weight, safe_mean(state.q, state.q.precision_mean))
    in_ep = state.round >= burn_in_rounds
    return mean, jax.tree.map(lambda v: jnp.where(in_ep, v, 0.0), variance)


# ----- the two methods ----------------------------------------------------------------------------


def _as_policy(damping: float | damping_policy.Damping) -> damping_policy.Damping:
    return damping if isinstance(damping, damping_policy.Damping) else damping_policy.fixed(damping)


def _ep_algorithm(
    name: str,
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    damping: damping_policy.Damping,
    start: EPStart,
    burn_in_rounds: int,
    client_init,
    ep_client,
    personal=None,
) -> Algorithm:
    """The :class:`Algorithm` around a method's EP-round client ``ep_client(key, message, cstate,
    data) -> (message, cstate, info)``: burn-in switch, server steps, posteriors."""

    def client_update(key, message: Broadcast, cstate, data):
        def burn_in():
            msg, info = burn_in_client_step(key, message, data, trainer, damping.adaptive)
            return msg, cstate, info

        return burn_in_switch(burn_in_rounds, message.ep, lambda: ep_client(key, message, cstate, data), burn_in)

    def server_update(key, state, aggregate):
        del key
        return burn_in_switch(
            burn_in_rounds,
            state.round >= burn_in_rounds,
            lambda s, a: server_step(s, a, server_optimizer, damping),
            lambda s, a: burn_in_server_step(s, a, server_optimizer, start, burn_in_rounds),
            state,
            aggregate,
        )

    return Algorithm(
        name=name,
        server_init=lambda key, params: server_init(params, server_optimizer, damping, start, burn_in_rounds),
        broadcast=lambda state: broadcast(state, burn_in_rounds),
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: safe_mean(state.q, state.q.precision_mean),
        message_ok=lambda state, message: gaussian_message_ok(message, state.q),
        trainer=trainer,
        server_posterior=lambda state: posterior_moments(state, burn_in_rounds),
        after_rejected_round=lambda state: state._replace(damping=damping.rejected(state.damping)),
        personal_posterior=personal,
    )


def _stateful_setup(init, damping, server_optimizer, site_optimizer, alpha_cov, prior_precision, total_examples, exact_late_sites):
    """The damping policy, the site optimizer (default: the server's, Guo et al. 2023 (FedEP) Table 7)
    and the EP start of a stateful FedEP, diagonal or dense."""
    if init not in INITS:
        raise ValueError(f"fedep: init must be one of {', '.join(INITS)}; got {init!r}")
    site_optimizer = site_optimizer if site_optimizer is not None else server_optimizer
    uniform = init == "uniform"
    start = EPStart(uniform, alpha_cov, prior_precision, float(total_examples), uniform or exact_late_sites)
    return _as_policy(damping), site_optimizer, start


def _stateful_client(uniform_like, client_step, inference, trainer, start, site_optimizer, policy, **step_settings):
    """``(client_init, client_update)`` of a stateful FedEP client: its site starts uniform
    (``uniform_like`` of the family) and ``client_step`` (:func:`fedep_client_step` or
    :func:`full_client_step`) updates it."""

    def client_init(params):
        site = uniform_like(params)
        return ClientState(site, site_optimizer.init(site), jnp.zeros((), jnp.bool_))

    def client_update(key, message, cstate, data):
        return client_step(
            key, message, cstate, data, inference, trainer, start=start, site_optimizer=site_optimizer, adaptive=policy.adaptive, **step_settings
        )

    return client_init, client_update


def fedep(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    inference: CavityInference,
    *,
    total_examples: int,
    num_clients: int,
    damping: float | damping_policy.Damping,
    alpha_cov: float,
    site_optimizer: optax.GradientTransformation | None = None,
    burn_in_rounds: int = 0,
    init: str = "benchmark",
    prior_precision: float = 0.0,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
) -> Algorithm:
    """Stateful FedEP (Guo et al. 2023 (FedEP) Alg. 1; docs/algorithms.md §7.1-7.7): :func:`fedep_client_step`,
    :func:`server_step`, after ``burn_in_rounds`` of :func:`burn_in_client_step` and :func:`burn_in_server_step`.
    The settings' ranges are :class:`FedEPConfig`'s.

    Args:
      trainer: local training of the burn-in rounds and of the SG-MCMC step.
      server_optimizer: optax transformation for the burn-in model and for ``(eta_g, Lambda_g)``
        (separate states; the latter starts fresh after burn-in).
      inference: a :class:`~fedbayes.inference.base.CavityInference` whose ``start`` is the sampler's
        first iterate (one of the four methods of :func:`fedbayes.inference.tilted.make_tilted_inference`).
      total_examples: ``N``, all clients' examples (site init ``q_g^{n_k/N}``).
      num_clients: ``K``.
      damping: ``delta``, a fixed value (Guo et al. 2023 (FedEP)'s default ``1 / M``) or a policy
        (:func:`fedbayes.algorithms.damping.adaptive`: the server chooses it each round).
      alpha_cov: per-example precision of the benchmark initialisation, ``c (lambda_0 + lambda_wd)``.
      site_optimizer: ClientOpt on the sites (default: the server optimizer's configuration,
        Guo et al. 2023 (FedEP) Table 7).
      burn_in_rounds: FedAvg rounds before EP.
      init: ``"benchmark"`` (docs/algorithms.md §7.3 [I]) or ``"uniform"`` (the paper's).
      prior_precision: precision of a zero-mean Gaussian prior ``p_0`` (0: none).
      delta_clip: optional joint global-norm clip ``G`` of ``(Delta eta, Delta Lambda)``.
      allow_improper_sites: accept a site whose precision turns non-positive somewhere. EP sites
        are factors and may be improper (docs/algorithms.md §1.1); the default rejects such a message (the
        robust server). The mcmc method's rescaling (docs/algorithms.md §7.6 M.3) redistributes the
        cavity's precision and routinely gives such sites, so it needs ``True`` to follow the
        paper, whose code has no guard (docs/algorithms.md §7.10).
      exact_late_sites: ``init="benchmark"``: a client first sampled after the first EP round starts
        its site at its share of the EP start's ``q_g / p_0`` (the broadcast then carries the EP
        start's model, ``d`` more floats), so ``q_g = p_0 prod_k q_k`` holds exactly under partial
        participation; ``False`` (the paper preset) takes the share of the current ``q_g``, which
        leaves ``q_g`` short of that share's precision (docs/results/posterior_defaults.md).
    """
    policy, site_optimizer, start = _stateful_setup(
        init, damping, server_optimizer, site_optimizer, alpha_cov, prior_precision, total_examples, exact_late_sites
    )
    client_init, ep_client = _stateful_client(
        gaussian.uniform_like, fedep_client_step, inference, trainer, start, site_optimizer, policy,
        delta_clip=delta_clip, allow_improper_sites=allow_improper_sites, exact_late_sites=exact_late_sites,
    )  # fmt: skip

    return _ep_algorithm(
        "fedep", trainer, server_optimizer, policy, start, burn_in_rounds, client_init, ep_client,
        personal=lambda state, cstate, weight: personal_posterior(state, cstate, weight, burn_in_rounds),
    )  # fmt: skip


def _sep_setup(init, sep_power, damping, alpha_cov, prior_precision, total_examples):
    """The damping policy and EP start of FedSEP, diagonal or dense, after checking its settings."""
    if init not in INITS:
        raise ValueError(f"fedsep: init must be one of {', '.join(INITS)}; got {init!r}")
    if sep_power not in SEP_POWERS:
        raise ValueError(f"fedsep: sep_power must be one of {', '.join(SEP_POWERS)}; got {sep_power!r}")
    policy = _as_policy(damping)
    uniform = init == "uniform"
    start = EPStart(uniform, alpha_cov, prior_precision, float(total_examples), uniform)
    return policy, start


def fedsep(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    inference: CavityInference,
    *,
    total_examples: int,
    num_clients: int,
    damping: float | damping_policy.Damping,
    alpha_cov: float,
    burn_in_rounds: int = 0,
    init: str = "benchmark",
    prior_precision: float = 0.0,
    delta_clip: float | None = None,
    sep_power: str = "data_fraction",
) -> Algorithm:
    """Stateless FedSEP (Guo et al. 2023 (FedEP) Sec. 2.2.4; docs/algorithms.md §7.9): ``q_g ∝ p_0 f^K`` with one shared average
    site, so the cavity is ``q_g^{1 - n_k/N}`` (``sep_power="data_fraction"``, the reference code)
    or ``q_g^{1 - 1/K}`` (``"one_over_k"``, textbook SEP): :func:`fedsep_client_step` and
    :func:`server_step`. Arguments as :func:`fedep`; the settings' ranges are :class:`FedSEPConfig`'s.
    FedSEP's clients keep no state, so it has no personal posterior."""
    policy, start = _sep_setup(init, sep_power, damping, alpha_cov, prior_precision, total_examples)

    def ep_client(key, message, cstate, data):
        msg, info = fedsep_client_step(
            key, message, data, inference, trainer, start=start, num_clients=num_clients, sep_power=sep_power, adaptive=policy.adaptive,
            delta_clip=delta_clip,
        )  # fmt: skip
        return msg, cstate, info

    return _ep_algorithm("fedsep", trainer, server_optimizer, policy, start, burn_in_rounds, stateless_client_init, ep_client)


# ----- full covariance (docs/algorithms.md §7.12) --------------------------------------------------


def full_tilted_step(
    key: jax.Array,
    message: Broadcast,
    cavity: gaussian_full.FullGaussian,
    data: ClientData,
    inference,
    trainer: LocalTrainer,
    *,
    uniform: bool,
    adaptive: bool,
    delta_clip: float | None,
):
    """:func:`tilted_step` with dense factors: the tilted approximation ``q^ = inference(cavity)``
    started at the mean of ``q_g`` (the anchor under ``init="uniform"``) and the damped message
    ``delta clip(q^ / q_g)``. Returns ``(step, cavity_ok, loss at the broadcast or None, info)``;
    ``cavity_ok``: finite and positive semi-definite to round-off
    (:func:`~fedbayes.algorithms.sites.psd_to_roundoff`)."""
    q = message.q
    cavity_ok = tree.all_finite(cavity) & psd_to_roundoff(cavity.precision, q.precision)
    begin = full_safe_mean(q, message.anchor if uniform else q.precision_mean)
    fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), begin, data, trainer) if adaptive else None
    tilted, info = inference(key, begin, cavity, data)
    step = optax.tree.scale(message.damping, clip_joint_norm(sites.dense_family(q).difference(tilted, q), delta_clip))
    return step, cavity_ok, fit, info


def full_client_step(
    key: jax.Array,
    message: Broadcast,
    cstate: ClientState,
    data: ClientData,
    inference,
    trainer: LocalTrainer,
    *,
    start: EPStart,
    site_optimizer: optax.GradientTransformation,
    adaptive: bool,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
):
    """One FedEP client with dense sites (Guo et al. 2023 (FedEP) Alg. 1; Vehtari et al. 2020, "EP as
    a way of life", Sec. 3): the cavity ``q_{-k} = q_g / t_k`` (a full quotient; :func:`first_site`
    for a site not yet initialised), the tilted approximation ``q^ = inference(cavity)``
    (:func:`~fedbayes.inference.tilted.make_full_laplace_inference`), the damped message
    ``delta clip(q^ / q_g)`` and the site update ``t_k <- t_k + ClientOpt(delta (q^ / q_g))``, which with
    plain SGD at lr 1 is ``t_k^(1 - delta) (q^ / q_{-k})^delta`` (natural parameters, as
    :func:`~fedbayes.gaussian_full.damp`). Returns ``(message, client_state, info)``.

    Policy for an improper result, as the diagonal path's: a cavity that is not positive
    semi-definite to round-off (:func:`~fedbayes.algorithms.sites.psd_to_roundoff`) flags the message, and so does (unless
    ``allow_improper_sites``) a new site that is not; the server then gives it weight zero and the
    client keeps its old site."""
    n = data.num_examples.astype(jnp.float32)
    total = start.total_examples
    q = message.q
    family = sites.dense_family(q)
    prior = prior_like(q.precision_mean, start.prior_precision)
    share, rest = n / total, (total - n) / total
    site, cavity = jax.lax.cond(
        cstate.initialized,
        lambda: (cstate.site, family.quotient(q, cstate.site)),
        lambda: first_site(message, prior, share, rest, start, exact_late_sites, family=family),
    )
    step, cavity_ok, fit, info = full_tilted_step(
        key, message, cavity, data, inference, trainer, uniform=start.uniform, adaptive=adaptive, delta_clip=delta_clip
    )
    new_site, opt_state = optimizer_step(site_optimizer, site, cstate.opt_state, step)
    proper = psd_to_roundoff(new_site.precision, q.precision)
    ok = cavity_ok if allow_improper_sites else jnp.logical_and(cavity_ok, proper)
    return GaussianMessage(step, ok, fit), ClientState(new_site, opt_state, jnp.ones((), jnp.bool_)), info


def full_server_step(state: ServerState, aggregate: Aggregate, server_optimizer, damping: damping_policy.Damping) -> tuple[ServerState, FedEPInfo]:
    """The server with dense sites: ``(eta_g, Lambda_g) <- (eta_g, Lambda_g) + ServerOpt(sum_k delta
    Delta_k)`` (with plain SGD at lr 1 the exact product ``q_g = p_0 prod_k t_k``, a sum of natural
    parameters); a step that leaves ``Lambda_g`` not positive definite (a momentum overshoot) keeps
    the old ``q_g`` whole, and ``precision_guarded`` counts all ``D`` coordinates then. The damping's
    rule watches the mean (of the moment-matched diagonal, :func:`~fedbayes.gaussian_full.project_to_diag`)."""
    q, opt_state, guarded = sites.full_server_step(server_optimizer, state.q, state.opt_state, aggregate.total.difference)
    info = FedEPInfo(precision_guarded=guarded, damping=state.damping.value)
    family = sites.dense_family(q)
    moved = damping.update(state.damping, family.project_to_diag(state.q), family.project_to_diag(q), aggregate.mean.loss)
    return ServerState(q, state.fedavg_opt_state, opt_state, state.round + 1, state.anchor, moved), info


def full_posterior_moments(state: ServerState) -> tuple[PyTree, PyTree]:
    """``(mean, marginal variances)`` of a dense ``q_g``: ``Lambda^{-1} eta`` and ``diag(Lambda^{-1})``
    (:func:`~fedbayes.gaussian_full.mean`, :func:`~fedbayes.gaussian_full.variance`)."""
    family = sites.dense_family(state.q)
    return family.mean(state.q), family.variance(state.q)


def full_personal_posterior(state: ServerState, cstate: ClientState, weight) -> tuple[PyTree, PyTree]:
    """Client ``k``'s ``q_g t_k^w`` in moments (docs/algorithms.md §13.8) with dense factors
    (:func:`~fedbayes.algorithms.sites.full_personal_moments`)."""
    return full_personal_moments(state.q, cstate.site, weight)


def fedep_full(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    inference,
    *,
    total_examples: int,
    num_clients: int,
    damping: float | damping_policy.Damping,
    alpha_cov: float,
    site_optimizer: optax.GradientTransformation | None = None,
    init: str = "benchmark",
    prior_precision: float = 0.0,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
    covariance: str = "full",
) -> Algorithm:
    """FedEP with dense (full-covariance) sites, cavity, tilted approximations and global
    (:class:`~fedbayes.gaussian_full.FullGaussian`; docs/algorithms.md §7, "Full-covariance
    messages"): :func:`full_client_step` and :func:`full_server_step`, arguments as :func:`fedep`
    (no burn-in rounds). ``inference`` maps a dense cavity to a dense tilted approximation
    (:func:`~fedbayes.inference.tilted.make_full_laplace_inference`). With ``covariance =
    "last_layer"`` every factor is a :class:`~fedbayes.gaussian_block.BlockGaussian` (dense over the
    last layer, diagonal elsewhere) and the same steps run in that family."""
    del num_clients
    policy, site_optimizer, start = _stateful_setup(
        init, damping, server_optimizer, site_optimizer, alpha_cov, prior_precision, total_examples, exact_late_sites
    )

    family = DENSE_FAMILIES[covariance]
    client_init, client_update = _stateful_client(
        family.uniform_like, full_client_step, inference, trainer, start, site_optimizer, policy,
        delta_clip=delta_clip, allow_improper_sites=allow_improper_sites, exact_late_sites=exact_late_sites,
    )  # fmt: skip
    return _full_algorithm("fedep", trainer, server_optimizer, policy, start, client_init, client_update, full_personal_posterior, family=family)


def _full_algorithm(name, trainer, server_optimizer, policy, start, client_init, client_update, personal_posterior=None, family=gaussian_full) -> Algorithm:
    """The :class:`Algorithm` of a dense EP method around its client: the server starts at the dense
    :func:`ep_start` (in ``family``: :mod:`fedbayes.gaussian_full`, or :mod:`fedbayes.gaussian_block`
    for the last-layer structure) and steps by :func:`full_server_step`."""

    def server_init_full(key, params):
        del key
        q, anchor = ep_start(params, start)
        q = family.product(family.uniform_like(params), q)  # the diagonal start, promoted exactly
        return ServerState(q, server_optimizer.init(params), server_optimizer.init(q), jnp.zeros((), jnp.int32), anchor, policy.init(params))

    def server_update(key, state, aggregate):
        del key
        return full_server_step(state, aggregate, server_optimizer, policy)

    return Algorithm(
        name=name,
        server_init=server_init_full,
        broadcast=lambda state: broadcast(state, 0),
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: family.mean(state.q),
        message_ok=lambda state, message: full_message_ok(message, state.q),
        trainer=trainer,
        server_posterior=full_posterior_moments,
        after_rejected_round=lambda state: state._replace(damping=policy.rejected(state.damping)),
        personal_posterior=personal_posterior,
        server_precision=lambda state: state.q.precision,
    )


def fedsep_full_client_step(
    key: jax.Array,
    message: Broadcast,
    data: ClientData,
    inference,
    trainer: LocalTrainer,
    *,
    start: EPStart,
    num_clients: int,
    sep_power: str,
    adaptive: bool,
    delta_clip: float | None = None,
):
    """One FedSEP client with a dense global (Guo et al. 2023 (FedEP) Sec. 2.2.4 in the
    full-covariance family): the cavity ``p_0 (q_g / p_0)^power`` (:func:`fedsep_cavity`'s, dense),
    the tilted approximation ``q^ = inference(cavity)`` and the damped message ``delta clip(q^ / q_g)``,
    as :func:`full_client_step` but stateless. A cavity that is not positive semi-definite to
    round-off flags the message. Returns ``(message, info)``."""
    n = data.num_examples.astype(jnp.float32)
    total = start.total_examples
    q = message.q
    prior = prior_like(q.precision_mean, start.prior_precision)
    power = (total - n) / total if sep_power == "data_fraction" else (num_clients - 1.0) / num_clients
    cavity = gaussian_full.product(prior, gaussian_full.power(gaussian_full.quotient(q, prior), power))
    step, cavity_ok, fit, info = full_tilted_step(
        key, message, cavity, data, inference, trainer, uniform=start.uniform, adaptive=adaptive, delta_clip=delta_clip
    )
    return GaussianMessage(step, cavity_ok, fit), info


def fedsep_full(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    inference,
    *,
    total_examples: int,
    num_clients: int,
    damping: float | damping_policy.Damping,
    alpha_cov: float,
    init: str = "benchmark",
    prior_precision: float = 0.0,
    delta_clip: float | None = None,
    sep_power: str = "data_fraction",
) -> Algorithm:
    """FedSEP with a dense global and shared site (docs/algorithms.md §7.12): :func:`fedsep_full_client_step`
    and :func:`full_server_step`, arguments as :func:`fedsep` (no burn-in rounds); ``inference`` as
    :func:`fedep_full`'s. Its clients keep no state, so it has no personal posterior."""
    policy, start = _sep_setup(init, sep_power, damping, alpha_cov, prior_precision, total_examples)

    def client_update(key, message, cstate, data):
        msg, info = fedsep_full_client_step(
            key, message, data, inference, trainer, start=start, num_clients=num_clients, sep_power=sep_power, adaptive=policy.adaptive,
            delta_clip=delta_clip,
        )  # fmt: skip
        return msg, cstate, info

    return _full_algorithm("fedsep", trainer, server_optimizer, policy, start, stateless_client_init, client_update)


# ----- structures in a shared basis (docs/algorithms.md §7.12, "Structures in a shared basis") ----


class SharedBasis(NamedTuple):
    """A structure whose basis the server keeps and broadcasts, so that every factor is written in
    it and a sum of messages is the exact product (docs/algorithms.md §1.1), static.

    Attributes:
      covariance: ``"kron"`` (:mod:`fedbayes.gaussian_kron`: per-layer Kronecker eigenbases, a
        :class:`~fedbayes.gaussian_kron.KronFrame` in the state) or ``"low_rank"``
        (:mod:`fedbayes.gaussian_subspace`: an orthonormal ``[D, rank]`` basis).
      basis_rounds: rounds before the basis is fixed.
      rank: ``"low_rank"``'s ``r``.
    """

    covariance: str
    basis_rounds: int
    rank: int = 0

    def family(self, frame):
        """The algebra of the factors in ``frame``."""
        return gaussian_kron.in_bases(frame.bases) if self.covariance == "kron" else gaussian_subspace.in_basis(frame)

    def bases(self, frame):
        """What the curvature takes: the per-leaf bases, or ``B``."""
        return frame.bases if self.covariance == "kron" else frame

    def init_frame(self, key: jax.Array, params: PyTree):
        """The identity bases (``"kron"``), or a random orthonormal ``B_0`` (``"low_rank"``, the
        server's key; Halko et al. 2011, Alg. 4.1)."""
        if self.covariance == "kron":
            return KronFrame(gaussian_kron.identity_bases(params), optax.tree.zeros_like(params))
        flat, _ = ravel_pytree(params)
        return gaussian_subspace.orthonormal_basis(jax.random.normal(key, (flat.size, self.rank), flat.dtype))

    def lift(self, g: DiagGaussian):
        """A diagonal factor whose precision is constant on every leaf (the prior, the EP start) in
        the structure: ``c I`` is the same in every orthonormal basis (``c`` eigenvalues; diagonal
        ``c`` and a zero core), and ``eta`` keeps its coordinates."""
        if self.covariance == "kron":
            return KronGaussian(precision_mean=g.precision_mean, precision=g.precision)
        flat, _ = ravel_pytree(g.precision)
        return SubspaceGaussian(g.precision_mean, SubspacePrecision(g.precision, jnp.zeros((self.rank, self.rank), flat.dtype)))

    def non_negative(self, precision, reference, rtol: float = 1e-5) -> jax.Array:
        """Positive semi-definite to round-off: every eigenvalue (``"kron"``), or the diagonal
        coordinatewise and the core's eigenvalues (``"low_rank"``), at least ``-rtol`` times the
        reference's scale (:func:`~fedbayes.algorithms.sites.non_negative_to_roundoff`)."""
        if self.covariance == "kron":
            return non_negative_to_roundoff(precision, reference, rtol)
        diagonal = non_negative_to_roundoff(precision.diagonal, reference.diagonal, rtol)
        scale = jnp.maximum(jnp.max(jnp.abs(jnp.diagonal(reference.core))), jnp.max(jnp.abs(jnp.diagonal(precision.core))))
        return diagonal & (jnp.min(jnp.linalg.eigvalsh(0.5 * (precision.core + precision.core.T))) >= -rtol * scale)

    def clamp(self, g):
        """Round-off below zero set to zero: the eigenvalues, or the diagonal and the core's
        eigenvalues. The core changes by its negative eigenpairs only, so the rest of it (its
        round-off asymmetry included) passes through: a cavity that lost part of ``q_g``'s core
        would send ``-delta`` times that part back from every client, a loop that grows it by
        ``|1 - delta K|`` a round."""
        if self.covariance == "kron":
            return KronGaussian(g.precision_mean, jax.tree.map(lambda v: jnp.maximum(v, 0.0), g.precision))
        values, vectors = jnp.linalg.eigh(0.5 * (g.precision.core + g.precision.core.T))
        core = g.precision.core - (vectors * jnp.minimum(values, 0.0)[None, :]) @ vectors.T
        return SubspaceGaussian(g.precision_mean, SubspacePrecision(jax.tree.map(lambda v: jnp.maximum(v, 0.0), g.precision.diagonal), core))

    def stale(self, fixed: jax.Array | bool, cstate: ClientState) -> jax.Array:
        """Whether a site is still in the identity bases of the basis rounds while the broadcast's
        are fixed (``"kron"``); a low-rank site's core is zero until the basis is fixed, so it never
        is."""
        if self.covariance != "kron":
            return jnp.zeros((), jnp.bool_)
        return jnp.asarray(fixed) & cstate.initialized & (cstate.fixed == 0)

    def move(self, site, frame):
        """A stale site moved into the fixed bases about the mean they were fixed at
        (:func:`fedbayes.gaussian_kron.move`)."""
        return gaussian_kron.move(site, frame.bases, frame.anchor) if self.covariance == "kron" else site

    def refresh(self, q, sketch, frame, round_: jax.Array):
        """The server's basis step after round ``round_``'s product: ``"kron"``, at the last basis
        round, the eigenvectors of the cohort's summed Kronecker factors, and ``q_g`` moved into them
        about its mean (:func:`fedbayes.gaussian_kron.move`) with a fresh optimizer state;
        ``"low_rank"``, in every basis round, one step of subspace iteration ``B <- orth(sum_k G_k
        B)`` (Halko et al. 2011, Alg. 4.3), ``q_g``'s core (zero then) carried along exactly.
        Returns ``(q, frame, reset)``."""
        if self.covariance == "kron":

            def fix_bases():  # a cond: the factors' eigendecompositions run in that round only
                mean = self.family(frame).mean(q)
                bases = gaussian_kron.bases_from_factors(sketch)
                return gaussian_kron.move(q, bases, mean), KronFrame(bases, mean), jnp.ones((), jnp.bool_)

            return jax.lax.cond(round_ == self.basis_rounds - 1, fix_bases, lambda: (q, frame, jnp.zeros((), jnp.bool_)))
        moving = round_ < self.basis_rounds
        basis = jnp.where(moving, gaussian_subspace.orthonormal_basis(sketch), frame)
        return jax.tree.map(lambda a, b: jnp.where(moving, a, b), gaussian_subspace.project(q, frame, basis), q), basis, jnp.zeros((), jnp.bool_)

    def spread(self, q, frame):
        """``q_g``'s precision for the evaluation and ``model.npz``: a
        :class:`~fedbayes.gaussian_kron.KronSpread`, or the low-rank family's
        :class:`~fedbayes.gaussian_lowrank.LowRankGaussian`."""
        if self.covariance == "kron":
            return gaussian_kron.KronSpread(q.precision, frame.bases)
        return gaussian_subspace.in_basis(frame).to_lowrank(SubspaceGaussian(optax.tree.zeros_like(q.precision_mean), q.precision))


def shared_basis_client_step(
    key: jax.Array,
    message: Broadcast,
    cstate: ClientState,
    data: ClientData,
    inference,
    trainer: LocalTrainer,
    *,
    structure: SharedBasis,
    start: EPStart,
    site_optimizer: optax.GradientTransformation,
    adaptive: bool,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
):
    """One FedEP client in a structure whose basis the server broadcasts (:func:`full_client_step`
    with the factors in that basis, :class:`SharedBasis`): a Kronecker site of the basis rounds is
    first moved into the fixed bases about the mean the server fixed them at
    (:func:`fedbayes.gaussian_kron.move`, as the server moved ``q_g``; its optimizer state starts
    afresh), then the cavity ``q_g / t_k``, the tilted Laplace approximation in the structure
    (:func:`~fedbayes.inference.tilted.make_shared_basis_laplace_inference`), the damped message
    ``delta clip(q^ / q_g)`` with the client's Kronecker factors or curvature sketch beside it, and
    the site update, as the diagonal method's. A cavity that is not positive semi-definite to
    round-off flags the message, and so does (unless ``allow_improper_sites``) a new site that is
    not. Returns ``(message, client_state, info)``."""
    n = data.num_examples.astype(jnp.float32)
    total = start.total_examples
    q, frame = message.q, message.basis
    family = structure.family(frame)
    prior = structure.lift(prior_like(q.precision_mean, start.prior_precision))
    share, rest = n / total, (total - n) / total
    # a cond: a client run on its own moves its site only when it must; under vmap it is a select
    site, opt_state = jax.lax.cond(
        structure.stale(message.basis_fixed, cstate),
        lambda: (lambda moved: (moved, site_optimizer.init(moved)))(structure.move(cstate.site, frame)),
        lambda: (cstate.site, cstate.opt_state),
    )
    site, cavity = jax.lax.cond(
        cstate.initialized,
        lambda: (site, family.quotient(q, site)),
        lambda: first_site(message, prior, share, rest, start, exact_late_sites, family=family, promote=structure.lift),
    )
    cavity_ok = tree.all_finite(cavity) & structure.non_negative(cavity.precision, q.precision)
    cavity = structure.clamp(cavity)
    begin = jax.tree.map(lambda m, f: jnp.where(family.is_proper(q), m, f), family.mean(q), message.anchor if start.uniform else q.precision_mean)
    fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), begin, data, trainer) if adaptive else None
    tilted, sketch, info = inference(key, begin, cavity, data, structure.bases(frame), message.basis_fixed)
    step = optax.tree.scale(message.damping, clip_joint_norm(family.difference(tilted, q), delta_clip))
    new_site, opt_state = optimizer_step(site_optimizer, site, opt_state, step)
    proper = structure.non_negative(new_site.precision, q.precision)
    ok = cavity_ok if allow_improper_sites else jnp.logical_and(cavity_ok, proper)
    fixed = None if cstate.fixed is None else jnp.asarray(message.basis_fixed, cstate.fixed.dtype)
    return GaussianMessage(step, ok, fit, sketch), ClientState(new_site, opt_state, jnp.ones((), jnp.bool_), fixed), info


def shared_basis_server_step(
    state: ServerState, aggregate: Aggregate, server_optimizer, damping: damping_policy.Damping, structure: SharedBasis
) -> tuple[ServerState, FedEPInfo]:
    """The server in a structure whose basis it broadcasts: :func:`full_server_step`'s product and
    guard in the current basis, then the basis step (:meth:`SharedBasis.refresh`): the Kronecker
    bases fixed at the end of round ``basis_rounds`` from the cohort's summed factors, ``q_g``
    moved into them about its mean ``w_s`` (``eta' = Lambda' w_s``), as every site is when its
    client next takes part, so ``q_g`` stays ``p_0 prod_k t_k`` (the natural-parameter optimizer's
    state starts afresh there); or the low-rank basis moved by one step of subspace iteration in
    each of the first ``basis_rounds`` rounds, while every core is zero."""
    family = structure.family(state.basis)
    q, opt_state, guarded = sites.full_server_step(server_optimizer, state.q, state.opt_state, aggregate.total.difference, family=family)
    moved = damping.update(state.damping, family.project_to_diag(state.q), family.project_to_diag(q), aggregate.mean.loss)
    q, frame, reset = structure.refresh(q, aggregate.total.sketch, state.basis, state.round)
    opt_state = jax.tree.map(lambda a, b: jnp.where(reset, a, b), server_optimizer.init(q), opt_state)
    info = FedEPInfo(precision_guarded=guarded, damping=state.damping.value)
    return ServerState(q, state.fedavg_opt_state, opt_state, state.round + 1, state.anchor, moved, frame), info


def fedep_shared_basis(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    inference,
    *,
    structure: SharedBasis,
    total_examples: int,
    damping: float | damping_policy.Damping,
    alpha_cov: float,
    site_optimizer: optax.GradientTransformation | None = None,
    init: str = "benchmark",
    prior_precision: float = 0.0,
    delta_clip: float | None = None,
    allow_improper_sites: bool = False,
    exact_late_sites: bool = False,
) -> Algorithm:
    """FedEP in a structure whose basis the server shares (docs/algorithms.md §7.12, "Structures in
    a shared basis"): :func:`shared_basis_client_step` and :func:`shared_basis_server_step`,
    arguments as :func:`fedep_full`; ``inference`` maps a cavity in the basis to the tilted
    approximation and the client's Kronecker factors or curvature sketch
    (:func:`~fedbayes.inference.tilted.make_shared_basis_laplace_inference`). The basis is the
    identity (``"kron"``) or found by subspace iteration (``"low_rank"``) for
    ``structure.basis_rounds`` rounds, then fixed."""
    policy, site_optimizer, start = _stateful_setup(
        init, damping, server_optimizer, site_optimizer, alpha_cov, prior_precision, total_examples, exact_late_sites
    )
    kron = structure.covariance == "kron"

    def server_init(key, params):
        q, anchor = ep_start(params, start)
        q = structure.lift(q)
        frame = structure.init_frame(key, params)
        return ServerState(q, server_optimizer.init(params), server_optimizer.init(q), jnp.zeros((), jnp.int32), anchor, policy.init(params), frame)

    def send(state):
        return Broadcast(state.q, jnp.ones((), jnp.bool_), state.anchor, state.damping.value, state.basis, state.round >= structure.basis_rounds)

    def client_init(params):
        site = structure.lift(prior_like(params, 0.0))  # uniform: all zeros
        return ClientState(site, site_optimizer.init(site), jnp.zeros((), jnp.bool_), jnp.zeros((), jnp.int32) if kron else None)

    def client_update(key, message, cstate, data):
        return shared_basis_client_step(
            key, message, cstate, data, inference, trainer, structure=structure, start=start, site_optimizer=site_optimizer,
            adaptive=policy.adaptive, delta_clip=delta_clip, allow_improper_sites=allow_improper_sites, exact_late_sites=exact_late_sites,
        )  # fmt: skip

    def server_update(key, state, aggregate):
        del key
        return shared_basis_server_step(state, aggregate, server_optimizer, policy, structure)

    def moments(state):
        family = structure.family(state.basis)
        return family.mean(state.q), family.variance(state.q)

    def personal_posterior(state, cstate: ClientState, weight):
        family = structure.family(state.basis)
        site = jax.lax.cond(
            structure.stale(state.round >= structure.basis_rounds, cstate), lambda: structure.move(cstate.site, state.basis), lambda: cstate.site
        )
        q_k = family.product(state.q, family.power(site, weight))
        q_k = jax.tree.map(lambda a, b: jnp.where(family.is_proper(q_k), a, b), q_k, state.q)
        return family.mean(q_k), family.variance(q_k)

    def message_ok(state, message):
        family = structure.family(state.basis)
        ok = jnp.logical_and(tree.all_finite(message.difference), message.ok) & tree.all_finite(message.sketch)
        return jnp.logical_and(ok, family.is_proper(family.product(state.q, message.difference)))

    return Algorithm(
        name="fedep",
        server_init=server_init,
        broadcast=send,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: structure.family(state.basis).mean(state.q),
        message_ok=message_ok,
        trainer=trainer,
        server_posterior=moments,
        after_rejected_round=lambda state: state._replace(damping=policy.rejected(state.damping)),
        personal_posterior=personal_posterior,
        server_precision=lambda state: structure.spread(state.q, state.basis),
    )


PRESETS = ("posterior", "paper")
# The paper's heuristics (Guo et al. 2023 (FedEP) Table 7 and its reference code), filled in for the
# fields a ``preset = "paper"`` config leaves unset; damping then defaults to 1 / clients_per_round.
PAPER_SETTINGS = {"method": "identity", "scale": 500.0, "clip_ratio": 2.0, "weight_decay": 1e-4, "prior_precision": 0.0, "ngvi_bias_correction": False}
DEFAULT_DAMPING = 0.5  # the posterior preset's fixed delta before the adaptive damping (a stored config's unset damping)
# The nuts method's default: a fixed, small delta. Its sites carry the draws' noise, which the
# adaptive rule reads as jitter about a fixed point and leaves alone;
# a small step averages that noise over about 2 / delta rounds (docs/results/posterior_full.md).
NUTS_DAMPING = 0.1
# the diagonal NGVI's settings, which the dense ngvi method (natural-gradient VI) does not take: their defaults
FULL_NGVI_FIXED = {f: TiltedSettings.model_fields[f].default for f in ("scale", "ngvi_epochs", "ngvi_beta", "ngvi_bias_correction")}


class EPConfig(TiltedSettings, sites.SharedBasisSettings):
    """Settings shared by FedEP and FedSEP (docs/algorithms.md §7; Guo et al. 2023 (FedEP) Table 7): the client method's
    (:class:`~fedbayes.inference.tilted.TiltedSettings`, declared once there) and the EP ones.

    Two presets fill the fields a config leaves unset; without a ``preset``, a config that asks for
    the identity or mcmc method gets ``"paper"`` (their variance is a hyperparameter, not the
    data's: the paper's heuristics are what they are), any other ``"posterior"``. ``"posterior"`` (the default): the laplace
    method with sites at the likelihood's scale (``scale = 1``, no Fisher clipping, bias-corrected
    NGVI), the prior ``N(0, 1 / prior_precision)`` (``prior_precision = 1``, ``weight_decay = 0``)
    and damping ``0.5``: the laplace and ngvi methods then reach the diagonal Laplace at the MAP
    (docs/results/posterior_defaults.md). ``"paper"``: Guo et al. 2023 (FedEP)'s heuristics
    (:data:`PAPER_SETTINGS`: identity method, ``scale = 500``, ``clip_ratio = 2``,
    ``weight_decay = 1e-4``, no separate prior, uncorrected NGVI, damping ``1 / clients_per_round``)
    for reproducing its tables; its variances are set by ``scale``, not by the data.
    """

    preset: Literal[PRESETS] = Field(  # type: ignore[valid-type]
        "posterior",
        description="defaults of the unset fields: posterior (laplace, scale 1, clip 0, prior N(0, 1/prior_precision), damping 0.5: "
        "the family's posterior) or paper (Guo et al.'s heuristics: identity, scale 500, clip 2, weight_decay 1e-4, damping 1/M); "
        "unset, paper for method identity or mcmc (their variance is a hyperparameter), posterior otherwise",
    )
    method: Literal[METHODS] = Field(  # type: ignore[valid-type]
        "laplace",
        description="client tilted inference: laplace (L, default) or ngvi (V) give a posterior; identity (I) and mcmc (M) "
        "give a variance set by alpha_cov = scale * (initial_precision + weight_decay), a hyperparameter, not the data; "
        "nuts matches the tilted mean by NUTS, its precision the curvature averaged over the draws (FedEP with covariance = 'full'; small models); "
        "with covariance = 'full', laplace takes the dense GGN and ngvi is full-covariance natural-gradient VI",
    )
    damping: Annotated[float, Field(gt=0, le=1)] | Literal["adaptive"] | None = Field(
        None,
        description="delta: adaptive (preset posterior: starts at 0.5, grown while the global posterior contracts, shrunk when it swings back "
        "or grows; docs/algorithms.md §7.8) or a fixed value in (0, 1]; default adaptive, 0.1 for the nuts method (its sites carry the draws' "
        "noise, which a small step averages), or 1 / clients_per_round (preset paper)",
    )
    delta_clip: float | None = Field(None, gt=0, description="joint global-norm clip G of each client's update")
    burn_in_rounds: int = Field(0, ge=0, description="FedAvg rounds before EP")
    init: Literal[INITS] = Field("benchmark", description="benchmark (docs/algorithms.md §7.3) or uniform (the paper's)")  # type: ignore[valid-type]
    prior_precision: float = Field(
        1.0,
        ge=0,
        description="delta of the prior p0 = N(0, 1/delta), one factor of q_g (default 1: N(0, 1)); weight_decay adds lambda_wd n_k per client on top",
    )
    covariance: Literal[COVARIANCES] = Field(  # type: ignore[valid-type]
        "diagonal",
        description="the Gaussian family of the sites, cavities, tilted approximations and q_g: diagonal (default), full, a dense [D, D] "
        f"precision over all D parameters (cavity q_g / t_k and product exact in the family; the laplace method with the dense GGN, ngvi or nuts; "
        f"for models up to {MAX_FULL_PARAMS} parameters, e.g. model.name = 'logreg'), or last_layer, dense over the last layer's weights and "
        "diagonal elsewhere (FedEP's laplace method with that block of the GGN; Laplace Redux's last-layer structure), or kron, per dense or "
        "conv layer the GGN's diagonal in the eigenbases of its two Kronecker factors (EKFAC; FedEP's laplace method, for networks), the "
        "bases fixed after basis_rounds rounds, or low_rank, the GGN exact in a shared basis of rank directions that the first basis_rounds "
        "rounds find (its leading eigenvectors) and diagonal outside it (FedEP's laplace method); full, last_layer, kron and low_rank take "
        "no burn-in, robust aggregation or privacy",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_preset(cls, data):
        if not isinstance(data, dict):
            return data
        preset = data.get("preset")
        if preset is None:  # the identity and mcmc methods are the paper's heuristics: their preset by default
            preset = "paper" if data.get("method") in ("identity", "mcmc") else "posterior"
            data = {**data, "preset": preset}
        if preset == "paper":
            data = {**PAPER_SETTINGS, **data}
        else:
            data = {"damping": NUTS_DAMPING if data.get("method") == "nuts" else damping_policy.ADAPTIVE, **data}
        return data

    @model_validator(mode="after")
    def _benchmark_needs_alpha_cov(self):
        if self.init == "benchmark" and not (self.alpha_cov > 0 or self.prior_precision > 0):
            raise ValueError(
                "algorithm.weight_decay: the benchmark initialisation needs alpha_cov = scale * (initial_precision + weight_decay) > 0 "
                "or prior_precision > 0; set one of them, or init = 'uniform'"
            )
        if self.method == "nuts" and self.covariance != "full":
            raise ValueError(
                f"algorithm.method: nuts matches the tilted mean with dense sites; set covariance = 'full' (FedEP; models up to {MAX_FULL_PARAMS} parameters)"
            )
        if self.covariance == "full" and self.method not in ("laplace", "ngvi", "nuts"):
            raise ValueError(
                "algorithm.covariance: 'full' takes the laplace method (a dense GGN at the tilted mode), ngvi (full-covariance natural-gradient VI) "
                f"or nuts (the tilted mean by NUTS); got method {self.method!r}"
            )
        if self.natural_steps != NATURAL_STEPS and not (self.covariance == "full" and self.method == "ngvi"):
            raise ValueError(
                f"algorithm.natural_steps: sets the iterations of the ngvi method with covariance = 'full'; got method {self.method!r}, "
                f"covariance {self.covariance!r}"
            )
        if self.covariance == "full" and self.method == "ngvi":
            changed = [f for f in FULL_NGVI_FIXED if getattr(self, f) != FULL_NGVI_FIXED[f]]
            if changed:
                raise ValueError(
                    f"algorithm.{changed[0]}: the ngvi method with covariance = 'full' is natural-gradient VI with its own iterations and draws "
                    f"(docs/algorithms.md §7.12) and the likelihood's scale; leave {', '.join(changed)} at "
                    + ", ".join(f"{f} = {FULL_NGVI_FIXED[f]}" for f in changed)
                )
        if self.covariance == "last_layer" and self.method != "laplace":
            raise ValueError(
                f"algorithm.covariance: 'last_layer' takes the laplace method (the GGN's last-layer block at the tilted mode); got method {self.method!r}"
            )
        if self.covariance in ("kron", "low_rank") and self.method != "laplace":
            raise ValueError(
                f"algorithm.covariance: {self.covariance!r} takes the laplace method (the GGN in the shared basis at the tilted mode); got method {self.method!r}"
            )
        if self.covariance != "diagonal" and self.burn_in_rounds > 0:
            raise ValueError(f"algorithm.covariance: {self.covariance!r} runs EP from the first round; set burn_in_rounds = 0; got {self.burn_in_rounds}")
        if self.method in ("identity", "mcmc") and not self.alpha_cov > 0:
            raise ValueError(
                f"algorithm.initial_precision: the {self.method} method's precision is alpha_cov = scale * (initial_precision + weight_decay) "
                "per example and needs it > 0; set initial_precision (or weight_decay), or preset = 'paper'"
            )
        return self

    def default_damping(self, clients_per_round: int) -> float | str:
        """``damping`` if set, else the preset's: ``"adaptive"`` or ``1 / clients_per_round``."""
        if self.damping is not None:
            return self.damping
        return 1.0 / clients_per_round if self.preset == "paper" else damping_policy.ADAPTIVE


class FedEPConfig(EPConfig):
    """FedEP (docs/algorithms.md §7): stateful clients keep their sites."""

    name: Literal["fedep"]
    improper_sites: Literal["reject", "allow"] = Field(
        "reject", description="a message whose site precision turns non-positive: reject it, or allow it (EP factors may be improper)"
    )


class FedSEPConfig(EPConfig):
    """FedSEP (docs/algorithms.md §7.9): stateless clients, one shared average site."""

    name: Literal["fedsep"]
    sep_power: Literal[SEP_POWERS] = Field("data_fraction", description="cavity power: 1 - n_k/N or 1 - 1/K")  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _dense_needs_moments(self):
        if self.covariance in ("last_layer", "kron", "low_rank"):
            raise ValueError(
                "algorithm.covariance: fedsep takes diagonal or full; its shared site's laplace fixed point is far from the Laplace in a dense "
                f"family (docs/results/posterior_full.md); use name = 'fedep' for the {self.covariance} structure"
            )
        if self.covariance == "full" and self.method == "laplace":
            raise ValueError(
                "algorithm.method: fedsep with covariance = 'full' takes the ngvi or nuts method; with laplace its shared site's fixed point "
                "is far from the full Laplace (docs/results/posterior_full.md); or use name = 'fedep'"
            )
        return self


def _common(hp: EPConfig, ctx: BuildContext) -> dict:
    inference = make_tilted_inference(hp.method, ctx.trainer, hp, apply_fn=ctx.apply_fn, task=ctx.task)
    return dict(
        inference=inference, total_examples=ctx.federation.total_examples, num_clients=ctx.federation.num_clients,
        damping=damping_policy.from_setting(hp.default_damping(ctx.clients_per_round)), alpha_cov=hp.alpha_cov, burn_in_rounds=hp.burn_in_rounds,
        init=hp.init, prior_precision=hp.prior_precision, delta_clip=hp.delta_clip,
    )  # fmt: skip


def build_fedep(hp: FedEPConfig, ctx: BuildContext) -> Algorithm:
    if hp.covariance != "diagonal":
        return _build_fedep_full(hp, ctx)
    return fedep(
        ctx.trainer, ctx.server_optimizer, allow_improper_sites=hp.improper_sites == "allow", exact_late_sites=hp.preset == "posterior", **_common(hp, ctx)
    )


def _full_inference(hp: EPConfig, ctx: BuildContext):
    """The dense tilted inference of ``hp.method`` (laplace, ngvi or nuts; the last-layer structure:
    laplace), after the size check."""
    if hp.covariance == "last_layer":
        sites.check_last_layer_size(ctx.last_layer_params, ctx.num_params)
    else:
        sites.check_full_size(ctx.num_params)
    if hp.method == "nuts":
        return make_full_nuts_inference(ctx.trainer, hp, apply_fn=ctx.apply_fn, task=ctx.task, max_examples=max(ctx.federation.client_sizes))
    if hp.method == "ngvi":
        return make_full_ngvi_inference(ctx.trainer, hp, apply_fn=ctx.apply_fn, task=ctx.task)
    return make_full_laplace_inference(ctx.trainer, hp, apply_fn=ctx.apply_fn, task=ctx.task)


def _build_fedep_full(hp: FedEPConfig, ctx: BuildContext) -> Algorithm:
    if hp.covariance in ("kron", "low_rank"):
        if hp.covariance == "low_rank":
            sites.check_low_rank_size(hp.rank, ctx.num_params)
        elif ctx.param_shapes is not None:
            sites.check_kron_size(ctx.param_shapes)
        inference = make_shared_basis_laplace_inference(ctx.trainer, hp, apply_fn=ctx.apply_fn, task=ctx.task, covariance=hp.covariance)
        return fedep_shared_basis(
            ctx.trainer, ctx.server_optimizer, inference, structure=SharedBasis(hp.covariance, hp.basis_rounds, hp.rank),
            total_examples=ctx.federation.total_examples, damping=damping_policy.from_setting(hp.default_damping(ctx.clients_per_round)),
            alpha_cov=hp.alpha_cov, init=hp.init, prior_precision=hp.prior_precision, delta_clip=hp.delta_clip,
            allow_improper_sites=hp.improper_sites == "allow", exact_late_sites=hp.preset == "posterior",
        )  # fmt: skip
    inference = _full_inference(hp, ctx)
    return fedep_full(
        ctx.trainer, ctx.server_optimizer, inference, total_examples=ctx.federation.total_examples, num_clients=ctx.federation.num_clients,
        damping=damping_policy.from_setting(hp.default_damping(ctx.clients_per_round)), alpha_cov=hp.alpha_cov, init=hp.init,
        prior_precision=hp.prior_precision, delta_clip=hp.delta_clip, allow_improper_sites=hp.improper_sites == "allow",
        exact_late_sites=hp.preset == "posterior", covariance=hp.covariance,
    )  # fmt: skip


def build_fedsep(hp: FedSEPConfig, ctx: BuildContext) -> Algorithm:
    if hp.covariance == "full":
        return fedsep_full(
            ctx.trainer, ctx.server_optimizer, _full_inference(hp, ctx), total_examples=ctx.federation.total_examples,
            num_clients=ctx.federation.num_clients, damping=damping_policy.from_setting(hp.default_damping(ctx.clients_per_round)),
            alpha_cov=hp.alpha_cov, init=hp.init, prior_precision=hp.prior_precision, delta_clip=hp.delta_clip, sep_power=hp.sep_power,
        )  # fmt: skip
    return fedsep(ctx.trainer, ctx.server_optimizer, sep_power=hp.sep_power, **_common(hp, ctx))


def _min_local_epochs(hp: EPConfig) -> tuple[int, str]:
    if hp.method == "mcmc":
        return 2, "the mcmc method estimates a variance from one sample per epoch"
    return 1, ""


def _stored_meaning(table: dict, stored: dict) -> dict:
    """A config written before the presets ran the paper's: its resolved table holds every setting
    but the damping (then ``1 / clients_per_round``) and the NGVI bias correction (then none), which
    the paper preset fills in exactly so. One written with the posterior preset before the adaptive
    damping left it unset for the fixed 0.5."""
    del stored
    table.setdefault("preset", "paper")
    if table["preset"] == "posterior" and table.get("damping") is None:  # written before the adaptive damping: 0.5
        table["damping"] = DEFAULT_DAMPING
    return table


# FedEP and FedSEP share their traits. The laplace and ngvi methods read the model's outputs, and
# make_tilted_inference says so when they lack them; the identity and mcmc methods build without.
_EP_TRAITS = dict(
    bayesian=True,
    min_local_epochs=_min_local_epochs,
    # laplace and ngvi: the tilted mode, so a client runs until its objective settles; identity and mcmc keep the paper's epochs
    local_budget=lambda hp: "converged" if hp.method in ("laplace", "ngvi") else "epochs",
    burn_in_rounds=burn_in_setting,
    # the posterior preset's posterior is the likelihood's: narrow its predictive post hoc, or temper it (the paper's knob)
    calibration_advice=(
        'to predict with a narrower posterior, choose its prior precision on held-out data (evaluation.prior_precision = "validation", '
        "data.validation_fraction > 0; laplace and ngvi sites) or temper it (algorithm.scale > 1; docs/algorithms.md, 'Choosing scale')"
    ),
    divergence_hint="the tilted precisions of FedEP's laplace/ngvi methods",
    default_predictive=lambda hp: "sample" if hp.method == "mcmc" else "linearised",  # mcmc: moments of samples; else a Gaussian about the mean
    # + sum_k scale F_k; a dense posterior's marginals are not 1 / (G_ii + delta): no post-hoc prior search there; the last-layer
    # structure's search reads its blocks (evaluation.prior_precision)
    posterior_prior_precision=lambda hp: (
        (hp.prior_precision, hp.scale * hp.weight_decay) if hp.method in ("laplace", "ngvi") and hp.covariance != "full" else None
    ),
    # a dense precision is no vector of coordinates: a robust rule's per-coordinate statistics, a precision cap and DP's clip and noise have no meaning for it
    settings_aggregator_policy=lambda hp: {
        "full": ("own", sites.FULL_AGGREGATOR_NOTE),
        "last_layer": ("own", sites.LAST_LAYER_AGGREGATOR_NOTE),
        "kron": ("own", sites.KRON_AGGREGATOR_NOTE),
    }.get(hp.covariance),  # fmt: skip
    stored_meaning=_stored_meaning,
)
FEDEP = AlgorithmSpec("fedep", FedEPConfig, build_fedep, "expectation propagation with stateful Gaussian sites", **_EP_TRAITS)
# FedSEP's clients keep client.max_epochs as their cap: longer local runs moved its fixed point further
# from the family optimum (0.12 -> 0.17 on breast cancer; docs/results/posterior_defaults.md)
FEDSEP = AlgorithmSpec("fedsep", FedSEPConfig, build_fedsep, "stochastic EP: one shared site, stateless clients", **_EP_TRAITS, local_max_steps=0)
SPECS = (FEDEP, FEDSEP)
