"""The ``fedbayes`` command line: run, deploy, resume, compare, sweep, config, datasets, new, bench, toy.

No math lives here: commands parse and validate configs, then call :mod:`fedbayes.runs` (one run:
:mod:`fedbayes.runs.loop`; comparisons and sweeps: :mod:`fedbayes.runs.compare`,
:mod:`fedbayes.runs.sweep`) and print what those return. Bad configs exit with code 2 and one line
naming the field and what is allowed, before any work. Every failure is one line on stderr and a
documented exit code (:mod:`fedbayes.errors`; the handler is :func:`fedbayes.cli.base.handled` and
:func:`main`).

Modules: :mod:`~fedbayes.cli.base` (the app, the command context, the error mapping, the entry
point), :mod:`~fedbayes.cli.progress` (progress displays), :mod:`~fedbayes.cli.common` (what the
commands share), :mod:`~fedbayes.cli.running` (run, deploy, resume), :mod:`~fedbayes.cli.comparing`
(compare, sweep), :mod:`~fedbayes.cli.info` (config, datasets, bench), :mod:`~fedbayes.cli.scaffold` (new).
"""

from __future__ import annotations

from fedbayes.cli import interrupts

# Ctrl-C and SIGTERM at any moment of start-up are one line and exit 130 (fedbayes.cli.interrupts):
# the handlers go in before the heavy imports below.
if interrupts.started_as_the_command():
    interrupts.install()

from fedbayes.sim import hostdevices  # noqa: E402

# One XLA host device per core, set before JAX starts (docs/design.md, "Using every core"). A device
# count already in XLA_FLAGS is kept.
hostdevices.configure()

from fedbayes.cli import comparing, info, running, scaffold  # noqa: E402
from fedbayes.cli.base import CACHE_ENV, CommandContext, PlainHelpCommand, app, console, describe_failure, enable_compilation_cache, main  # noqa: E402
from fedbayes.cli.progress import RichReporter  # noqa: E402
from fedbayes.toys.commands import toy_app  # noqa: E402  (toy quadratic | least-squares | niw)

__all__ = ["CACHE_ENV", "CommandContext", "RichReporter", "app", "console", "describe_failure", "enable_compilation_cache", "main"]

# The commands, in the order `fedbayes --help` lists them.
app.command()(running.run)
app.command()(running.deploy)
app.command()(running.resume)
app.command()(comparing.compare)
app.command(help=comparing.SWEEP_HELP)(comparing.sweep)
app.command("config")(info.config_reference)
app.command()(info.datasets)
app.command()(scaffold.new)
app.command()(info.bench)
app.add_typer(toy_app, name="toy")
for _command in (*app.registered_commands, *toy_app.registered_commands):
    if _command.cls in (None, PlainHelpCommand.__base__):  # typer's default: help without rich's escapes under older typer
        _command.cls = PlainHelpCommand
