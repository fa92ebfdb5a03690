"""The algorithm registry: every method's name, settings record and builder, in one place.

An entry is an :class:`AlgorithmSpec`: the name used in configs (``algorithm = {name = ...}``),
the :class:`~fedbayes.hparams.HParams` subclass its config section is parsed into, and a builder
``build(hparams, ctx) -> Algorithm``. The builder receives a :class:`BuildContext`: the client's
trainer, the server optimizer and a :class:`FederationInfo` (how many clients, how many examples)
rather than the data itself, so that a deployed server or client can build the same algorithm
without loading anyone's data. ``fedbayes run``, ``compare``, ``bench`` and the config parser all
read this registry; adding a method is one new module plus one line in :data:`_BUILTIN`, and the
conformance suite (``tests/algorithms/test_conformance.py``) then checks it like every other method.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import optax

from fedbayes.algorithms.base import Algorithm
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer

__all__ = ["AlgorithmSpec", "BuildContext", "FederationInfo", "build", "builtin_specs", "get", "names", "register", "specs", "unregister"]


class FederationInfo(NamedTuple):
    """The few facts about a federation that a builder may use."""

    num_clients: int
    total_examples: int
    client_sizes: tuple[int, ...]

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> FederationInfo:
        sizes = tuple(int(n) for n in np.asarray(sizes))
        return cls(num_clients=len(sizes), total_examples=sum(sizes), client_sizes=sizes)


class BuildContext(NamedTuple):
    """What a builder gets besides its own settings.

    Attributes:
      trainer: the clients' local training (loss, optimizer, epochs, batch size).
      server_optimizer: the optax transformation of the server step.
      federation: :class:`FederationInfo`.
      clients_per_round: the cohort size ``M`` (e.g. FedEP's default damping ``1 / M``).
      apply_fn: ``(params, x) -> outputs`` of the model, for methods that need the model's outputs
        (curvature); ``None`` when not needed.
      task: ``"classification"`` or ``"regression"``.
      keyed_apply_fn: ``(params, key, x) -> outputs``, one stochastic forward pass of a
        variational model (VBNN); ``None`` for deterministic models.
      feature_spec: shape and dtype of one example's features (no batch axis), for methods whose
        states hold inputs (FedLap-Func's memory points); ``None`` when not needed.
    """

    trainer: LocalTrainer
    server_optimizer: optax.GradientTransformation
    federation: FederationInfo
    clients_per_round: int
    apply_fn: Callable[[Any, Any], Any] | None = None
    task: str = "classification"
    keyed_apply_fn: Callable[[Any, Any, Any], Any] | None = None
    feature_spec: Any = None  # jax.ShapeDtypeStruct of one example


class AlgorithmSpec(NamedTuple):
    """One registry entry (see the module docstring)."""

    name: str
    hparams: type[HParams]
    build: Callable[[Any, BuildContext], Algorithm]
    summary: str = ""


# The package re-exports each method's factory under the module's own name (fedbayes.algorithms.fedavg
# is the function), so the modules are looked up by their full names.
admm, fedavg, feddyn, fedep, fedpa, fedprox, vbnn = (
    importlib.import_module(f"fedbayes.algorithms.{m}") for m in ("admm", "fedavg", "feddyn", "fedep", "fedpa", "fedprox", "vbnn")
)
pvi = importlib.import_module("fedbayes.algorithms.pvi")
fedlap = importlib.import_module("fedbayes.algorithms.fedlap")
fedlap_cov = importlib.import_module("fedbayes.algorithms.fedlap_cov")
fedlap_func = importlib.import_module("fedbayes.algorithms.fedlap_func")

_BUILTIN = (
    AlgorithmSpec("fedavg", fedavg.FedAvgConfig, fedavg.build, "weighted averaging of local deltas; FedAvgM/FedAdam/FedYogi via the server optimizer"),
    AlgorithmSpec("fedprox", fedprox.FedProxConfig, fedprox.build, "FedAvg with a proximal term on the clients"),
    AlgorithmSpec("feddyn", feddyn.FedDynConfig, feddyn.build, "dynamic regularisation with per-client gradient corrections"),
    AlgorithmSpec("admm", admm.ADMMConfig, admm.build, "federated ADMM with per-client duals"),
    AlgorithmSpec("fedpa", fedpa.FedPAConfig, fedpa.build, "posterior averaging: IASG samples, shrinkage covariance"),
    AlgorithmSpec("fedep", fedep.FedEPConfig, fedep.build_fedep, "expectation propagation with stateful Gaussian sites"),
    AlgorithmSpec("fedsep", fedep.FedSEPConfig, fedep.build_fedsep, "stochastic EP: one shared site, stateless clients"),
    AlgorithmSpec("vbnn", vbnn.VBNNConfig, vbnn.build, "variational BNN clients (Bayes-by-backprop); six rules to combine their posteriors"),
    AlgorithmSpec("pvi", pvi.PVIConfig, pvi.build, "partitioned variational inference: mean-field Gaussian sites, reparameterised local VI"),
    AlgorithmSpec("fedlap", fedlap.FedLapConfig, fedlap.build, "Laplace PVI with isotropic Gaussian sites: ADMM-like duals, w_g = sum of the sites"),
    AlgorithmSpec("fedlap_cov", fedlap_cov.FedLapCovConfig, fedlap_cov.build, "FedLap with diagonal-GGN site precisions: two duals, a preconditioned server"),
    AlgorithmSpec("fedlap_func", fedlap_func.FedLapFuncConfig, fedlap_func.build, "FedLap plus soft labels on memory points, fitted at the server"),
)

_REGISTRY: dict[str, AlgorithmSpec] = {spec.name: spec for spec in _BUILTIN}


def register(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Adds a method; its ``hparams`` must have a ``name`` field whose default or literal is the
    spec's name. Raises ``ValueError`` if the name is taken."""
    if spec.name in _REGISTRY:
        raise ValueError(f"algorithm {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Removes a method added by :func:`register` (built-in ones stay)."""
    if any(spec.name == name for spec in _BUILTIN):
        raise ValueError(f"algorithm {name!r} is built in and cannot be removed")
    _REGISTRY.pop(name, None)


def get(name: str) -> AlgorithmSpec:
    """The entry of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; allowed: {', '.join(_REGISTRY)}") from None


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def specs() -> tuple[AlgorithmSpec, ...]:
    return tuple(_REGISTRY.values())


def builtin_specs() -> tuple[AlgorithmSpec, ...]:
    """The methods that ship with fedbayes (what the config file's ``algorithm.name`` accepts)."""
    return _BUILTIN


def build(hparams: HParams, ctx: BuildContext) -> Algorithm:
    """Builds the algorithm ``hparams.name`` with its settings."""
    return get(hparams.name).build(hparams, ctx)
