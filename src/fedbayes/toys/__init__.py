"""Reproducible toy problems of the seed papers (docs/algorithms.md §15): ``fedbayes toy quadratic | least-squares | niw``.

* :mod:`fedbayes.toys.ep`: expectation propagation on Gaussian clients with exact tilted moments
  (diagonal and scaled-identity projections; Guo et al. 2023 (FedEP) Sec. 3.1).
* :mod:`fedbayes.toys.quadratic`: two 2-D quadratic clients; FedAvg, FedPA (IASG samples), MB-SGD
  server loops and EP (Al-Shedivat et al. 2021 (FedPA) Fig. 1, Guo et al. 2023 (FedEP) Fig. 1; docs/algorithms.md §15.1, 15.3).
* :mod:`fedbayes.toys.least_squares`: bias and variance of FedAvg and FedPA client deltas on
  ``make_regression`` problems (Al-Shedivat et al. 2021 (FedPA) App. A, Fig. 3; docs/algorithms.md §15.4).
* :mod:`fedbayes.toys.niw`: random normal-inverse-Wishart clients (Guo et al. 2023 (FedEP) Table 4, Fig. 4 left;
  docs/algorithms.md §15.2).

Everything runs in float64 (``jax.enable_x64``) unless a function says otherwise.
"""

import importlib

__all__ = ["FullGaussian", "NIWResult", "ep_step", "exact_global_mean", "run_ep", "run_least_squares", "run_niw", "run_quadratic"]

_HOMES = {
    "FullGaussian": "ep",
    "ep_step": "ep",
    "exact_global_mean": "ep",
    "run_ep": "ep",
    "NIWResult": "niw",
    "run_niw": "niw",
    "run_quadratic": "quadratic",
    "run_least_squares": "least_squares",
}


def __getattr__(name):
    # Lazy: ``fedbayes.cli`` imports ``fedbayes.toys.commands`` at start-up, which should not pay
    # for JAX and flax until a toy command runs.
    if name in _HOMES:
        return getattr(importlib.import_module(f"fedbayes.toys.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'fedbayes.toys' has no attribute {name!r}")
