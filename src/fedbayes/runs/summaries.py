"""A run's summary (``summary.json``, :func:`summarize`), curve summaries of one run and their
mean and spread over seeds.

Swaroop et al. 2025 (ADMM and Bayes) summarise a run's test-accuracy curve at round
``R`` three ways and average each over 3 seeds, with the standard deviation in parentheses:

* Table 1: the **mean** accuracy over rounds ``R-2, R-1, R``;
* Table 2: the **max** accuracy over the same rounds;
* Table 3: the first round whose accuracy reaches a threshold (no smoothing).

:func:`curve_summary` computes the three for one run's ``metrics.jsonl`` records (and the same on
the validation split, ``val_accuracy``, when the run has one); :func:`aggregate` combines the runs
of several seeds into means and sample standard deviations (:data:`STD_DDOF`). Regression runs
summarise the MSE instead (mean and max over ``R-2..R``; no threshold).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedbayes.evaluation import metrics

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)  # accuracies of summary.json's rounds_to
SPAN = 3  # rounds R-2..R
STD_DDOF = 1  # the sample standard deviation over seeds (n - 1 in the denominator)


def summarize(config, records: list[dict], task: str) -> dict:
    """Final metrics and curve summaries (docs/algorithms.md §13.2) of one run: ``summary.json``
    (``config``: its :class:`~fedbayes.config.schema.RunConfig`)."""
    last = records[-1] if records else {}
    summary: dict[str, Any] = {
        "name": config.name,
        "algorithm": config.algorithm.name,
        "server_optimizer": config.server.optimizer,
        "rounds": config.rounds,
        "final": {k: v for k, v in last.items() if k != "round"},
    }
    if task == "multilabel" and records:
        # Guo et al. 2023 (FedEP) Table 3: each metric's best 100-round running mean, taken separately.
        summary["best_running_mean_100"] = {k: _best(records, k, 100) for k in MULTILABEL_METRICS}
    if task in ("classification", "next_word") and records:
        rounds = [r["round"] for r in records]
        acc = [r["accuracy"] for r in records]
        summary["best_accuracy"] = float(max(acc))
        # Swaroop et al. 2025 (ADMM and Bayes) Table 3: the first round whose accuracy reaches the threshold (no smoothing);
        # Guo et al. 2023 (FedEP) and Al-Shedivat et al. 2021 (FedPA): the first round whose 10-evaluation running mean reaches it.
        summary["rounds_to"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=1) for t in THRESHOLDS}
        summary["rounds_to_rm10"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=10) for t in THRESHOLDS}
        summary["final_mean_3"] = metrics.final_mean(acc, 3)
        for w in (10, 100):
            m = metrics.running_mean(acc, w)
            summary[f"running_mean_{w}"] = None if np.isnan(m[-1]) else float(m[-1])
        summary["best_running_mean_100"] = {"accuracy": _best(records, "accuracy", 100)}
    return summary


MULTILABEL_METRICS = ("precision", "recall", "recall_at_5", "micro_f1", "macro_f1")


def _best(records: list[dict], key: str, window: int) -> float | None:
    """The best ``window``-evaluation running mean of ``key`` (None with fewer evaluations)."""
    pts = [(r["round"], r[key]) for r in records if key in r]
    return metrics.best_within([p[0] for p in pts], [p[1] for p in pts], pts[-1][0], window) if pts else None


def curve_key(records: Sequence[dict], prefix: str = "") -> str | None:
    """The metric a curve is summarised by: ``accuracy`` (classification) or ``mse``; None if absent."""
    for key in ("accuracy", "mse"):
        if any(prefix + key in r for r in records):
            return prefix + key
    return None


def curve_summary(records: Sequence[dict], threshold: float | None = None, *, prefix: str = "", final_round: int | None = None) -> dict[str, Any] | None:
    """Swaroop et al. 2025 (ADMM and Bayes)'s summaries of one curve: mean and max over rounds ``R-2..R``, rounds to ``threshold``.

    Args:
      records: a run's evaluation records (``round`` and the metrics), in round order.
      threshold: the accuracy for ``rounds_to`` (the first evaluated round whose accuracy reaches
        it; None when never reached); ignored for regression.
      prefix: ``"val_"`` summarises the validation split's curve.
      final_round: ``R``; default the last evaluated round. The window holds the *evaluated*
        rounds in ``max(1, R-2)..R``: all three when ``eval_every = 1``, as in the paper.

    Returns:
      ``{"metric", "final_round", "mean_last", "max_last", "rounds_to", "threshold"}``, or None
      when the records hold no such curve.
    """
    key = curve_key(records, prefix)
    if key is None:
        return None
    points = [(int(r["round"]), float(r[key])) for r in records if key in r and r[key] is not None]
    if not points:
        return None
    last = points[-1][0] if final_round is None else int(final_round)
    window = [v for r, v in points if max(1, last - SPAN + 1) <= r <= last] or [points[-1][1]]
    out: dict[str, Any] = {
        "metric": key,
        "final_round": last,
        "mean_last": float(np.mean(window)),
        "max_last": float(np.max(window)),
        "rounds_to": None,
        "threshold": None,
    }
    if key.endswith("accuracy") and threshold is not None:
        rounds, values = zip(*points)
        out["rounds_to"] = metrics.rounds_to_threshold(rounds, values, threshold, window=1)
        out["threshold"] = threshold
    return out


def mean_std(values: Sequence[float | None]) -> dict[str, Any]:
    """``{"mean", "std", "n", "of"}`` over the values that are not None (``n`` of ``of``).

    ``std`` is the sample standard deviation (``ddof = 1``), None for fewer than two values;
    ``mean`` is None when no value is given.
    """
    have = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    out: dict[str, Any] = {"mean": None, "std": None, "n": len(have), "of": len(values)}
    if have:
        out["mean"] = float(np.mean(have))
    if len(have) > STD_DDOF:
        out["std"] = float(np.std(have, ddof=STD_DDOF))
    return out


def is_stat(value) -> bool:
    """A :func:`mean_std` result."""
    return isinstance(value, Mapping) and "mean" in value and "std" in value


def _numbers(d: Mapping) -> dict[str, float]:
    return {k: v for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def aggregate(name: str, runs: Mapping[int, dict], curves: Mapping[int, Sequence[dict]], threshold: float | None = None) -> dict[str, Any]:
    """One method's runs over several seeds as one summary of means and standard deviations.

    Args:
      name: the method (variant) name.
      runs: seed -> that run's ``summary.json``.
      curves: seed -> that run's ``metrics.jsonl`` records.
      threshold: the accuracy for the rounds-to summary.

    Returns:
      A summary shaped like a run's, every number replaced by :func:`mean_std` over the seeds
      that did not diverge: ``final`` (each final metric), ``best_accuracy``, ``curve`` (mean and
      max over ``R-2..R``, rounds to ``threshold``) and ``val_curve`` when the runs have a
      validation split; plus ``message_bytes`` (the first seed's: a seed changes no shape), ``seeds``, ``diverged_seeds`` (seed -> where it diverged), ``runs``
      (the per-seed summaries) and ``diverged`` (the first seed's record) when every seed diverged.
    """
    seeds = sorted(runs)
    first = runs[seeds[0]] if seeds else {}
    ok = [s for s in seeds if not runs[s].get("diverged")]
    out: dict[str, Any] = {
        "name": name,
        **{k: first[k] for k in ("algorithm", "server_optimizer", "rounds", "message_bytes") if k in first},
        "seeds": seeds,
        "diverged_seeds": {str(s): runs[s]["diverged"] for s in seeds if runs[s].get("diverged")},
    }
    if not ok:
        out["diverged"] = runs[seeds[0]]["diverged"] if seeds else {"round": 0, "metric": "no runs"}
        out["runs"] = {str(s): runs[s] for s in seeds}
        return out
    finals = [_numbers(runs[s].get("final", {})) for s in ok]
    keys = [k for k in finals[0] if all(k in f for f in finals)]
    out["final"] = {k: mean_std([f[k] for f in finals]) for k in keys}
    if any("best_accuracy" in runs[s] for s in ok):
        out["best_accuracy"] = mean_std([runs[s].get("best_accuracy") for s in ok])
    for prefix, field in (("", "curve"), ("val_", "val_curve")):
        per_seed = [curve_summary(curves.get(s) or [], threshold, prefix=prefix) for s in ok]
        if all(c is not None for c in per_seed):
            out[field] = {
                "metric": per_seed[0]["metric"],
                "final_round": per_seed[0]["final_round"],
                "threshold": per_seed[0]["threshold"],
                **{k: mean_std([c[k] for c in per_seed]) for k in ("mean_last", "max_last", "rounds_to")},
            }
    out["runs"] = {str(s): runs[s] for s in seeds}
    return out


def mean_curves(curves: Sequence[Sequence[dict]]) -> tuple[list[dict], list[dict]]:
    """The mean and the standard deviation over seeds of every metric, round by round.

    Only rounds evaluated in every run are kept (a diverged run's curve stops early, and the
    mean would otherwise change its membership along the curve).
    """
    curves = [c for c in curves if c]
    if not curves:
        return [], []
    common = set.intersection(*({int(r["round"]) for r in c} for c in curves))
    by_round = [{int(r["round"]): r for r in c} for c in curves]
    mean, std = [], []
    for rnd in sorted(common):
        recs = [b[rnd] for b in by_round]
        keys = [k for k in recs[0] if k != "round" and all(isinstance(r.get(k), (int, float)) and r.get(k) is not None for r in recs)]
        values = {k: np.asarray([float(r[k]) for r in recs]) for k in keys}
        mean.append({"round": rnd, **{k: float(v.mean()) for k, v in values.items()}})
        std.append({"round": rnd, **{k: float(v.std(ddof=STD_DDOF)) if len(v) > STD_DDOF else 0.0 for k, v in values.items()}})
    return mean, std
