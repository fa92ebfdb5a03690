"""Where the test suite's time goes: a pytest plugin that records, per test, its wall time and the
seconds JAX spends tracing, lowering and compiling (``jax.monitoring`` events), and a summary of
the records by file. docs/results/suite_time.md has the numbers and the command.

Record (from an empty XLA cache, as on CI; each worker writes ``prof_<worker>.jsonl``)::

    rm -rf /tmp/prof-cache; mkdir -p /tmp/prof; PYTHONPATH=benchmarks FEDBAYES_CACHE=/tmp/prof-cache SUITE_PROFILE_OUT=/tmp/prof \\
      .venv/bin/python -m pytest -q -n 2 -p suite_profile --durations=0 > /tmp/prof/suite.log

Summarise: ``.venv/bin/python benchmarks/suite_profile.py /tmp/prof``. A worker that dies
(the rerun of a crashed test) takes its records with it; ``--durations=0`` in ``suite.log`` still
has every test's time, and the summary reads the times from there when the log is present.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

_current: dict[str, str | None] = {"test": None}
_records: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace_s",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s",
    "/jax/core/compile/backend_compile_duration": "compile_s",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load_s",
}


def _listener(event: str, duration: float, **_) -> None:
    name = EVENTS.get(event)
    if name is not None and _current["test"] is not None:
        record = _records[_current["test"]]
        record[name] += duration
        record[name.replace("_s", "_n")] += 1


def pytest_configure(config) -> None:
    import jax.monitoring

    jax.monitoring.register_event_duration_secs_listener(_listener)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid
    start = time.perf_counter()
    yield
    _records[item.nodeid]["wall_s"] = time.perf_counter() - start
    _current["test"] = None


def pytest_unconfigure(config) -> None:
    out = Path(os.environ.get("SUITE_PROFILE_OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    with (out / f"prof_{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl").open("w") as f:
        for test, record in _records.items():
            f.write(json.dumps({"test": test, **record}) + "\n")


def summarise(folder: Path, top: int = 15) -> str:
    """Markdown tables: the files and the tests that take longest (worker seconds, setup + call +
    teardown), with JAX's compile seconds where a worker's records survived."""
    records = {}
    for path in folder.glob("prof_*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            records[row["test"]] = row
    seconds: dict[str, float] = defaultdict(float)
    log = folder / "suite.log"
    if log.is_file():
        for line in log.read_text().splitlines():
            match = re.match(r"\s*([\d.]+)s (call|setup|teardown)\s+(.+?)\s*$", line)
            if match:
                seconds[match.group(3)] += float(match.group(1))
    else:
        seconds.update({test: row["wall_s"] for test, row in records.items()})
    total = sum(seconds.values())
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for test, s in seconds.items():
        files[test.split("::")[0]][0] += s
        files[test.split("::")[0]][1] += 1
    lines = ["| file | tests timed | worker s | share |", "| --- | ---: | ---: | ---: |"]
    for name, (s, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{name}` | {n} | {s:.0f} | {100 * s / total:.1f}% |")
    lines += [
        f"| all {len(files)} files | {len(seconds)} | {total:.0f} | 100% |",
        "",
        "| test | worker s | XLA compile or cache load s, in the test's process (programs) |",
        "| --- | ---: | ---: |",
    ]
    for test, s in sorted(seconds.items(), key=lambda kv: -kv[1])[:top]:
        row = records.get(test)
        compiled = f"{row.get('compile_s', 0):.0f} ({row.get('compile_n', 0):.0f})" if row else "(worker lost)"
        lines.append(f"| `{test}` | {s:.0f} | {compiled} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1])))
