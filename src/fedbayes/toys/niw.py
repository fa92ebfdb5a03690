"""Random normal-inverse-Wishart Gaussian clients (Guo et al. 2023 (FedEP) Sec. 3.1, Table 4 and Fig. 4 left).

docs/algorithms.md §15.2. Each trial draws ``K`` clients ``p_k = N(mu_k, Sigma_k)`` (Guo et al. 2023 (FedEP) Sec. 3.1; the
reference ``toy.py``):

    W ~ InvWishart(Psi, nu),   Sigma_k = W / lambda,   mu_k ~ N(mu_0 = 0, Sigma_k),

with ``Psi = sklearn.datasets.make_spd_matrix(dim, random_state=0)``, ``nu = 7`` and
``lambda = 0.2``. (The code uses ``W / lambda`` as both the client covariance and the mean's
covariance; the paper writes ``mu ~ N(mu_0, Sigma / lambda)``.) The inverse Wishart needs
``nu > dim - 1`` and has a finite mean only for ``nu > dim + 1``; for ``dim > 2`` we use
``nu = max(7, dim + 5)`` unless told otherwise (``dim = 2`` keeps the paper's 7).

Each method estimates the exact global mean ``mu* = (sum_k Sigma_k^{-1})^{-1} sum_k
Sigma_k^{-1} mu_k`` (uniform prior); the metric is the Euclidean distance ``||mu_hat - mu*||``,
averaged over trials:

* ``fedavg``: the mean of the means;
* ``fedpa``: one step of diagonal EP from uniform sites = the product of the clients' diagonal
  projections (docs/algorithms.md §7.11 item 2);
* ``fedep_diag``: ``steps`` synchronous diagonal EP steps with exact tilted moments
  (:mod:`fedbayes.toys.ep`; undamped for 2 clients, damped ``2 / K`` for more);
* ``fedep_iso``: the same with the scaled-identity projection (Guo et al. 2023 (FedEP) Fig. 4 left).

Guo et al. 2023 (FedEP) Table 4 reports FedAvg 0.54 ± 0.47, FedPA 0.26 ± 0.26, FedEP 1.1e-7 ± 9.8e-8 (float32
round-off). Randomness comes from ``numpy.random.RandomState(seed)`` passed to scipy, which
draws exactly what the reference code draws after ``np.random.seed(seed)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.toys.ep import FullGaussian, default_damping, fedavg_mean, run_ep

METHODS = ("fedavg", "fedpa", "fedep_diag", "fedep_iso")

__all__ = ["METHODS", "NIWResult", "default_nu", "sample_clients", "run_niw"]


def default_nu(dim: int) -> float:
    """``nu = 7`` (Guo et al. 2023 (FedEP)) where it gives a finite-mean inverse Wishart, else ``dim + 5``."""
    return float(max(7, dim + 5)) if dim > 2 else 7.0


def sample_clients(rng: np.random.RandomState, num_clients: int, dim: int, nu: float, scale: np.ndarray, lam: float = 0.2) -> FullGaussian:
    """Draws ``num_clients`` NIW clients, in the reference code's order (``Sigma`` then ``mu``)."""
    from scipy.stats import invwishart, multivariate_normal

    means, covs = [], []
    for _ in range(num_clients):
        cov = np.atleast_2d(invwishart.rvs(df=nu, scale=scale, random_state=rng)) / lam
        means.append(np.atleast_1d(multivariate_normal.rvs(cov=cov, random_state=rng)))
        covs.append(cov)
    return FullGaussian(np.stack(means).astype(np.float64), np.stack(covs).astype(np.float64))


@dataclass
class NIWResult:
    """Distances to the exact global mean.

    Attributes:
      distances: method -> ``[trials]`` final distances.
      curves: method -> ``[steps]`` mean distance after each EP step (``fedep_diag``,
        ``fedep_iso``); step 1 of them equals ``fedpa`` and ``fedavg``.
      settings: what was run.
    """

    distances: dict[str, np.ndarray]
    curves: dict[str, np.ndarray]
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, float]]:
        """``method -> {"mean", "std", "max"}`` over trials (std with ``ddof=0``, as numpy)."""
        return {m: {"mean": float(np.mean(d)), "std": float(np.std(d)), "max": float(np.max(d))} for m, d in self.distances.items()}


