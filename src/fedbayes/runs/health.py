"""The run's health guards: divergence (a non-finite loss or model) and calibration (a posterior
too wide for the data).

* **Divergence** (``server.on_divergence``): :func:`non_finite` names the first non-finite
  quantity of a round (the server model's parameters, the round's training loss, then the
  evaluated losses :data:`DIVERGENCE_METRICS`), and :class:`RejectionStreak` a run whose every
  message was refused for ``server.max_rejected_rounds`` rounds in a row (it would end untrained);
  the run loop then stops with :class:`Diverged` (exit code 3; ``summary.json`` records
  ``diverged``) or warns once and goes on. :func:`divergence_message` says what to change (the
  step-size settings the method has, read from its spec and settings) and how to continue.
* **Calibration**: :class:`CalibrationCheck` warns once when the marginalised accuracy stays more
  than :data:`CALIBRATION_GAP` below the point estimate's for :data:`CALIBRATION_ROUNDS` evaluated
  rounds in a row, or is that far below at the run's end.
* **Learning** (``[health]``): :class:`LearningCheck` warns once about a run whose test NLL stays
  above its untrained model's, or whose accuracy stays far below its best, for several evaluations
  in a row, and stops it (exit 3, :class:`Diverged`) past stricter bounds, naming what to change.
* **Fixed point**: :class:`FixedPointCheck` follows the server posterior (mean and variance; the
  server parameters of a point method) round by round, gives each evaluation record the last
  round's relative change (``posterior_change``), and warns at the end of a run whose last
  :data:`FIXED_POINT_WINDOW` rounds still drift, beyond their round-to-round jitter, by more than
  :data:`FIXED_POINT_MEAN_TOL` (mean) or :data:`FIXED_POINT_VAR_TOL` (the variances' mean log):
  the run stopped before its fixed point.

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
from fedbayes.evaluation.distances import flat64

__all__ = [
    "CALIBRATION_GAP",
    "CALIBRATION_ROUNDS",
    "DIVERGENCE_METRICS",
    "FIXED_POINT_MEAN_TOL",
    "FIXED_POINT_SIGNIFICANCE",
    "FIXED_POINT_VAR_TOL",
    "FIXED_POINT_WINDOW",
    "STOPPED_LEARNING",
    "CalibrationCheck",
    "Diverged",
    "FixedPointCheck",
    "LearningCheck",
    "RejectionStreak",
    "calibration_advice",
    "calibration_after_round",
    "comparison_warnings",
    "divergence_hint",
    "divergence_message",
    "learning_knobs",
    "make_calibration_check",
    "make_learning_check",
    "posterior_snapshot",
    "non_finite",
    "step_settings",
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
    (``calibration_advice``); ``{}`` keeps the check's default (:data:`DEFAULT_CALIBRATION_ADVICE`)."""
    advice = config.spec.calibration_advice
    return {"advice": advice} if advice else {}


def calibration_after_round(config: RunConfig) -> int:
    """The last round the calibration check skips: the method's burn-in (0: only the initial model)."""
    return config.spec.burn_in_rounds(config.algorithm)


# ----- divergence --------------------------------------------------------------------------------


def step_settings(config: RunConfig) -> list[str]:
    """The step-size settings this run's method has: ``client.lr``, ``server.lr`` unless the
    method's server is exact (its spec's ``exact_server``: server.lr is then fixed at 1), and the
    method's own rates (its settings named ``*lr``, e.g. FedLap-Func's ``algorithm.server_lr``)."""
    out = ["client.lr"] + ([] if config.spec.exact_server else ["server.lr"])
    return out + [f"algorithm.{k}" for k in type(config.algorithm).model_fields if k.endswith("lr") and k != "name"]


def divergence_message(config: RunConfig, round_idx: int, metric: str, out: Path, checkpoint: int | None) -> str:
    """The one line of a diverged run: where, the likely cause, the last good checkpoint, how to go on.

    ``metric``: what went wrong (a non-finite quantity, or a :class:`RejectionStreak`'s reason)."""
    knobs = step_settings(config)
    what = metric if metric.startswith(("every ", STOPPED_LEARNING)) else f"{metric} non-finite"
    cause = f"likely cause: a step too large for the loss's curvature ({', '.join(knobs)}" + divergence_hint(config) + ")"
    ckpt = f"last good checkpoint: round {checkpoint}" if checkpoint is not None else "no checkpoint was saved yet (checkpoint_every)"
    alt = f" (or {', '.join(k + '=...' for k in knobs[1:])})" if len(knobs) > 1 else ""
    return f"diverged at round {round_idx}: {what}; {cause}; {ckpt}; continue with: fedbayes resume {out} --set {knobs[0]}=...{alt}"


