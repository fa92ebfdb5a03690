"""fedbayes: federated learning as Bayesian inference, in JAX.

The curated surface (as optax curates its root): a method is an :class:`Algorithm` of pure
functions, described to the registry by an :class:`AlgorithmSpec` and built from its settings
(:class:`HParams`) and a :class:`BuildContext`; :func:`register` adds one, so that a config names
it. A run is a :class:`RunConfig` (:func:`load_config` reads a TOML file) that
:func:`run_experiment` runs on the :class:`Simulator`; :func:`load_run` reads a finished run
folder; your own data is a :class:`Dataset` (:func:`from_arrays`, :func:`load_files`).
:mod:`fedbayes.gaussian` is the diagonal-Gaussian algebra, :mod:`fedbayes.protocol` the
round. Everything else lives in its subpackage (``fedbayes.algorithms``, ``fedbayes.models``, ...).

Names are imported when first used: ``import fedbayes`` imports neither JAX nor any method.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from fedbayes import gaussian, protocol
    from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext
    from fedbayes.algorithms.registry import register
    from fedbayes.config.schema import RunConfig, load_config
    from fedbayes.data.dataset import Dataset
    from fedbayes.data.user import from_arrays, load_files
    from fedbayes.hparams import HParams
    from fedbayes.runs.export import load_run
    from fedbayes.runs.loop import run_experiment
    from fedbayes.sim.simulator import Simulator

# name -> the module that defines it (None: the name is the module fedbayes.<name>)
_API: dict[str, str | None] = {
    "Algorithm": "fedbayes.algorithms.base",
    "AlgorithmSpec": "fedbayes.algorithms.base",
    "BuildContext": "fedbayes.algorithms.base",
    "HParams": "fedbayes.hparams",
    "register": "fedbayes.algorithms.registry",
    "RunConfig": "fedbayes.config.schema",
    "load_config": "fedbayes.config.schema",
    "Simulator": "fedbayes.sim.simulator",
    "run_experiment": "fedbayes.runs.loop",
    "Dataset": "fedbayes.data.dataset",
    "from_arrays": "fedbayes.data.user",
    "load_files": "fedbayes.data.user",
    "load_run": "fedbayes.runs.export",
    "gaussian": None,
    "protocol": None,
}

__all__ = [
    "Algorithm",
    "AlgorithmSpec",
    "BuildContext",
    "Dataset",
    "HParams",
    "RunConfig",
    "Simulator",
    "__version__",
    "from_arrays",
    "gaussian",
    "load_config",
    "load_files",
    "load_run",
    "protocol",
    "register",
    "run_experiment",
]


def __getattr__(name: str):
    if name not in _API:
        raise AttributeError(f"module 'fedbayes' has no attribute {name!r}")
    module = _API[name]
    value = importlib.import_module(f"fedbayes.{name}") if module is None else getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
