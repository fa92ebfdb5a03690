"""The aggregation rules of federated variational Bayesian neural networks (Ozer et al. 2022,
"How to Combine Variational Bayesian Networks in Federated Learning"; docs/algorithms.md §12.3), the
server side of :mod:`fedbayes.algorithms.vbnn`.

The rules combine the clients' variational parameters (means, log-variances and deterministic
weights, :mod:`fedbayes.models.variational`) elementwise for every variational weight;
deterministic leaves (biases, convolutions) always by the weighted mean, exactly as FedAvg's
:func:`fedbayes.tree.weighted_mean`. The weights ``beta_k`` are the round's client weights
normalised to sum 1: uniform gives the paper's FVBA, ``n_k``-proportional its FVBWA (the
simulator's ``weighting``). :func:`variational_rule` is a rule as an aggregator.

**Two variants.** ``variant = "bayes"`` (the default) is what the rules must be when each client
optimises its share of the federation's ELBO (:mod:`fedbayes.algorithms.vbnn`: the prior counted
once). ``variant = "paper"`` is the paper's Eqs. 4-8 with the published code's clamp.

*What a rule must do* (``bayes``). Client ``k`` minimises ``F_k(q) = -E_q log p(D_k | theta) +
(n_k / N) KL(q || p)``, so ``sum_k F_k`` is the negative ELBO of all the data with the prior once.
Per weight, with a Gaussian likelihood of precision ``h_k`` and mode ``m_k`` on client ``k``, the
client's optimum is ``q_k = N(mu_k, 1/lambda_k)`` with ``lambda_k = (N/n_k) h_k + 1/s^2`` and
``lambda_k mu_k = (N/n_k) h_k m_k`` (prior ``N(0, s^2)``): the posterior of its data replicated
``N/n_k`` times under the whole prior. The posterior of the union is

    p(theta | D) ∝ p(theta) prod_k p(D_k | theta) = prod_k [p(theta) p(D_k | theta)^{N/n_k}]^{n_k/N},

the ``beta``-weighted geometric mean of the clients' posteriors (``beta_k = n_k / N``): natural
parameters averaged, ``lambda = sum_k beta_k lambda_k = sum_k h_k + 1/s^2`` and
``lambda mu = sum_k h_k m_k``, exact. Every rule must return ``q`` when all clients return ``q``
(they agree with the broadcast: a fixed point, round after round); the rules differ in how they
treat disagreement. With ``alpha = log sigma^2``:

* ``cf`` (conflation done right): ``lambda = sum beta_k e^{-alpha_k}``,
  ``mu = sum beta_k e^{-alpha_k} mu_k / lambda``, ``alpha = -log lambda``: the product of the
  clients' likelihood contributions above (``prod_k q_k^{beta_k}``, normalised). The paper's CF
  multiplies the variance by ``beta_max``: with ``beta = 1/K`` it is the untempered product of K
  posteriors that each hold the whole prior and (here) the whole data's weight, ``K`` times too
  narrow, and again every round;
* ``aalv``: ``mu = sum beta mu_k``, ``alpha = sum beta alpha_k``: FedAvg of the variational
  parameters ``(mu, log sigma^2)``, i.e. local SGD on ``sum_k F_k``; the geometric mean of the
  variances;
* ``gaa``: ``mu = sum beta mu_k``, ``sigma = sum beta sigma_k``: the sum rule of Gaussians
  ``sum_k beta_k X_k`` (the paper's derivation) with the clients' draws coupled,
  ``X_k = mu_k + sigma_k eps`` with one ``eps``, instead of independent: the clients' posteriors
  describe the same weight, not K independent measurements to be averaged (independence gives
  the paper's ``sum beta^2 sigma_k^2``, ``1/K`` of the clients' variance when they agree). It is the
  Wasserstein-2 barycentre of the clients' Gaussians;
* ``eaa``: ``mu = sum beta mu_k``, ``sigma^2 = sum beta sigma_k^2``: FedAvg of ``(mu, sigma^2)``;
* ``merging``: the moment-matched mixture, ``sigma^2 = sum beta [(mu - mu_k)^2 + sigma_k^2]``
  (Ozer et al. 2022's code, not its paper): EAA plus the clients' disagreement on the mean;
* ``ppa``: a pooled population (below), the mixture by Monte Carlo.

With disagreeing variances ``sigma^2_CF <= sigma^2_AALV <= sigma^2_GAA <= sigma^2_EAA <=
sigma^2_merging`` (harmonic <= geometric <= squared arithmetic mean of ``sigma`` <= arithmetic
mean of ``sigma^2``), all equal when the clients agree. The log-variances are clipped to the
models' guard [-30, 20] only where they are exponentiated.

``variant = "paper"`` (Eqs. 4-8, ``alpha`` clamped to [-8, 8] wherever it is exponentiated, as the
published code):

* ``eaa``: ``mu = sum beta mu_k``, ``sigma^2 = sum beta sigma_k^2`` (log-sum-exp in log space);
* ``gaa``: ``mu = sum beta mu_k``, ``sigma^2 = sum beta^2 sigma_k^2``;
* ``aalv``: ``mu = sum beta mu_k``, ``alpha = sum beta alpha_k`` on the stored (unclamped)
  ``alpha``, as the published code (``geometric`` averages every parameter);
* ``cf`` in precision form: ``lambda = sum beta e^{-alpha_k}``,
  ``mu = sum beta e^{-alpha_k} mu_k / lambda``, ``alpha = log beta_max - log lambda``;
* ``merging`` and ``ppa`` as above, on clamped ``alpha``.

``ppa`` (both variants): pooled population of ``c_k = max(1, floor(beta_k N))`` draws from each
client with ``beta_k > 0`` (``N = population``), mean and variance (the paper's ``1/N`` estimator;
the code's ``torch.std`` is ``1/(N-1)``) of the pool. The draws are not materialised: per client
and weight, the sample mean ``mu_k + sigma_k z / sqrt(c_k)`` and the within-client sum of squares
``sigma_k^2 chi^2_{c_k - 1}`` are drawn from their exact distributions (independent for Gaussian
samples), so the pooled moments have exactly the distribution of the explicit pool at ``O(K d)``
cost and with traced ``c_k``.

A client with weight 0 (padded, rejected) contributes nothing, even when its values are not
finite.

``accumulation = "reference_code"`` (``paper`` variant only) reproduces how the published code
(BFL-P, ``utils/FL/update.py``) sums the variances of ``eaa``, ``gaa`` and ``merging``: client by
client, with the running partial sum's log clamped to [-8, 8] before each addition,

    s_1 = log(c_1 e^{clamp alpha_1}),   s_k = log(e^{clamp s_{k-1}} + c_k e^{clamp alpha_k}),

(``c_k = beta_k``, ``beta_k^2`` or ``beta_k ((mu - mu_k)^2 + ...)``). Whenever the first terms lie
below ``e^-8`` the clamp lifts the partial sum to the floor, so the result is at least
``e^-8 + sum_{k>=2} c_k sigma_k^2`` rather than the paper's ``sum_k c_k sigma_k^2`` (Eqs. 4 and 5):
GAA stays at the floor instead of shrinking by ``sum beta^2``, and EAA inflates round after
round. The paper's Table 4 (std norms CF < AALV < GAA << EAA, PPA) comes from this code; the
default ``"exact"`` is the paper's equations (docs/results/vbnn.md compares both). The order of
the clients matters there (the cohort's order); absent clients are skipped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedbayes import tree
from fedbayes.aggregators import Aggregator, Rule, weighted
from fedbayes.models.variational import LOGVAR_MAX, LOGVAR_MIN, PAPER_LOGVAR_MAX, PAPER_LOGVAR_MIN, merge_variational, split_variational

__all__ = ["ACCUMULATIONS", "RULES", "VARIANTS", "aggregate", "aggregate_params", "variational_rule"]

RULES: tuple[str, ...] = ("eaa", "gaa", "aalv", "ppa", "cf", "merging")
VARIANTS: tuple[str, ...] = ("bayes", "paper")
_TINY_VAR = 1e-30  # floor of a pooled variance before its log (PPA with all draws equal)


def _clamp(alpha: jax.Array) -> jax.Array:
    """The published code's clamp."""
    return jnp.clip(alpha, PAPER_LOGVAR_MIN, PAPER_LOGVAR_MAX)