class RejectionStreak:
    """Rounds in a row in which the server refused every message it got (``server.max_rejected_rounds``
    of them end the run as diverged; 0: never). A round in which no client sent anything (all
    dropped or late) neither extends nor ends a streak. ``count`` is kept in checkpoints."""

    def __init__(self, limit: int, count: int = 0):
        self.limit, self.count = limit, count

    def update(self, info) -> str | None:
        """Takes a round's ``RoundInfo``; returns the reason to stop, or None."""
        c = info.clients
        failed = np.zeros(len(c["client"]), bool) if "dropped" not in c else np.asarray(c["dropped"], bool) | np.asarray(c["late"], bool)
        sent = ~failed
        if not sent.any():
            return None
        self.count = 0 if np.asarray(c["accepted"], bool)[sent].any() else self.count + 1
        if self.limit and self.count >= self.limit:
            return f"every client's message was rejected for {self.count} rounds in a row (server.max_rejected_rounds = {self.limit}; 0 never stops)"
        return None


# ----- learning ----------------------------------------------------------------------------------

STOPPED_LEARNING = "stopped learning"  # the ``metric`` of a run the learning check stops


class LearningCheck:
    """A run that has stopped learning, judged from its evaluations (``[health]``,
    :class:`~fedbayes.config.schema.HealthConfig`).

    An evaluation is *unhealthy* when its test NLL (MSE for regression) is above ``nll_ratio``
    times the untrained model's (the round-0 record) or its accuracy is more than
    ``accuracy_drop`` below the best evaluation so far, and *past the stop bounds* when above
    ``stop_nll_ratio`` times the untrained loss or more than ``stop_accuracy_drop`` below the best.
    ``warn_after`` unhealthy evaluations in a row give one warning; ``stop_after`` evaluations in a
    row past a stop bound make :meth:`check` return the reason to stop. A model worse than no
    training at all, or one that lost most of what it had learnt and does not get it back, is a
    failure of the run's settings (a step or damping too large), not a result: an exit code 0 would
    hide it. The check is a function of the records alone, so a resumed run replays it
    (:meth:`replay`) and warns and stops exactly where an uninterrupted one would.
    """

    def __init__(self, name: str, settings, knobs: str):
        self.name, self.s, self.knobs = name, settings, knobs
        self.loss_key = "nll"
        self.untrained: float | None = None
        self.best: float | None = None
        self.best_round = 0
        self.unhealthy = 0  # evaluations in a row
        self.failing = 0  # evaluations in a row past a stop bound
        self.message: str | None = None  # the warning, once given

    def replay(self, records) -> None:
        """Takes a resumed run's records as if they had just been checked (no log line)."""
        for r in records:
            self.check(r, log=False)

    def _why(self, loss: float | None, acc: float | None, ratio: float, drop: float) -> str | None:
        if loss is not None and self.untrained is not None and np.isfinite(loss) and loss > ratio * self.untrained:
            return f"test {self.loss_key} {loss:.4g} above {'the' if ratio == 1 else f'{ratio:g} times the'} untrained model's {self.untrained:.4g}"
        if acc is not None and self.best is not None and acc < self.best - drop:
            return f"accuracy {acc:.4f}, more than {drop:g} below its best {self.best:.4f} (round {self.best_round})"
        return None

    def check(self, record: dict, log: bool = True) -> str | None:
        """Takes an evaluated round's record; returns the reason to stop the run, or None."""
        self.loss_key = "nll" if "nll" in record else "mse"
        loss, acc = record.get(self.loss_key), record.get("accuracy")
        if record["round"] == 0:
            self.untrained = loss if loss is not None and np.isfinite(loss) and loss > 0 else None
            self.best, self.best_round = acc, 0
            return None
        s = self.s
        warn_why = self._why(loss, acc, s.nll_ratio, s.accuracy_drop)
        stop_why = self._why(loss, acc, s.stop_nll_ratio, s.stop_accuracy_drop)
        self.unhealthy = self.unhealthy + 1 if warn_why else 0
        self.failing = self.failing + 1 if stop_why else 0
        if acc is not None and (self.best is None or acc > self.best):
            self.best, self.best_round = acc, record["round"]
        if warn_why and s.warn_after and self.unhealthy >= s.warn_after and self.message is None:
            self.message = (
                f"{self.name}: round {record['round']}: the run is not learning: {warn_why}, for {self.unhealthy} evaluations in a row; "
                f"likely cause: {self.knobs} ([health] sets when this warns)"
            )
            if log:
                logging.getLogger("fedbayes").warning("warning: %s", self.message)
        if stop_why and s.stop_after and self.failing >= s.stop_after:
            return f"{STOPPED_LEARNING}: {stop_why}, for {self.failing} evaluations in a row (health.stop_after = {s.stop_after}; 0 never stops)"
        return None


