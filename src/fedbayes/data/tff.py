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

__all__ = [
    "TFF_INSTRUCTIONS",
    "TFF_URL",
    "client_checker",
    "client_sizes",
    "load_fed_cifar100",
    "load_fed_emnist",
    "read_client",
    "read_clients",
    "tff_file",
    "tff_instructions",
]

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
    with _open(h5py, path) as f:
        examples, names = _examples(h5py, path, f)
        for name in names[:limit]:
            yield name, _client(h5py, path, examples, name, features)


def _open(h5py, path: Path):
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise DataError(f"{path}: not a readable HDF5 file ({' '.join(str(err).split())[:160]})") from None


def _examples(h5py, path: Path, f) -> tuple:
    """The ``/examples`` group and its client names, sorted."""
    try:
        examples = f.get("examples")
        if not isinstance(examples, h5py.Group):
            raise DataError(f"{path}: no '/examples' group (TFF's layout: /examples/<client>/<feature>)")
        return examples, sorted(examples)
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: damaged HDF5 file ({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None


def client_sizes(path: Path, features: tuple[str, ...], limit: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(names, sizes)`` of the first ``limit`` clients (all when None) of a TFF file in sorted
    name order: names as UTF-8 byte strings, sizes as the length of each client's first feature,
    read from the file's metadata (no example is read).

    Raises:
      DataError: as :func:`read_clients`, or a client without ``features[0]``, or no client.
    """
    h5py = _h5py()
    with _open(h5py, path) as f:
        examples, names = _examples(h5py, path, f)
        names = names[:limit]
        sizes = np.zeros(len(names), np.int64)
        first = features[0]
        for i, name in enumerate(names):
            try:  # h5py's low-level open: half the time of examples[name][first] (one lookup, no objects)
                shape = h5py.h5d.open(examples.id, f"{name}/{first}".encode()).shape
            except Exception:  # missing or not a dataset: the checks below name what is wrong
                shape = ()
            if len(shape):
                sizes[i] = shape[0]
                continue
            try:
                group = examples[name]
                data = group.get(first) if isinstance(group, h5py.Group) else None
                if not isinstance(data, h5py.Dataset) or data.ndim == 0:
                    raise DataError(f"{path}: client {name!r} has no {first} (TFF's layout: /examples/<client>/<feature>, one value per example)")
                sizes[i] = data.shape[0]
            except (OSError, RuntimeError, KeyError, ValueError, TypeError) as err:
                if isinstance(err, DataError):
                    raise
                raise DataError(f"{path}: client {name!r}: damaged ({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None
    if not len(names):
        raise DataError(f"{path}: holds no clients")
    return np.array([n.encode() for n in names], dtype=bytes), sizes


def read_client(path: Path, name: str, features: tuple[str, ...], *, rows: int | None = None, handle=None) -> dict[str, np.ndarray]:
    """One client's feature arrays (its first ``rows`` examples; all when None), checked as
    :func:`read_clients` checks them; ``handle``: the file already open (else opened here)."""
    h5py = _h5py()
    if handle is not None:
        return _client(h5py, path, _examples_group(h5py, path, handle), name, features, rows)
    with _open(h5py, path) as f:
        return _client(h5py, path, _examples_group(h5py, path, f), name, features, rows)


def _examples_group(h5py, path: Path, f):
    examples = f.get("examples")
    if not isinstance(examples, h5py.Group):
        raise DataError(f"{path}: no '/examples' group (TFF's layout: /examples/<client>/<feature>)")
    return examples


def _client(h5py, path: Path, examples, name: str, features: tuple[str, ...], rows: int | None = None) -> dict[str, np.ndarray]:
    """One client's feature arrays, checked (see :func:`read_clients`)."""
    try:
        group = examples[name]
        if not isinstance(group, h5py.Group):
            raise DataError(f"{path}: client {name!r} is a {type(group).__name__}, not a group of features (TFF's layout: /examples/<client>/<feature>)")
        missing = [k for k in features if not isinstance(group.get(k), h5py.Dataset)]
        if missing:
            raise DataError(f"{path}: client {name!r} has no {', '.join(missing)} (it holds {sorted(group)})")
        arrays = {k: group[k][()] if rows is None or group[k].ndim == 0 else group[k][:rows] for k in features}
    except (OSError, RuntimeError, KeyError, ValueError, TypeError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{path}: client {name!r}: damaged ({type(err).__name__}: {' '.join(str(err).split())[:160]})") from None
    scalar = [k for k, a in arrays.items() if np.ndim(a) == 0]
    if scalar:
        raise DataError(f"{path}: client {name!r}: {scalar[0]} is a scalar, not one value per example")
    lengths = {len(a) for a in arrays.values()}
    if len(lengths) != 1:
        raise DataError(f"{path}: client {name!r} has features of different lengths {sorted(lengths)}")
    return arrays


def _federated(train, test, x_key: str, y_key: str, checks) -> tuple[np.ndarray, ...]:
    """Stacked ``x, y, client ids`` of train and test; ``checks``: for train and for test,
    ``check(client, x, y)`` returning a client's ``(x float32, y int32)`` (:func:`client_checker`)."""
    ids = {name: i for i, (name, _) in enumerate(train)}
    for name, _ in test:
        ids.setdefault(name, len(ids))

    def stack(clients, check):
        checked = [check(n, a[x_key], a[y_key]) for n, a in clients]
        x = np.concatenate([c[0] for c in checked])
        y = np.concatenate([c[1] for c in checked])
        cid = np.concatenate([np.full(len(a[y_key]), ids[n], np.int64) for n, a in clients])
        return x, y, cid

    return (*stack(train, checks[0]), *stack(test, checks[1]))


def client_checker(path: Path, shape: tuple[int, ...], pixels: tuple[float, float], num_classes: int):
    """``check(client, x, y)`` for :func:`_federated`: images of ``shape`` with real values in
    ``pixels`` (inclusive) and integer labels in ``[0, num_classes)``, never cast or wrapped;
    a :class:`DataError` names the file, the client and the value."""

    def check(name: str, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        where = f"{path}: client {name!r}"
        x, y = np.asarray(x), np.asarray(y)
        if x.dtype.kind not in "iuf":
            raise DataError(f"{where}: pixels must be real numbers; got {x.dtype} values")
        if x.shape[1:] != shape:
            raise DataError(f"{where}: images of shape {list(x.shape[1:])}; this dataset's are {list(shape)}")
        if x.size and not (np.all(np.isfinite(x)) and x.min() >= pixels[0] and x.max() <= pixels[1]):
            bad = x[~(np.isfinite(x) & (x >= pixels[0]) & (x <= pixels[1]))].flat[0]
            raise DataError(f"{where}: pixel {bad} outside {pixels[0]:g}..{pixels[1]:g}")
        if y.ndim != 1 or y.dtype.kind not in "iuf":
            raise DataError(f"{where}: labels must be one integer per example; got {y.dtype} of shape {list(y.shape)}")
        bad = ~np.isfinite(y) | (y != np.round(y)) | (y < 0) | (y >= num_classes) if y.dtype.kind == "f" else (y < 0) | (y >= num_classes)
        if np.any(bad):
            raise DataError(f"{where}: label {y[np.argmax(bad)]} is not a class 0..{num_classes - 1}")
        return x.astype(np.float32), y.astype(np.int32)

    return check


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
    num_classes = 10 if only_digits else 62
    x, y, cid, xt, yt, tid = _federated(train, test, "pixels", "label", [client_checker(p, (28, 28), (0.0, 1.0), num_classes) for p in (train_path, test_path)])
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
    x, y, cid, xt, yt, tid = _federated(train, test, "image", "label", [client_checker(p, (32, 32, 3), (0.0, 255.0), 100) for p in (train_path, test_path)])
    return Dataset("fed_cifar100", x, y, xt, yt, 100, "classification", cid, tid)
