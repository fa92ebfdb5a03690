"""Bias and variance of FedAvg and FedPA client deltas on least squares (Al-Shedivat et al. 2021 (FedPA) App. A.1, Fig. 3).

docs/algorithms.md §15.4. Problems are ``sklearn.datasets.make_regression`` with ``d`` features, 500 points,
``min(10, d)`` informative features, no noise and no bias, and a column of ones appended (the
FedPA code's ``create_random_least_squares``), so the dimension is ``D = d + 1``. The client
objective is ``f(theta) = 1/2 mean((X theta - y)^2) = 1/2 (theta - mu)^T A (theta - mu) + c`` with
``A = X^T X / n`` and ``mu = A^{-1} X^T y / n``; its exact delta is ``g* = A (theta - mu)``
(``compute_exact_delta``).

For every problem and each of ``inits`` starting points ``theta ~ mu + init_scale N(0, I)``, the
delta estimators are repeated ``reps`` times with fresh gradient noise, and

    bias = || E[g_hat] - g* ||_2,      variance = || Cov(g_hat) ||_F

(sample mean and covariance over repetitions) are averaged over problems and starting points.
The bias is corrected for the sampling error of the mean over ``reps`` repetitions (see
:func:`_bias_variance`; ``bias_raw`` is the uncorrected figure, which has a floor of about
``sqrt(tr Cov / reps)``). For FedAvg the expected delta is known in closed form, and
``bias_exact`` reports ``||(I - (I - lr A)^K) / (lr K) (theta - mu) - g*||``.
The estimators (:mod:`fedbayes.toys.local`, same noisy oracle ``A (theta - mu) + N(0, tau A)``):

* ``fedavg``: after ``K`` local SGD steps, the delta read as a gradient estimate,
  ``(theta - theta_K) / (lr K)`` (the mean gradient along the local path: FedAvg's delta is
  ``lr K`` times it, and with ``K = 1`` it is unbiased). Its expectation is
  ``(I - (I - lr A)^K) / (lr K) (theta - mu)``, whose distance from ``g*`` grows with ``K``
  (Al-Shedivat et al. 2021 (FedPA) Fig. 3a: bias grows, variance falls).
* ``fedpa``: ``l`` IASG samples of ``steps_per_sample`` steps each after ``burn_in`` steps (not
  counted, as in Fig. 3b), shrinkage ``rho`` fixed per dimension (0.01, 0.005, 0.001 for
  ``d`` = 10, 100, 1000, Al-Shedivat et al. 2021 (FedPA) Fig. 3b); ``Sigma_l^{-1} (theta - mean)`` estimates ``g*``
  without rescaling. Bias falls with ``l``; variance first rises (``rho_l`` shrinks) then falls.
* ``fedpa_rho``: the same with ``l`` fixed (the largest ``l``) and ``rho`` swept (Fig. 3c).

Defaults are smaller than the paper's (10 problems x 10 starting points) so a run takes about a
minute on two CPU cores; ``problems``, ``inits`` and ``reps`` raise them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.toys import local

PAPER_RHO = {10: 0.01, 100: 0.005, 1000: 0.001}

__all__ = ["LeastSquaresResult", "PAPER_RHO", "make_problems", "run_least_squares"]


def make_problems(dim: int, num_problems: int, seed: int, num_examples: int = 500) -> list[tuple[np.ndarray, np.ndarray]]:
    """``num_problems`` least-squares problems ``(A [D, D], mu [D])``, ``D = dim + 1`` (float64)."""
    from sklearn.datasets import make_regression

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_problems):
        x, y = make_regression(
            n_samples=num_examples,
            n_features=dim,
            n_informative=min(10, dim),
            bias=0.0,
            noise=0.0,
            random_state=int(rng.integers(2**31 - 1)),
        )
        x = np.hstack([x, np.ones((num_examples, 1))])
        hessian = x.T @ x / num_examples
        out.append((hessian, np.linalg.lstsq(x, y, rcond=None)[0]))
    return out


def _bias_variance(deltas: np.ndarray, exact: np.ndarray) -> tuple[float, float, float]:
    """``deltas [P, I, R, D]``, ``exact [P, I, D]`` -> mean ``(bias, raw bias, variance)`` over ``P x I``.

    The raw bias ``||mean_R g_hat - g*||`` includes the sampling error of the mean, whose
    expected square is ``tr(Cov) / R``; ``bias`` removes it,
    ``sqrt(max(||mean - g*||^2 - tr(C_hat) / R, 0))`` (``C_hat`` unbiased, so the squared bias
    estimate is unbiased).
    """
    num = deltas.shape[2]
    err2 = np.sum(np.square(deltas.mean(axis=2) - exact), axis=-1)
    centred = deltas - deltas.mean(axis=2, keepdims=True)
    cov = np.einsum("pird,pire->pide", centred, centred) / (num - 1)
    trace = np.trace(cov, axis1=-2, axis2=-1)
    bias = np.sqrt(np.maximum(err2 - trace / num, 0.0))
    return float(bias.mean()), float(np.sqrt(err2).mean()), float(np.linalg.norm(cov, axis=(-2, -1)).mean())


@dataclass
class LeastSquaresResult:
    """Per dimension: ``{"fedavg": {...}, "fedpa": {...}, "fedpa_rho": {...}}`` of lists."""

    by_dim: dict[int, dict[str, dict[str, list]]]
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict[str, dict[str, dict[str, list]]]:
        """``method -> str(dim) -> figures`` (the ``--json`` layout)."""
        out: dict[str, dict] = {}
        for dim, methods in self.by_dim.items():
            for name, figures in methods.items():
                out.setdefault(name, {})[str(dim)] = figures
        return out


def run_least_squares(
    *,
    dims: tuple[int, ...] = (10, 100),
    seed: int = 0,
    problems: int = 3,
    inits: int = 3,
    reps: int = 10,
    fedavg_reps: int | None = None,
    num_examples: int = 500,
    init_scale: float = 10.0,
    lr: float | None = None,
    fedavg_steps: tuple[int, ...] = (1, 2, 5, 10, 20, 50, 100, 200),
    fedpa_samples: tuple[int, ...] = (2, 5, 10, 20, 50, 100),
    rho: float | None = None,
    rhos: tuple[float, ...] = (1e-4, 1e-3, 1e-2, 1e-1, 1.0),
    sampler: str = "iasg",
    steps_per_sample: int = 100,
    burn_in: int = 200,
    temperature: float = 1.0,
) -> LeastSquaresResult:
    """Runs the least-squares bias/variance study.

    Args:
      dims: feature counts ``d`` (Al-Shedivat et al. 2021 (FedPA): 10, 100, 1000).
      seed: seeds the problems, starting points and noise.
      problems: random problems per dimension (Al-Shedivat et al. 2021 (FedPA): 10).
      inits: starting points per problem (Al-Shedivat et al. 2021 (FedPA): 10).
      reps: repetitions of each FedPA estimator (for the mean and covariance).
      fedavg_reps: repetitions of each FedAvg estimator (default ``10 * reps``: its chains are
        short, and its variance at few steps is large).
      num_examples: points per problem (Al-Shedivat et al. 2021 (FedPA): 500).
      init_scale: ``theta = mu + init_scale N(0, I)``. The default 10 puts the starting points
        far enough from ``mu`` that the biases (proportional to ``theta - mu``) dominate the
        sampling noise (which is not); Al-Shedivat et al. 2021 (FedPA) starts from random parameters.
      lr: client SGD / IASG learning rate; default ``0.5 / lambda_max(A)`` per problem.
      fedavg_steps: FedAvg local step counts.
      fedpa_samples: FedPA sample counts ``l`` (steps ``= l * steps_per_sample``).
      rho: FedPA shrinkage for the sample sweep (default :data:`PAPER_RHO`, else 0.01).
      rhos: shrinkage values for the ``fedpa_rho`` sweep (at ``l = max(fedpa_samples)``).
      sampler: ``"iasg"`` or ``"exact"``.
      steps_per_sample: IASG steps per sample ``K`` (also sets the noise ``tau``).
      burn_in: IASG burn-in steps (not counted in ``steps``).
      temperature: gradient-noise temperature (``tau = temperature * steps_per_sample``).
    """
    if sampler not in local.SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(local.SAMPLERS)}; got {sampler!r}")
    if reps < 2 or problems < 1 or inits < 1:
        raise ValueError("need reps >= 2, problems >= 1 and inits >= 1")
    fedavg_steps = tuple(sorted(set(fedavg_steps)))
    fedpa_samples = tuple(sorted(set(fedpa_samples)))
    if fedavg_steps[0] < 1 or fedpa_samples[0] < 1:
        raise ValueError("step and sample counts must be >= 1")
    noise = temperature * steps_per_sample
    fedavg_reps = 10 * reps if fedavg_reps is None else fedavg_reps
    if fedavg_reps < 2:
        raise ValueError("need fedavg_reps >= 2")
    max_steps, max_samples = fedavg_steps[-1], fedpa_samples[-1]
    by_dim = {}
    with jax.enable_x64(True):

        def chains(key, q, theta0, lr):
            """FedAvg trajectories ``[I, R_avg, K_max, D]`` and FedPA samples ``[I, R, l_max, D]``."""
            k_avg, k_pa = jax.random.split(key)

            def trajectory(k, theta):
                return local.sgd_trajectory(k, q, theta, lr=lr, num_steps=max_steps, noise_scale=noise)

            def draw(k, theta):
                if sampler == "exact":
                    return local.exact_samples(k, q, max_samples)
                return local.iasg_samples(
                    k,
                    q,
                    theta,
                    lr=lr,
                    burn_in_steps=burn_in,
                    steps_per_sample=steps_per_sample,
                    num_samples=max_samples,
                    noise_scale=noise,
                )

            num_inits = theta0.shape[0]
            paths = jax.vmap(jax.vmap(trajectory, in_axes=(0, None)))(jax.random.split(k_avg, (num_inits, fedavg_reps)), theta0)
            samples = jax.vmap(jax.vmap(draw, in_axes=(0, None)))(jax.random.split(k_pa, (num_inits, reps)), theta0)
            return paths, samples

        @jax.jit
        def run_chains(key, q, theta0, lr):
            paths, samples = chains(key, q, theta0, lr)
            return paths[:, :, np.asarray(fedavg_steps) - 1], samples  # only the FedAvg iterates used

        # [I, R, l, D] samples, [I, D] theta -> [I, R, D] deltas. One jit per sample count and one
        # for the rho sweep (vmapped): a single batched solve per program, each waited for (see
        # toys/local.py on the XLA:CPU deadlock).
        fedpa_deltas = jax.jit(jax.vmap(jax.vmap(local.fedpa_delta, in_axes=(0, None, None)), in_axes=(0, 0, None)))
        rho_deltas = jax.jit(jax.vmap(fedpa_deltas, in_axes=(None, None, 0)))

        for d_idx, dim in enumerate(dims):
            dim_rho = PAPER_RHO.get(dim, 0.01) if rho is None else rho
            key = jax.random.fold_in(jax.random.key(seed), dim)
            avg_d, pa_d, rho_d, exact_d = [], [], [], []
            avg_exact = [[] for _ in fedavg_steps]  # closed-form FedAvg bias per step count
            for p, (hessian, mu) in enumerate(make_problems(dim, problems, seed + 7919 * d_idx, num_examples)):
                q = local.make_quadratic(hessian, mu)
                p_lr = 0.5 / float(np.linalg.eigvalsh(hessian).max()) if lr is None else lr
                k_init, k_run = jax.random.split(jax.random.fold_in(key, p))
                theta0 = q.optimum[None, :] + init_scale * jax.random.normal(k_init, (inits, dim + 1), jnp.float64)
                path, samples = (np.asarray(a) for a in run_chains(k_run, q, theta0, p_lr))
                per_l = [np.asarray(fedpa_deltas(samples[:, :, :num], theta0, dim_rho)) for num in fedpa_samples]
                per_rho = np.asarray(rho_deltas(samples, theta0, jnp.asarray(rhos, jnp.float64)))
                th = np.asarray(theta0)
                exact_d.append(np.asarray(jax.vmap(local.exact_delta, in_axes=(None, 0))(q, theta0)))
                eye = np.eye(dim + 1)
                for j, k in enumerate(fedavg_steps):
                    expected = (eye - np.linalg.matrix_power(eye - p_lr * hessian, k)) / (p_lr * k)
                    err = (th - mu) @ (expected - hessian).T
                    avg_exact[j].extend(np.linalg.norm(err, axis=-1))
                avg_d.append(np.stack([(th[:, None] - path[:, :, j]) / (p_lr * k) for j, k in enumerate(fedavg_steps)]))
                pa_d.append(np.stack(per_l))
                rho_d.append(per_rho)
            exact = np.stack(exact_d)  # [P, I, D]

            def sweep(deltas):  # list over problems of [S, I, R, D] -> {"bias", "bias_raw", "variance"} lists
                stacked = np.stack(deltas, axis=1)  # [S, P, I, R, D]
                bv = [_bias_variance(s, exact) for s in stacked]
                return {"bias": [b[0] for b in bv], "bias_raw": [b[1] for b in bv], "variance": [b[2] for b in bv]}

            by_dim[dim] = {
                "fedavg": {"steps": list(fedavg_steps), **sweep(avg_d), "bias_exact": [float(np.mean(b)) for b in avg_exact]},
                "fedpa": {
                    "samples": list(fedpa_samples),
                    "steps": [n * steps_per_sample for n in fedpa_samples],
                    "rho": dim_rho,
                    **sweep(pa_d),
                },
                "fedpa_rho": {"rho": list(rhos), "samples": max_samples, "steps": max_samples * steps_per_sample, **sweep(rho_d)},
                "exact": {"norm": float(np.linalg.norm(exact, axis=-1).mean())},
            }
    return LeastSquaresResult(
        by_dim=by_dim,
        settings={
            "dims": list(dims),
            "seed": seed,
            "problems": problems,
            "inits": inits,
            "reps": reps,
            "fedavg_reps": fedavg_reps,
            "num_examples": num_examples,
            "init_scale": init_scale,
            "lr": "0.5 / lambda_max(A)" if lr is None else lr,
            "sampler": sampler,
            "steps_per_sample": steps_per_sample,
            "burn_in": burn_in,
            "noise_tau": noise,
        },
    )