def learning_knobs(config: RunConfig) -> str:
    """What to change in a run that stopped learning: the step sizes, and the method's own knobs."""
    return f"a step too large for the loss's curvature ({', '.join(step_settings(config))}{divergence_hint(config)})"


def make_learning_check(config: RunConfig) -> LearningCheck:
    """The run's learning check with its ``[health]`` settings."""
    return LearningCheck(config.name, config.health, learning_knobs(config))


# ----- calibration -------------------------------------------------------------------------------

CALIBRATION_GAP = 0.05  # marginalised accuracy this far below the point estimate ...
CALIBRATION_ROUNDS = 5  # ... in this many evaluated rounds in a row (or at the run's end) gets a warning
DEFAULT_CALIBRATION_ADVICE = (
    'choose its prior precision on held-out data (evaluation.prior_precision = "validation", data.validation_fraction > 0), '
    "where the method's posterior has one (docs/algorithms.md §13.3)"
)


class CalibrationCheck:
    """Warns once per run, in the log, when the marginalised accuracy stays more than
    :data:`CALIBRATION_GAP` below the point estimate's for :data:`CALIBRATION_ROUNDS` evaluated
    rounds in a row, or is that far below at the run's end (:meth:`finish`): the posterior is too
    wide for the data. The initial model and burn-in rounds are not checked.

    A gap in the first rounds after the posterior forms is not a verdict: FedEP's damped sites and
    FedLap-Cov's first curvature start wide and narrow over a few rounds (on scikit-learn's digits,
    FedEP's gap was 15.6 points in its first round after burn-in and under 4 points from its third;
    docs/results/fmnist_compare_digits_fallback.md). A posterior that stays too wide (a
    FedLap-Cov whose marginalised accuracy was 0.07 for 50 rounds) is caught in its fifth round."""

    def __init__(self, name: str, after_round: int = 0, advice: str = DEFAULT_CALIBRATION_ADVICE):
        self.name = name
        self.after_round = after_round  # the initial model and burn-in rounds are not checked
        self.advice = advice  # what to change (the method's spec says; else the post hoc prior precision)
        self.message: str | None = None
        self.streak = 0  # checked evaluations in a row with the gap beyond CALIBRATION_GAP
        self.recent: list[dict] = []  # the last CALIBRATION_ROUNDS checked evaluations

    def replay(self, records) -> None:
        """Takes a resumed run's records as if they had just been checked (no log line)."""
        for r in records:
            self.check(r, log=False)

    def check(self, record: dict, log: bool = True) -> None:
        if self.message is not None or "accuracy_marg" not in record or record["round"] <= self.after_round:
            return
        self.recent = [*self.recent, record][-CALIBRATION_ROUNDS:]
        if _gap(record) <= CALIBRATION_GAP:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= CALIBRATION_ROUNDS:
            self._warn(record, _gap(record), f"for {self.streak} evaluated rounds in a row", log)

    def finish(self, log: bool = True) -> str | None:
        """The run's end: warns if the median gap over its last :data:`CALIBRATION_ROUNDS` checked
        evaluations (fewer in a short or rarely evaluated run) is beyond :data:`CALIBRATION_GAP`.
        Returns the message, if any."""
        if self.message is None and self.recent:
            gap = float(np.median([_gap(r) for r in self.recent]))
            if gap > CALIBRATION_GAP:
                self._warn(self.recent[-1], gap, f"(the median over the run's last {len(self.recent)} evaluated rounds)", log)
        return self.message

    def _warn(self, last: dict, gap: float, when: str, log: bool) -> None:
        self.message = (
            f"{self.name}: round {last['round']}: the marginalised accuracy is {100 * gap:.1f} points below the point "
            f"estimate's {when} ({last['accuracy_marg']:.4f} against {last['accuracy']:.4f} in that round); the posterior is "
            f"too wide for this data: {self.advice}"
        )
        if log:
            logging.getLogger("fedbayes").warning("warning: %s", self.message)


