"""The run-folder format: the one place that knows every file name, how files are written and read.

A **run folder** (``fedbayes run``, ``fedbayes deploy``, one variant or seed of a comparison, one
run of a sweep) holds:

* ``config.toml`` (:data:`CONFIG`): the resolved config (every default written out);
* ``metrics.jsonl`` (:data:`METRICS`): one strict-JSON record per evaluation (:class:`MetricsWriter`,
  :func:`read_metrics`);
* ``clients.jsonl`` (:data:`CLIENTS`): one line per sampled client and round;
* ``model.npz`` (:data:`MODEL`): the final server parameters by tree path (:mod:`fedbayes.runs.export`);
* ``checkpoints/round_NNNNNN.npz`` (:data:`CHECKPOINTS`, :data:`CHECKPOINT_GLOB`);
* ``summary.json`` (:data:`SUMMARY`) and ``curves.png`` (:data:`CURVES`) at the end;
* ``conformal.json`` (:data:`CONFORMAL`) at the end, with ``evaluation.conformal_alpha``
  (:mod:`fedbayes.runs.conformal`);
* ``personal.json`` (:data:`PERSONAL`) at the end, with ``evaluation.personal_fraction``
  (:mod:`fedbayes.runs.personal`);
* ``resume_changes.jsonl`` (:data:`RESUME_CHANGES`): config changes accepted on resume;
* ``client_store/`` (:data:`CLIENT_STORE`): the disk client store when ``store_dir`` is unset;
* ``metrics.csv`` (:data:`METRICS_CSV`, ``--log csv``) and ``error.log`` (:data:`ERROR_LOG`).

A comparison folder holds ``comparison.toml`` and ``compare.{md,json,png}`` beside one run folder
per variant (``VARIANT/``, or ``VARIANT/seed_S/`` over seeds); a sweep folder holds ``sweep.toml``
and ``sweep.{md,json}`` beside ``VARIANT/CELL/seed_S/``.

Every file is replaced atomically (:func:`write_atomic`: a temporary file renamed into place, so a
kill leaves the old file or the new one, never a torn one) except the two append-only logs, whose
torn last line a reader drops. Every JSON file is strict JSON (:mod:`fedbayes.runs.strictjson`:
non-finite values written as ``null`` and named under ``"nonfinite"``).

This module imports nothing heavier than the standard library and NumPy, so reading a run folder
(``fedbayes.load_run``) does not load the simulator or the algorithms.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from fedbayes.runs.strictjson import dumps_record, loads_strict, restore_record

__all__ = [
    "CHECKPOINTS",
    "CHECKPOINT_GLOB",
    "CHECKPOINT_NAME",
    "CLIENTS",
    "CLIENT_STORE",
    "COMPARE_JSON",
    "COMPARE_MD",
    "COMPARE_PLOT",
    "COMPARISON",
    "CONFIG",
    "CONFORMAL",
    "CURVES",
    "ERROR_LOG",
    "METRICS",
    "METRICS_CSV",
    "MODEL",
    "RESUME_CHANGES",
    "SUMMARY",
    "SWEEP",
    "SWEEP_JSON",
    "SWEEP_MD",
    "MetricsWriter",
    "append_jsonl",
    "checkpoint_name",
    "damage",
    "has_checkpoint",
    "read_metrics",
    "read_summary",
    "seed_folder",
    "write_atomic",
    "write_json",
]

# ----- a run folder ------------------------------------------------------------------------------
CONFIG = "config.toml"
METRICS = "metrics.jsonl"
CLIENTS = "clients.jsonl"
MODEL = "model.npz"
SUMMARY = "summary.json"
CONFORMAL = "conformal.json"
PERSONAL = "personal.json"
CURVES = "curves.png"
CHECKPOINTS = "checkpoints"
CHECKPOINT_GLOB = "round_*.npz"
CHECKPOINT_NAME = re.compile(r"^round_(\d{6,})\.npz$")  # group 1: the round
RESUME_CHANGES = "resume_changes.jsonl"
CLIENT_STORE = "client_store"
METRICS_CSV = "metrics.csv"
ERROR_LOG = "error.log"

# ----- a comparison or sweep folder --------------------------------------------------------------
COMPARISON = "comparison.toml"
COMPARE_MD = "compare.md"
COMPARE_JSON = "compare.json"
COMPARE_PLOT = "compare.png"
SWEEP = "sweep.toml"
SWEEP_MD = "sweep.md"
SWEEP_JSON = "sweep.json"

TEMPORARY_SUFFIX = ".tmp"


def seed_folder(folder: str | Path, seed: int) -> Path:
    """The run folder of one seed under a variant's (or a sweep cell's) folder: ``seed_S``."""
    return Path(folder) / f"seed_{seed}"


def checkpoint_name(round_idx: int) -> str:
    """The file name of the checkpoint after ``round_idx`` rounds: ``round_NNNNNN.npz``."""
    return f"round_{round_idx:06d}.npz"


def has_checkpoint(folder: str | Path) -> bool:
    """Whether the run folder holds at least one complete checkpoint (a run to resume)."""
    ckpts = Path(folder) / CHECKPOINTS
    return ckpts.is_dir() and any(ckpts.glob(CHECKPOINT_GLOB))


def write_atomic(path: str | Path, data: str | bytes | Callable[[IO[bytes]], None], *, durable: bool = False) -> Path:
    """Replaces ``path`` with ``data`` (text, bytes, or a function that writes into the open
    binary file) through a temporary file renamed into place: a kill or an error leaves the old
    file (the temporary one is removed on an error). ``durable``: flush to disk before the rename,
    so that the new file survives a power cut too (checkpoints)."""
    path = Path(path)
    tmp = path.with_name(path.name + TEMPORARY_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_json(path: str | Path, record: dict) -> Path:
    """A summary-style JSON file: strict JSON, indented, atomically."""
    return write_atomic(path, dumps_record(record, indent=2) + "\n")


def append_jsonl(path: str | Path, record: dict) -> None:
    """Appends one strict-JSON line (an append-only log: a torn last line is dropped on reading)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, allow_nan=False) + "\n")


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (a missing file: none). Reading stops at the first line
    that is not strict JSON: a line torn by a kill, and everything after it, is dropped.
    Non-finite values written as ``null`` come back as ``nan``."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(restore_record(loads_strict(line)))
            except ValueError:
                break  # a line torn by a kill: everything after it is dropped too
    return out


