"""The programs of one test, loaded again and again with every copy kept: memory mappings per program
and the crash at Linux's cap (suite_time.md, "The crash in deserialize_executable").

Runs the first case of tests/sim/test_pipeline.py's ``test_pipelined_and_device_store_equal_plain_loop``
once, recording each program it loads from the persistent compilation cache (run it twice: the first
run fills ``FEDBAYES_CACHE``), then loads those programs in turn with ``deserialize_executable``,
keeping the last ``KEEP`` (all by default), and prints the mappings and resident memory every 200
loads. The recording wraps JAX's own loader, ``jax._src.compilation_cache.get_executable_and_time``
(jax 0.10.2), a private function: this is a measurement, not library code.

    FEDBAYES_CACHE=/tmp/pipe-cache python docs/results/deserialize_loop.py [KEEP]
"""

import faulthandler
import sys
from pathlib import Path

faulthandler.enable()
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "sim")]

import conftest  # noqa: E402, F401  (the suite's XLA flags and cache folder)
import test_pipeline as tp  # noqa: E402
from jax._src import compilation_cache as cc  # noqa: E402

loads = []
original = cc.get_executable_and_time


def recording(cache_key, compile_options, backend, executable_devices):
    raw = cc._get_cache(backend).get(cache_key)
    if raw is not None:
        serialized, _ = cc.extract_executable_and_time(cc.decompress_executable(raw))
        loads.append((serialized, compile_options, backend, executable_devices))
    return original(cache_key, compile_options, backend, executable_devices)


def status() -> tuple[int, str]:
    rss = next(line.split(":", 1)[1].strip() for line in open("/proc/self/status") if line.startswith("VmRSS"))
    return open("/proc/self/maps", "rb").read().count(b"\n"), rss


cc.get_executable_and_time = recording
tp.test_pipelined_and_device_store_equal_plain_loop(*tp.CASES[0])
print(f"{len(loads)} programs loaded from the cache by the test", flush=True)
keep = int(sys.argv[1]) if len(sys.argv) > 1 else None
held = []
for i in range(100_000):
    if i % 200 == 0:
        print(i, *status(), flush=True)
    serialized, options, backend, devices = loads[i % len(loads)]
    held.append(backend.deserialize_executable(serialized, devices, options))
    if keep is not None and len(held) > keep:
        held.pop(0)
