"""``python tests/killed_run.py ROUND fedbayes-args...``: the fedbayes CLI, killed abruptly after a round.

Runs ``fedbayes ARGS`` in this process and ends it with ``os._exit(137)`` (what a SIGKILL leaves:
no cleanup, no flushing) right after round ``ROUND`` has been recorded and reported, so tests can
check that a run interrupted at that point resumes exactly. A test tool, not part of the library.
"""

import os
import sys

from fedbayes import cli
from fedbayes.runs import loggers


def _die_after(round_to_die: int) -> None:
    for reporter in (loggers.PlainReporter, cli.RichReporter):
        update = reporter.update

        def killing_update(self, round_idx, total, record, _update=update):
            _update(self, round_idx, total, record)
            if round_idx == round_to_die:
                os._exit(137)

        reporter.update = killing_update


if __name__ == "__main__":
    _die_after(int(sys.argv[1]))
    sys.argv = ["fedbayes", *sys.argv[2:]]
    cli.main()
