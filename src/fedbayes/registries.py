"""Specs by name: the one registry behind methods, datasets, partitions and models.

Each of :mod:`fedbayes.algorithms.registry`, :mod:`fedbayes.data.registry`,
:mod:`fedbayes.data.partitions` and :mod:`fedbayes.models.registry` keeps one :class:`Registry` of
its own kind of spec: the built-in specs (loaded on first use where loading costs imports) and those
a user adds with ``register``, which a config then names like a built-in one. Built-in names come
first and cannot be removed or taken.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Generic, TypeVar

__all__ = ["Registry"]

S = TypeVar("S")


class Registry(Generic[S]):
    """Specs of one kind by name (each spec has a ``name`` attribute).

    Args:
      kind: what a spec is, for messages ("algorithm", "dataset", ...).
      spec_type: the class every spec is an instance of.
      builtin_names: the built-in names, in the order :meth:`names` lists them.
      load: ``name -> spec`` for a built-in name, called once per name (e.g. an import).
    """

    def __init__(self, kind: str, spec_type: type, builtin_names: Iterable[str], load: Callable[[str], S]):
        self.kind = kind
        self.spec_type = spec_type
        self._builtin_names = tuple(builtin_names)
        self._load = load
        self._loaded: dict[str, S] = {}
        self._registered: dict[str, S] = {}

    @classmethod
    def of(cls, kind: str, spec_type: type, builtin: Mapping[str, S]) -> Registry[S]:
        """A registry whose built-in specs are already built (no loading)."""
        return cls(kind, spec_type, builtin, builtin.__getitem__)

    def _builtin(self, name: str) -> S:
        if name not in self._loaded:
            self._loaded[name] = self._load(name)
        return self._loaded[name]

    def register(self, spec: S) -> S:
        """Adds ``spec`` under ``spec.name``.

        Raises:
          ValueError: the name is taken, or ``spec`` is not a ``spec_type``.
        """
        if not isinstance(spec, self.spec_type):
            article = "an" if self.spec_type.__name__[0] in "AEIOU" else "a"
            raise ValueError(f"register: expected {article} {self.spec_type.__name__}; got {type(spec).__name__}")
        if spec.name in self._builtin_names or spec.name in self._registered:
            raise ValueError(f"{self.kind} {spec.name!r} is already registered")
        self._registered[spec.name] = spec
        return spec

    def unregister(self, name: str) -> None:
        """Removes a spec added by :meth:`register` (a name never registered is no error).

        Raises:
          ValueError: ``name`` is built in.
        """
        if name in self._builtin_names:
            raise ValueError(f"{self.kind} {name!r} is built in and cannot be removed")
        self._registered.pop(name, None)

    def get(self, name: str) -> S:
        """The spec of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
        if name in self._registered:
            return self._registered[name]
        if name in self._builtin_names:
            return self._builtin(name)
        raise ValueError(f"unknown {self.kind} {name!r}; allowed: {', '.join(self.names())}")

    def names(self) -> tuple[str, ...]:
        """Every name, built-in ones first (loads nothing)."""
        return (*self._builtin_names, *self._registered)

    def specs(self) -> tuple[S, ...]:
        """Every spec (loads every built-in one)."""
        return tuple(self.get(name) for name in self.names())

    def builtin_specs(self) -> tuple[S, ...]:
        """The specs that ship with fedbayes."""
        return tuple(self._builtin(name) for name in self._builtin_names)
