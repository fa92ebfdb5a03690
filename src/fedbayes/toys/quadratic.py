"""Two clients with 2-D quadratic objectives: FedAvg vs FedPA vs EP (Al-Shedivat et al. 2021 (FedPA) Fig. 1, Guo et al. 2023 (FedEP) Fig. 1).

docs/algorithms.md §15.1 and 15.3. The clients are the two Gaussians of Guo et al. 2023 (FedEP)'s Fig. 1 (docs/algorithms.md §15.1), read as
quadratics ``f_k(theta) = 1/2 (theta - mu_k)^T A_k (theta - mu_k)`` with ``A_k = Sigma_k^{-1}``:

    mu_1 = (7.0, -10.6),  Sigma_1 = [[11, -5.3], [-5.3, 3.5]]
    mu_2 = (0.2,   2.24), Sigma_2 = [[ 5,  4.9], [ 4.9, 5.5]]

With equal weights the global objective ``sum_k f_k`` has its optimum at the product's mean
``theta* = (sum_k A_k)^{-1} sum_k A_k mu_k = (-4.75695, -3.60154)`` (Al-Shedivat et al. 2021 (FedPA) Eq. 3, Prop. 2).
(``problem="random"`` instead draws two quadratics as the FedPA code's
``create_random_quadratics(dim=2, min_eig=1, max_eig=10, b_scale=10)``.)

Server loop (Al-Shedivat et al. 2021 (FedPA) Alg. 1): full participation, ``theta <- theta - eta_s mean_k g_k``
(``optax.sgd(server_lr)``), from ``inits`` starting points at distance ``init_radius`` from
``theta*``. Client deltas ``g_k`` (:mod:`fedbayes.toys.local`):

* ``fedavg_K``: ``K`` local SGD steps (``K = 10, 100``); its fixed point solves
  ``sum_k B_k (theta - mu_k) = 0`` with ``B_k = I - (I - lr A_k)^K`` and moves from ``theta*``
  (``K = 1``) to the mean of the means (``K -> inf``) as ``K`` grows (Al-Shedivat et al. 2021 (FedPA) Sec. 3);
* ``mbsgd``: ``lr`` times the mean of 100 gradients at ``theta`` (unbiased, converges to
  ``theta*`` up to noise, slowly);
* ``fedpa_l``: ``l = 10, 100`` IASG samples (or exact posterior samples), shrinkage ``rho = 1``
  as in Al-Shedivat et al. 2021 (FedPA) Fig. 1; ``Sigma_l^{-1} -> A_k`` as ``l`` grows, so the fixed point approaches
  ``theta*``.

The stochastic gradient is ``A_k (theta - mu_k) + N(0, tau A_k)`` with
``tau = temperature * steps_per_sample``, calibrated so that IASG samples approximate the
client posterior ``N(mu_k, Sigma_k)`` (see :mod:`fedbayes.toys.local`); every method sees the
same oracle. The reported distance of a run is ``||theta_t - theta*||`` averaged over its last
``tail`` rounds (the iterates fluctuate around the fixed point); mean and std are over inits.

EP on the same two Gaussians (:mod:`fedbayes.toys.ep`; docs/algorithms.md §15.1): the one-shot FedAvg
(3.6, -4.18) and FedPA (2.3250, -5.6067) estimates, 10 diagonal EP steps (-4.7631, -3.6106) and
100 scaled-identity EP steps (the exact mean).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes.toys import local
from fedbayes.toys.ep import FullGaussian, exact_global_mean, fedavg_mean, run_ep

SPEC_MEANS = np.array([[7.0, -10.6], [0.2, 2.24]])
SPEC_COVS = np.array([[[11.0, -5.3], [-5.3, 3.5]], [[5.0, 4.9], [4.9, 5.5]]])
PROBLEMS = ("gaussians", "random")

__all__ = ["PROBLEMS", "QuadraticResult", "fedavg_fixed_point", "make_problem", "run_quadratic", "server_loop"]


def make_problem(problem: str = "gaussians", seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The two clients' ``(mu [2, 2], Sigma [2, 2, 2])``.

    ``"gaussians"``: docs/algorithms.md §15.1 (Guo et al. 2023 (FedEP) Fig. 1). ``"random"``: the FedPA code's
    ``create_random_quadratics(dim=2, num_objectives=2, min_eig=1, max_eig=10, b_scale=10)``
    (``A = V diag(w) V^T`` with the eigenvalues of a random symmetric matrix rescaled to
    ``[1, 10]``, ``b = 10 N(0, I)``, ``mu = A^{-1} b``), drawn from ``default_rng(seed)``.
    """
    if problem == "gaussians":
        return SPEC_MEANS.copy(), SPEC_COVS.copy()
    if problem != "random":
        raise ValueError(f"problem must be one of {', '.join(PROBLEMS)}; got {problem!r}")
    rng = np.random.default_rng(seed)
    means, covs = [], []
    for _ in range(2):
        m = rng.normal(size=(2, 2))
        w, v = np.linalg.eigh(0.5 * (m + m.T))
        w = 9.0 * (w - w.min()) / (w.max() - w.min()) + 1.0
        hessian = v @ np.diag(w) @ v.T
        means.append(np.linalg.solve(hessian, 10.0 * rng.normal(size=2)))
        covs.append(np.linalg.inv(hessian))
    return np.stack(means), np.stack(covs)


