"""Device time per XLA operation, read from a JAX profiler trace: where a round's device time goes.

``jax.profiler.trace(directory, create_perfetto_trace=True)`` writes, beside its XPlane file, a
``*.trace.json.gz`` in the Chrome trace-event format: one complete event (``"ph": "X"``, start
``ts`` and duration ``dur`` in microseconds) per executed operation, on the thread that ran it. On
the CPU backend the host devices run their compiled programs' thunks on the threads of XLA's
Eigen pool; a thunk that calls into a loop (``while.N``, ``conditional.N``) encloses the thunks of
its body, so the events nest. This module turns such a trace into **self times** (an event's
duration less that of the events nested in it on the same thread) and sums them per operation and
per class:

* ``sync``: collectives (``all-reduce``, ``all-gather``, ``reduce-scatter``, ``collective-permute``,
  ``all-to-all``) and the rendezvous inside them. A collective ends only when every device has
  reached it, so on a host device this is mostly **waiting for the other devices**;
* ``control``: the loops' and the thunk executor's own time (``while``, ``conditional``,
  ``ThunkExecutor::Execute``), i.e. dispatch between thunks;
* ``loop``: operations run at least an eighth as often as the loop that carries the most time (the
  call count whose operations add up to the most time: a training step's matmuls and parameter
  update; then a curvature batch's or a server optimiser step's operations count too);
* ``once``: the rest (per client or per round: the cavity, moments, messages, the store).

The JAX ``python`` thread's events (function calls, named ``$file:line name``) and the client
threads' ``... (wait for completion)`` events are host-side and left out. No JAX import: the
parent process of ``fedbayes bench`` reads traces without starting XLA.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["CLASSES", "find_trace", "load_events", "main_loop_count", "op_breakdown", "op_class", "self_times"]

CLASSES = ("loop", "once", "control", "sync")
_SYNC = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "Rendezvous", "Wait: ")
_CONTROL = ("while", "conditional", "call", "ThunkExecutor::Execute")
LOOP_SHARE = 1 / 8  # an op at least this share of the most frequent op's count is a loop op


def find_trace(directory: str | Path) -> Path:
    """The newest ``*.trace.json.gz`` under ``directory`` (where ``jax.profiler.trace`` wrote it)."""
    found = sorted(Path(directory).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(f"no *.trace.json.gz under {directory}: trace with jax.profiler.trace(..., create_perfetto_trace=True)")
    return found[-1]


def load_events(path: str | Path) -> tuple[list[dict[str, Any]], dict[tuple[int, int], str]]:
    """``(complete events, thread names by (pid, tid))`` of a ``.json`` or ``.json.gz`` trace."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return [e for e in events if e.get("ph") == "X"], names


def _is_host(name: str, thread: str) -> bool:
    return thread == "python" or name.startswith("$") or "(wait for completion)" in name or "PjRt" in name or "PjitFunction" in name


def self_times(events: Iterable[Mapping[str, Any]], thread_names: Mapping[tuple[int, int], str] | None = None) -> dict[tuple[int, int], Counter]:
    """Per device thread, the self time (microseconds) of each operation name, and its count.

    Returns ``{(pid, tid): Counter}`` where the counter maps ``name -> self time`` and
    ``("#", name) -> count``. Host-side events are dropped before nesting is resolved.
    """
    thread_names = thread_names or {}
    by_thread: dict[tuple[int, int], list[tuple[float, float, str]]] = defaultdict(list)
    for e in events:
        key = (e["pid"], e["tid"])
        name = e["name"]
        if _is_host(name, thread_names.get(key, "")):
            continue
        by_thread[key].append((float(e["ts"]), float(e.get("dur", 0.0)), name))
    out: dict[tuple[int, int], Counter] = {}
    for key, evs in by_thread.items():
        # Parents first: earlier start, and at equal starts the longer event.
        evs.sort(key=lambda t: (t[0], -t[1]))
        totals: Counter = Counter()
        stack: list[list] = []  # [end, name, self]

        def close(entry):
            totals[entry[1]] += max(entry[2], 0.0)

        for ts, dur, name in evs:
            while stack and ts >= stack[-1][0]:
                close(stack.pop())
            if stack:
                stack[-1][2] -= dur
            stack.append([ts + dur, name, dur])
            totals[("#", name)] += 1
        while stack:
            close(stack.pop())
        out[key] = totals
    return out


