"""Counts the SuperLink's HTTP requests, for ``benchmarks/flower_overhead.py --count-requests``.

Python imports ``sitecustomize`` at start-up from the path; ``flower_overhead.py`` puts this folder
on the federation's ``PYTHONPATH`` and names a file in ``FEDBAYES_COUNT_REQUESTS``. In the
``flower-superlink`` process only, every HTTP request of its web app is written there as one line
``start (Unix s)  seconds  process CPU s  path`` when it ends. Every other process is untouched.
"""

import os
import sys
import time

if os.environ.get("FEDBAYES_COUNT_REQUESTS") and os.path.basename(sys.argv[0]).startswith("flower-superlink"):
    import fastapi

    _log = open(os.environ["FEDBAYES_COUNT_REQUESTS"], "a", buffering=1)  # noqa: SIM115 - open for the process's life
    _call = fastapi.FastAPI.__call__

    async def _counted(self, scope, receive, send):
        if scope.get("type") != "http":
            return await _call(self, scope, receive, send)
        start = time.time()
        try:
            return await _call(self, scope, receive, send)
        finally:
            _log.write(f"{start:.4f} {time.time() - start:.4f} {time.process_time():.4f} {scope.get('path')}\n")

    fastapi.FastAPI.__call__ = _counted