def run_niw(
    *,
    trials: int = 200,
    num_clients: int = 2,
    dim: int = 2,
    steps: int = 100,
    iso_steps: int | None = None,
    damping: float | None = None,
    seed: int = 0,
    nu: float | None = None,
    lam: float = 0.2,
    dtype=jnp.float64,
) -> NIWResult:
    """Runs the NIW toy: ``trials`` random problems, four estimators of the global mean.

    Args:
      trials: number of random problems (Guo et al. 2023 (FedEP): 200).
      num_clients: clients per problem (Guo et al. 2023 (FedEP): 2).
      dim: dimension (Guo et al. 2023 (FedEP): 2).
      steps: diagonal EP steps (Guo et al. 2023 (FedEP) ``num_steps = 100``).
      iso_steps: scaled-identity EP steps (default: ``steps``).
      damping: EP damping ``delta`` (default ``min(1, 2 / K)``, :func:`fedbayes.toys.ep.default_damping`).
      seed: seeds the ``RandomState`` that draws the problems.
      nu: inverse-Wishart degrees of freedom (default :func:`default_nu`).
      lam: the NIW scale ``lambda`` (Guo et al. 2023 (FedEP): 0.2).
      dtype: ``jnp.float64`` (default; runs under ``jax.enable_x64``) or ``jnp.float32``.
    """
    from sklearn.datasets import make_spd_matrix

    if trials < 1 or num_clients < 1 or dim < 1 or steps < 1:
        raise ValueError("trials, clients, dim and steps must be >= 1")
    nu = default_nu(dim) if nu is None else float(nu)
    if nu <= dim - 1:
        raise ValueError(f"the inverse Wishart needs nu > dim - 1 = {dim - 1}; got nu = {nu}")
    iso_steps = steps if iso_steps is None else iso_steps
    damping = default_damping(num_clients) if damping is None else float(damping)
    rng = np.random.RandomState(seed)
    scale = make_spd_matrix(dim, random_state=0)
    problems = [sample_clients(rng, num_clients, dim, nu, scale, lam) for _ in range(trials)]
    means = np.stack([p.mean for p in problems])
    covs = np.stack([p.cov for p in problems])
    precisions = np.linalg.inv(covs)
    exact = np.linalg.solve(precisions.sum(1), np.einsum("tkij,tkj->ti", precisions, means)[..., None])[..., 0]  # float64

    with jax.enable_x64(dtype == jnp.float64):
        clients = FullGaussian(jnp.asarray(means, dtype), jnp.asarray(covs, dtype))
        # One program per method, each finished before the next starts: XLA:CPU can deadlock when
        # two batched LAPACK calls run at once on a 2-thread pool (see toys/local.py).
        diag = np.asarray(jax.jit(jax.vmap(lambda c: run_ep(c, steps, "diag", damping)))(clients))
        iso = np.asarray(jax.jit(jax.vmap(lambda c: run_ep(c, iso_steps, "iso", damping)))(clients))
        avg = jax.vmap(fedavg_mean)(clients)

        def dist(x):
            return np.linalg.norm(np.asarray(x, np.float64) - exact[:, None, :], axis=-1)

        diag_d, iso_d = dist(diag), dist(iso)
        distances = {
            "fedavg": dist(avg[:, None, :])[:, 0],
            "fedpa": diag_d[:, 0],
            "fedep_diag": diag_d[:, -1],
            "fedep_iso": iso_d[:, -1],
        }
    return NIWResult(
        distances=distances,
        curves={"fedep_diag": diag_d.mean(axis=0), "fedep_iso": iso_d.mean(axis=0)},
        settings={
            "trials": trials,
            "clients": num_clients,
            "dim": dim,
            "steps": steps,
            "iso_steps": iso_steps,
            "damping": damping,
            "seed": seed,
            "nu": nu,
            "lambda": lam,
            "dtype": jnp.dtype(dtype).name,
        },
    )