def _gap(record: dict) -> float:
    return record["accuracy"] - record["accuracy_marg"]


def make_calibration_check(config: RunConfig) -> CalibrationCheck:
    """The run's calibration check with the method's burn-in and advice."""
    return CalibrationCheck(config.name, after_round=calibration_after_round(config), **calibration_advice(config))


# ----- fixed point -------------------------------------------------------------------------------

UNSETTLED = "the run ended before its fixed point"  # the start of FixedPointCheck's message (a comparison sums these up)


def comparison_warnings(lines: list[str]) -> list[str]:
    """The runs' warning ``lines`` that a comparison says after its table: all but a run ending
    before its fixed point (:class:`FixedPointCheck`), which is no warning there: the comparison
    chose the round budget, and its table's "fixed point" column says, for every method, whether
    its posterior had settled and how far it still drifted."""
    return [line for line in lines if f": {UNSETTLED}:" not in line]


FIXED_POINT_WINDOW = 10  # rounds over which the end of a run is judged (two halves)
FIXED_POINT_MEAN_TOL = 0.01  # relative L2 drift of the mean between the window's halves
FIXED_POINT_VAR_TOL = 0.05  # drift of the variances' mean log between the window's halves
FIXED_POINT_SIGNIFICANCE = 3.0  # a drift counts only when this many times its noise level


def posterior_snapshot(algorithm, server_state, params) -> tuple[np.ndarray, np.ndarray | None]:
    """The server posterior on the host, flattened: ``(mean, variance)`` from the method's
    ``server_posterior``, or ``(params, None)`` for a point method (``params``: the server model)."""
    posterior = getattr(algorithm, "server_posterior", None)
    if posterior is not None:
        mean, var = jax.device_get(posterior(server_state))
        return flat64(mean), flat64(var)
    return flat64(jax.device_get(params)), None


def _mean_log(v: np.ndarray | None) -> float | None:
    if v is None:
        return None
    ok = (v > 0) & np.isfinite(v)
    return float(np.mean(np.log(v[ok]))) if ok.any() else 0.0


