"""The run's health guards: divergence (a non-finite loss or model) and calibration (a posterior
too wide for the data).

* **Divergence** (``server.on_divergence``): :func:`non_finite` names the first non-finite
  quantity of a round (the server model's parameters, the round's training loss, then the
  evaluated losses :data:`DIVERGENCE_METRICS`); the run loop then stops with :class:`Diverged`
  (exit code 3; ``summary.json`` records ``diverged``) or warns once and goes on.
  :func:`divergence_message` says what to change and how to continue.
* **Calibration**: :class:`CalibrationCheck` warns once when the marginalised accuracy falls more
  than :data:`CALIBRATION_GAP` below the point estimate's.

The per-method advice (which knob to turn) is read from the method in :func:`divergence_hint`,
:func:`calibration_advice` and :func:`calibration_after_round`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedbayes.config.schema import RunConfig
from fedbayes.errors import DivergedError

__all__ = [
    "CALIBRATION_GAP",
    "DIVERGENCE_METRICS",
    "CalibrationCheck",
    "Diverged",
    "calibration_advice",
    "calibration_after_round",
    "divergence_hint",
    "divergence_message",
    "make_calibration_check",
    "non_finite",
]


class Diverged(DivergedError):
    """A run stopped because a loss or the server model turned non-finite (``server.on_divergence``;
    exit code 3).

    Attributes: ``round``, ``metric`` (what turned non-finite), ``checkpoint`` (the round of the
    last good checkpoint, or None).
    """

    def __init__(self, message: str, round_idx: int, metric: str, checkpoint: int | None):
        super().__init__(message)
        self.round, self.metric, self.checkpoint = round_idx, metric, checkpoint


DIVERGENCE_METRICS = ("loss", "nll", "mse", "nll_marg")  # evaluated losses a guard checks


def non_finite(record: dict | None, params: Any, training_loss: float | None = None) -> str | None:
    """The first non-finite quantity: the server model's parameters, the round's training loss
    (of its accepted clients), then the evaluated losses; None when all are finite.

    The parameters are checked on the host: a check on the devices would queue behind the next
    round, which the pipelined loop has already started."""
    if training_loss is not None and not np.isfinite(training_loss):
        return "training loss"
    if params is not None and not all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(params)):
        return "server parameters"
    for key in DIVERGENCE_METRICS:
        if record is not None and key in record and not np.isfinite(record[key]):
            return f"evaluated {key}"
    return None


# ----- per-method advice -------------------------------------------------------------------------


def divergence_hint(config: RunConfig) -> str:
    """The method's own knobs that can make a run diverge, beside the step sizes (its spec's
    ``divergence_hint``; may be empty)."""
    hint = config.spec.divergence_hint
    return f", or {hint}" if hint else ""


def calibration_advice(config: RunConfig) -> dict:
    """``{"advice": ...}`` for :class:`CalibrationCheck` from the method's spec
    (``calibration_advice``); ``{}`` keeps the check's default (FedEP's and FedSEP's knob)."""
    advice = config.spec.calibration_advice
    return {"advice": advice} if advice else {}


def calibration_after_round(config: RunConfig) -> int:
    """The last round the calibration check skips: the method's burn-in (0: only the initial model)."""
    return config.spec.burn_in_rounds(config.algorithm)


# ----- divergence --------------------------------------------------------------------------------


def divergence_message(config: RunConfig, round_idx: int, metric: str, out: Path, checkpoint: int | None) -> str:
    """The one line of a diverged run: where, the likely cause, the last good checkpoint, how to go on."""
    cause = "likely cause: a step too large for the loss's curvature (client.lr, server.lr" + divergence_hint(config) + ")"
    ckpt = f"last good checkpoint: round {checkpoint}" if checkpoint is not None else "no checkpoint was saved yet (checkpoint_every)"
    return f"diverged at round {round_idx}: {metric} non-finite; {cause}; {ckpt}; continue with: fedbayes resume {out} --set client.lr=... (or server.lr=...)"


# ----- calibration -------------------------------------------------------------------------------

CALIBRATION_GAP = 0.05  # marginalised accuracy this far below the point estimate gets a warning


class CalibrationCheck:
    """Warns once per run, in the log, when the marginalised accuracy falls more than
    :data:`CALIBRATION_GAP` below the point estimate's: the posterior is too wide for the data
    (FedEP/FedSEP: ``scale`` too small for the data size; see docs/algorithms.md, "Choosing scale").
    The initial model and burn-in rounds are not checked."""

    def __init__(self, name: str, after_round: int = 0, advice: str = "raise algorithm.scale (see docs/algorithms.md, 'Choosing scale')"):
        self.name = name
        self.after_round = after_round  # the initial model and burn-in rounds are not checked
        self.advice = advice  # what to change (the default is FedEP's and FedSEP's knob)
        self.message: str | None = None

    def check(self, record: dict) -> None:
        if self.message is not None or "accuracy_marg" not in record or record["round"] <= self.after_round:
            return
        gap = record["accuracy"] - record["accuracy_marg"]
        if gap > CALIBRATION_GAP:
            self.message = (
                f"{self.name}: round {record['round']}: the marginalised accuracy {record['accuracy_marg']:.4f} is "
                f"{100 * gap:.1f} points below the point estimate's {record['accuracy']:.4f}; the posterior is too wide "
                f"for this data: {self.advice}"
            )
            logging.getLogger("fedbayes").warning("warning: %s", self.message)


def make_calibration_check(config: RunConfig) -> CalibrationCheck:
    """The run's calibration check with the method's burn-in and advice."""
    return CalibrationCheck(config.name, after_round=calibration_after_round(config), **calibration_advice(config))