def _guard(alpha: jax.Array) -> jax.Array:
    """The models' underflow/overflow guard."""
    return jnp.clip(alpha, LOGVAR_MIN, LOGVAR_MAX)


def _expand(beta: jax.Array, leaf: jax.Array) -> jax.Array:
    return beta.reshape((-1,) + (1,) * (leaf.ndim - 1)).astype(leaf.dtype)


ACCUMULATIONS = ("exact", "reference_code")


def _reference_code_log_sum(alpha: jax.Array, coef: jax.Array, present: jax.Array) -> jax.Array:
    """``log sum_k coef_k e^{alpha_k}`` accumulated as Ozer et al. 2022's code does (module
    docstring): the running log-sum clamped to [-8, 8] before each addition after the first;
    clients with ``present`` false are skipped. ``alpha`` is already clamped."""

    def step(carry, inputs):
        s, started = carry
        a, c, p = inputs
        first = jnp.log(c) + a
        later = jnp.log(jnp.exp(_clamp(s)) + c * jnp.exp(a))
        new = jnp.where(p, jnp.where(started, later, first), s)
        return (new, started | p), None

    init = (jnp.zeros(alpha.shape[1:], alpha.dtype), jnp.zeros(alpha.shape[1:], bool))
    (s, _), _ = jax.lax.scan(step, init, (alpha, jnp.broadcast_to(coef, alpha.shape), jnp.broadcast_to(present, alpha.shape)))
    return s


