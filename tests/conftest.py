"""Test configuration: two XLA host devices (as on the 2-core machine), CPU, strict numerics.

Rank promotion raises, so silent broadcasting bugs fail (docs/style.md, Tests 7). Algebra tests that
need float64 use ``jax.enable_x64`` locally.
"""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
# The suite's programs are tiny and run for milliseconds, so XLA's compile is most of their cost: skip
# its expensive CPU optimisations (one third less CPU on the conformance suite, measured). Results stay
# deterministic; every bitwise comparison in the suite compares programs compiled with the same flags
# (the CLI processes a test starts inherit them: use os.environ["XLA_FLAGS"] when setting it).
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"

# XLA's persistent compilation cache (the one `fedbayes` CLI runs use, fedbayes.cli.enable_compilation_cache),
# in a folder of the tests' own: many tests compile the same small programs (a fresh simulator for a
# resume, the same tiny config through the CLI), and a hit skips XLA's compile. The key holds the
# program, the flags and the versions, so a hit is the same executable. Tests that start the CLI
# in a process of its own set FEDBAYES_CACHE themselves (off, or a folder they test).
os.environ.setdefault("FEDBAYES_CACHE", os.path.join(tempfile.gettempdir(), "fedbayes-tests-xla-cache"))

import time  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from fedbayes.sim.compiled import release_if_crowded  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
# Dtype promotion stays "standard" (docs/style.md asks for "strict"): optax 0.2.8 promotes implicitly
# inside its own code, where no cast of ours reaches: Adam's bias correction (optax.tree_utils.
# tree_bias_correction: a Python float decay to the power of the int32 step count) and the cosine
# schedule of fedbayes.algorithms.fedlap_memory.optimise_global. So "strict" fails every method that runs
# Adam (PVI's local VI with client.optimizer = "adam", FedLap and FedLap-Cov in their tests, the
# FedLap-Func server). Measured with "strict" on tests/inference, evaluation, models, aggregators and
# the FedEP/PVI/FedLap tests: 22 failures; besides optax, fedbayes.data.batches.get_batch mixes int64
# and int32 indices under the FedLap tests' jax.enable_x64, and tests/inference/test_curvature.py mixes
# float64 with float32.
if os.environ["FEDBAYES_CACHE"].lower() not in ("off", "0", "false", "no"):
    jax.config.update("jax_compilation_cache_dir", os.environ["FEDBAYES_CACHE"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.load_profile("ci")


def pytest_addoption(parser):
    parser.addoption(
        "--benchmarks", action="store_true", help="also run the tests marked benchmark (wall-clock and resident-memory assertions); run them alone, without -n"
    )


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` run first; tests marked ``benchmark`` are deselected unless
    ``--benchmarks`` is given: their bounds on time and memory hold on a quiet machine, not beside
    another worker's tests."""
    # The tests marked slow (minutes each) go first, so that no worker runs a 5-minute test alone
    # at the end. pytest-xdist's load scheduler (xdist/scheduler/load.py, LoadScheduling.schedule)
    # gives each worker a first chunk of a quarter of its share of consecutive tests, so the slow
    # ones all land in the first worker's chunk; the other worker takes more of the rest, and both
    # finish on short tests. The order within each group is kept.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if config.getoption("--benchmarks"):
        return
    chosen = [item for item in items if item.get_closest_marker("benchmark") is None]
    if len(chosen) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("benchmark") is not None])
        items[:] = chosen


_last_release_check = [0.0]


@pytest.hookimpl(trylast=True)  # after the test's fixtures are gone, with whatever programs they held
def pytest_runtest_teardown(item, nextitem):
    """A worker runs about a thousand tests in one process, and JAX keeps the compiled programs of
    each: past the kernel's cap on memory mappings the next program crashes the worker
    (fedbayes.sim.compiled). Counting the mappings reads /proc/self/maps (tens of milliseconds at
    30,000), so it runs at most every 2 seconds; a test loads far fewer than the half of the cap
    that release_if_crowded leaves free."""
    now = time.monotonic()
    if now - _last_release_check[0] >= 2.0:
        _last_release_check[0] = now
        release_if_crowded()


@pytest.fixture
def key():
    return jax.random.key(0)