class FixedPointCheck:
    """Whether a run ended at its fixed point, judged from the server posterior's last rounds.

    Every round :meth:`observe` takes the posterior after it (:func:`posterior_snapshot`) and gives
    ``change`` for the round's metric record: ``posterior_change``, the relative L2 change of the
    mean in the round, and ``posterior_var_change``, the change of the variances' mean log.

    :meth:`finish` judges the last ``window`` rounds, split in two halves. A run at its fixed
    point only jitters there (stochastic local steps, sampled curvature), a run on its way drifts.
    So the drift is the change between the halves' averages, and it counts only when it is at
    least :data:`FIXED_POINT_SIGNIFICANCE` times what the round-to-round jitter alone would give
    (for independent jitter, ``E||avg_2 - avg_1||^2 = E||per-round change||^2 / h``, ``h`` rounds
    a half; a steady drift gives ``h^1.5`` times that level). A mean drift above
    :data:`FIXED_POINT_MEAN_TOL` (relative L2) or a drift of the variances' mean log above
    :data:`FIXED_POINT_VAR_TOL` gives one warning that says how far and what to change. A run
    shorter than ``2 * window`` rounds, or resumed inside the window, is not judged, nor is a point
    method (its ``posterior_change`` is recorded all the same): a network trained for a fixed
    budget is rarely at a fixed point, and only a posterior is read as the method's answer.
    """

    def __init__(self, name: str, rounds: int, window: int = FIXED_POINT_WINDOW):
        self.name, self.rounds, self.window = name, rounds, window
        self.half = window // 2
        self.previous: tuple | None = None
        self.change: dict = {}
        self.message: str | None = None
        self.result: dict | None = None  # when judged: settled, and the drifts (summary.json's "fixed_point")
        self.start = rounds - 2 * self.half  # the window is rounds start + 1 .. rounds
        self.sums: list = [None, None]  # per half: [sum of means, sum of mean log variances, count]
        self.jitter: list = []  # per round in the window: (||mean change||^2, mean-log-variance change^2)

    def observe(self, round_idx: int, snapshot: tuple) -> None:
        """Takes the posterior after round ``round_idx`` (the resumed state's too, as a start)."""
        mean, var = snapshot
        level = _mean_log(var)
        if self.previous is not None:
            m0, level0 = self.previous
            with np.errstate(invalid="ignore", over="ignore"):  # a diverged run's NaN: its own check reports it
                dm = float(np.linalg.norm(mean - m0) / max(np.linalg.norm(mean), 1e-12))
            self.change = {"posterior_change": dm} if level is None else {"posterior_change": dm, "posterior_var_change": abs(level - level0)}
            if round_idx > self.start + 1:
                self.jitter.append((float(np.sum(np.square(mean - m0))), 0.0 if level is None else (level - level0) ** 2))
        if self.start < round_idx <= self.rounds and (round_idx == self.start + 1 or self.sums[0] is not None):
            h = 0 if round_idx <= self.start + self.half else 1
            if self.sums[h] is None:
                self.sums[h] = [np.zeros_like(mean), 0.0, 0]
            self.sums[h][0] = self.sums[h][0] + mean
            self.sums[h][1] += 0.0 if level is None else level
            self.sums[h][2] += 1
        self.previous = (mean, level)

    def saved(self) -> dict[str, np.ndarray]:
        """The running sums and jitters, as checkpoint arrays (float64: restored bit for bit)."""
        out = {"fixed_point/jitter": np.asarray(self.jitter, np.float64).reshape(-1, 2)}
        for h, x in enumerate(self.sums):
            if x is not None:
                out[f"fixed_point/sum{h}"] = np.asarray(x[0], np.float64)
                out[f"fixed_point/level{h}"] = np.asarray([x[1], x[2]], np.float64)
        return out

    def restore(self, saved: dict[str, np.ndarray], round_idx: int, snapshot: tuple) -> None:
        """Continues from a checkpoint after round ``round_idx``: its :meth:`saved` arrays and the
        posterior then (``snapshot``, already counted in the sums). Without the arrays (a
        checkpoint of an older version) the run is observed afresh from ``round_idx``."""
        if "fixed_point/jitter" not in saved:
            self.observe(round_idx, snapshot)
            return
        self.jitter = [tuple(map(float, j)) for j in np.asarray(saved["fixed_point/jitter"], np.float64)]
        for h in (0, 1):
            if f"fixed_point/sum{h}" in saved:
                level, count = np.asarray(saved[f"fixed_point/level{h}"], np.float64)
                self.sums[h] = [np.asarray(saved[f"fixed_point/sum{h}"], np.float64), float(level), int(count)]
        self.previous = (snapshot[0], _mean_log(snapshot[1]))

    def finish(self) -> str | None:
        """The warning (also returned) when the last ``window`` rounds drift beyond their jitter;
        :attr:`result` holds the verdict and the drifts whenever the run was judged."""
        if self.rounds < 2 * self.window or self.half < 1 or any(x is None or x[2] != self.half for x in self.sums) or not self.jitter:
            return None
        has_var = self.previous is not None and self.previous[1] is not None
        if not has_var:  # a point method's model: no posterior to read as the method's answer (the metric is kept)
            return None
        (a, la, _), (b, lb, _) = self.sums
        a, b, la, lb = a / self.half, b / self.half, la / self.half, lb / self.half
        jm, jv = (np.mean([j[k] for j in self.jitter]) for k in (0, 1))
        drift_m = float(np.linalg.norm(b - a))
        rel_m = drift_m / max(float(np.linalg.norm(b)), 1e-12)
        moved, kinds = [], []
        if rel_m > FIXED_POINT_MEAN_TOL and drift_m > FIXED_POINT_SIGNIFICANCE * np.sqrt(jm / self.half):
            moved.append(f"mean by {100 * rel_m:.1f}% (relative L2)")
            kinds.append("mean")
        drift_v = abs(lb - la)
        if drift_v > FIXED_POINT_VAR_TOL and drift_v > FIXED_POINT_SIGNIFICANCE * np.sqrt(jv / self.half):
            moved.append(f"variances by {100 * drift_v:.1f}% (mean log ratio)")
            kinds.append("var")
        self.result = {"settled": not moved, "moved": kinds, "mean_drift": rel_m, "var_drift": float(drift_v), "window": self.window}
        if not moved:
            return None
        self.message = (
            f"{self.name}: {UNSETTLED}: over the last {self.window} rounds the server posterior's "
            f"{' and '.join(moved)} still drifted, beyond its round-to-round jitter (tolerance {100 * FIXED_POINT_MEAN_TOL:.0f}% and "
            f"{100 * FIXED_POINT_VAR_TOL:.0f}%); its result is not yet the method's answer: run more rounds (rounds), or converge faster "
            "with a larger damping or more local steps (client.epochs, client.lr); metrics.jsonl's posterior_change shows the trend"
        )
        return self.message
