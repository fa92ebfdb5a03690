"""One process per run folder: an advisory lock held for the run's life.

``run``, ``resume`` and ``compare`` hold ``<folder>/.fedbayes.lock`` while they write into a
folder. A second process asking for the same folder fails at once with
:class:`~fedbayes.errors.RunFolderBusyError`, naming the holder's process id. The lock is an
``flock`` on the file, so the kernel releases it when the holder dies (``kill -9`` included):
a stale lock file never blocks a resume.

The holder's pid is written into the lock file after the lock is taken. (``filelock`` is not used
here: it opens its lock file with ``O_TRUNC`` before trying the lock, so a second process would
erase the pid it is meant to report.)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from fedbayes.errors import BadInputError, RunFolderBusyError

LOCK_NAME = ".fedbayes.lock"


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


@contextlib.contextmanager
def hold(folder: str | os.PathLike, what: str = "run") -> Iterator[Path]:
    """Creates ``folder`` if needed and holds its lock until the block ends.

    Raises:
      RunFolderBusyError: another process holds the lock (the message names its pid).
      BadInputError: the folder cannot be created or written (a file in the way, permissions).
    """
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except FileExistsError:
        raise BadInputError(f"output folder {folder}: a file of that name is in the way") from None
    except NotADirectoryError:
        raise BadInputError(f"output folder {folder}: a parent of it is a file, not a folder") from None
    except PermissionError:
        raise BadInputError(f"output folder {folder}: permission denied (cannot create or write it)") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise RunFolderBusyError(
                f"{folder} is in use by another fedbayes process (pid {_holder(fd)}); wait for it to finish or stop it, then `fedbayes resume {folder}`"
                if what == "run"
                else f"{folder} is in use by another fedbayes process (pid {_holder(fd)}); wait for it to finish or stop it"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield folder
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock
