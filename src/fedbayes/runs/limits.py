"""What the machine can hold: sizes checked before the work starts, and running out of memory as bad input.

* :func:`check_model` estimates, before any parameter is allocated (``jax.eval_shape`` of the
  model's initialiser), the least memory a run needs: the server's parameters and one working copy
  per client of the cohort (its parameters and its gradient), 4 bytes each (float32). A run whose
  least need exceeds the machine's physical memory (:func:`physical_memory`) is refused with one
  line naming the size settings and the estimate (exit 2), instead of failing minutes later.
* :func:`out_of_memory_line` is the one line for a run that ran out of memory all the same (a
  method's own sample or memory-point counts, batch sizes): it names the config's largest size
  settings (:func:`size_settings`), so the user knows which to lower (exit 2, never "please report it").
"""

from __future__ import annotations

import os
from typing import Any

from fedbayes.config.schema import ConfigError, RunConfig
from fedbayes.data import registry as data_registry
from fedbayes.errors import one_line
from fedbayes.models import registry as model_registry

__all__ = ["check_model", "format_bytes", "model_sizes", "out_of_memory_line", "physical_memory", "reads", "size_settings"]

BYTES_PER_PARAMETER = 4  # float32
LARGE = 4096  # a size setting at least this large is named when a run runs out of memory


def physical_memory() -> int | None:
    """The machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def reads(config: RunConfig, key: str) -> bool:
    """Whether the run reads the setting ``key`` (``section.name``): a ``[data]`` key that is some
    registered dataset's own (a key of its spec's ``settings``) is read only by the datasets whose
    settings hold it, and likewise a ``[model]`` key by the models; the on-demand cache's bounds
    only with ``data.on_demand``; every other key is read."""
    if key in ("data.cache_clients", "data.cache_bytes"):
        return config.data.on_demand
    section, _, name = key.partition(".")
    registry, own = {"data": (data_registry, config.data.dataset), "model": (model_registry, config.model.name)}.get(section, (None, None))
    if registry is None or not any(name in spec.setting_keys for spec in registry.specs()):
        return True
    return name in registry.get(own).setting_keys


def model_sizes(config: RunConfig) -> list[tuple[str, Any]]:
    """``(key, value)`` of the run's model's own settings that give its size: the keys of its
    spec's ``settings`` that hold an integer or a list of integers (an MLP's ``model.hidden``, a
    ResNet's ``model.width`` when set)."""
    sizes = []
    for name in model_registry.get(config.model.name).setting_keys:
        value = getattr(config.model, name, None)
        items = list(value) if isinstance(value, (list, tuple)) else [value]
        if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            sizes.append((f"model.{name}", list(value) if isinstance(value, (list, tuple)) else value))
    return sizes


def size_settings(config: RunConfig) -> list[str]:
    """``key = value`` for the config's integer settings of at least :data:`LARGE` (model widths,
    a method's counts, batch sizes) that the run reads (:func:`reads`), largest first; else the
    model's sizes (:func:`model_sizes`) and the batch size."""
    flat: list[tuple[str, Any]] = []

    def walk(prefix: str, d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                walk(f"{prefix}{k}.", v)
            else:
                flat.append((prefix + k, v))

    walk("", config.model_dump(mode="json"))
    ints = [(k, v) for k, v in flat if k not in ("seed", "rounds") and reads(config, k) and _largest(v) >= LARGE]
    ints.sort(key=lambda kv: -_largest(kv[1]))
    if not ints:
        ints = [*model_sizes(config), ("client.batch_size", config.client.batch_size)]
    return [f"{k} = {v}" for k, v in ints]


def _largest(v: Any) -> int:
    items = v if isinstance(v, list) else [v]
    return max((x for x in items if isinstance(x, int) and not isinstance(x, bool)), default=0)


def check_model(config: RunConfig, count_parameters) -> None:
    """Refuses a model that cannot fit: ``count_parameters()`` gives its parameter count without
    allocating it (``jax.eval_shape``).

    Raises:
      ConfigError: the least need exceeds the physical memory; the line names the size settings
        and both numbers.
    """
    have = physical_memory()
    if have is None:
        return
    n = int(count_parameters())
    need = n * BYTES_PER_PARAMETER * (1 + 2 * config.server.clients_per_round)
    if need > have:
        settings = ", ".join(k for k, _ in model_sizes(config)) or "model.name"
        raise ConfigError(
            f"config error: {settings}: the model has {n:,} parameters; with {config.server.clients_per_round} clients a round the run needs "
            f"at least {format_bytes(need)} of memory, this machine has {format_bytes(have)}; choose a smaller model"
        )


def out_of_memory_line(config: RunConfig | None, exc: BaseException) -> str:
    """The one line of a run that ran out of memory: what ran out and the sizes to lower."""
    what = one_line(exc)[:200]
    sizes = f"; lower its sizes: {', '.join(size_settings(config)[:4])}" if config is not None else "; lower the config's sizes"
    return f"error: out of memory: the config asks for more than this machine holds ({what}){sizes}"


def raise_if_too_large(config: RunConfig, exc: BaseException) -> None:
    """Re-raises an out-of-memory failure of a run as its one line (exit 2); other errors pass."""
    from fedbayes.errors import is_out_of_memory

    if is_out_of_memory(exc):
        raise ConfigError(out_of_memory_line(config, exc)) from None
