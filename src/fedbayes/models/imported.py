"""Your own flax model, named by an import path: ``"package.module:Class"`` or ``"path/to/file.py:Class"``.

A config names it with ``model.module`` and its keyword arguments with ``model.kwargs``; Python
passes the module itself to :func:`fedbayes.run_experiment` (``model=``). Either way it must be a
``flax.linen.Module`` that maps float32 inputs ``[batch, *feature_shape]`` to logits
``[batch, num_classes]``; a ``num_classes`` attribute left out of ``model.kwargs`` is set from the
data. Its variables must be the ``params`` collection alone: fedbayes' methods combine parameters
(and Gaussians over them) across clients, and a mutable collection such as BatchNorm's
``batch_stats`` would need its own federated rule, which none of the papers' methods defines for
every method here. Such a model is refused with one line before any training
(:func:`check_module`); ``flax.linen.GroupNorm`` or ``LayerNorm`` normalise without running
statistics and work with every method.

A module path is imported with the current folder on ``sys.path`` (as ``python -m`` would); a
file path is loaded as a module of its own.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["check_module", "import_class", "make_module"]


def import_class(path: str) -> type[nn.Module]:
    """The ``flax.linen.Module`` subclass that ``"package.module:Class"`` or ``"file.py:Class"`` names.

    Raises:
      ValueError: one line naming the path and what is wrong (no colon, not importable, no such
        class, not a flax module).
    """
    where, sep, name = path.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise ValueError(f"model.module: expected 'package.module:Class' or 'path/to/file.py:Class'; got {path!r}")
    try:
        module = _load_file(Path(where)) if where.endswith(".py") else _import(where)
    except ValueError:
        raise
    except Exception as exc:  # the user's code: any import-time error is one line
        raise ValueError(f"model.module: importing {where!r} failed: {type(exc).__name__}: {' '.join(str(exc).split())}") from None
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"model.module: {where!r} has no {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"model.module: {path!r} is not a flax.linen.Module subclass")
    return cls


def _import(dotted: str):
    cwd = str(Path.cwd())
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(dotted)
    except ModuleNotFoundError as exc:
        raise ValueError(f"model.module: no module {exc.name!r} (importing {dotted!r} from {cwd} and the installed packages)") from None
    finally:
        if added:
            sys.path.remove(cwd)


def _load_file(file: Path):
    if not file.is_file():
        raise ValueError(f"model.module: {str(file)!r}: no such file")
    resolved = file.resolve()
    name = "fedbayes_user_model_" + "".join(c if c.isalnum() else "_" for c in str(resolved))
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, resolved)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before exec: dataclasses and flax look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _hashable(value: Any) -> Any:
    """TOML arrays as tuples: flax modules are hashed (they are static arguments of jit)."""
    if isinstance(value, list | tuple):
        return tuple(_hashable(v) for v in value)
    return value


def make_module(path: str, kwargs: dict[str, Any], num_classes: int | None = None) -> nn.Module:
    """An instance of the class at ``path`` with ``kwargs`` (and ``num_classes`` when the class has
    that attribute and ``kwargs`` does not set it).

    Raises:
      ValueError: the import failed or a keyword is not an attribute of the class (the allowed ones named).
    """
    cls = import_class(path)
    fields = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ValueError(f"model.kwargs: {path} has no attribute(s) {unknown}; allowed: {', '.join(fields) or '(none)'}")
    args = {k: _hashable(v) for k, v in kwargs.items()}
    if num_classes is not None and "num_classes" in fields and "num_classes" not in args:
        args["num_classes"] = num_classes
    try:
        return cls(**args)
    except TypeError as exc:
        raise ValueError(f"model.kwargs: {path}: {' '.join(str(exc).split())}") from None


def check_module(model: nn.Module, feature_shape: tuple[int, ...], num_classes: int) -> None:
    """Checks, from shapes alone (``jax.eval_shape``: nothing is computed), that ``model`` has only
    the ``params`` collection and maps ``[batch, *feature_shape]`` to ``[batch, num_classes]``.

    Raises:
      ValueError: one line: the mutable collections it has (BatchNorm's ``batch_stats``, ...), the
        output shape it gives, or the error flax raised when it was applied.
    """
    what = type(model).__name__
    dummy = jax.ShapeDtypeStruct((2, *feature_shape), jnp.float32)
    try:
        variables = jax.eval_shape(model.init, jax.random.key(0), dummy)
    except Exception as exc:  # the user's code
        raise ValueError(f"model.module: {what} cannot be initialised on inputs [batch, {', '.join(map(str, feature_shape))}]: {_first_line(exc)}") from None
    other = sorted(k for k in variables if k != "params")
    if other:
        raise ValueError(
            f"model.module: {what} has the mutable collection(s) {other} (BatchNorm's running statistics); fedbayes federates the "
            "'params' collection only: use flax.linen.GroupNorm or LayerNorm instead"
        )
    try:
        out = jax.eval_shape(lambda p, x: model.apply({"params": p}, x), variables["params"], dummy)
    except Exception as exc:  # dropout or another RNG stream, a mutable collection written in apply, ...
        raise ValueError(f"model.module: {what} cannot be applied to its params alone (no RNG streams, no mutable state): {_first_line(exc)}") from None
    if getattr(out, "shape", None) != (2, num_classes):
        raise ValueError(
            f"model.module: {what} must map [batch, ...] to logits [batch, {num_classes}] (the data's classes); it gives {getattr(out, 'shape', out)}"
        )


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
