"""Gaussian sites: the machinery shared by the methods that keep per-client Gaussian factors (public building blocks).

FedEP, FedSEP, PVI and FedLap-Cov each keep the global approximation ``q_g ∝ p_0 prod_k q_k``
with diagonal Gaussian sites in natural parameters (:class:`~fedbayes.gaussian.DiagGaussian`),
form cavities and send natural-parameter differences (:class:`GaussianMessage`, checked by
:func:`gaussian_message_ok`). FedEP, FedSEP and PVI send the damped difference
(:func:`damped_difference`) and move the global by an optax optimizer (:func:`site_server_step`:
damping as optimisation on natural parameters; Guo et al., "Federated learning as variational
inference: a scalable expectation propagation approach", ICLR 2023, Sec. 2.2.3). FedLap-Cov
damps its site as a convex combination (:func:`fedbayes.gaussian.damp`: ``(1 - rho) t + rho t*``
is not ``t + rho (t* - t)`` in floating point, so the two forms stay apart) and its exact server
multiplies the sites' changes into ``q_g`` with a floor instead of an optimizer.

Every step states its policy for an improper result (docs/style.md): a cavity or site that is not
proper enough rejects the client's message; a global coordinate that an aggregated step would make
non-positive keeps its value.

:func:`personalised` is client ``k``'s own posterior from the global and its site, ``q_k ∝ q_g t_k^w``
(docs/algorithms.md §13.8), which each site method exposes as ``Algorithm.personal_posterior``.

With ``covariance = "full"`` (FedEP, PVI, FedLap-Cov) the factors are dense
(:class:`~fedbayes.gaussian_full.FullGaussian`); :func:`psd_to_roundoff`, :func:`full_safe_mean`,
:func:`full_message_ok`, :func:`full_server_step` and :func:`full_personal_moments` are the
dense counterparts of the diagonal checks, guard and personalisation.

:func:`burn_in_switch` is the "FedAvg for the first ``B`` rounds" switch that FedEP, FedSEP and
FedPA share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from fedbayes import gaussian, gaussian_block, gaussian_full, gaussian_kron, tree
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_block import BlockGaussian, BlockPrecision
from fedbayes.gaussian_full import FullGaussian
from fedbayes.hparams import HParams

PyTree = Any

__all__ = [
    "BROADCAST_LOSS_TAG",
    "FULL_AGGREGATOR_NOTE",
    "LAST_LAYER_AGGREGATOR_NOTE",
    "LOW_RANK_AGGREGATOR_NOTE",
    "DEFAULT_BASIS_ROUNDS",
    "DEFAULT_RANK",
    "MAX_FULL_PARAMS",
    "SharedBasisSettings",
    "GaussianMessage",
    "all_positive",
    "all_non_negative",
    "non_negative_to_roundoff",
    "burn_in_switch",
    "check_full_size",
    "check_last_layer_size",
    "check_kron_size",
    "check_low_rank_size",
    "checked_cavity",
    "clip_joint_norm",
    "damped_difference",
    "dense_family",
    "full_message_ok",
    "full_personal_moments",
    "full_safe_mean",
    "full_server_step",
    "gaussian_message_ok",
    "guard_positive",
    "natural_bytes",
    "optimizer_step",
    "personal_moments",
    "personalised",
    "psd_to_roundoff",
    "safe_mean",
    "site_server_step",
]


BROADCAST_LOSS_TAG = 0x6C6F7373  # folded into a client's round key for its broadcast loss: every other draw stays as it was


class GaussianMessage(NamedTuple):
    """A site method's message: a natural-parameter difference (a factor, usually improper), the
    client's own validity flag (a proper cavity, a valid site or curvature), its mean data loss
    at the broadcast mean (:func:`fedbayes.inference.sgd.broadcast_loss`; ``None``: not measured, no
    leaf), whose weighted mean over the cohort the adaptive damping watches, and the product
    ``G_k B`` of its curvature with the broadcast basis (``[D, r]``; ``None``: no leaf), whose sum
    over the cohort the low-rank structure's server turns into its next basis
    (:mod:`fedbayes.gaussian_subspace`)."""

    difference: DiagGaussian
    ok: jax.Array
    loss: jax.Array | None = None
    sketch: jax.Array | None = None


def checked_cavity(cavity: DiagGaussian, q: DiagGaussian, rtol: float = 1e-5) -> tuple[DiagGaussian, jax.Array]:
    """The cavity with float round-off below zero clamped to 0, and whether it is proper enough to
    serve as a prior: finite, and no precision below ``-rtol * Lambda_g`` (a truly negative cavity
    precision means the site outweighs the global: the client is rejected)."""
    tol_ok = jax.tree.map(lambda c, g: jnp.all(c >= -rtol * jnp.abs(g)), cavity.precision, q.precision)
    ok = jnp.logical_and(tree.all_finite(cavity), jnp.all(jnp.stack(jax.tree.leaves(tol_ok))))
    clamped = DiagGaussian(precision_mean=cavity.precision_mean, precision=jax.tree.map(lambda c: jnp.maximum(c, 0.0), cavity.precision))
    return clamped, ok


def all_positive(precision: PyTree) -> jax.Array:
    """Whether every precision is strictly positive."""
    return jnp.all(jnp.stack([jnp.all(lam > 0) for lam in jax.tree.leaves(precision)]))


def all_non_negative(precision: PyTree) -> jax.Array:
    """Whether every precision is >= 0 (a zero is a flat factor: no information in that coordinate)."""
    return jnp.all(jnp.stack([jnp.all(lam >= 0) for lam in jax.tree.leaves(precision)]))


def non_negative_to_roundoff(precision: PyTree, reference: PyTree, rtol: float = 1e-5) -> jax.Array:
    """Whether every precision is >= 0 up to float round-off: no entry below ``-rtol`` times the
    matching ``reference`` precision (the global's, from which a site's update is a difference).
    A site with no information in a coordinate is 0 there, and ``site + delta (tilted - global)``
    computes that 0 as a difference of numbers the size of the global precision: in float32 it
    came out at -1.5e-8 against a global of ~1500 and every message of a round was rejected."""
    ok = jax.tree.map(lambda lam, ref: jnp.all(lam >= -rtol * jnp.abs(ref)), precision, reference)
    return jnp.all(jnp.stack(jax.tree.leaves(ok)))


def safe_mean(q: DiagGaussian, fallback: PyTree) -> PyTree:
    """``eta / Lambda`` where ``Lambda > 0``, else ``fallback`` (a coordinate without information)."""
    return jax.tree.map(lambda eta, lam, f: jnp.where(lam > 0, eta / jnp.where(lam > 0, lam, 1.0), f), q.precision_mean, q.precision, fallback)


def clip_joint_norm(d: DiagGaussian, max_norm: float | None) -> DiagGaussian:
    """Scales both natural parameters together to a global L2 norm of at most ``max_norm``
    (``None``: no clipping)."""
    if max_norm is None:
        return d
    norm = optax.tree.norm(d)
    return optax.tree.scale(jnp.minimum(1.0, max_norm / jnp.maximum(norm, 1e-30)), d)


def optimizer_step(optimizer: optax.GradientTransformation, value: PyTree, opt_state, increase: PyTree):
    """Moves ``value`` by ``optimizer`` in the direction of ``increase`` (optax descends, so it
    receives ``-increase``); with ``optax.sgd(1)`` this is ``value + increase``."""
    return apply_server_optimizer(optimizer, value, opt_state, optax.tree.scale(-1.0, increase))


def guard_positive(new: DiagGaussian, old: DiagGaussian) -> tuple[DiagGaussian, jax.Array]:
    """``new`` where its precision is positive, ``old`` elsewhere (a momentum overshoot must not
    make the global improper), and the number of coordinates kept."""
    keep = jax.tree.map(lambda lam: lam > 0, new.precision)
    guarded = DiagGaussian(
        precision_mean=jax.tree.map(jnp.where, keep, new.precision_mean, old.precision_mean),
        precision=jax.tree.map(jnp.where, keep, new.precision, old.precision),
    )
    kept = sum(jnp.sum(jnp.logical_not(k).astype(jnp.int32)) for k in jax.tree.leaves(keep))
    return guarded, jnp.asarray(kept, jnp.int32)


def damped_difference(new: DiagGaussian, reference: DiagGaussian, damping: float | jax.Array, max_norm: float | None = None) -> DiagGaussian:
    """``damping * clip(new / reference)``: the damped natural-parameter difference that FedEP and
    PVI send (Guo et al. 2023 (FedEP) Sec. 2.2.3, ``delta Delta_k``; Swaroop et al. 2025 (ADMM and
    Bayes) Eq. 6, ``rho (lambda_{q_k} - lambda_{q_g})``), the difference clipped to a joint norm of
    at most ``max_norm`` first (:func:`clip_joint_norm`; ``None``: no clipping). ``damping`` may be
    traced (the adaptive damping arrives in the broadcast)."""
    return optax.tree.scale(damping, clip_joint_norm(gaussian.difference(new, reference), max_norm))


def gaussian_message_ok(message: GaussianMessage, q: DiagGaussian | None = None) -> jax.Array:
    """The server's acceptance test of a :class:`GaussianMessage`: finite, flagged valid by its
    client and, given the global ``q`` it will be added to, keeping every precision of
    ``q`` positive on its own (``None``: no such check, for a server that floors its precision)."""
    ok = jnp.logical_and(tree.all_finite(message.difference), message.ok)
    if q is None:
        return ok
    lam_after = jax.tree.map(jnp.add, q.precision, message.difference.precision)
    return jnp.logical_and(ok, all_positive(lam_after))


def site_server_step(optimizer: optax.GradientTransformation, q: DiagGaussian, opt_state, total: DiagGaussian):
    """The site methods' server step: ``q_g <- q_g + ServerOpt(sum_k Delta_k)`` (:func:`optimizer_step`;
    with ``optax.sgd(1)`` the product of the accepted differences into ``q_g``), then the positivity
    guard (:func:`guard_positive`). Returns ``(q, opt_state, guarded)``, ``guarded`` the number of
    coordinates that kept their old value."""
    new_q, opt_state = optimizer_step(optimizer, q, opt_state, total)
    new_q, guarded = guard_positive(new_q, q)
    return new_q, opt_state, guarded


def personalised(q: DiagGaussian, site: DiagGaussian, weight: float | jax.Array) -> tuple[DiagGaussian, jax.Array]:
    """Client ``k``'s personalised posterior ``q_k ∝ q_g t_k^w``, the global times its own site
    ``weight = w`` times more, and the number of coordinates kept at ``q_g``'s.

    The site ``t_k`` stands in for the client's likelihood ``p(D_k | theta)`` (EP and PVI fit it so
    that ``q_g = p_0 prod_j t_j``). pFedBayes (Zhang et al. 2022, "Personalized federated learning
    via variational Bayesian inference", ICML) fits each client's own posterior by

        q_k = argmin_q  E_q[-log p(D_k | theta)] + zeta KL(q || q_g),

    whose minimiser over all densities is ``q_k ∝ q_g p(D_k | theta)^(1 / zeta)``; with the site for
    the likelihood and ``w = 1 / zeta`` that is ``q_k ∝ q_g t_k^w``, in natural parameters

        eta_k = eta_g + w eta_{t_k},     Lambda_k = Lambda_g + w Lambda_{t_k}.

    ``w = 0`` is the global; ``w = 1`` (pFedBayes's ``zeta = 1``) counts the client's data twice,
    once inside ``q_g`` and once more on its own, so ``q_k`` is the posterior of the pooled data
    with ``D_k`` duplicated when the sites are exact (a conjugate model).

    **Policy for an improper result** (a site may have negative precisions): a coordinate where
    ``Lambda_k <= 0`` keeps ``q_g``'s natural parameters (:func:`guard_positive`).
    """
    return guard_positive(gaussian.product(q, gaussian.power(site, weight)), q)


def personal_moments(q: DiagGaussian, site: DiagGaussian, weight: float | jax.Array, fallback: PyTree) -> tuple[PyTree, PyTree]:
    """``(mean, variance)`` of :func:`personalised`; a coordinate without information
    (``Lambda_k = 0``, so ``Lambda_g = 0`` too) takes ``fallback`` (the method's global point
    estimate) as its mean and variance 0."""
    q_k, _ = personalised(q, site, weight)
    variance = jax.tree.map(lambda lam: jnp.where(lam > 0, 1.0 / jnp.where(lam > 0, lam, 1.0), 0.0), q_k.precision)
    return safe_mean(q_k, fallback), variance


def burn_in_switch(burn_in_rounds: int, over: jax.Array, main: Callable, burn_in: Callable, *operands):
    """``main(*operands)`` once burn-in is ``over`` (a traced boolean, e.g. ``round >= B``), else
    ``burn_in(*operands)``, the "FedAvg for the first ``B`` rounds" of FedEP, FedSEP and FedPA.

    A ``lax.cond``: a client run on its own (the sequential layout) computes only the branch it
    takes; under vmap this is a select. Without burn-in (``burn_in_rounds == 0``) ``main`` is
    called directly.
    """
    if burn_in_rounds == 0:
        return main(*operands)
    return jax.lax.cond(over, main, burn_in, *operands)


# ----- dense (full-covariance) factors ------------------------------------------------------------

DEFAULT_BASIS_ROUNDS = 3  # covariance = "low_rank" / "kron": rounds before the basis is fixed
DEFAULT_RANK = 10  # covariance = "low_rank": directions of the shared basis
MAX_FULL_PARAMS = 5000  # a [D, D] float32 message of 100 MB: the dense family is for GLMs and small heads


class SharedBasisSettings(HParams):
    """The settings of a structure in a shared basis (``covariance = "low_rank"`` or ``"kron"``),
    the same for every method that takes one (FedLap-Cov, FedEP)."""

    rank: int = Field(DEFAULT_RANK, ge=1, description="covariance = low_rank: the directions r of the shared basis; each message adds D r + r^2 numbers")
    basis_rounds: int = Field(
        DEFAULT_BASIS_ROUNDS,
        ge=1,
        description="covariance = low_rank: rounds of subspace iteration on the cohort's GGN before the basis is fixed; "
        "kron: rounds of the diagonal method before the bases are fixed from the cohort's Kronecker factors",
    )


FULL_AGGREGATOR_NOTE = "with covariance = 'full' sends dense [D, D] precisions, which only the weighted mean combines"
LAST_LAYER_AGGREGATOR_NOTE = "with covariance = 'last_layer' sends a dense precision over the last layer, which only the weighted mean combines"
LOW_RANK_AGGREGATOR_NOTE = "with covariance = 'low_rank' sends a core in a shared basis and a curvature sketch, which only the weighted mean combines"
KRON_AGGREGATOR_NOTE = (
    "with covariance = 'kron' sends eigenvalues in shared Kronecker eigenbases and the layers' Kronecker factors, which only the weighted mean combines"
)
FLOAT32_BYTES = 4


def natural_bytes(num_params: int, covariance: str, rank: int = 0) -> int:
    """The bytes of a float32 Gaussian over ``D = num_params`` parameters in natural parameters,
    what a site method's message difference holds: ``2 D`` numbers (``eta``, the diagonal
    precision) for ``"diagonal"``, ``D + D^2`` (``eta``, the dense precision) for ``"full"``, and
    ``2 D + r^2 + D r`` for ``"low_rank"`` of rank ``r`` (``eta``, the diagonal, the ``r x r``
    core, and the ``[D, r]`` curvature sketch beside it). The message adds its few scalars
    (validity flag, loss). For ``"kron"``, ``rank`` is the number of the layers' Kronecker factors'
    entries (``sum m^2 + n^2``, sent beside ``2 D``: :func:`fedbayes.gaussian_kron.factor_numbers`)."""
    d, r = int(num_params), int(rank)
    if covariance == "kron":
        return FLOAT32_BYTES * (2 * d + r)
    if covariance == "full":
        return FLOAT32_BYTES * (d + d * d)
    if covariance == "low_rank":
        return FLOAT32_BYTES * (2 * d + r * r + d * r)
    return FLOAT32_BYTES * 2 * d


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:.1f} MB ({num_bytes:,} bytes)"


def check_full_size(num_params: int | None) -> None:
    """Raises ValueError (one line naming ``algorithm.covariance`` and the message sizes) for a
    model of more than :data:`MAX_FULL_PARAMS` parameters: a dense site, message and global are
    ``[D, D]``, and each client's message would exceed the bound's :func:`natural_bytes`."""
    if num_params is not None and num_params > MAX_FULL_PARAMS:
        raise ValueError(
            f"algorithm.covariance: 'full' keeps a dense [D, D] precision per site and message, for models up to {MAX_FULL_PARAMS} parameters; "
            f"this model has {num_params}, whose messages would be {_size(natural_bytes(num_params, 'full'))} each (D + D^2 float32 numbers) "
            f"against the bound's {_size(natural_bytes(MAX_FULL_PARAMS, 'full'))}; use covariance = 'diagonal', "
            f"whose messages are {_size(natural_bytes(num_params, 'diagonal'))}, or a smaller model (model.name = 'logreg')"
        )


def check_last_layer_size(last_layer_params: int | None, num_params: int | None) -> None:
    """Raises ValueError (one line naming ``algorithm.covariance``) where the last layer has more
    than :data:`MAX_FULL_PARAMS` parameters (its dense block's message); ``None``: not known (a
    model whose parameters are no dict of layers is refused by
    :func:`fedbayes.gaussian_block.last_layer_key` when the method starts)."""
    if last_layer_params is not None and last_layer_params > MAX_FULL_PARAMS:
        rest = 0 if num_params is None else num_params - last_layer_params
        size = natural_bytes(last_layer_params, "full") + natural_bytes(rest, "diagonal")
        raise ValueError(
            f"algorithm.covariance: 'last_layer' keeps a dense precision over the last layer, for last layers up to {MAX_FULL_PARAMS} parameters; "
            f"this model's has {last_layer_params}, whose messages would be {_size(size)} each; use covariance = 'diagonal' or a narrower last layer"
        )


def check_low_rank_size(rank: int, num_params: int | None) -> None:
    """Raises ValueError (one line naming ``algorithm.rank``) where the rank is not below the
    model's number of parameters (the structure would then be the dense one, at more cost), or the
    message (:func:`natural_bytes`) would exceed the dense family's bound."""
    if num_params is None:
        return
    if rank >= num_params:
        raise ValueError(
            f"algorithm.rank: must be below the model's {num_params} parameters for covariance = 'low_rank'; got {rank} "
            "(covariance = 'full' keeps the whole dense precision)"
        )
    bound = natural_bytes(MAX_FULL_PARAMS, "full")
    if natural_bytes(num_params, "low_rank", rank) > bound:
        raise ValueError(
            f"algorithm.rank: a rank-{rank} message over this model's {num_params} parameters would be "
            f"{_size(natural_bytes(num_params, 'low_rank', rank))} (2 D + r^2 + D r float32 numbers) against the bound's {_size(bound)}; "
            "use a smaller rank or covariance = 'last_layer'"
        )


def check_kron_size(params: Any) -> None:  # arrays or shape structs
    """Raises ValueError (one line naming ``algorithm.covariance``) where a ``"kron"`` message
    (:func:`natural_bytes`: ``2 D`` numbers and the Kronecker factors) would exceed the dense
    family's bound: a layer of many inputs (a ``[4096, n]`` kernel's input factor alone is 67 MB)."""
    num_params = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
    size, bound = natural_bytes(num_params, "kron", gaussian_kron.factor_numbers(params)), natural_bytes(MAX_FULL_PARAMS, "full")
    if size > bound:
        raise ValueError(
            f"algorithm.covariance: a 'kron' message over this model's layers would be {_size(size)} (2 D numbers and each layer's "
            f"[m, m] and [n, n] Kronecker factors) against the bound's {_size(bound)}; use covariance = 'low_rank' or 'diagonal'"
        )


def dense_family(g: Any):
    """The algebra of a structured Gaussian: :mod:`fedbayes.gaussian_block` for a
    :class:`~fedbayes.gaussian_block.BlockGaussian` (the last-layer structure), else
    :mod:`fedbayes.gaussian_full`. The ``full_*`` helpers below take either."""
    return gaussian_block if isinstance(g, BlockGaussian) else gaussian_full


def psd_to_roundoff(precision: jax.Array | BlockPrecision, reference: jax.Array | BlockPrecision, rtol: float = 1e-5) -> jax.Array:
    """Whether a dense precision is positive semi-definite up to float round-off: ``precision + eps I``
    has a Cholesky factor, ``eps = rtol max_i max(|reference_ii|, |precision_ii|)`` (the larger of
    the global's scale, from which sites and cavities are differences, and the matrix's own: a
    first site is a client's GGN, a float32 sum of PSD terms whose smallest eigenvalues come out at
    -1e-8 of its largest), the dense counterpart of :func:`non_negative_to_roundoff`. A zero matrix
    (a flat factor) passes. A last-layer precision: its diagonal block by
    :func:`non_negative_to_roundoff`, its dense block so."""
    if isinstance(precision, BlockPrecision):
        diagonal = non_negative_to_roundoff(precision.diagonal, reference.diagonal, rtol) if jax.tree.leaves(precision.diagonal) else jnp.asarray(True)
        return diagonal & psd_to_roundoff(precision.dense, reference.dense, rtol)
    eps = (rtol * jnp.maximum(jnp.max(jnp.abs(jnp.diagonal(reference))), jnp.max(jnp.abs(jnp.diagonal(precision))))).astype(precision.dtype)
    chol = gaussian_full.cholesky(precision + eps * jnp.eye(precision.shape[0], dtype=precision.dtype))
    return jnp.all(jnp.isfinite(chol)) & jnp.all(jnp.diagonal(chol) > 0)


def full_safe_mean(q: FullGaussian | BlockGaussian, fallback: PyTree) -> PyTree:
    """``mean(q)`` where ``q`` is proper, else ``fallback`` (the dense :func:`safe_mean`)."""
    family = dense_family(q)
    mean, proper = family.mean(q), family.is_proper(q)
    return jax.tree.map(lambda m, f: jnp.where(proper, m, f), mean, fallback)


def full_message_ok(message: GaussianMessage, q: FullGaussian) -> jax.Array:
    """The server's test of a dense message: finite, flagged valid by its client, and ``q_g`` plus
    the message proper (a Cholesky factor exists; :func:`~fedbayes.gaussian_full.is_proper`)."""
    ok = jnp.logical_and(tree.all_finite(message.difference), message.ok)
    family = dense_family(q)
    return jnp.logical_and(ok, family.is_proper(family.product(q, message.difference)))


def full_server_step(optimizer: optax.GradientTransformation, q: FullGaussian, opt_state, total: FullGaussian, family=None):
    """The dense :func:`site_server_step`: ``q_g <- q_g + ServerOpt(sum_k Delta_k)`` (with
    ``optax.sgd(1)`` the exact product of the accepted factors into ``q_g``); a step that leaves
    ``Lambda_g`` not positive definite (a momentum overshoot) keeps the old ``q_g`` whole. Returns
    ``(q, opt_state, guarded)``, ``guarded`` all ``D`` coordinates then, else 0. ``family``: the
    algebra of a structure in a shared basis (:func:`fedbayes.gaussian_kron.in_bases`); by default
    :func:`dense_family`'s."""
    new_q, opt_state = optimizer_step(optimizer, q, opt_state, total)
    proper = (family or dense_family(q)).is_proper(new_q)
    kept = jax.tree.map(lambda a, b: jnp.where(proper, a, b), new_q, q)
    return kept, opt_state, jnp.where(proper, 0, gaussian_full.num_params(q.precision_mean)).astype(jnp.int32)


def full_personal_moments(q: FullGaussian, site: FullGaussian, weight: float | jax.Array) -> tuple[PyTree, PyTree]:
    """``(mean, marginal variances)`` of client ``k``'s ``q_g t_k^w`` with dense factors
    (:func:`personalised`'s product); where that product is not proper, ``q_g``'s moments."""
    family = dense_family(q)
    q_k = family.product(q, family.power(site, weight))
    q_k = jax.tree.map(lambda a, b: jnp.where(family.is_proper(q_k), a, b), q_k, q)
    return family.mean(q_k), family.variance(q_k)
