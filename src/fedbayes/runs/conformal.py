"""A finished run's conformal prediction sets (``evaluation.conformal_alpha``): ``conformal.json``.

After the last round, each client scores its own calibration examples (held out of its training
data, :func:`fedbayes.runs.build.prepare_splits`) under the run's final predictives, the server
finds the threshold from the clients' counts (:mod:`fedbayes.evaluation.conformal`: no score
leaves a client), and the sets are evaluated on the test set: coverage against the nominal
``1 - alpha`` and its finite-sample bound, set sizes, and each client's coverage under label skew.
Every predictive the run reports gets its own threshold: the point one and, for a method with a
posterior, the marginalised one (``_marg``, the same draws as ``*_marg``); a variational model's
marginalised predictive is its only one. The simulation computes all clients' scores in one
batch; what the server sees is the protocol's, the counts' sums.

:func:`fedbayes.runs.shift` calibrates the same way on the clean calibration examples and
evaluates the sets on each shifted test set.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedbayes.evaluation import conformal as cf

__all__ = ["NAMES", "SOURCE", "calibrate", "conformal_body", "sets_record", "summary_fields"]

SOURCE = (
    "split conformal (Angelopoulos and Bates 2021), the threshold the federated quantile of the clients' "
    "calibration scores from counts only (fedbayes.evaluation.conformal)"
)
NAMES = {"": "point", "_marg": "marginal"}  # a predictive's suffix -> its name in conformal.json
Predict = Callable[[np.ndarray, int], np.ndarray]
_CALIBRATION_STREAM, _TEST_STREAM = 1, 0


def calibrate(config, predict: Predict, x_train: np.ndarray, y_train: np.ndarray, calibration: Sequence[np.ndarray]) -> cf.Quantile:
    """The threshold of one predictive from the clients' calibration examples (indices into the
    training set), by the count protocol."""
    e = config.evaluation
    index = np.concatenate(calibration)
    scores = cf.label_scores(predict(x_train[index], _CALIBRATION_STREAM), y_train[index], e.conformal_score)
    per_client = np.split(scores, np.cumsum([len(c) for c in calibration])[:-1])  # each client's own
    count, total = cf.client_counts(per_client)
    return cf.federated_quantile(count, total, e.conformal_alpha)


def sets_record(config, predict: Predict, q: cf.Quantile, x: np.ndarray, y: np.ndarray, label_counts: np.ndarray | None = None) -> dict[str, Any]:
    """Coverage and set sizes of the threshold ``q`` on ``(x, y)``; with ``label_counts`` (``[K, C]``,
    each client's labels) each client's coverage (:func:`fedbayes.evaluation.conformal.mixture_coverage`)."""
    e = config.evaluation
    probs = predict(x, _TEST_STREAM)
    sets = cf.prediction_sets(cf.all_scores(probs, e.conformal_score), q.value)
    sizes = cf.set_sizes(sets)
    out: dict[str, Any] = {
        "threshold": q.value,
        "coverage": cf.coverage(sets, y),
        "set_size": float(sizes.mean()),
        "empty_sets": float(np.mean(sizes == 0)),
        "set_size_counts": np.bincount(sizes, minlength=probs.shape[1] + 1).tolist(),  # how many sets of 0, 1, ..., C classes
    }
    if label_counts is not None:
        per_client = cf.mixture_coverage(cf.class_coverage(sets, y, probs.shape[1]), label_counts)
        known = per_client[~np.isnan(per_client)]
        out["client_coverage"] = {
            "min": float(known.min()) if known.size else None,
            "median": float(np.median(known)) if known.size else None,
            "max": float(known.max()) if known.size else None,
            "values": [None if np.isnan(v) else float(v) for v in per_client],
        }
    return out


def conformal_body(config, predictives: Mapping[str, Predict], dataset, parts: Sequence[np.ndarray], calibration: Sequence[np.ndarray], round_idx: int) -> dict:
    """``conformal.json``'s content for the predictives (suffix -> predict) of the model after ``round_idx``."""
    e = config.evaluation
    n = int(sum(len(c) for c in calibration))
    label_counts = np.stack(
        [np.bincount(dataset.y_train[np.concatenate([p, c])], minlength=dataset.num_classes) for p, c in zip(parts, calibration, strict=True)]
    )
    body: dict[str, Any] = {
        "source": SOURCE,
        "alpha": e.conformal_alpha,
        "nominal": 1 - e.conformal_alpha,
        "bound": [1 - e.conformal_alpha, 1 - e.conformal_alpha + 1 / (n + 1)],  # for exchangeable data without ties
        "score": e.conformal_score,
        "round": round_idx,
        "calibration_examples": n,
        "calibration_per_client": [len(c) for c in calibration],
        "test_examples": len(dataset.y_test),
        "client_coverage_note": "each client's coverage under label skew: sum_y pi_j(y) cov(y), pi_j its label mix, cov(y) the class-conditional test coverage",
        "predictives": {},
    }
    for suffix, predict in predictives.items():
        q = calibrate(config, predict, dataset.x_train, dataset.y_train, calibration)
        record = {"rank": q.rank, "queries": q.queries}
        record.update(sets_record(config, predict, q, dataset.x_test, dataset.y_test, label_counts))
        body["predictives"][NAMES[suffix]] = record
    return body


def summary_fields(body: Mapping) -> dict[str, float]:
    """The numbers ``summary.json``'s ``final`` gets (and so the comparison tables): ``coverage``,
    ``set_size`` and ``coverage_client_min`` of each predictive (``_marg`` for the marginalised)."""
    out = {}
    for suffix, name in NAMES.items():
        record = body["predictives"].get(name)
        if record is None:
            continue
        out[f"coverage{suffix}"] = record["coverage"]
        out[f"set_size{suffix}"] = record["set_size"]
        if record.get("client_coverage", {}).get("min") is not None:
            out[f"coverage_client_min{suffix}"] = record["client_coverage"]["min"]
    return out
