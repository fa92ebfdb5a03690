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
import pickle
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.data.pachinko import pachinko
from fedbayes.errors import DataError

__all__ = ["CIFAR_INSTRUCTIONS", "load_cifar10", "load_cifar100", "read_batch"]

CIFAR_INSTRUCTIONS = (
    "Download the 'python version' from https://www.cs.toronto.edu/~kriz/cifar.html on a machine with network access, unpack it "
    "and pass the folder holding cifar-10-batches-py/ or cifar-100-python/ as data_dir (or put it in $FEDBAYES_DATA/cifar). "
    "fedbayes never downloads data."
)


def read_batch(path: Path, label_keys: tuple[str, ...]) -> tuple[np.ndarray, list[np.ndarray]]:
    """Images ``[n, 32, 32, 3]`` float32 and the label arrays of one pickled batch.

    Raises:
      DatasetNotFoundError: the file is missing. DataError: it is not a CIFAR batch (named).
    """
    if not path.is_file():
        raise DatasetNotFoundError(f"{path} is missing. {CIFAR_INSTRUCTIONS}")
    try:
        with open(path, "rb") as f:
            blob = pickle.load(f, encoding="bytes")
        data = np.asarray(blob[b"data"], np.uint8)
        labels = [np.asarray(blob[k.encode()], np.int32) for k in label_keys]
    except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError, AttributeError) as err:
        raise DataError(f"{path}: not a CIFAR Python batch ({type(err).__name__}: {str(err)[:100]})") from None
    if data.ndim != 2 or data.shape[1] != 3072 or any(len(y) != len(data) for y in labels):
        raise DataError(f"{path}: data must be [n, 3072] with one label per row; got {data.shape} and {[len(y) for y in labels]} labels")
    images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1).astype(np.float32)
    return images, labels


def _folder(data_dir: str | os.PathLike, sub: str) -> Path:
    folder = Path(data_dir)
    return folder if folder.name == sub else folder / sub


def load_cifar10(data_dir: str | os.PathLike) -> Dataset:
    """CIFAR-10: 50,000 / 10,000 images, 10 classes, no client structure (any partitioner)."""
    folder = _folder(data_dir, "cifar-10-batches-py")
    parts = [read_batch(folder / f"data_batch_{i}", ("labels",)) for i in range(1, 6)]
    x_test, (y_test,) = read_batch(folder / "test_batch", ("labels",))
    return Dataset("cifar10", np.concatenate([p[0] for p in parts]), np.concatenate([p[1][0] for p in parts]), x_test, y_test, 10, "classification")


def load_cifar100(data_dir: str | os.PathLike, seed: int = 0, num_clients: int = 500, test_clients: int = 100) -> Dataset:
    """CIFAR-100 split by the Pachinko partition: ``num_clients`` train clients (500) and
    ``test_clients`` (100) test clients, each with an equal share of its split (100 images).

    The partition's generator is ``default_rng([seed, 14])`` for train and ``[seed, 15]`` for
    test (docs/algorithms.md §14.3: alpha 0.1 over coarse labels, beta 10 over fine labels).
    """
    folder = _folder(data_dir, "cifar-100-python")
    x, (y, coarse) = read_batch(folder / "train", ("fine_labels", "coarse_labels"))
    x_test, (y_test, coarse_test) = read_batch(folder / "test", ("fine_labels", "coarse_labels"))

    def split(fine, coarse, k, tag):
        parts = pachinko(fine, coarse, k, np.random.default_rng([seed, tag]))
        order = np.concatenate(parts)
        ids = np.concatenate([np.full(len(p), i, np.int64) for i, p in enumerate(parts)])
        return order, ids

    order, ids = split(y, coarse, num_clients, 14)
    test_order, test_ids = split(y_test, coarse_test, test_clients, 15)
    return Dataset("cifar100", x[order], y[order], x_test[test_order], y_test[test_order], 100, "classification", ids, test_ids + num_clients)
