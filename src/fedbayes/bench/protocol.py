"""The subprocess protocol between ``fedbayes bench`` and its workers.

Every measurement runs in a fresh Python process, so that its start-up, compile time and peak
memory are its own and its XLA flags are set before JAX starts. The parent starts
``python -m fedbayes.bench SPEC`` with ``XLA_FLAGS`` in the environment, where ``SPEC`` is one
JSON object:

* ``{"workload", "settings", "spawn_time", "profile_top"}``: a federated workload
  (:func:`~fedbayes.bench.measure.measure_federated`), one XLA host device per core;
* ``{"workload", "settings", "share", "num_shares", "core", "sync"}``: one process of a limit
  (:func:`~fedbayes.bench.measure.measure_limit`), pinned to ``core`` when it is not null; with
  ``sync`` it prints :data:`READY` once compiled and warm and waits for :data:`GO` on stdin;
* ``{"paired", "rounds", "settings"}``: :func:`~fedbayes.bench.measure.measure_paired`;
* ``{"relative", "settings"}``: a relative workload (:data:`fedbayes.bench.relative.MEASURES`),
  one XLA host device per core.

``settings`` is :func:`settings_to_dict`'s. A federated worker prints its progress as lines of
:data:`PROGRESS_PREFIX` followed by ``DONE TOTAL`` (its timed rounds, at most every
:data:`PROGRESS_INTERVAL_S` seconds), and every worker prints its raw result as one line,
:data:`RESULT_PREFIX` followed by JSON; a non-zero exit or no such line is a
:class:`~fedbayes.bench.workloads.BenchError` carrying the last lines of the worker's stderr.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from fedbayes.bench.measure import measure_federated, measure_limit, measure_paired
from fedbayes.bench.workloads import WORKLOADS, BenchError, BenchSettings, FederatedWorkload, LimitWorkload
from fedbayes.sim.hostdevices import num_cores, xla_flags

RESULT_PREFIX = "FEDBAYES_BENCH_RESULT "
PROGRESS_PREFIX = "FEDBAYES_BENCH_PROGRESS "
PROGRESS_INTERVAL_S = 0.25
READY = "FEDBAYES_BENCH_READY"
GO = "go"


# ----- the parent's side ------------------------------------------------------------------------
def _spawn(spec: dict[str, Any], env_flags: str, stderr) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=env_flags)
    return subprocess.Popen(
        [sys.executable, "-m", "fedbayes.bench", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        text=True,
        bufsize=1,
    )


def _tail(errfile) -> str:
    """The last 15 lines a worker wrote to its stderr file."""
    errfile.seek(0)
    return "\n".join(errfile.read().strip().splitlines()[-15:])


Progress = Callable[[int, int], None]  # progress(done, total): a worker's timed rounds so far


def _read_result(proc: subprocess.Popen, errfile, label: str, progress: Progress | None = None) -> dict[str, Any]:
    result = None
    for line in proc.stdout:
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX) :])
        elif (reported := progress_of(line)) is not None and progress is not None:
            progress(*reported)
    code = proc.wait()
    if code != 0 or result is None:
        raise BenchError(f"benchmark worker {label} failed (exit code {code}):\n{_tail(errfile)}")
    return result


def progress_of(line: str) -> tuple[int, int] | None:
    """``(done, total)`` of a worker's progress line (:func:`progress_lines`), else ``None``."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    done, total = map(int, line[len(PROGRESS_PREFIX) :].split())
    return done, total


def settings_to_dict(settings: BenchSettings) -> dict[str, Any]:
    """``settings`` as the JSON-ready dict a worker's spec carries (:func:`settings_from_dict` reads it)."""
    return dataclasses.asdict(settings)


def settings_from_dict(fields: dict[str, Any]) -> BenchSettings:
    """The :class:`BenchSettings` that :func:`settings_to_dict` wrote (JSON turned ``hidden`` into a list)."""
    return BenchSettings(
        **{**fields, "hidden": tuple(fields["hidden"]), "image_shape": tuple(fields["image_shape"]), "curvature_models": tuple(fields["curvature_models"])}
    )


def run_federated_process(workload: FederatedWorkload, settings: BenchSettings, *, profile_top: int = 0, progress: Progress | None = None) -> dict[str, Any]:
    """Runs one federated workload in a fresh process laid out as the CLI lays itself out (one XLA
    host device per core); ``progress(done, total)`` as its timed rounds advance."""
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    with tempfile.TemporaryFile("w+") as err:
        spec = {"workload": workload.name, "settings": settings_to_dict(settings), "spawn_time": time.time(), "profile_top": profile_top}
        proc = _spawn(spec, flags, err)
        proc.stdin.close()
        return _read_result(proc, err, workload.name, progress)


