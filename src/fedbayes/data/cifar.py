"""CIFAR-10 and CIFAR-100 from their Python batches (Krizhevsky 2009,
https://www.cs.toronto.edu/~kriz/cifar.html), read locally, never downloaded.

* ``cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5`` and ``test_batch``, each a
  pickle ``{b"data": [10000, 3072] uint8, b"labels": [...]}``;
* ``cifar-100-python/``: ``train`` and ``test``, each ``{b"data": [N, 3072] uint8,
  b"fine_labels": [...], b"coarse_labels": [...]}``.

A row of ``data`` is the red, green and blue planes of a 32x32 image; images come out
``[32, 32, 3]`` float32 in 0..255 (the models standardise them). CIFAR-100 is split over clients
by the Pachinko partition (:mod:`fedbayes.data.pachinko`), train and test separately, as TFF's
``fed_cifar100``; the split is kept as the natural partition.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.data.pachinko import pachinko
from fedbayes.data.plainpickle import load_plain
from fedbayes.errors import DataError

__all__ = ["CIFAR_INSTRUCTIONS", "load_cifar10", "load_cifar100", "read_batch"]

CIFAR_INSTRUCTIONS = (
    "Download the 'python version' from https://www.cs.toronto.edu/~kriz/cifar.html on a machine with network access, unpack it "
    "and pass the folder holding cifar-10-batches-py/ or cifar-100-python/ as data_dir (or put it in $FEDBAYES_DATA/cifar). "
    "fedbayes never downloads data."
)


def read_batch(path: Path, label_keys: tuple[str, ...], num_classes: tuple[int, ...] | None = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """Images ``[n, 32, 32, 3]`` float32 and the label arrays of one pickled batch.

    The batch is read by :func:`~fedbayes.data.plainpickle.load_plain` (no code runs). Pixels
    must be integers in 0..255 and labels integers in ``[0, num_classes[i])`` (any non-negative
    integer when ``num_classes`` is None); nothing is cast or wrapped.

    Raises:
      DatasetNotFoundError: the file is missing. DataError: it is not a CIFAR batch, names a
        callable, or holds a pixel or label out of range (the file, key and value named).
    """
    if not path.is_file():
        raise DatasetNotFoundError(f"{path} is missing. {CIFAR_INSTRUCTIONS}")
    blob = load_plain(path)
    if not isinstance(blob, dict):
        raise DataError(f"{path}: not a CIFAR Python batch (a pickled {type(blob).__name__}, not a dict)")
    data = _pixels(path, _entry(path, blob, "data"))
    bounds = num_classes or (None,) * len(label_keys)
    labels = [_labels(path, key, _entry(path, blob, key), bound) for key, bound in zip(label_keys, bounds)]
    if any(len(y) != len(data) for y in labels):
        raise DataError(f"{path}: one label per row needed; got {len(data)} rows and {[len(y) for y in labels]} labels")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).astype(np.float32)
    return images, labels


def _entry(path: Path, blob: dict, key: str):
    for k in (key.encode(), key):
        if k in blob:
            return blob[k]
    raise DataError(f"{path}: not a CIFAR Python batch (no {key!r} entry; it has {sorted(map(str, blob))[:6]})")


def _pixels(path: Path, data) -> np.ndarray:
    if not isinstance(data, np.ndarray) or data.dtype.kind not in "iu":
        kind = data.dtype if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{path}: data must be an integer array of pixels 0..255; got {kind}")
    if data.ndim != 2 or data.shape[1] != 3072:
        raise DataError(f"{path}: data must be [n, 3072]; got {data.shape}")
    if data.size and (data.min() < 0 or data.max() > 255):
        bad = data.min() if data.min() < 0 else data.max()
        raise DataError(f"{path}: pixel {int(bad)} outside 0..255")
    return data.astype(np.uint8)


def _labels(path: Path, key: str, values, num_classes: int | None) -> np.ndarray:
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise DataError(f"{path}: {key} must be integer labels, one per row; got a {values.dtype} array of shape {values.shape}")
    elif isinstance(values, list):
        bad = next((v for v in values if not isinstance(v, (int, np.integer)) or isinstance(v, bool)), None)
        if bad is not None:
            raise DataError(f"{path}: {key} must be integer labels; got {repr(bad)[:40]}")
    else:
        raise DataError(f"{path}: {key} must be a list of integer labels; got {type(values).__name__}")
    allowed = f"0..{num_classes - 1}" if num_classes is not None else ">= 0"
    for v in values:
        if v < 0 or (num_classes is not None and v >= num_classes):
            raise DataError(f"{path}: {key} label {int(v)} outside {allowed}")
    return np.asarray(values, np.int64).astype(np.int32)


def _folder(data_dir: str | os.PathLike, sub: str) -> Path:
    folder = Path(data_dir)
    return folder if folder.name == sub else folder / sub


def load_cifar10(data_dir: str | os.PathLike) -> Dataset:
    """CIFAR-10: 50,000 / 10,000 images, 10 classes, no client structure (any partitioner)."""
    folder = _folder(data_dir, "cifar-10-batches-py")
    parts = [read_batch(folder / f"data_batch_{i}", ("labels",), (10,)) for i in range(1, 6)]
    x_test, (y_test,) = read_batch(folder / "test_batch", ("labels",), (10,))
    return Dataset("cifar10", np.concatenate([p[0] for p in parts]), np.concatenate([p[1][0] for p in parts]), x_test, y_test, 10, "classification")


def load_cifar100(data_dir: str | os.PathLike, seed: int = 0, num_clients: int = 500, test_clients: int = 100) -> Dataset:
    """CIFAR-100 split by the Pachinko partition: ``num_clients`` train clients (500) and
    ``test_clients`` (100) test clients, each with an equal share of its split (100 images).

    The partition's generator is ``default_rng([seed, 14])`` for train and ``[seed, 15]`` for
    test (docs/algorithms.md §14.3: alpha 0.1 over coarse labels, beta 10 over fine labels).
    """
    folder = _folder(data_dir, "cifar-100-python")
    x, (y, coarse) = read_batch(folder / "train", ("fine_labels", "coarse_labels"), (100, 20))
    x_test, (y_test, coarse_test) = read_batch(folder / "test", ("fine_labels", "coarse_labels"), (100, 20))

    def split(fine, coarse, k, tag):
        parts = pachinko(fine, coarse, k, np.random.default_rng([seed, tag]))
        order = np.concatenate(parts)
        ids = np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(parts)])
        return order, ids

    order, ids = split(y, coarse, num_clients, 14)
    test_order, test_ids = split(y_test, coarse_test, test_clients, 15)
    return Dataset("cifar100", x[order], y[order], x_test[test_order], y_test[test_order], 100, "classification", ids, test_ids + num_clients)
