"""Experiment logging on the reporter hook: CSV, TensorBoard, Weights & Biases; per-client metrics.

A *reporter* (:class:`Reporter`) is what :func:`fedbayes.runs.loop.run_experiment` calls as it goes:
``start(name, total_rounds, rounds_done)``, ``update(round, total_rounds, record_or_None)`` and
``stop()``. :class:`PlainReporter` prints one line per evaluation (the default);
:class:`Reporters` fans one call out to several, so the progress bar and any number
of loggers run side by side. ``fedbayes run --log csv --log tensorboard`` builds them with
:func:`make_loggers`.

* ``csv``: ``metrics.csv`` in the run folder, one row per evaluation (the same records as
  ``metrics.jsonl``). Always available.
* ``tensorboard``: event files in ``<run>/tensorboard`` through ``tensorboardX``
  (``pip install -e '.[tensorboard]' (from the fedbayes clone)``); view with ``tensorboard --logdir runs``.
* ``wandb``: a Weights & Biases run through the ``wandb`` client (``pip install -e '.[wandb]' (from the fedbayes clone)``),
  written under ``<run>/wandb``. It runs offline unless ``WANDB_MODE`` says otherwise; upload later
  with ``wandb sync``.

Per-client metrics go to ``clients.jsonl`` (:class:`ClientLog`): one line per sampled client and
round with its example count and, where the algorithm reports it, its training loss.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedbayes.runs import folder

LOGGERS = ("csv", "tensorboard", "wandb")


class Reporter(Protocol):
    """What the run loop tells as it goes (progress displays and loggers)."""

    def start(self, name: str, total: int, done: int) -> None: ...

    def update(self, round_idx: int, total: int, record: dict | None) -> None: ...

    def stop(self) -> None: ...


def format_record(r: dict, total: int) -> str:
    """One evaluation as a progress line: ``round R/T  acc ... nll ... ece ...%  S s``."""
    if "nll" in r:
        body = f"acc {r['accuracy']:.4f}  nll {r['nll']:.4f}  ece {100 * r['ece']:.2f}%"
    elif "micro_f1" in r:  # multi-label tag prediction
        body = f"precision {r['precision']:.4f}  recall@5 {r['recall_at_5']:.4f}  micro-F1 {r['micro_f1']:.4f}  macro-F1 {r['macro_f1']:.4f}"
    elif "accuracy" in r:  # next-word prediction
        body = f"acc {r['accuracy']:.4f}  loss {r['loss']:.4f}"
    else:
        body = f"mse {r['mse']:.5f}"
    rej = f"  rejected {r['rejected']}" if r.get("rejected") else ""
    return f"round {r['round']:>4}/{total}  {body}  {r['seconds']:.1f}s{rej}"


def status_text(record: dict) -> str:
    """The short status of a progress bar: accuracy, micro-F1 (multi-label) or MSE."""
    if "accuracy" in record:
        return f"acc {record['accuracy']:.4f}"
    if "micro_f1" in record:
        return f"micro-F1 {record['micro_f1']:.4f}"
    return f"mse {record.get('mse', float('nan')):.5f}"


class PlainReporter:
    """Progress as plain lines (when output is not a terminal)."""

    def __init__(self, echo: Callable[[str], None] = print):
        self.echo = echo

    def start(self, name: str, total: int, done: int) -> None:
        self.echo(f"[{name}] rounds {done}/{total}")

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is not None:
            self.echo(format_record(record, total))

    def stop(self) -> None:
        pass


class LoggerUnavailable(RuntimeError):
    """A logger's optional package is not installed; the message says how to install it."""


class Reporters:
    """Calls every reporter in turn (the first is usually the progress display)."""

    def __init__(self, reporters: Iterable[Any]):
        self.reporters = [r for r in reporters if r is not None]

    def start(self, name: str, total: int, done: int) -> None:
        for r in self.reporters:
            r.start(name, total, done)

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        for r in self.reporters:
            r.update(round_idx, total, record)

    def stop(self) -> None:
        for r in self.reporters:
            r.stop()


class CSVLogger:
    """``metrics.csv``: rewritten atomically after every evaluation from the run's records.

    On a resumed run it starts from ``metrics.jsonl`` (already cut back to the checkpoint), so the
    CSV never holds rows of rounds that were undone.
    """

    def __init__(self, out: str | Path):
        self.out = Path(out)
        self.path = self.out / folder.METRICS_CSV
        self.records: list[dict] = []

    def start(self, name: str, total: int, done: int) -> None:
        self.records = [r for r in folder.read_metrics(self.out / folder.METRICS) if r["round"] <= done]
        self._write()

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is not None:
            self.records.append(record)
            self._write()

    def stop(self) -> None:
        pass

    def _write(self) -> None:
        fields: list[str] = []
        for r in self.records:
            fields += [k for k in r if k not in fields]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(self.records)
        folder.write_atomic(self.path, buf.getvalue())


