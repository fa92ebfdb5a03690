"""Feature scaling (``data.standardize``): each feature centred and scaled by its mean and standard
deviation over the clients' training examples, from statistics the clients share.

A network's first layer starts with weights of one scale for every input: a table whose features
differ by orders of magnitude (a concentration near 1000 beside ratios near 0.1) trains to the
majority class unless its features are scaled. Standardising needs each feature's mean and
variance over the training data; in a federation no party holds that data pooled, so each client
shares three sums of its own training rows (:func:`client_moments`: its count, the sum and the sum
of squares of each feature) and the server adds them (:func:`combine`); with them, each feature's
largest magnitude, which decides the default. The test split and the
validation split are scaled by the same statistics; neither contributes to them.

``data.standardize = "auto"`` (the default) is on for your own data (a dataset whose spec has the
``user_data`` trait: ``files``, ``arrays``, or one you register with it) whose features' magnitudes
differ by more than :data:`SCALE_RATIO` (:func:`scale_ratio`), off otherwise: the built-in datasets
come scaled by their loaders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from fedbayes.data import registry
from fedbayes.data.dataset import Dataset

__all__ = ["SCALE_RATIO", "Moments", "client_moments", "combine", "is_user_data", "scale_ratio", "should_standardize", "standardize"]

SCALE_RATIO = 100.0  # features whose largest magnitudes differ by more than this are standardised by default


def is_user_data(dataset: str) -> bool:
    """Whether the registered dataset ``dataset`` is the user's own data (its spec's ``user_data``
    trait), where ``data.standardize = "auto"`` may switch scaling on; an unknown name is not."""
    return dataset in registry.names() and registry.get(dataset).user_data


class Moments(NamedTuple):
    """What one client shares: its number of examples and, per feature, the sum, the sum of
    squares and the largest magnitude."""

    count: int
    sum: np.ndarray
    sum_sq: np.ndarray
    max_abs: np.ndarray


def client_moments(x: np.ndarray, rows: np.ndarray) -> Moments:
    """The moments of the examples ``x[rows]`` (one client's training rows), in float64."""
    part = np.asarray(x[rows], np.float64)
    return Moments(len(rows), part.sum(axis=0), np.square(part).sum(axis=0), np.abs(part).max(axis=0, initial=0.0))


def combine(moments: Sequence[Moments]) -> tuple[np.ndarray, np.ndarray]:
    """Per feature, the mean and the standard deviation of all the clients' examples together,
    from their moments alone; a feature without spread gets a standard deviation of 1 (it stays
    at 0 once centred).

    Raises:
      ValueError: no examples.
    """
    count = sum(m.count for m in moments)
    if count == 0:
        raise ValueError("standardize: the clients hold no training examples")
    mean = sum(m.sum for m in moments) / count
    variance = np.maximum(sum(m.sum_sq for m in moments) / count - np.square(mean), 0.0)
    std = np.sqrt(variance)
    return mean, np.where(std > 1e-12 * np.maximum(np.abs(mean), 1.0), std, 1.0)


def scale_ratio(moments: Sequence[Moments]) -> float:
    """The largest feature magnitude over the smallest, a feature's magnitude being its largest
    absolute value over all the clients' examples (not its spread: a pixel rarely lit is not a
    feature of another scale); features that are all zero are left out; 1 for fewer than two others."""
    magnitude = np.max([m.max_abs for m in moments], axis=0).reshape(-1)
    magnitude = magnitude[magnitude > 0]
    return float(magnitude.max() / magnitude.min()) if len(magnitude) > 1 else 1.0


def should_standardize(setting: bool | str, dataset: str, moments: Sequence[Moments]) -> bool:
    """``data.standardize`` resolved: as set, or (``"auto"``) on for your own data whose features'
    magnitudes differ by more than :data:`SCALE_RATIO`."""
    if setting != "auto":
        return bool(setting)
    return is_user_data(dataset) and scale_ratio(moments) > SCALE_RATIO


def standardize(data: Dataset, parts: Sequence[np.ndarray], setting: bool | str = True, dataset: str = "files") -> Dataset:
    """``data`` with every split's features standardised by the statistics of the clients'
    training rows ``parts`` (a validation split held out of ``x_train`` is scaled, not counted),
    or ``data`` itself where ``setting`` (``data.standardize``, for the config's ``dataset``)
    resolves to off (:func:`should_standardize`)."""
    moments = [client_moments(data.x_train, rows) for rows in parts]
    if not should_standardize(setting, dataset, moments):
        return data
    mean, std = combine(moments)
    scale = lambda x: ((np.asarray(x, np.float64) - mean) / std).astype(data.x_train.dtype)  # noqa: E731
    return dataclasses.replace(data, x_train=scale(data.x_train), x_test=scale(data.x_test))