def _bayes_leaf_rule(rule: str, mu: jax.Array, alpha: jax.Array, b: jax.Array, present: jax.Array):
    """The ``bayes`` variant of ``eaa``, ``gaa``, ``aalv``, ``cf``, ``merging`` (module docstring) on
    one leaf; absent clients are already zeroed, ``b`` is 0 for them."""
    mean = jnp.sum(b * mu, axis=0)
    bb = jnp.broadcast_to(b, alpha.shape)
    if rule == "eaa":
        return mean, jax.nn.logsumexp(alpha, axis=0, b=bb)
    if rule == "gaa":  # log (sum beta sigma_k)^2
        return mean, 2.0 * jax.nn.logsumexp(0.5 * alpha, axis=0, b=bb)
    if rule == "aalv":
        return mean, jnp.sum(b * alpha, axis=0)
    if rule == "merging":
        return mean, jnp.log(jnp.sum(b * (jnp.square(mean[None] - mu) + jnp.exp(alpha)), axis=0))
    # cf: log lambda = logsumexp(-alpha, b=beta); each client's share beta_k e^{-alpha_k} / lambda
    log_lam = jax.nn.logsumexp(-alpha, axis=0, b=bb)
    share = jnp.where(present, b * jnp.exp(-alpha - log_lam[None]), jnp.zeros((), mu.dtype))
    return jnp.sum(share * mu, axis=0), -log_lam


