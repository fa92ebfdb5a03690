"""``fedbayes bench``'s driver: every workload in its own process(es), repeats interleaved, then
the paired runs; returns the summarized results (see :mod:`fedbayes.bench`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from fedbayes.bench.protocol import run_federated_process, run_limit_processes, run_paired_process, run_relative_process
from fedbayes.bench.report import add_paired, federated_entry, limit_entry, relative_entry, summarize
from fedbayes.bench.workloads import WORKLOADS, BenchSettings, LimitWorkload, baseline_of, check_dataset, is_relative, resolve_names, steady_rounds


class Step(Protocol):
    """One measurement's progress: ``update(done, total)`` while it runs (a federated workload's
    timed rounds; other measurements report none), ``finish(line)`` once it ends, with its result."""

    def update(self, done: int, total: int) -> None: ...

    def finish(self, line: str) -> None: ...


Steps = Callable[[str], Step]  # a measurement's label -> its Step, as it starts


class LoggedStep:
    """A :class:`Step` as one plain line when it ends: its label and result."""

    def __init__(self, log: Callable[[str], None], label: str):
        self.log, self.label = log, label

    def update(self, done: int, total: int) -> None:
        pass

    def finish(self, line: str) -> None:
        self.log(f"{self.label} {line}")


def paired_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """``baseline -> [baseline, *workloads measured against it]`` among ``names``."""
    groups: dict[str, list[str]] = {}
    for n in names:
        base = baseline_of(n)
        if base is not None and base in names:
            groups.setdefault(base, [base]).append(n)
    return groups


def run_bench(
    settings: BenchSettings,
    names: Sequence[str] | None = None,
    *,
    log: Callable[[str], None] = lambda s: None,
    steps: Steps | None = None,
) -> dict[str, dict[str, Any]]:
    """Runs the workloads ``settings.repeats`` times, each in its own process(es), interleaved
    (all workloads of repeat 1, then of repeat 2, ...) so that a change in machine load affects
    workloads and limit alike, and returns :func:`summarize`'s object; then each group of
    workloads that share a ``baseline`` runs once more in one process (:func:`measure_paired`,
    ``steady_rounds * repeats`` interleaved rounds), which adds :data:`PAIRED_RATIO`; last, each
    relative workload runs once in its own process (its repetitions are paired inside it).
    ``steps(label)`` gives each measurement's progress (default: a line to ``log`` as each ends,
    :class:`LoggedStep`).

    Raises:
      BenchError: an unknown workload name (checked first, before any data is touched), a dataset
        that is not on this machine, or a worker that failed.
    """
    steps = steps or (lambda label: LoggedStep(log, label))
    names = resolve_names(names)
    relative = [n for n in names if is_relative(n)]
    names = [n for n in names if not is_relative(n)]
    if names:
        check_dataset(settings)  # the relative workloads run on random inputs, without data
    repeats = []
    for r in range(settings.repeats if names else 0):
        rep = {}
        for name in names:
            w = WORKLOADS[name]
            step = steps(f"repeat {r + 1}/{settings.repeats}  {name:<18}")
            t0 = time.perf_counter()
            if isinstance(w, LimitWorkload):
                rep[name] = limit_entry(run_limit_processes(w, settings))
            else:
                rep[name] = federated_entry(run_federated_process(w, settings, progress=step.update))
            speed = rep[name]["examples_per_s"]
            step.finish(f"{speed:>10,.0f} examples/s  ({time.perf_counter() - t0:.1f} s)")
        repeats.append(rep)
    results = summarize(repeats) if repeats else {}
    # The posterior methods against FedAvg once more, rounds interleaved in one process: the same
    # ratio as ratio_to_fedavg without the process-to-process noise.
    for base, group in paired_groups(names).items() if settings.paired else ():
        rounds = steady_rounds(WORKLOADS[base], settings) * settings.repeats
        step = steps(f"paired        {' + '.join(group):<40}")
        t0 = time.perf_counter()
        add_paired(results, run_paired_process(group, settings, rounds), base)
        step.finish(f"{rounds} interleaved rounds each ({time.perf_counter() - t0:.1f} s)")
    for name in relative:
        step = steps(f"relative      {name:<18}")
        t0 = time.perf_counter()
        results[name] = relative_entry(name, run_relative_process(name, settings))
        step.finish(f"{settings.relative_reps} paired repetitions ({time.perf_counter() - t0:.1f} s)")
    return results
