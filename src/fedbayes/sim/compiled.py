"""The compiled programs a process holds, released before the kernel's cap on memory mappings.

XLA:CPU links every program it compiles, or loads from the persistent compilation cache, into
memory of its own: each of the program's object files gets its own mappings for code, read-only
data and data. Linux caps the mappings of one process (``vm.max_map_count``, 65,530 by default).
JAX keeps the programs it compiled in least-recently-used caches of up to thousands of entries,
also those of runs that have finished, so a process that runs many experiments one after another
(a comparison, a sweep, a warm Flower node, a notebook, the test suite's workers) gains mappings
with every new program. At the cap the next program's memory cannot be mapped; jaxlib 0.10's
loader then fails, and the process dies with a segmentation fault while the error unwinds,
instead of raising it (docs/results/suite_time.md, "The crash in deserialize_executable").

:func:`release_if_crowded` drops JAX's caches of compiled programs (``jax.clear_caches``) once the
process holds more than a given fraction of the cap. A program that is called again afterwards is
traced again and compiled, or loaded from the persistent cache: results do not change. Outside
Linux (no ``/proc``) nothing is counted and nothing is released.
"""

from __future__ import annotations

import gc

__all__ = ["CROWDED", "MAPS_FILE", "LIMIT_FILE", "mapping_limit", "memory_mappings", "release_if_crowded"]

MAPS_FILE = "/proc/self/maps"
LIMIT_FILE = "/proc/sys/vm/max_map_count"
# Half the cap leaves room for hundreds of programs before the next check: a round program of
# the test suite's logistic regression takes about 76 mappings.
CROWDED = 0.5


def memory_mappings() -> int | None:
    """The number of memory mappings this process holds (lines of ``/proc/self/maps``); None
    where the system does not say."""
    try:
        with open(MAPS_FILE, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def mapping_limit() -> int | None:
    """The kernel's cap on one process's memory mappings (``vm.max_map_count``); None where the
    system does not say."""
    try:
        with open(LIMIT_FILE) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def release_if_crowded(fraction: float = CROWDED) -> bool:
    """Clears JAX's caches of compiled programs when this process holds more than ``fraction`` of
    the kernel's cap on memory mappings; returns whether it did.

    Raises:
      ValueError: ``fraction`` not in ``(0, 1]``.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    count, limit = memory_mappings(), mapping_limit()
    if count is None or limit is None or count <= fraction * limit:
        return False
    import jax

    jax.clear_caches()
    gc.collect()  # the programs go with the last reference to them; cycles hold some
    return True
