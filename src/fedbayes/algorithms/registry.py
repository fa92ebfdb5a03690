"""The algorithm registry: every method's :class:`~fedbayes.algorithms.base.AlgorithmSpec`, by name.

A spec holds the name used in configs (``[algorithm] name = ...``), the
:class:`~fedbayes.hparams.HParams` subclass its config section is validated into, the builder
``build(hparams, ctx) -> Algorithm`` and the method's traits (exact server, aggregator policy, what
the builder needs, minimum local epochs, burn-in, advice). The builder receives a
:class:`~fedbayes.algorithms.base.BuildContext`: the client's trainer, the server optimizer and a
:class:`~fedbayes.algorithms.base.FederationInfo` rather than the data itself, so that a deployed
server or client can build the same algorithm without loading anyone's data.

Each method's module declares its spec (``SPEC``; ``SPECS`` lists the module's specs) and
:data:`_BUILTIN` has one line per method: its name and its module. The modules are imported on
first use, so that validating a config imports only the method it names. ``fedbayes run``,
``compare``, ``bench`` and the config read the live registry: a method added with
:func:`register` runs from a config file, and the conformance suite
(``tests/algorithms/test_conformance.py``) checks it like every built-in method.
"""

from __future__ import annotations

import importlib

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, FederationInfo
from fedbayes.hparams import HParams
from fedbayes.registries import Registry

__all__ = ["AlgorithmSpec", "BuildContext", "FederationInfo", "build", "builtin_specs", "get", "names", "register", "specs", "unregister"]

# One line per built-in method: its config name and the module whose SPECS declare it. Modules are
# imported when a method is first asked for (full module paths, so the layering test can follow them).
_BUILTIN: dict[str, str] = {
    "fedavg": "fedbayes.algorithms.fedavg",
    "fedprox": "fedbayes.algorithms.fedprox",
    "feddyn": "fedbayes.algorithms.feddyn",
    "admm": "fedbayes.algorithms.admm",
    "fedpa": "fedbayes.algorithms.fedpa",
    "fedep": "fedbayes.algorithms.fedep",
    "fedsep": "fedbayes.algorithms.fedep",
    "vbnn": "fedbayes.algorithms.vbnn",
    "pvi": "fedbayes.algorithms.pvi",
    "fedlap": "fedbayes.algorithms.fedlap",
    "fedlap_cov": "fedbayes.algorithms.fedlap_cov",
    "fedlap_func": "fedbayes.algorithms.fedlap_func",
}


def _import_spec(name: str) -> AlgorithmSpec:
    """The built-in spec of ``name`` from its module's SPECS (the registry calls this once per name)."""
    module = importlib.import_module(_BUILTIN[name])
    found = [s for s in module.SPECS if s.name == name]
    if len(found) != 1:
        raise RuntimeError(f"{_BUILTIN[name]}.SPECS must declare algorithm {name!r} exactly once")
    return found[0]


_REGISTRY = Registry("algorithm", AlgorithmSpec, _BUILTIN, _import_spec)


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Adds a method; a config naming it then validates and runs like a built-in one.

    Raises:
      ValueError: the name is taken, or ``spec`` is not an :class:`AlgorithmSpec`.
    """
    return _REGISTRY.register(spec)


def unregister(name: str) -> None:
    """Removes a method added by :func:`register` (a name never registered is no error).

    Raises:
      ValueError: ``name`` is built in (built-in methods stay).
    """
    _REGISTRY.unregister(name)


def get(name: str) -> AlgorithmSpec:
    """The entry of ``name`` (its module imported on first use); an unknown name raises
    ``ValueError`` listing the known ones."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered name, built-in ones first (imports no method)."""
    return _REGISTRY.names()


def specs() -> tuple[AlgorithmSpec, ...]:
    """Every registered spec (imports every method's module)."""
    return _REGISTRY.specs()


def builtin_specs() -> tuple[AlgorithmSpec, ...]:
    """The methods that ship with fedbayes."""
    return _REGISTRY.builtin_specs()


def build(hparams: HParams, ctx: BuildContext) -> Algorithm:
    """Builds the algorithm ``hparams.name`` with its settings.

    Raises:
      ValueError: an unknown name, or ``ctx`` lacks what the method's traits say it needs.
    """
    spec = get(hparams.name)
    spec.check_context(ctx)
    return spec.build(hparams, ctx)
