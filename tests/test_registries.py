"""Tests for fedbayes.registries: the one registry behind methods, datasets, partitions and models."""

from typing import NamedTuple

import pytest

from fedbayes.registries import Registry


class Spec(NamedTuple):
    name: str
    value: int = 0


class Other(NamedTuple):
    name: str


def test_builtins_load_once_and_come_first():
    calls = []

    def load(name):
        calls.append(name)
        return Spec(name, len(name))

    reg = Registry("widget", Spec, ("a", "bb"), load)
    assert reg.names() == ("a", "bb") and calls == []  # names load nothing
    assert reg.get("bb") == Spec("bb", 2) and reg.get("bb") is reg.get("bb")
    assert calls == ["bb"]
    reg.register(Spec("c", 7))
    assert reg.names() == ("a", "bb", "c")
    assert reg.specs() == (Spec("a", 1), Spec("bb", 2), Spec("c", 7))
    assert reg.builtin_specs() == (Spec("a", 1), Spec("bb", 2))
    assert calls == ["bb", "a"]


def test_register_and_unregister_rules():
    reg = Registry.of("widget", Spec, {"a": Spec("a")})
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register(Spec("a"))
    with pytest.raises(ValueError, match="register: expected a Spec; got Other"):
        reg.register(Other("x"))
    with pytest.raises(ValueError, match="widget 'a' is built in and cannot be removed"):
        reg.unregister("a")
    reg.register(Spec("x", 1))
    with pytest.raises(ValueError, match="widget 'x' is already registered"):
        reg.register(Spec("x", 2))
    reg.unregister("x")
    reg.unregister("never")  # no error
    with pytest.raises(ValueError, match="unknown widget 'x'; allowed: a"):
        reg.get("x")
