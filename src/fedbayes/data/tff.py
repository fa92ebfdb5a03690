"""TensorFlow Federated's HDF5 files, read locally (never downloaded): federated EMNIST and
CIFAR-100 (``tff.simulation.datasets.emnist`` / ``cifar100``, as FedPA's and FedEP's tables use
them), and the reader that :mod:`fedbayes.data.stackoverflow` shares.

A TFF file holds one group per client under ``/examples``, each with one dataset per feature,
all of one length (the client's examples)::

    fed_emnist_train.h5      /examples/<writer>/pixels [n, 28, 28] float32, label [n] int32
    fed_cifar100_train.h5    /examples/<client>/image [n, 32, 32, 3] uint8, label [n] int64,
                             coarse_label [n] int64
    stackoverflow_train.h5   /examples/<user>/tokens, title, tags, ... [n] byte strings

The client structure is kept: clients are numbered in sorted name order over the train file,
a test client that shares a train client's name (EMNIST's writers) gets its id, and the others
(CIFAR-100's 100 test clients) follow. h5py is an optional dependency (the ``papers`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.errors import DataError

__all__ = ["TFF_INSTRUCTIONS", "TFF_URL", "tff_instructions", "load_fed_cifar100", "load_fed_emnist", "read_clients", "tff_file"]

TFF_URL = "https://storage.googleapis.com/tff-datasets-public/"  # where tff.simulation.datasets fetches its archives


def tff_instructions(stem: str) -> str:
    """How to get TFF's archive ``STEM.tar.bz2`` (``fed_emnist``, ``fed_emnist_digitsonly``,
    ``fed_cifar100``, ``stackoverflow``): its URL on a line of its own, never cut."""
    return (
        f"Download {TFF_URL}{stem}.tar.bz2 on a machine with network access, unpack it and pass its folder as data_dir "
        "(or put it in $FEDBAYES_DATA/tff). fedbayes never downloads data."
    )


TFF_INSTRUCTIONS = tff_instructions("fed_emnist")


def _h5py():
    try:
        import h5py
    except ImportError:
        raise DataError("reading TFF's HDF5 files needs h5py: pip install 'fedbayes[papers]'") from None
    return h5py


def tff_file(folder: str | os.PathLike, name: str) -> Path:
    """``folder / name``, or :class:`DatasetNotFoundError` naming it and how to get it."""
    path = Path(folder) / name
    if not path.is_file():
        stem = name.removesuffix(".h5").removesuffix("_train").removesuffix("_test").split(".")[0]  # stackoverflow.word_count: stackoverflow
        raise DatasetNotFoundError(f"{path} is missing. {tff_instructions(stem)}")
    return path


def read_clients(path: Path, features: tuple[str, ...], limit: int | None = None) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    """``(client name, {feature: array})`` for each client of a TFF file, in sorted name order.

    Args:
      path: the ``.h5`` file.
      features: the datasets every client group must hold (all of one length).
      limit: read only the first ``limit`` clients.

    Raises:
      DataError: the file is not HDF5, has no ``/examples`` group, or a client lacks a feature
        or has features of different lengths (the message names the file and the client).
    """
    h5py = _h5py()
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path}: not a readable HDF5 file ({' '.join(str(err).split())[:160]})") from None
    with f:
        examples = f.get("examples")
        if not isinstance(examples, h5py.Group):
            raise DataError(f"{path}: no '/examples' group (TFF's layout: /examples/<client>/<feature>)")
        names = sorted(examples)
        for name in names[:limit]:
            group = examples[name]
            missing = [k for k in features if not isinstance(group.get(k), h5py.Dataset)]
            if missing:
                raise DataError(f"{path}: client {name!r} has no {', '.join(missing)} (it holds {sorted(group)})")
            arrays = {k: group[k][()] for k in features}
            lengths = {len(a) for a in arrays.values()}
            if len(lengths) != 1:
                raise DataError(f"{path}: client {name!r} has features of different lengths {sorted(lengths)}")
            yield name, arrays


def _federated(train, test, x_key: str, y_key: str, dtype) -> tuple[np.ndarray, ...]:
    ids = {name: i for i, (name, _) in enumerate(train)}
    for name, _ in test:
        ids.setdefault(name, len(ids))

    def stack(clients):
        x = np.concatenate([np.asarray(a[x_key], dtype) for _, a in clients])
        y = np.concatenate([np.asarray(a[y_key]).astype(np.int32) for _, a in clients])
        cid = np.concatenate([np.full(len(a[y_key]), ids[n], np.int64) for n, a in clients])
        return x, y, cid

    return (*stack(train), *stack(test))


def _empty(path, clients):
    if not clients or all(len(next(iter(a.values()))) == 0 for _, a in clients):
        raise DataError(f"{path}: holds no examples")
    return clients


def load_fed_emnist(folder: str | os.PathLike, only_digits: bool = False) -> Dataset:
    """TFF's federated EMNIST (Caldas et al. 2018's writers): 3,400 writers, 62 classes
    (``only_digits``: the digits-only files, 3,383 writers, 10 classes). Images stay as TFF stores
    them, ``[28, 28, 1]`` float32 in [0, 1] (Reddi et al. 2021 feed them unchanged).

    Reads ``fed_emnist_train.h5`` and ``fed_emnist_test.h5`` (``fed_emnist_digitsonly_*.h5``).
    """
    stem = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
    train_path, test_path = tff_file(folder, f"{stem}_train.h5"), tff_file(folder, f"{stem}_test.h5")
    train = _empty(train_path, list(read_clients(train_path, ("pixels", "label"))))
    test = _empty(test_path, list(read_clients(test_path, ("pixels", "label"))))
    x, y, cid, xt, yt, tid = _federated(train, test, "pixels", "label", np.float32)
    num_classes = 10 if only_digits else 62
    return Dataset("emnist", x[..., None], y, xt[..., None], yt, num_classes, "classification", cid, tid)


def load_fed_cifar100(folder: str | os.PathLike) -> Dataset:
    """TFF's federated CIFAR-100 (Reddi et al. 2021's Pachinko split): 500 train clients and 100
    test clients of 100 images each, 100 fine labels. Images are kept raw, ``[32, 32, 3]``
    float32 in 0..255: :class:`~fedbayes.models.papers.ResNet18GN` crops to 24x24 (random for
    training, central for test) and standardises each image, as TFF's preprocessing does.

    Reads ``fed_cifar100_train.h5`` and ``fed_cifar100_test.h5``.
    """
    train_path, test_path = tff_file(folder, "fed_cifar100_train.h5"), tff_file(folder, "fed_cifar100_test.h5")
    train = _empty(train_path, list(read_clients(train_path, ("image", "label"))))
    test = _empty(test_path, list(read_clients(test_path, ("image", "label"))))
    x, y, cid, xt, yt, tid = _federated(train, test, "image", "label", np.float32)
    return Dataset("fed_cifar100", x, y, xt, yt, 100, "classification", cid, tid)
