"""What can go wrong, as one-line errors with documented exit codes.

Every failure a user can cause or meet (a bad config, missing or damaged data, a run that
diverged, a damaged or busy run folder) is an exception whose message is one line for the user
and whose class carries the process exit code. The CLI's top-level handler (``fedbayes.cli``)
prints the line and exits with :func:`exit_code_for`; anything else is unanticipated: one line
plus the path of a log file holding the traceback (exit 1).

=====  ====================================================================================
code   meaning
=====  ====================================================================================
0      success
1      an unanticipated error (a bug): one line and the log file with the traceback
2      bad input: config, command line, an output path that cannot be used, a run larger than
       the machine's memory
3      missing or damaged data, or a run that diverged (non-finite metrics, ``fail_fast``)
4      a damaged run folder that cannot be recovered (no intact checkpoint, a damaged store)
5      the run folder is in use by another fedbayes process (its process id is named)
130    interrupted (Ctrl-C, SIGTERM); the line says how to resume
=====  ====================================================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_BAD_INPUT = 2
EXIT_DATA = 3
EXIT_RUN_FOLDER = 4
EXIT_BUSY = 5
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_UNEXPECTED: "unanticipated error: one line plus the log file holding the traceback",
    EXIT_BAD_INPUT: "bad input: config, command line, unusable output path",
    EXIT_DATA: "missing or damaged data, or a diverged run (non-finite metrics, server.fail_fast)",
    EXIT_RUN_FOLDER: "damaged run folder that cannot be recovered",
    EXIT_BUSY: "run folder in use by another fedbayes process",
    EXIT_INTERRUPTED: "interrupted; the message says how to resume",
}


class FedbayesError(Exception):
    """A failure with a one-line message for the user and an exit code."""

    exit_code = EXIT_UNEXPECTED


class BadInputError(FedbayesError, ValueError):
    """A config value, a command-line argument or an output path that cannot be used."""

    exit_code = EXIT_BAD_INPUT


class DataError(FedbayesError, ValueError):
    """Data that is missing, unreadable or invalid (non-finite values, labels out of range,
    empty splits, damaged gzip/IDX/JSON files). The message names the file (and the client)."""

    exit_code = EXIT_DATA


class DivergedError(FedbayesError, RuntimeError):
    """A run that cannot go on: non-finite server state or metrics, or rejected client messages
    under ``server.fail_fast``."""

    exit_code = EXIT_DATA


class RunFolderError(FedbayesError, RuntimeError):
    """A run folder whose state cannot be recovered: no intact checkpoint, a damaged client store,
    a config that differs from the checkpoint's."""

    exit_code = EXIT_RUN_FOLDER


class RunFolderBusyError(FedbayesError, RuntimeError):
    """Another fedbayes process holds the run folder's lock."""

    exit_code = EXIT_BUSY


def exit_code_for(exc: BaseException) -> int:
    """The documented exit code of an exception (see the module docstring).

    Exceptions of other libraries are mapped by kind: a file that cannot be read or written
    (permissions, a file where a folder is expected, a full disk) is bad input (2), and
    :class:`KeyboardInterrupt` is 130. Anything else is unanticipated (1).
    """
    code = getattr(type(exc), "exit_code", None)
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)):
        return EXIT_BAD_INPUT
    if isinstance(exc, OSError) and exc.errno in (28, 30, 122):  # ENOSPC, EROFS, EDQUOT
        return EXIT_BAD_INPUT
    if is_out_of_memory(exc):  # a config asking for more than the machine holds
        return EXIT_BAD_INPUT
    return EXIT_UNEXPECTED


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is running out of memory: Python's ``MemoryError``, or XLA's
    ``RESOURCE_EXHAUSTED`` (read from the message: this module imports no JAX)."""
    return isinstance(exc, MemoryError) or (type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and "RESOURCE_EXHAUSTED" in str(exc))


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (newlines folded), never empty."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text