class TensorBoardLogger:
    """Scalars per evaluated round in ``<run>/tensorboard`` (tensorboardX)."""

    def __init__(self, out: str | Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise LoggerUnavailable("--log tensorboard needs tensorboardX: pip install -e '.[tensorboard]' (from the fedbayes clone)") from None
        self.writer = SummaryWriter(logdir=str(Path(out) / "tensorboard"))

    def start(self, name: str, total: int, done: int) -> None:
        pass

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is None:
            return
        for key, value in record.items():
            if key != "round" and isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=round_idx)
        self.writer.flush()

    def stop(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (offline unless ``WANDB_MODE`` is set) in ``<run>/wandb``."""

    def __init__(self, out: str | Path, config: dict | None = None):
        try:
            import wandb
        except ImportError:
            raise LoggerUnavailable("--log wandb needs the wandb client: pip install -e '.[wandb]' (from the fedbayes clone)") from None
        self.wandb = wandb
        self.out = Path(out)
        self.config = config or {}
        self.run = None

    def start(self, name: str, total: int, done: int) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=os.environ.get("WANDB_PROJECT", "fedbayes"),
            name=name,
            dir=str(self.out),
            config=self.config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="finish_previous",
        )

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is not None and self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "round"}, step=round_idx)

    def stop(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def make_loggers(names: Sequence[str], out: str | Path, config: dict | None = None) -> list[Any]:
    """The loggers named (each at most once), writing into the run folder ``out``.

    Raises:
      ValueError: an unknown name (the message lists the allowed ones).
      LoggerUnavailable: the logger's optional package is missing.
    """
    made = []
    for name in dict.fromkeys(names):
        if name == "csv":
            made.append(CSVLogger(out))
        elif name == "tensorboard":
            made.append(TensorBoardLogger(out))
        elif name == "wandb":
            made.append(WandbLogger(out, config))
        else:
            raise ValueError(f"--log: unknown logger {name!r}; allowed: {', '.join(LOGGERS)}")
    return made


class ClientLog:
    """``clients.jsonl``: one line per sampled client and round.

    Each line holds ``round``, ``client``, ``examples`` (the client's training examples),
    ``rejected`` (whether the server refused its message), ``loss`` (its mean minibatch training
    loss this round) and ``steps`` (its local steps), plus ``acceptance`` and ``divergences`` for
    a sampling client (FedEP's nuts method: the mean acceptance probability of its kept draws and
    its divergent transitions), from the round's
    :attr:`fedbayes.sim.simulator.RoundInfo.clients`.

    The log also keeps the text written so far (:meth:`saved`, zlib-compressed), which each
    checkpoint carries: a resumed run rewrites the file from it (:meth:`restart`), so lines lost,
    cut or garbled since are rebuilt exactly, and the damage is named in one line.
    """

    def __init__(self, path: str | Path, sizes: Sequence[int]):
        self.path = Path(path)
        self.sizes = sizes
        self.text = io.StringIO()

    def saved(self) -> np.ndarray:
        """The text written so far, compressed, as a checkpoint array (uint8)."""
        return np.frombuffer(zlib.compress(self.text.getvalue().encode(), 1), dtype=np.uint8)

    def restart(self, done: int, saved: np.ndarray | None = None, warn: Callable[[str], None] | None = None) -> None:
        """Rewrites the file with the lines of rounds ``<= done`` (0: a fresh run starts an empty file).

        ``saved``: the checkpoint's copy (:meth:`saved`); ``warn`` then gets one line when the file
        did not hold it. A checkpoint without a copy (written by an older version) keeps the file's
        lines of rounds ``<= done``, which must be ``done * per_round`` whole lines.

        Raises:
          RunFolderError: (no ``saved``) the file lacks lines of rounds ``<= done`` or holds a
            damaged one.
        """
        if done == 0:
            kept = ""
        elif saved is not None:
            kept = zlib.decompress(np.asarray(saved, dtype=np.uint8).tobytes()).decode()
            what = folder.damage(self.path, kept, more=True)
            if what is not None and warn is not None:
                warn(f"warning: {self.path}: {what}; rebuilt from the run's checkpoint (round {done})")
        else:
            kept = self._kept_lines(done)
        folder.write_atomic(self.path, kept)
        self.text = io.StringIO()
        self.text.write(kept)

    def _kept_lines(self, done: int) -> str:
        """The file's lines of rounds ``<= done`` (a checkpoint of an older version holds no copy)."""
        from fedbayes.errors import RunFolderError

        lines = self.path.read_text(errors="replace").splitlines() if self.path.is_file() else []
        kept, last = [], 0
        for i, line in enumerate(lines):
            try:
                rec = json.loads(line)
                r = rec["round"] if isinstance(rec, dict) else None
            except (ValueError, KeyError):
                r = None
            if not isinstance(r, int) or isinstance(r, bool) or r < last:
                if last < done:
                    raise RunFolderError(
                        f"{self.path}: line {i + 1} is damaged and the checkpoint (round {done}) holds no copy of it; start the run again with --overwrite"
                    )
                break
            if r > done:
                break
            kept.append(line + "\n")
            last = r
        if last < done:
            raise RunFolderError(
                f"{self.path}: holds rounds up to {last}, the checkpoint is at round {done} and holds no copy; start the run again with --overwrite"
            )
        return "".join(kept)

    def write(self, info: Any, round_idx: int) -> None:
        """Appends the lines of round ``round_idx`` (1 for the first round trained, as in
        ``metrics.jsonl``) from its ``RoundInfo``."""
        c = info.clients
        lines = []
        for i, cid in enumerate(c["client"]):
            line = {"round": int(round_idx), "client": int(cid), "examples": int(c["num_examples"][i]), "rejected": not bool(c["accepted"][i])}
            loss = float(c["loss"][i])
            line["loss"] = loss if math.isfinite(loss) else None  # strict JSON: no bare NaN
            line["steps"] = int(c["steps"][i])
            if "acceptance" in c:  # a sampling client (FedEP's nuts method): its sampler's health
                line.update(acceptance=float(c["acceptance"][i]), divergences=int(c["divergences"][i]))
            if "dropped" in c and (c["dropped"][i] or c["late"][i]):  # failed this round: sent nothing, was not rejected
                line.update(rejected=False, dropped=bool(c["dropped"][i]), late=bool(c["late"][i]))
            lines.append(json.dumps(line) + "\n")
        with open(self.path, "a") as f:
            f.writelines(lines)
        self.text.writelines(lines)
