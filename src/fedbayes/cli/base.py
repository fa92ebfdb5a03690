"""The command line's frame: the typer app, the console, the command context, the
error-to-exit-code mapping and the entry point.

Every command that writes a folder runs under :func:`handled`, which gives it a fresh
:class:`CommandContext` (the run folder being written, the comparison or sweep a resume
continues, the locks held) and turns any failure into one line on stderr and a documented exit
code (:func:`describe_failure`, :mod:`fedbayes.errors`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from fedbayes import __version__
from fedbayes.cli import interrupts
from fedbayes.errors import EXIT_INTERRUPTED, EXIT_UNEXPECTED, exit_code_for, one_line
from fedbayes.runs import folder as run_folder
from fedbayes.runs import report

__all__ = ["CACHE_ENV", "CommandContext", "app", "console", "describe_failure", "enable_compilation_cache", "fail", "handled", "main"]

CACHE_ENV = "FEDBAYES_CACHE"


def enable_compilation_cache() -> str | None:
    """Turns on JAX's persistent compilation cache for CLI runs; returns its folder or None.

    Compiled rounds, evaluators and initialisers are reused across processes, which cuts a
    repeated run's fixed start-up (docs/results/bench.md, "Start-up with the persistent
    compilation cache"). Folder: ``$FEDBAYES_CACHE``, else ``$XDG_CACHE_HOME/fedbayes/xla``,
    else ``~/.cache/fedbayes/xla``; ``FEDBAYES_CACHE=off`` disables it. Capped at 2 GB (JAX
    evicts the least recently used entries).
    """
    import jax

    setting = os.environ.get(CACHE_ENV, "")
    if setting.lower() in ("off", "0", "false", "no"):
        return None
    cache = setting or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fedbayes", "xla")
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:
        return None  # a read-only home: run without the cache
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", 2 * 1024**3)
    return cache


class PlainHelpCommand(typer.core.TyperCommand):
    """A command whose plain-text help shows ``[required]`` and ``[default: ...]`` as written:
    the typer releases flwr pins (0.13-0.20) escape them for rich markup (``\\[required]``) even
    when the help is plain text."""

    def format_help(self, ctx, formatter) -> None:
        super().format_help(ctx, formatter)
        formatter.buffer[:] = [text.replace("\\[", "[") for text in formatter.buffer]


# rich_markup_mode=None: help text is plain text, so "[flower]" and "[privacy]" stay as written (rich markup would eat them)
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None, help="Federated learning as Bayesian inference, in JAX.")
console = Console()
if not console.is_terminal:
    console = Console(width=report.terminal_width())  # logs and CI: $COLUMNS, else 160


def _version(value: bool):
    if value:
        print(f"fedbayes {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")] = False,
):
    """Federated learning as Bayesian inference, in JAX."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Ends the command with ``message`` as one unwrapped line on stderr and exit code ``code``."""
    print(message, file=sys.stderr, flush=True)  # one unwrapped line, whatever the terminal width
    raise typer.Exit(code)


# ----- the command context and the top-level handler -------------------------------------------


@dataclasses.dataclass
class CommandContext:
    """What one command invocation has under way, for the failure line and the cleanup.

    Attributes:
      stack: the locks the command holds (released when it ends, however it ends).
      folder: the run folder being written (its ``error.log``; the resume line of an interrupt).
      resume_target: the comparison or sweep whose ``fedbayes resume`` continues the interrupted run.
      compile_seconds: JAX's compilation in each run folder this command ran (the tables' "compile
        s", which the runs' own files leave out: it belongs to the process, not to the run).
      noted: the notes this command has printed (each once, however many runs it makes).
    """

    stack: contextlib.ExitStack
    folder: Path | None = None
    resume_target: Path | None = None
    compile_seconds: dict[Path, float] = dataclasses.field(default_factory=dict)
    noted: set[str] = dataclasses.field(default_factory=set)

    def hold(self, folder: Path, what: str) -> None:
        """Holds ``folder``'s run lock until the command ends (see :mod:`fedbayes.runs.runlock`)."""
        from fedbayes.runs import runlock

        self.stack.enter_context(runlock.hold(folder, what))


