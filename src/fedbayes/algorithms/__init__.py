"""Federated algorithms, each a small set of pure functions (see :mod:`fedbayes.algorithms.base`).

One module per method (``fedbayes.algorithms.fedavg``, ``...fedep`` with FedEP and FedSEP, ...),
each declaring its factory, its settings and its ``SPEC``; :mod:`fedbayes.algorithms.registry`
finds them by name. No method's module imports another's: what methods share lives in modules of
its own (``base``, ``sites``, ``damping``, ``server_opt``, ``laplace_sites``, ``point``,
``fedlap_memory``). ``from fedbayes.algorithms import fedlap`` is the module (its factory is
``fedlap.fedlap``). The package imports nothing until a name is used, so that reading a config
imports only the method it names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, FederationInfo
    from fedbayes.algorithms.server_opt import make_server_optimizer

__all__ = ["Algorithm", "AlgorithmSpec", "BuildContext", "FederationInfo", "make_server_optimizer"]

_NAMES = {
    "Algorithm": "fedbayes.algorithms.base",
    "AlgorithmSpec": "fedbayes.algorithms.base",
    "BuildContext": "fedbayes.algorithms.base",
    "FederationInfo": "fedbayes.algorithms.base",
    "make_server_optimizer": "fedbayes.algorithms.server_opt",
}


def __getattr__(name: str):
    if name in _NAMES:
        return getattr(importlib.import_module(_NAMES[name]), name)
    try:  # a submodule: fedbayes.algorithms.fedlap after a plain `import fedbayes.algorithms`
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
