"""Partitions by name: the partition registry, one :class:`PartitionSpec` per way of splitting a
training set over clients (the functions themselves live in :mod:`fedbayes.data.partition`).

A spec holds the name used in configs (``[data] partition = ...``), the
:class:`~fedbayes.data.registry.DataSettings` record of the ``[data]`` keys only it reads, its
function ``split(labels, num_clients, rng, client_ids=None, **params) -> list of index arrays``
and whether it needs the data's own client ids. A partition added with :func:`register` runs from
a config file like a built-in one, and the conformance suite (``tests/data/test_dataset_conformance.py``)
splits every registered dataset with every partition that applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import Field

from fedbayes.data.partition import natural, partition
from fedbayes.data.registry import DataSettings, setting
from fedbayes.hparams import HParams
from fedbayes.registries import Registry

__all__ = ["PartitionSpec", "builtin_specs", "get", "names", "register", "specs", "unregister"]


@dataclasses.dataclass(frozen=True)
class PartitionSpec:
    """A registered partition.

    Attributes:
      name: registry key, the config's ``data.partition``.
      description: one line on what the split does.
      split: ``(labels, num_clients, rng, client_ids=None, **params) -> list[np.ndarray]``, one
        int64 array of training-set indices per client; ``rng`` a seeded ``np.random.Generator``.
        A ``ValueError`` it raises is reported as a config error on ``data.partition``.
      settings: the :class:`~fedbayes.data.registry.DataSettings` record of the ``[data]`` keys
        only this partition reads (``None``: none); ``params`` passes them to ``split`` by name.
      needs_client_ids: it splits by the data's own client ids (the clients are the data's).
    """

    name: str
    description: str
    split: Callable[..., list[np.ndarray]]
    settings: type[DataSettings] | None = None
    needs_client_ids: bool = False

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"PartitionSpec: name must be a non-empty string; got {self.name!r}")
        if self.settings is not None and not (isinstance(self.settings, type) and issubclass(self.settings, HParams)):
            raise ValueError(f"PartitionSpec {self.name!r}: settings must be an HParams subclass; got {self.settings!r}")

    @property
    def setting_keys(self) -> tuple[str, ...]:
        """The ``[data]`` keys only this partition reads."""
        return tuple(self.settings.model_fields) if self.settings is not None else ()

    def params(self, data: Any) -> dict[str, Any]:
        """``split``'s keyword parameters from a data config."""
        return {key: setting(data, key) for key in self.setting_keys}


class DirichletSettings(DataSettings):
    """Dirichlet label skew."""

    alpha: float = Field(0.5, gt=0, description="Dirichlet label-skew concentration (partition = dirichlet)")


class TwoLevelDirichletSettings(DataSettings):
    """Client sizes and class mixes from two Dirichlets."""

    alpha1: float = Field(1.0, gt=0, description="two-level Dirichlet: client-size concentration")
    alpha2: float = Field(0.5, gt=0, description="two-level Dirichlet: class-mix concentration")


class ShardsSettings(DataSettings):
    """Label shards."""

    classes_per_client: int = Field(2, ge=1, description="shards partition")


def _by_name(name: str) -> Callable[..., list[np.ndarray]]:
    """:func:`fedbayes.data.partition.partition` with ``name`` (its checks and its dispatch)."""

    def split(labels, num_clients: int, rng: np.random.Generator, client_ids=None, **params) -> list[np.ndarray]:
        return partition(name, labels, num_clients, rng, **params)

    return split


def _natural(labels, num_clients: int, rng: np.random.Generator, client_ids=None) -> list[np.ndarray]:
    return natural(client_ids)


_BUILTIN: dict[str, PartitionSpec] = {
    spec.name: spec
    for spec in (
        PartitionSpec("iid", "a random permutation cut into near-equal chunks", _by_name("iid")),
        PartitionSpec("dirichlet", "Dirichlet label skew, NIID-Bench noniid-labeldir", _by_name("dirichlet"), DirichletSettings),
        PartitionSpec(
            "two_level_dirichlet",
            "client sizes and class mixes from two Dirichlets (Swaroop et al. 2025, App. E.1)",
            _by_name("two_level_dirichlet"),
            TwoLevelDirichletSettings,
        ),
        PartitionSpec("shards", "sort by label and deal shards (McMahan et al. 2017, Sec. 3)", _by_name("shards"), ShardsSettings),
        PartitionSpec("natural", "one client per client id of the data (LEAF users, generated clients, a client column)", _natural, needs_client_ids=True),
    )
}


_REGISTRY = Registry.of("partition", PartitionSpec, _BUILTIN)


def register(spec: PartitionSpec) -> PartitionSpec:
    """Adds a partition; a config naming it (``[data] partition = ...``, its own keys flat in
    ``[data]``) then validates and runs like a built-in one.

    Raises:
      ValueError: the name is taken, or ``spec`` is not a :class:`PartitionSpec`.
    """
    return _REGISTRY.register(spec)


def unregister(name: str) -> None:
    """Removes a partition added by :func:`register` (a name never registered is no error).

    Raises:
      ValueError: ``name`` is built in (built-in partitions stay).
    """
    _REGISTRY.unregister(name)


def get(name: str) -> PartitionSpec:
    """The spec of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered name, built-in ones first."""
    return _REGISTRY.names()


def specs() -> tuple[PartitionSpec, ...]:
    """Every registered spec."""
    return _REGISTRY.specs()


def builtin_specs() -> tuple[PartitionSpec, ...]:
    """The partitions that ship with fedbayes."""
    return _REGISTRY.builtin_specs()