class MetricsWriter:
    """Writes ``metrics.jsonl``: :meth:`rewrite` replaces it atomically (a fresh run: empty; a
    resumed one: the records its checkpoint holds), :meth:`append` adds one record."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def rewrite(self, records: Iterable[dict]) -> None:
        write_atomic(self.path, "".join(dumps_record(r) + "\n" for r in records))

    def append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(dumps_record(record) + "\n")


def damage(path: str | Path, expected: str, *, more: bool = False) -> str | None:
    """How the file at ``path`` departs from ``expected`` (the text a checkpoint says it holds), in a
    few words naming the first differing line; None when it holds exactly ``expected`` (``more``:
    followed by anything, the lines of rounds after the checkpoint)."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8", "replace")
    except FileNotFoundError:
        return "missing" if expected else None
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    if text == expected or (more and text.startswith(expected)):
        return None
    want, have = expected.splitlines(keepends=True), text.splitlines(keepends=True)
    for i, line in enumerate(want):
        if i >= len(have):
            return f"cut short after line {i} of {len(want)}" if i else "empty"
        if have[i] != line:
            return f"line {i + 1} differs from the run's record"
    return f"{len(have) - len(want)} line(s) more than the run wrote"


def read_summary(folder: str | Path) -> dict:
    """A run folder's ``summary.json``.

    Raises:
      OSError: there is none; ValueError: it is not JSON.
    """
    return json.loads((Path(folder) / SUMMARY).read_text())