def run_limit_processes(workload: LimitWorkload, settings: BenchSettings) -> list[dict[str, Any]]:
    """Runs a limit: one pinned single-threaded process per core started together, or one process."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(num_cores()))
    base = os.environ.get("XLA_FLAGS", "")
    if workload.per_core:
        plan = [(i, core) for i, core in enumerate(cores)]
        flags = xla_flags(base, device_count=1, single_thread=True)
    else:
        plan = [(0, None)]
        flags = xla_flags(base, device_count=1)
    errs = [tempfile.TemporaryFile("w+") for _ in plan]
    procs = []
    try:
        for (share, core), err in zip(plan, errs):
            spec = {"workload": workload.name, "settings": settings_to_dict(settings), "share": share, "num_shares": len(plan), "core": core, "sync": True}
            procs.append(_spawn(spec, flags, err))
        for proc, err, (share, _) in zip(procs, errs, plan):  # every process compiled and warm
            line = proc.stdout.readline()
            if line.strip() != READY:
                proc.kill()
                proc.wait()
                raise BenchError(f"benchmark worker {workload.name}[{share}] did not start (exit code {proc.returncode}):\n{_tail(err)}")
        for proc in procs:
            proc.stdin.write(GO + "\n")
            proc.stdin.flush()
            proc.stdin.close()
        return [_read_result(p, e, f"{workload.name}[{s}]") for p, e, (s, _) in zip(procs, errs, plan)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for e in errs:
            e.close()


def run_paired_process(names: Sequence[str], settings: BenchSettings, rounds: int) -> dict[str, Any]:
    """Runs :func:`measure_paired` for ``names`` in a fresh process laid out as the CLI's."""
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    with tempfile.TemporaryFile("w+") as err:
        spec = {"paired": list(names), "rounds": rounds, "settings": settings_to_dict(settings)}
        proc = _spawn(spec, flags, err)
        proc.stdin.close()
        return _read_result(proc, err, "paired " + "+".join(names))


def run_relative_process(name: str, settings: BenchSettings) -> dict[str, Any]:
    """Runs relative workload ``name`` in a fresh process laid out as the CLI's."""
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    with tempfile.TemporaryFile("w+") as err:
        proc = _spawn({"relative": name, "settings": settings_to_dict(settings)}, flags, err)
        proc.stdin.close()
        return _read_result(proc, err, name)


# ----- the worker's side -----------------------------------------------------------------------
def progress_lines(interval_s: float = PROGRESS_INTERVAL_S) -> Progress:
    """``progress(done, total)`` printing :data:`PROGRESS_PREFIX` lines: the first, the last, and
    between them at most one each ``interval_s`` (a print per round would enter the round times)."""
    last = [-float("inf")]

    def progress(done: int, total: int) -> None:
        now = time.perf_counter()
        if done in (0, total) or now - last[0] >= interval_s:
            last[0] = now
            print(f"{PROGRESS_PREFIX}{done} {total}", flush=True)

    return progress


def worker(argv: Sequence[str]) -> None:
    """The entry point of ``python -m fedbayes.bench SPEC``: measures what ``SPEC`` (JSON) names
    and prints :data:`RESULT_PREFIX` and the raw result as one JSON line (see the module docstring)."""
    spec = json.loads(argv[0])
    if spec.get("core") is not None:
        os.sched_setaffinity(0, {spec["core"]})  # before JAX starts its threads
    settings = settings_from_dict(spec["settings"])
    if "paired" in spec:
        print(RESULT_PREFIX + json.dumps(measure_paired(spec["paired"], settings, spec.get("rounds"))), flush=True)
        return
    if "relative" in spec:
        from fedbayes.bench.relative import MEASURES

        print(RESULT_PREFIX + json.dumps(MEASURES[spec["relative"]](settings)), flush=True)
        return
    workload = WORKLOADS[spec["workload"]]
    if isinstance(workload, LimitWorkload):

        def wait_for_go():
            print(READY, flush=True)
            if sys.stdin.readline().strip() != GO:
                raise BenchError("the parent process stopped before the start signal")

        raw = measure_limit(workload, settings, share=spec["share"], num_shares=spec["num_shares"], wait_for_go=wait_for_go if spec.get("sync") else None)
    else:
        raw = measure_federated(workload, settings, spawn_time=spec.get("spawn_time"), profile_top=spec.get("profile_top", 0), on_round=progress_lines())
    print(RESULT_PREFIX + json.dumps(raw), flush=True)
