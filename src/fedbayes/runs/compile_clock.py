"""How long JAX spends compiling: tracing, lowering and the backend's compilation, as JAX itself
reports them (``jax.monitoring``'s duration events), summed while a :class:`CompileClock` listens.

A run's ``seconds`` (``train s``) leave this time out: on a short run it is most of the wall time
(docs/results/bench.md, "compilation against training in a short run"), and it does not grow
with the rounds. The command line reports it apart.
"""

from __future__ import annotations

import threading

__all__ = ["COMPILE_EVENTS", "CompileClock"]

# jax._src.dispatch's JAXPR_TRACE_EVENT, JAXPR_TO_MLIR_MODULE_EVENT and BACKEND_COMPILE_EVENT
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)


class CompileClock:
    """A context manager: ``seconds`` is the compilation time of every JAX program traced,
    lowered or compiled (on any thread) since it was entered."""

    def __init__(self):
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event in COMPILE_EVENTS:
            with self._lock:
                self.seconds += duration

    def __enter__(self) -> CompileClock:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        import jax.monitoring

        jax.monitoring.unregister_event_duration_listener(self._listen)