def fedavg_fixed_point(means: np.ndarray, covs: np.ndarray, lr: float, num_steps: int) -> np.ndarray:
    """FedAvg's fixed point in expectation: ``theta_F = (sum_k B_k)^{-1} sum_k B_k mu_k``.

    With ``K`` local SGD steps of size ``lr`` on ``f_k`` the expected delta is
    ``B_k (theta - mu_k)``, ``B_k = I - (I - lr A_k)^K`` (the noise has mean zero and the
    recursion is linear), and the server's fixed point sets their sum to zero (Al-Shedivat et al. 2021 (FedPA) Sec. 3;
    ``K = 1`` gives ``theta*``, ``K -> inf`` the mean of the means).
    """
    eye = np.eye(means.shape[1])
    b = [eye - np.linalg.matrix_power(eye - lr * np.linalg.inv(c), num_steps) for c in covs]
    return np.linalg.solve(sum(b), sum(bk @ m for bk, m in zip(b, means)))


def server_loop(key, clients: local.Quadratic, theta0, delta_fn, *, rounds: int, server_lr: float):
    """Runs ``rounds`` rounds of the generalised FedAvg loop (Al-Shedivat et al. 2021 (FedPA) Alg. 1), full participation.

    Args:
      key: PRNG key.
      clients: a :class:`~fedbayes.toys.local.Quadratic` with leaves stacked on axis 0 (``K``).
      theta0: ``[R, d]`` starting points (independent runs, vmapped).
      delta_fn: ``(key, client, theta) -> g``.
      rounds: number of rounds.
      server_lr: server SGD learning rate ``eta_s``.

    Returns:
      ``[rounds + 1, R, d]``: the server iterate before round 1 and after every round.
    """
    opt = optax.sgd(server_lr)
    num_runs = theta0.shape[0]
    num_clients = clients.optimum.shape[0]
    per_client = jax.vmap(delta_fn, in_axes=(0, 0, None))  # over clients
    per_run = jax.vmap(per_client, in_axes=(0, None, 0))  # over runs

    def one_round(carry, round_key):
        theta, opt_state = carry
        keys = jax.random.split(round_key, (num_runs, num_clients))
        g = jnp.mean(per_run(keys, clients, theta), axis=1)  # equal weights q_k = 1/K
        updates, opt_state = opt.update(g, opt_state, theta)
        theta = optax.apply_updates(theta, updates)
        return (theta, opt_state), theta

    _, path = jax.lax.scan(one_round, (theta0, opt.init(theta0)), jax.random.split(key, rounds))
    return jnp.concatenate([theta0[None], path], axis=0)