def op_class(name: str, count: float, loop_count: float) -> str:
    """``sync``, ``control``, ``loop`` or ``once`` (see the module docstring); ``loop_count`` is the
    call count of the loop that carries the most time (:func:`main_loop_count`)."""
    if name.startswith(_SYNC):
        return "sync"
    if name.startswith(_CONTROL):
        return "control"
    return "loop" if count >= LOOP_SHARE * loop_count else "once"


def main_loop_count(times: Mapping[str, float], counts: Mapping[str, float]) -> float:
    """The call count whose (compute) operations add up to the most time: a training loop's steps."""
    by_count: Counter = Counter()
    for name, t in times.items():
        if not name.startswith(_SYNC + _CONTROL):
            by_count[counts[name]] += t
    return by_count.most_common(1)[0][0] if by_count else 1.0


def op_breakdown(
    events: Iterable[Mapping[str, Any]], thread_names: Mapping[tuple[int, int], str] | None = None, *, rounds: int, top: int = 12
) -> dict[str, Any]:
    """Per-round device time by thread, class and operation.

    Args:
      events: the trace's complete events (:func:`load_events`).
      thread_names: ``(pid, tid) -> name``.
      rounds: how many rounds the trace spans (every figure is divided by it).
      top: how many operations to list.

    Returns:
      ``{"threads": [{"thread", "busy_ms", "loop_ms", "once_ms", "control_ms", "sync_ms"}, ...]``
      (busiest first, threads with under 1% of the busiest one's time dropped), ``"ops": [{"name",
      "class", "ms", "calls"}, ...]`` summed over the threads, most time first, and ``"classes"``:
      each class's milliseconds summed over the threads}; all per round.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    thread_names = thread_names or {}
    per = self_times(events, thread_names)
    busy = {k: sum(v for n, v in c.items() if not isinstance(n, tuple)) for k, c in per.items()}
    if not busy:
        return {"threads": [], "ops": [], "classes": dict.fromkeys(CLASSES, 0.0)}
    most = max(busy.values())
    ops_ms: Counter = Counter()
    ops_calls: Counter = Counter()
    ops_class: dict[str, str] = {}
    threads = []
    for key, c in sorted(per.items(), key=lambda kv: -busy[kv[0]]):
        if busy[key] < 0.01 * most:
            continue
        counts = {n[1]: v for n, v in c.items() if isinstance(n, tuple)}
        loop_count = main_loop_count({n: v for n, v in c.items() if not isinstance(n, tuple)}, counts)
        row = {"thread": thread_names.get(key, f"{key[0]}/{key[1]}"), "busy_ms": busy[key] / 1000 / rounds}
        row.update({f"{cls}_ms": 0.0 for cls in CLASSES})
        for name, us in c.items():
            if isinstance(name, tuple):
                continue
            cls = op_class(name, counts[name], loop_count)
            row[f"{cls}_ms"] += us / 1000 / rounds
            ops_ms[name] += us / 1000 / rounds
            ops_calls[name] += counts[name] / rounds
            ops_class.setdefault(name, cls)
        threads.append(row)
    classes = {cls: sum(t[f"{cls}_ms"] for t in threads) for cls in CLASSES}
    ops = [{"name": n, "class": ops_class[n], "ms": ms, "calls": ops_calls[n]} for n, ms in ops_ms.most_common(top)]
    return {"threads": threads, "ops": ops, "classes": classes}
