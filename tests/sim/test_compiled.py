"""Compiled programs released before the kernel's cap on memory mappings (fedbayes.sim.compiled)."""

import jax
import jax.numpy as jnp
import pytest

from fedbayes.config.schema import validate
from fedbayes.runs.compile_clock import CompileClock
from fedbayes.runs.loop import run_experiment
from fedbayes.sim import compiled

linux = pytest.mark.skipif(compiled.memory_mappings() is None or compiled.mapping_limit() is None, reason="no /proc/self/maps or vm.max_map_count here")


def _programs(n: int) -> None:
    """Compiles ``n`` distinct programs and keeps no reference to them: only JAX's caches do."""
    for i in range(n):
        jax.jit(lambda x, i=i: jnp.sin(x) * (i + 1.5) + jnp.cos(x) ** 2)(jnp.ones(i + 2)).block_until_ready()


@linux
def test_programs_take_mappings_that_a_release_gives_back():
    """Programs that no test code holds stay in JAX's caches (these 40 functions are dropped after
    one call each; jax.numpy's helpers compiled for each new shape too), each with mappings of its
    own (2-3 for these, about 76 for a round of the tests' logistic regression); a release gives
    them back."""
    compiled.release_if_crowded(fraction=1e-9)  # the tests before this one: every program released
    start = compiled.memory_mappings()
    _programs(40)
    grown = compiled.memory_mappings()
    assert grown >= start + 40, (start, grown)
    assert compiled.release_if_crowded(fraction=1e-9)
    after = compiled.memory_mappings()
    assert after <= start + (grown - start) / 2, (start, grown, after)


@linux
def test_release_happens_only_past_the_fraction_of_the_cap(monkeypatch):
    limit = compiled.mapping_limit()
    f = jax.jit(lambda x: jnp.tanh(x) * 3.25)
    f(jnp.ones(5))
    monkeypatch.setattr(compiled, "memory_mappings", lambda: limit // 2)
    assert not compiled.release_if_crowded(0.5)
    with CompileClock() as kept:
        f(jnp.ones(5)).block_until_ready()
    monkeypatch.setattr(compiled, "memory_mappings", lambda: limit // 2 + 1)
    assert compiled.release_if_crowded(0.5)
    with CompileClock() as released:
        f(jnp.ones(5)).block_until_ready()
    assert kept.seconds == 0 and released.seconds > 0


def test_without_proc_nothing_is_counted_or_released(monkeypatch):
    monkeypatch.setattr(compiled, "MAPS_FILE", "/nonexistent/maps")
    monkeypatch.setattr(compiled, "LIMIT_FILE", "/nonexistent/max_map_count")
    assert compiled.memory_mappings() is None and compiled.mapping_limit() is None
    assert not compiled.release_if_crowded(1e-9)


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, float("nan")])
def test_a_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="fraction"):
        compiled.release_if_crowded(fraction)


@pytest.mark.parametrize("crowded", [False, True])
def test_a_run_in_a_crowded_process_starts_by_releasing_the_programs_before_it(monkeypatch, tmp_path, crowded):
    """A comparison, a sweep or a warm node runs experiment after experiment in one process."""
    limit = compiled.mapping_limit() or 65530
    monkeypatch.setattr(compiled, "mapping_limit", lambda: limit)
    monkeypatch.setattr(compiled, "memory_mappings", lambda: limit if crowded else 0)
    f = jax.jit(lambda x: jnp.tanh(x) * 1.75)
    f(jnp.ones(7))
    config = validate(
        {"rounds": 1, "checkpoint_every": 0, "data": {"dataset": "digits", "num_clients": 2}, "model": {"name": "logreg"}, "server": {"clients_per_round": 2}}
    )
    run_experiment(config, tmp_path / "run", warn=lambda s: None)
    with CompileClock() as again:
        f(jnp.ones(7)).block_until_ready()
    assert (again.seconds > 0) == crowded
