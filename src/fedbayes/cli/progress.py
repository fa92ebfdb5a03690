"""Progress displays: a rich progress bar on a terminal, plain lines otherwise (runs and sweeps),
and the reporter of a run with the loggers of ``--log`` beside it."""

from __future__ import annotations

import sys
from pathlib import Path

from fedbayes.cli.base import console, fail
from fedbayes.config.schema import RunConfig
from fedbayes.runs.loggers import PlainReporter, format_record, status_text

__all__ = ["BenchProgress", "BenchStep", "RichReporter", "RunLineReporter", "StepsBar", "SweepProgress", "SweepRunReporter", "progress_bar", "reporter"]


# Widths of the progress bar's fixed columns: the count ("100/100"), the status ("acc 0.9123"),
# the time elapsed and the time left ("0:01:23" each); columns are one space apart.
_COUNT, _STATUS, _TIME, _MIN_BAR, _MIN_DESCRIPTION = 7, 10, 7, 10, 12


def progress_bar(on=None):
    """The rich progress bar of runs and sweeps: description, bar, done/total, status, time
    elapsed, time left. It fits the console's width (``on``, default the CLI's console): the bar
    takes what is left beside the description; where too little is left, the bar and then the
    status are left out, with a one-line note, and a long description ends in an ellipsis; the
    count and both times always show."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
    from rich.table import Column

    on = on or console
    width = on.width
    fixed = _COUNT + 1 + 2 * (_TIME + 1)  # count and times, with the spaces before them
    status = _STATUS + 1
    bar = min(40, width - fixed - status - 24 - 1)  # a description of 24 characters beside it
    dropped = []
    if bar < _MIN_BAR:
        bar = 0
        dropped.append("bar")
        if width - fixed - status < _MIN_DESCRIPTION:
            status = 0
            dropped.append("status")
    description = max(_MIN_DESCRIPTION, width - fixed - status - (bar + 1 if bar else 0) - 1)
    cols = [TextColumn("[bold]{task.description}", table_column=Column(no_wrap=True, overflow="ellipsis", max_width=description))]
    if bar:
        cols.append(BarColumn(bar_width=bar))
    cols.append(MofNCompleteColumn())
    if status:
        cols.append(TextColumn("{task.fields[status]}", table_column=Column(no_wrap=True, min_width=_STATUS)))
    cols += [TimeElapsedColumn(), TimeRemainingColumn(elapsed_when_finished=False)]
    if dropped:
        on.print(f"(progress: the {' and the '.join(dropped)} left out to fit {width} columns)", highlight=False, markup=False)
    return Progress(*cols, console=on)


class RichReporter:
    """A rich progress bar (round, accuracy, ETA) for terminals."""

    def __init__(self):
        self.progress = progress_bar()
        self.task = None

    def start(self, name, total, done):
        self.progress.start()
        self.task = self.progress.add_task(name, total=total, completed=done, status="")

    def update(self, round_idx, total, record):
        status = None
        if record is not None:
            status = status_text(record)
        self.progress.update(self.task, completed=round_idx, **({"status": status} if status else {}))

    def stop(self):
        self.progress.stop()


class RunLineReporter:
    """Plain progress of one run of several (a comparison's), where the output is not a terminal:
    one line when the run ends, its last evaluation, instead of a line per round."""

    def __init__(self, echo=print):
        self.echo, self.last, self.total = echo, None, 0

    def start(self, name, total, done):
        self.total = total

    def update(self, round_idx, total, record):
        if record is not None:
            self.last = record

    def stop(self):
        if self.last is not None:
            self.echo(f"    {format_record(self.last, self.total)}")


def reporter(out: Path | None = None, logs: list[str] | None = None, config: RunConfig | None = None, stderr: bool = False, per_round: bool = True):
    """The progress display (stderr when stdout is for JSON) plus the loggers of ``--log``: a bar
    on a terminal, else plain lines, one per evaluation (``per_round``) or one when the run ends."""
    from fedbayes.runs.loggers import LoggerUnavailable, Reporters, make_loggers

    echo = lambda s: print(s, file=sys.stderr if stderr else sys.stdout, flush=True)  # noqa: E731
    if console.is_terminal and not stderr:
        progress = RichReporter()
    else:
        progress = PlainReporter(echo) if per_round else RunLineReporter(echo)
    if not logs:
        return progress
    try:
        loggers = make_loggers(logs, out, config.model_dump(mode="json") if config is not None else None)
    except (ValueError, LoggerUnavailable) as exc:
        fail(f"error: {exc}")
    return Reporters([progress, *loggers])


class StepsBar:
    """A bar for a job counted in steps (``update(done, total)``: the evaluations of a comparison
    under shift) on a terminal, started at its first update; nothing elsewhere, where the job's
    own lines say what it does."""

    def __init__(self, label: str, stderr: bool = False):
        self.label, self.on = label, console.is_terminal and not stderr
        self.progress = self.task = None

    def update(self, done: int, total: int) -> None:
        if not self.on:
            return
        if self.progress is None:
            self.progress = progress_bar()
            self.progress.start()
            self.task = self.progress.add_task(self.label, total=total, status="")
        self.progress.update(self.task, completed=done, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class SweepProgress:
    """One rich progress display for a sweep: the whole sweep and the run in progress; plain
    lines (one per run) when the output is not a terminal."""

    def __init__(self, total: int):
        self.total, self.count = total, 0
        self.progress = None
        if console.is_terminal:
            self.progress = progress_bar()
            self.progress.start()
            self.overall = self.progress.add_task("sweep (runs)", total=total, status="")

    def skip(self, label: str) -> None:
        self.count += 1
        if self.progress is None:
            console.print(f"[{self.count}/{self.total}] {label}: finished earlier, not rerun", highlight=False, soft_wrap=True, markup=False)
        else:
            self.progress.advance(self.overall)

    def reporter(self, label: str):
        return SweepRunReporter(self, label)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class SweepRunReporter:
    """The reporter of one run of a sweep (``run_experiment``'s start/update/stop)."""

    def __init__(self, parent: SweepProgress, label: str):
        self.parent, self.label, self.task, self.last, self.total = parent, label, None, None, 0

    def start(self, name, total, done):
        p = self.parent
        self.total = total
        if p.progress is not None:
            self.task = p.progress.add_task(self.label, total=total, completed=done, status="")
        else:
            console.print(
                f"[{p.count + 1}/{p.total}] {self.label} (from round {done})" if done else f"[{p.count + 1}/{p.total}] {self.label}",
                highlight=False,
                markup=False,
            )

    def update(self, round_idx, total, record):
        if record is not None:
            self.last = record
        if self.task is not None:
            status = "" if record is None else status_text(record)
            self.parent.progress.update(self.task, completed=round_idx, **({"status": status} if status else {}))

    def stop(self):
        p = self.parent
        p.count += 1
        if p.progress is not None:
            if self.task is not None:
                p.progress.remove_task(self.task)
            p.progress.advance(p.overall)
        elif self.last is not None:
            console.print(f"    {format_record(self.last, self.total)}", highlight=False, markup=False)


class BenchProgress:
    """``fedbayes bench``'s progress (the ``steps`` of :func:`fedbayes.bench.run_bench`), on stderr
    so that stdout keeps the table or the JSON: on a terminal, the measurement in progress as a bar
    over its timed rounds (a moving bar for those that report no rounds: limits, paired, relative),
    replaced by its line when it ends; elsewhere only those lines (``echo``). ``on``: the console
    (default stderr's)."""

    def __init__(self, echo=print, on=None):
        from rich.console import Console

        self.echo, self.progress = echo, None
        on = on or Console(stderr=True)
        if on.is_terminal:
            self.progress = progress_bar(on)
            self.progress.start()

    def __call__(self, label: str) -> BenchStep:
        return BenchStep(self, label)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class BenchStep:
    """One measurement of a bench (:class:`fedbayes.bench.Step`): its bar, then its line."""

    def __init__(self, parent: BenchProgress, label: str):
        self.parent, self.label, self.task = parent, label, None
        if parent.progress is not None:
            self.task = parent.progress.add_task(" ".join(label.split()), total=None, status="")

    def update(self, done: int, total: int) -> None:
        if self.task is not None:
            self.parent.progress.update(self.task, completed=done, total=total)

    def finish(self, line: str) -> None:
        progress = self.parent.progress
        if self.task is None or progress is None:
            self.parent.echo(f"{self.label} {line}")
            return
        progress.remove_task(self.task)
        progress.console.print(f"{self.label} {line}", highlight=False, markup=False, soft_wrap=True)