def _leaf_rule(
    rule: str, mu: jax.Array, alpha: jax.Array, beta: jax.Array, key: jax.Array | None, population: int, accumulation: str = "exact", variant: str = "bayes"
):
    """One rule on one leaf ``mu, alpha [K, ...]`` with normalised weights ``beta [K]``."""
    b = _expand(beta, mu)
    present = b > 0
    # Absent clients must not leak NaN/inf into any sum (0 * nan = nan).
    mu = jnp.where(present, mu, jnp.zeros((), mu.dtype))
    raw_alpha = jnp.where(present, alpha, jnp.zeros((), alpha.dtype))
    if variant == "bayes":
        alpha = _guard(raw_alpha)
        if rule != "ppa":
            return _bayes_leaf_rule(rule, mu, alpha, b, present)
    else:
        alpha = _clamp(raw_alpha)
    mean = jnp.sum(b * mu, axis=0)
    if accumulation == "reference_code" and rule in ("eaa", "gaa", "merging"):
        if rule == "merging":
            # the code sums beta_k ((mu_g - mu_k)^2 + sigma_k^2) with the same running clamp
            extra = jnp.square(mean[None] - mu)
            alpha_m = jnp.log(extra + jnp.exp(alpha))
            return mean, _reference_code_log_sum(alpha_m, b, present)
        return mean, _reference_code_log_sum(alpha, b if rule == "eaa" else jnp.square(b), present)
    if rule == "eaa":
        return mean, jax.nn.logsumexp(alpha, axis=0, b=jnp.broadcast_to(b, alpha.shape))
    if rule == "gaa":
        return mean, jax.nn.logsumexp(alpha, axis=0, b=jnp.broadcast_to(jnp.square(b), alpha.shape))
    if rule == "aalv":
        return mean, jnp.sum(b * raw_alpha, axis=0)
    if rule == "merging":
        var = jnp.sum(b * (jnp.square(mean[None] - mu) + jnp.exp(alpha)), axis=0)
        return mean, jnp.log(var)
    if rule == "cf":
        precision = b * jnp.exp(-alpha)  # at most e^8 per client: no underflow, no overflow
        lam = jnp.sum(precision, axis=0)
        cf_mean = jnp.sum(precision * mu, axis=0) / lam
        return cf_mean, jnp.log(jnp.max(beta)).astype(alpha.dtype) - jnp.log(lam)
    if rule == "ppa":
        counts = jnp.where(beta > 0, jnp.maximum(1.0, jnp.floor(beta * population)), 0.0).astype(mu.dtype)
        c = _expand(counts, mu)
        sigma2 = jnp.exp(alpha)
        k_mean, k_ss = jax.random.split(key)
        z = jax.random.normal(k_mean, mu.shape, mu.dtype)
        sample_mean = mu + jnp.sqrt(sigma2 / jnp.maximum(c, 1.0)) * z
        dof = jnp.broadcast_to(c - 1.0, mu.shape)
        chi2 = 2.0 * jax.random.gamma(k_ss, jnp.maximum(dof, 1.0) / 2.0, mu.shape, mu.dtype)
        within = jnp.where(dof > 0, sigma2 * chi2, jnp.zeros((), mu.dtype))
        total = jnp.sum(counts)
        pooled_mean = jnp.sum(c * sample_mean, axis=0) / total
        between = c * jnp.square(sample_mean - pooled_mean[None])
        pooled_var = jnp.sum(jnp.where(c > 0, within + between, jnp.zeros((), mu.dtype)), axis=0) / total
        return pooled_mean, jnp.log(jnp.maximum(pooled_var, _TINY_VAR))
    raise ValueError(f"aggregation must be one of {', '.join(RULES)}, got {rule!r}")