@dataclass
class QuadraticResult:
    """Distances to ``theta*`` per method, and the EP estimates.

    Attributes:
      curves: method -> ``[rounds + 1, R]`` distances ``||theta_t - theta*||`` per run.
      final: method -> ``[R]`` distance averaged over the last ``tail`` rounds.
      estimates: method -> the mean final server point over runs (or the EP / one-shot point).
      ep_curves: ``fedep_diag`` / ``fedep_iso`` -> ``[steps]`` distances after each EP step.
      optimum: ``theta*``.
      problem: ``(mu, Sigma)`` of the two clients.
      settings: what was run.
    """

    curves: dict[str, np.ndarray]
    final: dict[str, np.ndarray]
    estimates: dict[str, np.ndarray]
    ep_curves: dict[str, np.ndarray]
    optimum: np.ndarray
    problem: tuple[np.ndarray, np.ndarray]
    settings: dict = field(default_factory=dict)

    def summary(self) -> dict[str, dict]:
        """``method -> {"mean", "std", "estimate", "estimate_distance"}``.

        ``mean`` and ``std`` are over runs of the tail-averaged distance ``||theta_t - theta*||``
        (noise included); ``estimate`` is the mean tail iterate over runs and
        ``estimate_distance`` its distance to ``theta*`` (the fixed point's bias, noise averaged
        out). For EP and the one-shot estimates all four are deterministic (``std = 0``).
        """
        out = {}
        for m, d in self.final.items():
            est = self.estimates[m]
            out[m] = {
                "mean": float(np.mean(d)),
                "std": float(np.std(d)),
                "estimate": [float(x) for x in est],
                "estimate_distance": float(np.linalg.norm(est - self.optimum)),
            }
        return out


