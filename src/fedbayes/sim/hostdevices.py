"""How fedbayes lays XLA out over a CPU's cores: one host device per core.

The simulator shards a round's cohort over the local devices and runs each device's clients one
after another (docs/design.md, "Using every core"). XLA reads ``XLA_FLAGS`` once, when JAX starts, so
:func:`configure` must run before JAX is imported; this module imports no JAX. A device count the
user already put in ``XLA_FLAGS`` is kept (the user chose the layout).

Each device keeps XLA's default threading. Single-threaded devices (``SINGLE_THREAD_FLAGS``, as
the compute limit's pinned processes use) were measured and rejected (docs/results/bench.md,
"Threads per device"): with unequal client sizes a device that finishes its clients early no
longer lends its core to the other through Eigen's pool, IID rounds gained nothing clear, and
evaluation split over single-threaded devices was slower.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# The single-threaded XLA CPU flags of the JAX FAQ (the compute limit's processes use them).
SINGLE_THREAD_FLAGS = ("--xla_cpu_multi_thread_eigen=false", "intra_op_parallelism_threads=1")

__all__ = ["DEVICE_COUNT_FLAG", "SINGLE_THREAD_FLAGS", "configure", "num_cores", "xla_flags"]


def num_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def xla_flags(base: str, *, device_count: int, single_thread: bool = False) -> str:
    """``base`` with its device-count and threading flags replaced: ``device_count`` host devices,
    single-threaded if asked; other flags are kept in order."""
    drop = (DEVICE_COUNT_FLAG, "--xla_cpu_multi_thread_eigen", "intra_op_parallelism_threads")
    kept = [f for f in base.split() if not f.startswith(drop)]
    kept.append(f"{DEVICE_COUNT_FLAG}={device_count}")
    if single_thread:
        kept.extend(SINGLE_THREAD_FLAGS)
    return " ".join(kept)


def configure(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets ``XLA_FLAGS`` for one host device per core, unless it already names a device count
    (the user's choice). Returns whether it changed anything."""
    base = environ.get("XLA_FLAGS", "")
    if DEVICE_COUNT_FLAG in base:
        return False
    environ["XLA_FLAGS"] = f"{base} {DEVICE_COUNT_FLAG}={num_cores()}".strip()  # the user's other flags stay
    return True