def aggregate(
    rule: str,
    mean: Any,
    log_var: Any,
    weights: jax.Array,
    *,
    key: jax.Array | None = None,
    population: int = 1000,
    accumulation: str = "exact",
    variant: str = "bayes",
) -> tuple[Any, Any]:
    """Aggregates clients' mean-field Gaussians by one of the rules (module docstring).

    Args:
        rule: one of :data:`RULES`.
        mean: clients' means, an array or pytree whose leaves have a leading client axis ``[K, ...]``.
        log_var: clients' log-variances, the same structure and shapes.
        weights: ``[K]`` non-negative client weights (normalised here to ``beta``; 0 = absent).
        key: PRNG key, needed by ``"ppa"`` only.
        population: ``N`` of ``"ppa"``, at least 1.
        accumulation: ``"exact"`` (the paper's equations) or ``"reference_code"`` (the published
            code's running clamp for ``eaa``, ``gaa`` and ``merging``; ``paper`` variant only).
        variant: ``"bayes"`` (rules with the clients' agreement as their fixed point) or
            ``"paper"`` (Eqs. 4-8 with the published clamp); module docstring.

    Returns:
        ``(mean, log_var)`` with the client axis reduced, the inputs' structure.

    Raises:
        ValueError: for an unknown rule, accumulation or variant, ``reference_code`` outside the
            ``paper`` variant, mismatched structures or shapes, ``ppa`` without a key, or a
            population below 1.
    """
    _check(rule, accumulation, variant, population)
    if rule == "ppa" and key is None:
        raise ValueError("aggregation 'ppa' needs a key")
    weights = jnp.asarray(weights)
    if weights.ndim != 1:
        raise ValueError(f"weights must be a vector [K], got shape {weights.shape}")
    m_leaves, treedef = jax.tree.flatten(mean)
    a_leaves, a_treedef = jax.tree.flatten(log_var)
    if treedef != a_treedef:
        raise ValueError(f"mean and log_var must have the same structure, got {treedef} and {a_treedef}")
    for m, a in zip(m_leaves, a_leaves):
        if jnp.shape(m) != jnp.shape(a) or jnp.ndim(m) == 0 or jnp.shape(m)[0] != weights.shape[0]:
            raise ValueError(
                f"mean and log_var leaves need equal shapes with a leading client axis of {weights.shape[0]}, got {jnp.shape(m)} and {jnp.shape(a)}"
            )
    total = jnp.sum(weights)
    beta = weights / jnp.where(total > 0, total, 1.0)
    out_m, out_a = [], []
    for i, (m, a) in enumerate(zip(m_leaves, a_leaves)):
        leaf_key = None if key is None else jax.random.fold_in(key, i)
        mu, alpha = _leaf_rule(rule, jnp.asarray(m), jnp.asarray(a), beta.astype(jnp.result_type(m)), leaf_key, int(population), accumulation, variant)
        out_m.append(mu)
        out_a.append(alpha)
    return jax.tree.unflatten(treedef, out_m), jax.tree.unflatten(treedef, out_a)


def aggregate_params(
    rule: str,
    stacked_params: Any,
    weights: jax.Array,
    key: jax.Array | None = None,
    population: int = 1000,
    accumulation: str = "exact",
    variant: str = "bayes",
) -> Any:
    """Aggregates stacked variational parameter trees ``[K, ...]``: variational weights by
    ``rule`` (:func:`aggregate`), deterministic leaves by :func:`fedbayes.tree.weighted_mean`.

    When every weight is 0 (all clients rejected) the result is not meaningful; callers keep the
    previous parameters (:func:`vbnn` does).
    """
    means, log_vars, deterministic = split_variational(stacked_params)
    agg_m, agg_a = aggregate(rule, means, log_vars, weights, key=key, population=population, accumulation=accumulation, variant=variant) if means else ({}, {})
    return merge_variational(agg_m, agg_a, tree.weighted_mean(deterministic, weights))


def _check(rule: str, accumulation: str, variant: str, population: int) -> None:
    if rule not in RULES:
        raise ValueError(f"aggregation must be one of {', '.join(RULES)}, got {rule!r}")
    if accumulation not in ACCUMULATIONS:
        raise ValueError(f"accumulation must be one of {', '.join(ACCUMULATIONS)}, got {accumulation!r}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if accumulation != "exact" and variant != "paper":
        raise ValueError(f"accumulation: {accumulation!r} is the published code's sum, for variant 'paper' only; got variant {variant!r}")
    if int(population) < 1:
        raise ValueError(f"population must be at least 1, got {population}")


def variational_rule(rule: str, population: int = 1000, accumulation: str = "exact", variant: str = "bayes") -> Aggregator:
    """The rule as an :class:`~fedbayes.aggregators.Aggregator`: its ``mean`` is the combined
    parameter tree (:func:`aggregate_params`; PPA samples with the round's server key), ``total``
    and ``count`` as the default rule's (:data:`fedbayes.aggregators.weighted`).

    Raises:
        ValueError: for an unknown rule, accumulation or variant, ``reference_code`` outside the
            ``paper`` variant, or a population below 1 (at construction).
    """
    _check(rule, accumulation, variant, population)

    def combine(key, messages, weights):
        return weighted(key, messages, weights)._replace(mean=aggregate_params(rule, messages, weights, key, population, accumulation, variant))

    return Rule(combine)
