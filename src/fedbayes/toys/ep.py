"""Expectation propagation on Gaussian clients with exact tilted moments (Guo et al. 2023 (FedEP) Sec. 3.1, 3.3).

The toy setting of Guo et al. 2023 (FedEP), Sec. 3.1 and Fig. 1/4, Table 4; docs/algorithms.md §7.1,
7.11 and 15.1-15.2. Client ``k``'s likelihood is a full-covariance Gaussian
``p_k(theta) = N(theta; mu_k, Sigma_k)`` (natural parameters ``P_k = Sigma_k^{-1}``,
``h_k = P_k mu_k``), the prior is uniform, so the exact global posterior is the product

    p(theta | D) ∝ prod_k p_k(theta) = N(mu*, (sum_k P_k)^{-1}),  mu* = (sum_k P_k)^{-1} sum_k h_k.

The approximating family is the mean-field Gaussian (:class:`fedbayes.gaussian.DiagGaussian`).
One step of synchronous (parallel) EP (Guo et al. 2023 (FedEP) Eq. 3; docs/algorithms.md §7.1) updates every site
``q_k`` from the same global ``q_g = prod_k q_k``:

1. cavity ``q_{-k} = q_g / q_k`` (:func:`fedbayes.gaussian.quotient`);
2. exact tilted distribution ``q_{-k} p_k``: a full Gaussian with precision
   ``diag(Lambda_{-k}) + P_k`` and precision-mean ``eta_{-k} + h_k``;
3. projection onto the family: ``"diag"`` matches moments, keeping the tilted mean and the
   diagonal of the tilted **covariance** (:func:`fedbayes.gaussian.project_full_to_diag`;
   docs/algorithms.md §1.1); ``"iso"`` keeps the tilted mean but replaces the local precision by the identity,
   i.e. the tilted covariance ``(diag(Lambda_{-k}) + 1)^{-1}`` (Guo et al. 2023 (FedEP) Fig. 4 left, the
   scaled-identity method of Sec. 2.2.2 with unit local precision; docs/algorithms.md §15.1 last bullet);
4. new site ``q_k = proj / q_{-k}``, optionally damped: ``q_k^(1 - delta) (proj / q_{-k})^delta``
   (Guo et al. 2023 (FedEP) App. A.1; :func:`fedbayes.gaussian.damp`).

From uniform sites, step 1 of ``"diag"`` is FedPA's product of the clients' diagonal projections
and step 1 of ``"iso"`` is FedAvg's unweighted mean of the client means (docs/algorithms.md §7.11 items 2-3).
Repeated ``"diag"`` steps converge to the exact ``mu*`` (docs/algorithms.md §7.11 item 4). So do ``"iso"``
steps, only more slowly: at a fixed point every site has unit precision (``(Lambda_{-k} + 1) -
Lambda_{-k}``), so ``Lambda_g = K``, ``Lambda_{-k} = K - 1``, and an unchanged site
``eta_k = K m_k - eta_{-k}`` forces every tilted mean ``m_k = eta_g / K = mu_g``. The tilted
stationarity condition ``(K - 1 + P_k) mu_g = eta_g - eta_k + P_k mu_k`` then reads
``P_k (mu_g - mu_k) = mu_g - eta_k``; summed over ``k`` it gives ``sum_k P_k (mu_g - mu_k) =
K mu_g - eta_g = 0``, i.e. ``mu_g = mu*``.

**Damping.** Guo et al. 2023 (FedEP)'s toy (2 clients) is undamped and converges. With ``K >= 3`` clients
undamped parallel EP diverges on many NIW draws (both projections): for ``"iso"`` the mean
update is linear, ``eta_k <- (K M_k - I) sum_{j != k} eta_j + const`` with
``M_k = ((K - 1) I + P_k)^{-1}``, whose eigenvalues approach ``-(K - 1)`` when the client
precisions dominate the unit local precision. Damping maps an eigenvalue ``l`` to
``1 - delta + delta l``, which stays in ``(-1, 1]`` for ``delta <= 2 / K``. The default
(:func:`default_damping`) is therefore ``delta = min(1, 2 / K)``: undamped for 2 clients, as in
the paper, and the fastest safe damping we measured for 3-10 clients (docs/results/toys.md).
Damping does not change step 1 (the global mean is invariant to scaling all sites by ``delta``),
so step 1 is still FedPA / FedAvg.

Run these in float64 (``jax.enable_x64``): the diagonal EP error then reaches ~1e-16.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from fedbayes import gaussian
from fedbayes.gaussian import DiagGaussian

METHODS = ("diag", "iso")

__all__ = [
    "METHODS",
    "FullGaussian",
    "ep_step",
    "exact_global_mean",
    "default_damping",
    "fedavg_mean",
    "global_mean",
    "project",
    "run_ep",
    "tilted",
    "uniform_sites",
]


class FullGaussian(NamedTuple):
    """A full-covariance Gaussian client likelihood ``N(mean, cov)`` over a flat ``[d]`` vector.

    Leaves may carry leading batch axes (``mean [..., d]``, ``cov [..., d, d]``); the toys stack
    clients on axis 0.
    """

    mean: jax.Array
    cov: jax.Array

    @property
    def precision(self) -> jax.Array:
        """``P = Sigma^{-1}``."""
        return jnp.linalg.inv(self.cov)

    @property
    def precision_mean(self) -> jax.Array:
        """``h = Sigma^{-1} mu``."""
        return jnp.linalg.solve(self.cov, self.mean[..., None])[..., 0]


def uniform_sites(num_clients: int, dim: int, dtype=jnp.float64) -> DiagGaussian:
    """``K`` uniform (improper) sites stacked on axis 0: ``eta = Lambda = 0`` (docs/algorithms.md §7.3, paper init)."""
    return gaussian.uniform_like(jnp.zeros((num_clients, dim), dtype))


def _product_of_sites(sites: DiagGaussian) -> DiagGaussian:
    # prod_k q_k: natural parameters add (docs/algorithms.md §1.1); sites are stacked on axis 0.
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), sites)


def global_mean(sites: DiagGaussian) -> jax.Array:
    """The mean of ``q_g = prod_k q_k`` (uniform prior): ``sum_k eta_k / sum_k Lambda_k``."""
    return gaussian.mean(_product_of_sites(sites))


def tilted(cavity: DiagGaussian, client: FullGaussian) -> tuple[jax.Array, jax.Array]:
    """Exact moments of the tilted distribution ``q_{-k}(theta) p_k(theta)`` (Guo et al. 2023 (FedEP) Eq. 3).

    ``Lambda_t = diag(Lambda_{-k}) + P_k``, ``mean_t = Lambda_t^{-1} (eta_{-k} + h_k)``,
    ``cov_t = Lambda_t^{-1}``. The cavity may be improper (zero precision in step 1) as long as
    ``Lambda_t`` is positive definite.

    Returns:
      ``(mean [d], cov [d, d])``.
    """
    precision = jnp.diag(cavity.precision) + client.precision
    cov = jnp.linalg.inv(precision)
    mean = jnp.linalg.solve(precision, cavity.precision_mean + client.precision_mean)
    return mean, cov


def project(mean: jax.Array, cov: jax.Array, cavity: DiagGaussian, method: str) -> DiagGaussian:
    """Projects the tilted ``N(mean, cov)`` onto the mean-field family (the ``proj`` of EP).

    ``"diag"``: moment matching, ``N(mean, diag(cov))`` (docs/algorithms.md §1.1; minimises the KL from the
    tilted distribution). ``"iso"``: ``N(mean, (diag(Lambda_{-k}) + 1)^{-1})``, the tilted mean
    with a unit local precision (Guo et al. 2023 (FedEP) Fig. 4 left; docs/algorithms.md §15.1).
    """
    if method == "diag":
        return gaussian.project_full_to_diag(mean, cov)
    if method == "iso":
        return gaussian.from_moments(mean, 1.0 / (cavity.precision + 1.0))
    raise ValueError(f"EP method must be one of {', '.join(METHODS)}; got {method!r}")


def default_damping(num_clients: int) -> float:
    """``min(1, 2 / K)``: undamped for two clients (Guo et al. 2023 (FedEP)), safe for more (see module doc)."""
    return min(1.0, 2.0 / num_clients)


def ep_step(sites: DiagGaussian, clients: FullGaussian, method: str = "diag", damping=1.0) -> DiagGaussian:
    """One synchronous EP step over all clients (Guo et al. 2023 (FedEP) Eq. 3; damped as in App. A.1).

    ``q_k <- q_k^(1 - delta) [proj(q_{-k} p_k) / q_{-k}]^delta`` with ``q_{-k} = q_g / q_k`` and
    ``q_g = prod_j q_j`` taken before the step for every ``k`` (parallel EP, as in Guo et al. 2023 (FedEP)'s
    ``toy.py``, which uses ``delta = 1``). Improper sites are allowed (EP sites often have
    negative precisions); only the tilted precision must stay positive definite.

    Args:
      sites: the current sites, a ``DiagGaussian`` with leaves ``[K, d]``.
      clients: the client likelihoods, ``mean [K, d]``, ``cov [K, d, d]``.
      method: ``"diag"`` or ``"iso"``.
      damping: ``delta`` in ``(0, 1]``; 1 is undamped.

    Returns:
      The new sites.
    """
    q_global = _product_of_sites(sites)

    def update(site, client):
        cavity = gaussian.quotient(q_global, site)
        mean, cov = tilted(cavity, client)
        return gaussian.quotient(project(mean, cov, cavity, method), cavity)

    return gaussian.damp(sites, jax.vmap(update)(sites, clients), damping)


def run_ep(clients: FullGaussian, num_steps: int, method: str = "diag", damping: float | None = None) -> jax.Array:
    """Runs ``num_steps`` EP steps from uniform sites; returns the global mean after each step.

    Args:
      clients: ``mean [K, d]``, ``cov [K, d, d]``.
      num_steps: number of synchronous steps (static).
      method: ``"diag"`` or ``"iso"``.
      damping: ``delta``; default :func:`default_damping` (1 for two clients).

    Returns:
      ``[num_steps, d]``: row ``t`` is ``mu_g`` after ``t + 1`` steps.
    """
    if method not in METHODS:
        raise ValueError(f"EP method must be one of {', '.join(METHODS)}; got {method!r}")
    num_clients, dim = clients.mean.shape
    damping = default_damping(num_clients) if damping is None else damping
    if not 0.0 < damping <= 1.0:
        raise ValueError(f"EP damping must be in (0, 1]; got {damping}")

    def body(sites, _):
        sites = ep_step(sites, clients, method, damping)
        return sites, global_mean(sites)

    _, means = jax.lax.scan(body, uniform_sites(num_clients, dim, clients.mean.dtype), length=num_steps)
    return means


def exact_global_mean(clients: FullGaussian) -> jax.Array:
    """The product's mean ``(sum_k P_k)^{-1} sum_k P_k mu_k`` (Al-Shedivat et al. 2021 (FedPA) Eq. 3; docs/algorithms.md §6.1, 15.1)."""
    return jnp.linalg.solve(jnp.sum(clients.precision, axis=0), jnp.sum(clients.precision_mean, axis=0))


def fedavg_mean(clients: FullGaussian) -> jax.Array:
    """FedAvg's fixed point on Gaussian clients with equal weights: the mean of the means (docs/algorithms.md §15.1)."""
    return jnp.mean(clients.mean, axis=0)