def run_quadratic(
    *,
    seed: int = 0,
    problem: str = "gaussians",
    rounds: int = 50,
    inits: int = 5,
    init_radius: float = 10.0,
    lr: float | None = None,
    server_lr: float = 1.0,
    fedavg_steps: tuple[int, ...] = (10, 100),
    fedpa_samples: tuple[int, ...] = (10, 100),
    mbsgd_grads: int = 100,
    rho: float = 1.0,
    sampler: str = "iasg",
    steps_per_sample: int = 100,
    burn_in: int = 200,
    temperature: float = 1.0,
    ep_steps: int = 10,
    iso_steps: int = 100,
    tail: int = 10,
) -> QuadraticResult:
    """Runs the 2-D quadratic toy.

    Args:
      seed: seeds the starting points and the gradient noise (and the problem if ``"random"``).
      problem: ``"gaussians"`` (docs/algorithms.md §15.1) or ``"random"``.
      rounds: server rounds.
      inits: independent runs from different starting points (Al-Shedivat et al. 2021 (FedPA) Fig. 1: 5).
      init_radius: distance of the starting points from ``theta*``.
      lr: client SGD / IASG learning rate (default ``1 / max_k lambda_max(A_k)``).
      server_lr: server SGD learning rate.
      fedavg_steps: local step counts for FedAvg.
      fedpa_samples: sample counts ``l`` for FedPA.
      mbsgd_grads: gradients per client per round for MB-SGD (0 to skip).
      rho: FedPA shrinkage (Al-Shedivat et al. 2021 (FedPA) Fig. 1: 1).
      sampler: ``"iasg"`` or ``"exact"`` posterior samples for FedPA.
      steps_per_sample: IASG steps averaged per sample ``K`` (also sets the noise ``tau``).
      burn_in: IASG burn-in steps.
      temperature: gradient-noise temperature (``tau = temperature * steps_per_sample``).
      ep_steps: diagonal EP steps (docs/algorithms.md §15.1: 10).
      iso_steps: scaled-identity EP steps (docs/algorithms.md §15.1: 100).
      tail: rounds averaged for the final distance.
    """
    if sampler not in local.SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(local.SAMPLERS)}; got {sampler!r}")
    if rounds < 1 or inits < 1 or not 1 <= tail <= rounds:
        raise ValueError("need rounds >= 1, inits >= 1 and 1 <= tail <= rounds")
    means, covs = make_problem(problem, seed)
    hessians = np.linalg.inv(covs)
    if lr is None:
        lr = 1.0 / max(np.linalg.eigvalsh(h).max() for h in hessians)
    noise = temperature * steps_per_sample
    curves, final, estimates = {}, {}, {}
    with jax.enable_x64(True):
        clients = local.stack_quadratics([local.make_quadratic(h, m) for h, m in zip(hessians, means)])
        gauss = FullGaussian(jnp.asarray(means), jnp.asarray(covs))
        optimum = np.asarray(exact_global_mean(gauss))
        key = jax.random.key(seed)
        key, init_key = jax.random.split(key)
        z = jax.random.normal(init_key, (inits, 2), jnp.float64)
        theta0 = jnp.asarray(optimum)[None, :] + init_radius * z / jnp.linalg.norm(z, axis=1, keepdims=True)

        methods = {}
        for k in fedavg_steps:
            methods[f"fedavg_{k}"] = lambda kk, q, th, k=k: local.fedavg_delta(kk, q, th, lr=lr, num_steps=k, noise_scale=noise)
        if mbsgd_grads:
            methods["mbsgd"] = lambda kk, q, th: local.mbsgd_delta(kk, q, th, lr=lr, num_grads=mbsgd_grads, noise_scale=noise)
        for num in fedpa_samples:
            if sampler == "iasg":

                def draw(kk, q, th, num=num):
                    return local.iasg_samples(kk, q, th, lr=lr, burn_in_steps=burn_in, steps_per_sample=steps_per_sample, num_samples=num, noise_scale=noise)
            else:

                def draw(kk, q, th, num=num):
                    return local.exact_samples(kk, q, num)

            methods[f"fedpa_{num}"] = lambda kk, q, th, draw=draw: local.fedpa_delta(draw(kk, q, th), th, rho)

        for i, (name, fn) in enumerate(methods.items()):
            # One program per method, each finished before the next (see toys/local.py).
            loop = jax.jit(lambda kk, t0, fn=fn: server_loop(kk, clients, t0, fn, rounds=rounds, server_lr=server_lr))
            path = np.asarray(loop(jax.random.fold_in(key, i), theta0))
            dist = np.linalg.norm(path - optimum, axis=-1)
            curves[name] = dist
            final[name] = dist[-tail:].mean(axis=0)
            estimates[name] = path[-tail:].mean(axis=(0, 1))
        diag = np.asarray(jax.jit(lambda c: run_ep(c, ep_steps, "diag", 1.0))(gauss))
        iso = np.asarray(jax.jit(lambda c: run_ep(c, iso_steps, "iso", 1.0))(gauss))
        one_shot = {
            "fedavg_oneshot": np.asarray(fedavg_mean(gauss)),
            "fedpa_oneshot": diag[0],
            "fedep_diag": diag[-1],
            "fedep_iso": iso[-1],
        }
    for name, point in one_shot.items():
        final[name] = np.array([np.linalg.norm(point - optimum)])
        estimates[name] = point
    return QuadraticResult(
        curves=curves,
        final=final,
        estimates=estimates,
        ep_curves={"fedep_diag": np.linalg.norm(diag - optimum, axis=1), "fedep_iso": np.linalg.norm(iso - optimum, axis=1)},
        optimum=optimum,
        problem=(means, covs),
        settings={
            "seed": seed,
            "problem": problem,
            "rounds": rounds,
            "inits": inits,
            "init_radius": init_radius,
            "lr": float(lr),
            "server_lr": server_lr,
            "rho": rho,
            "sampler": sampler,
            "steps_per_sample": steps_per_sample,
            "burn_in": burn_in,
            "noise_tau": noise,
            "ep_steps": ep_steps,
            "iso_steps": iso_steps,
            "tail": tail,
        },
    )