def _log_traceback(exc: BaseException, ctx: CommandContext | None) -> Path | None:
    """Writes the traceback to ``<run folder>/error.log``, else a file under the user's cache."""
    import datetime
    import tempfile
    import traceback

    text = "".join(traceback.format_exception(exc))
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "fedbayes" / "logs"
    candidates = [ctx.folder / run_folder.ERROR_LOG] if ctx is not None and ctx.folder is not None else []
    candidates += [cache / f"error-{stamp}-{os.getpid()}.log", Path(tempfile.gettempdir()) / f"fedbayes-error-{stamp}-{os.getpid()}.log"]
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a") as f:
                f.write(f"{stamp} fedbayes {' '.join(sys.argv[1:])}\n{text}\n")
            return path
        except OSError:
            continue
    return None


def describe_failure(exc: BaseException, ctx: CommandContext | None = None) -> tuple[int, str]:
    """The exit code and the one line the user sees for ``exc`` (see :mod:`fedbayes.errors`);
    ``ctx``: the failed command's context (None: a failure outside the commands)."""
    code = exit_code_for(exc)
    if code == EXIT_INTERRUPTED:
        folder = ctx.folder if ctx is not None else None
        if folder is None:
            target = ctx.resume_target if ctx is not None else None
            return code, f"interrupted; `fedbayes resume {target}` continues it" if target is not None else "interrupted"
        from fedbayes.runs.checkpoint import latest_checkpoint

        ckpt = latest_checkpoint(Path(folder) / run_folder.CHECKPOINTS)
        where = f"from its checkpoint {ckpt.name}" if ckpt is not None else "from the start (no checkpoint was written yet)"
        if ctx.resume_target is not None:  # a run of a sweep or a comparison: resuming that resumes it
            return code, f"interrupted; `fedbayes resume {ctx.resume_target}` continues it ({folder} {where})"
        return code, f"interrupted; `fedbayes resume {folder}` continues {where}"
    if code == EXIT_UNEXPECTED:
        log = _log_traceback(exc, ctx)
        where = f"; traceback in {log}" if log is not None else ""
        return code, f"internal error: {type(exc).__name__}: {one_line(exc)[:300]}{where} (please report it)"
    line = one_line(exc)
    if not line.startswith(("config error:", "data error:", "error:")):
        from fedbayes.errors import DivergedError

        kind = "diverged" if isinstance(exc, DivergedError) else {3: "data error", 4: "run folder error"}.get(code, "error")
        line = f"{kind}: {line}"
    return code, line


def handled(command):
    """Runs a command under the top-level handler with a fresh :class:`CommandContext` as its
    first argument (hidden from the command line): a failure prints one line and exits with its
    code; the locks the command took are released."""
    signature = inspect.signature(command, eval_str=True)

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            ctx = CommandContext(stack)
            try:
                return command(ctx, *args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, (SystemExit, typer.Exit, typer.Abort)) or type(exc).__module__.split(".")[0] in ("click", "typer"):
                    raise
                code, line = describe_failure(exc, ctx)
                interrupts.say_line(line) if code == EXIT_INTERRUPTED else print(line, file=sys.stderr, flush=True)
                raise typer.Exit(code) from None

    wrapper.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])  # typer sees the options only
    return wrapper


# ----- the entry point ---------------------------------------------------------------------------


def main() -> int:
    """The ``fedbayes`` entry point: a failure outside the run commands is one line too.

    It is the process's entry point: once the command has ended, signals are ignored while the
    interpreter shuts down (:func:`fedbayes.cli.interrupts.ignore_from_now`)."""
    code = EXIT_INTERRUPTED
    try:
        interrupts.install()  # again: a program that imported fedbayes.cli and then calls main()
        code = _main()
    except KeyboardInterrupt:  # a signal in the few instructions around the command's own handler
        interrupts.say_line("interrupted")
    finally:
        interrupts.ignore_from_now()
        if code == EXIT_INTERRUPTED:
            if not interrupts.line_said():  # exit 130 always comes with its line, whichever path led here
                interrupts.say_line("interrupted")
            interrupts.exit_interrupted(code)
    return code


def _main() -> int:
    app.pretty_exceptions_enable = False
    try:
        enable_compilation_cache()
        app()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as exc:
        code, line = describe_failure(exc)
        interrupts.say_line(line) if code == EXIT_INTERRUPTED else print(line, file=sys.stderr, flush=True)
        return code
    return 0
