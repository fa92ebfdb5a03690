"""Signals at any moment: SIGINT and SIGTERM end a command with one line and exit 130.

:func:`install` runs first thing when ``fedbayes.cli`` is imported (before typer, JAX and the
rest are), so there is no window of start-up in which Ctrl-C prints a traceback or SIGTERM kills
without a word. The handler turns the first signal into :class:`KeyboardInterrupt`, which the
command's handler turns into its line (the folder and the resume command, :mod:`fedbayes.cli.base`),
except where raising it would do harm; there it is delivered :data:`DEFER_S` later instead:

* while a module is being imported: an import cut in the middle leaves a half-initialised
  extension module behind (seen: segfaults and a C++ abort at exit when JAX's import was cut);
* while the garbage collector runs a callback (JAX registers one) or a finalizer runs
  (``__del__``, ``weakref.finalize``): an exception there is printed as "Exception ignored" with a
  traceback and then dropped.

Any other place where C code runs Python code and cannot raise (seen once in CI: "Exception
ignored in: 'Path'" during start-up, from no frame the list above names) reaches
:func:`_unraisable`, installed as ``sys.unraisablehook``: the dropped interrupt is delivered
again :data:`DEFER_S` later instead of being printed and lost.

A second signal while the first is being handled (the command cleaning up, writing its line) is
ignored, and so is any signal once the command has ended (:func:`ignore_from_now`: the
interpreter's shutdown). This module imports nothing but the standard library.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

__all__ = ["DEFER_S", "exit_interrupted", "ignore_from_now", "install", "line_said", "say_line", "started_as_the_command", "stopping"]

DEFER_S = 0.05
SIGNALS = (signal.SIGINT, signal.SIGTERM)
_state = {"stopping": False, "command": False}


def stopping() -> bool:
    """Whether a signal has been turned into the interrupt that ends this command."""
    return _state["stopping"]


def started_as_the_command() -> bool:
    """Whether this process is the ``fedbayes`` command (the script, or ``python -m fedbayes.cli``),
    not a program that imports :mod:`fedbayes.cli` (tests): only the command's import installs."""
    if os.path.basename(sys.argv[0] if sys.argv else "") == "fedbayes" or sys.argv[:1] == ["-m"]:
        _state["command"] = True
    return _state["command"]


def say_line(line: str) -> None:
    """Prints the interrupted command's one line on stderr and records that it is out."""
    print(line, file=sys.stderr, flush=True)
    _state["said"] = True


def line_said() -> bool:
    """Whether the interrupted command's line is out (:func:`say_line`)."""
    return bool(_state.get("said"))


def exit_interrupted(code: int) -> None:
    """Ends the command's process at once with ``code`` once its line is out (the command has
    cleaned up: locks released, files written atomically). The interpreter's own shutdown is
    skipped: after a ``KeyboardInterrupt`` it may turn the exit status into death by SIGINT
    (CPython's "unhandled KeyboardInterrupt" exit), and JAX's teardown after an interrupted start
    is where the aborts were seen. A program that merely imported :mod:`fedbayes.cli` returns."""
    if _state["command"]:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def install() -> None:
    """Makes SIGINT and SIGTERM end the command as described above (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in SIGNALS:
        signal.signal(sig, _handle)
    signal.signal(signal.SIGALRM, _handle)  # a deferred signal comes back as SIGALRM
    if sys.unraisablehook is not _unraisable:
        _state["unraisable"] = sys.unraisablehook
        sys.unraisablehook = _unraisable


def ignore_from_now() -> None:
    """The command has ended (its line and exit code are set): a signal during the interpreter's
    shutdown changes nothing, so it is ignored."""
    if threading.current_thread() is threading.main_thread():
        for sig in SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def _handle(signum, frame) -> None:
    if _state["stopping"]:
        return  # the first signal is being handled: clean-up is not cut short
    if signum == signal.SIGALRM and not _state.get("deferred"):
        return  # not ours
    if _must_wait(frame):
        _defer()
        return
    _state["deferred"] = False
    _state["stopping"] = True
    raise KeyboardInterrupt


def _defer() -> None:
    _state["deferred"] = True
    signal.setitimer(signal.ITIMER_REAL, DEFER_S)


def _unraisable(unraisable) -> None:
    """``sys.unraisablehook``: the interrupt that :func:`_handle` raised where Python could only
    drop it is delivered again :data:`DEFER_S` later (nothing was stopped by it); every other
    unraisable exception goes to the hook that was there before."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _state["stopping"] and not line_said():
        _state["stopping"] = False
        _defer()
        return
    _state.get("unraisable", sys.__unraisablehook__)(unraisable)


def _finalizer(code) -> bool:
    """A finalizer (``__del__``, ``weakref.finalize``) also prints an exception as "Exception
    ignored" with a traceback, and drops it (seen: a signal inside ``weakref.finalize.__call__``)."""
    return code.co_name == "__del__" or (code.co_name == "__call__" and os.path.basename(code.co_filename) == "weakref.py")


def _must_wait(frame) -> bool:
    """Whether ``frame`` (or a caller) is importing a module or running a garbage-collector
    callback or a finalizer."""
    depth = 0
    while frame is not None and depth < 400:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or "gc_callback" in code.co_name or _finalizer(code):
            return True
        frame, depth = frame.f_back, depth + 1
    return False
