"""The in-memory dataset every fedbayes loader returns.

A :class:`Dataset` holds host (numpy) arrays for one train/test split. Federated structure is kept
separately: either a natural partition (``client_ids``, for LEAF and synthetic federations) or a
partition computed later by :mod:`fedbayes.data.partition` as index arrays into the train set.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fedbayes.errors import DataError

TASKS = ("classification", "regression", "multilabel", "next_word")
# Tasks whose targets are one row per example: multilabel 0/1 [N, L]; next_word token ids [N, T].
ROW_TARGETS = ("multilabel", "next_word")


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are not on this machine. The message says how to get them (exit code 3)."""

    exit_code = DataError.exit_code


def check_dataset(ds: Dataset, source: str) -> None:
    """The checks every loaded dataset passes once, before any training: both splits non-empty,
    finite features (and targets), integer labels inside ``[0, num_classes)``.

    Raises:
      DataError: one line naming ``source`` (the dataset's folder or name), the split and the
        first offending example.
    """
    for split, x, y, ids in (("train", ds.x_train, ds.y_train, ds.client_ids), ("test", ds.x_test, ds.y_test, ds.test_client_ids)):
        where = lambda i: f"{source}: {split} example {i}" + ("" if ids is None else f" (client {int(ids[i])})")  # noqa: E731
        if len(y) == 0:
            raise DataError(f"{source}: the {split} split holds no examples")
        if np.issubdtype(x.dtype, np.floating):
            bad = ~np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            if bad.any():
                raise DataError(f"{where(int(np.argmax(bad)))}: non-finite feature (NaN, Inf or null); {int(bad.sum())} such example(s)")
        if np.issubdtype(y.dtype, np.floating):
            bad = ~np.isfinite(y)
            if bad.any():
                raise DataError(f"{where(int(np.argmax(bad)))}: non-finite target; {int(bad.sum())} such example(s)")
        if ds.task in ("classification", "next_word"):
            bad = ((y < 0) | (y >= ds.num_classes)).reshape(len(y), -1).any(axis=1)
            if bad.any():
                i = int(np.argmax(bad))
                raise DataError(f"{where(i)}: label {y[i].max() if y.ndim > 1 else y[i]} is outside the {ds.num_classes} classes 0..{ds.num_classes - 1}")
        if ds.task == "multilabel":
            bad = ~((y == 0) | (y == 1)).all(axis=1)
            if bad.any():
                raise DataError(f"{where(int(np.argmax(bad)))}: multi-label targets must be 0 or 1")


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """A train/test split held as numpy arrays.

    Equality is identity (``eq=False``): element-wise array comparison has no single truth value.

    Attributes:
      name: short name, e.g. ``"fashion_mnist"``.
      x_train: ``[N, *feature_shape]`` float32 features (int32 token ids for text).
      y_train: ``[N]`` int32 labels (classification) or float32 targets (regression);
        ``[N, L]`` float32 0/1 (multilabel) or ``[N, T]`` int32 next tokens (next_word).
      x_test: ``[N_test, *feature_shape]``, same dtype as ``x_train``.
      y_test: ``[N_test]``, same dtype as ``y_train``.
      num_classes: number of classes (labels L for multilabel; the extended vocabulary for
        next_word); 0 for regression.
      task: one of :data:`TASKS`.
      client_ids: optional ``[N]`` int64 natural partition of the train set.
      test_client_ids: optional ``[N_test]`` int64 natural partition of the test set.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    task: str
    client_ids: np.ndarray | None = None
    test_client_ids: np.ndarray | None = None

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if self.task == "regression" and self.num_classes != 0:
            raise ValueError(f"num_classes must be 0 for regression, got {self.num_classes}")
        if self.task != "regression" and self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1 for classification, got {self.num_classes}")
        for split, x, y, ids in (
            ("train", self.x_train, self.y_train, self.client_ids),
            ("test", self.x_test, self.y_test, self.test_client_ids),
        ):
            if x.shape[0] != y.shape[0] or y.ndim != (2 if self.task in ROW_TARGETS else 1):
                raise ValueError(f"{self.name}: {split} features {x.shape} and targets {y.shape} do not align")
            if ids is not None and ids.shape != y.shape[:1]:
                raise ValueError(f"{self.name}: {split} client ids {ids.shape} do not align with targets {y.shape}")
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"{self.name}: train feature shape {self.x_train.shape[1:]} differs from test {self.x_test.shape[1:]}")

    @property
    def feature_shape(self) -> tuple[int, ...]:
        """Shape of one example, ``x_train.shape[1:]``."""
        return tuple(self.x_train.shape[1:])

    @property
    def num_train(self) -> int:
        """Number of training examples."""
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        """Number of test examples."""
        return int(self.x_test.shape[0])

    def subsample(self, fraction: float, rng: np.random.Generator) -> Dataset:
        """A random ``fraction`` of the train set, drawn without replacement; the test set is kept.

        Swaroop et al. 2025 (ADMM and Bayes) (001) trains its 10-client FMNIST runs on a random 10% of the training set per seed
        (docs/algorithms.md §14.1). Kept examples stay in their original order and ``client_ids`` stays
        aligned with them.

        Args:
          fraction: in ``(0, 1]``; ``round(fraction * N)`` examples are kept (at least one).
          rng: the source of randomness.
        """
        if not 0.0 < fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        n = self.num_train
        size = max(1, int(round(fraction * n)))
        keep = np.sort(rng.choice(n, size=size, replace=False))
        return dataclasses.replace(
            self,
            x_train=self.x_train[keep],
            y_train=self.y_train[keep],
            client_ids=None if self.client_ids is None else self.client_ids[keep],
        )

    def __repr__(self) -> str:
        clients = "" if self.client_ids is None else f", clients={len(np.unique(self.client_ids))}"
        return (
            f"Dataset(name={self.name!r}, task={self.task!r}, num_train={self.num_train}, "
            f"num_test={self.num_test}, feature_shape={self.feature_shape}, "
            f"x_dtype={self.x_train.dtype}, num_classes={self.num_classes}{clients})"
        )
