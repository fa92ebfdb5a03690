"""Reproducible toy problems of the seed papers (spec 15): ``fedbayes toy quadratic | least-squares | niw``.

* :mod:`fedbayes.toys.ep`: expectation propagation on Gaussian clients with exact tilted moments
  (diagonal and scaled-identity projections; seed 000 Sec. 3.1).
* :mod:`fedbayes.toys.quadratic`: two 2-D quadratic clients; FedAvg, FedPA (IASG samples), MB-SGD
  server loops and EP (seed 003 Fig. 1, seed 000 Fig. 1; spec 15.1, 15.3).
* :mod:`fedbayes.toys.least_squares`: bias and variance of FedAvg and FedPA client deltas on
  ``make_regression`` problems (seed 003 App. A, Fig. 3; spec 15.4).
* :mod:`fedbayes.toys.niw`: random normal-inverse-Wishart clients (seed 000 Table 4, Fig. 4 left;
  spec 15.2).

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
