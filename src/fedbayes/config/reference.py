"""The config reference (``fedbayes config [SECTION]``), generated from the pydantic models.

One source of truth: every key, its type, default and meaning come from :class:`RunConfig` and
the models of its sections. The algorithm section is validated against the live registry; its
tables are read from there (every registered method's settings), one table per algorithm.
"""

from __future__ import annotations

import dataclasses
import functools
import textwrap
import types
import typing
from typing import Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from fedbayes.algorithms import registry
from fedbayes.config.schema import RunConfig
from fedbayes.hparams import HParams


@dataclasses.dataclass(frozen=True)
class Key:
    name: str
    type: str
    default: str
    meaning: str


@dataclasses.dataclass(frozen=True)
class Section:
    """One TOML table: ``title`` (``""`` for the top level, ``"algorithm (name = 'fedep')"``...)."""

    name: str
    title: str
    doc: str
    keys: tuple[Key, ...]


def _models(annotation) -> list[type[BaseModel]]:
    """The BaseModel classes an annotation holds directly or as union members; the registered
    methods' settings for the ``[algorithm]`` table (annotated with their base, ``HParams``)."""
    if annotation is HParams:
        return [spec.hparams for spec in registry.specs()]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _models(typing.get_args(annotation)[0])
    if origin in (Union, types.UnionType):
        return [m for a in typing.get_args(annotation) for m in _models(a)]
    return []


def type_name(annotation) -> str:
    """A short, readable type: ``int``, ``float | None``, ``one of 'sgd', 'adam'``, ``list of int``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (tuple, list):
        inner = [a for a in args if a is not Ellipsis]
        return "list of " + (type_name(inner[0]) if inner else "any")
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    value = field.default
    if value is PydanticUndefined and field.default_factory is not None:
        value = field.default_factory()
    if value is PydanticUndefined:
        return "(required)"
    if value is None:
        return "none"
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, dict) and not value:
        return "{}"
    return repr(value) if isinstance(value, str) else str(value).replace("True", "true").replace("False", "false")


_BOUNDS = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))


def _constraints(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, word in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{word} {value}")
    return ", ".join(parts)


def _keys(model: type[BaseModel]) -> tuple[Key, ...]:
    keys = []
    for name, field in model.model_fields.items():
        if _models(field.annotation):
            continue  # a section of its own
        kind = type_name(field.annotation)
        bounds = _constraints(field)
        keys.append(Key(name, f"{kind}, {bounds}" if bounds else kind, _default(field), field.description or ""))
    return tuple(keys)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def sections(model: type[BaseModel] = RunConfig) -> list[Section]:
    """The top level, then each section; the algorithm union gives one section per member."""
    out = [Section("", "top level", _doc(model), _keys(model))]
    for name, field in model.model_fields.items():
        members = _models(field.annotation)
        if len(members) == 1:
            out.append(Section(name, f"[{name}]", _doc(members[0]), _keys(members[0])))
        for member in members if len(members) > 1 else ():
            tag = member.model_fields["name"].annotation
            tag_value = typing.get_args(tag)[0] if typing.get_origin(tag) is Literal else member.model_fields["name"].default
            keys = tuple(k for k in _keys(member) if k.name != "name")
            out.append(Section(f"{name}.{tag_value}", f"[{name}] name = {tag_value!r}", _doc(member), keys))
    return out


def section_names(model: type[BaseModel] = RunConfig) -> list[str]:
    return [s.name for s in sections(model) if s.name]


def select(section: str | None, model: type[BaseModel] = RunConfig) -> list[Section]:
    """The sections ``section`` names: ``None`` all, ``"data"``, ``"algorithm"`` (every algorithm),
    ``"algorithm.fedep"`` or just ``"fedep"``.

    Raises:
      ValueError: unknown section (the message lists the allowed ones).
    """
    all_sections = sections(model)
    if not section:
        return all_sections
    chosen = [s for s in all_sections if s.name == section or s.name.startswith(section + ".") or s.name.endswith("." + section)]
    if section in ("top", "run"):
        chosen = all_sections[:1]
    if not chosen:
        raise ValueError(f"unknown section {section!r}; allowed: run, {', '.join(section_names(model))}")
    return chosen


def render(chosen: list[Section], width: int = 100) -> str:
    """Plain text no wider than ``width`` (a word longer than a line aside): per section its title
    and doc line, then per key ``key = default  (type, constraints)  meaning``, wrapped at spaces
    under the key."""
    lines: list[str] = []
    wrap = functools.partial(textwrap.wrap, width=width, subsequent_indent=" " * 6, break_long_words=False, break_on_hyphens=False)
    for s in chosen:
        lines.append(s.title)
        if s.doc:
            lines += wrap(s.doc, initial_indent="  ", subsequent_indent="  ")
        if not s.keys:
            lines.append("  (no keys besides name)")
        head_width = max([len(f"{k.name} = {k.default}") for k in s.keys] + [0])
        for k in s.keys:
            head = f"{k.name} = {k.default}"
            lines += wrap(f"{head:<{head_width}}  ({k.type})  {k.meaning}".rstrip(), initial_indent="  ")
        lines.append("")
    return "\n".join(lines)
