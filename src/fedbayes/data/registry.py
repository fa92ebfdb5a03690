"""Datasets by name: one place for loaders, descriptions and how to get each one.

``load_dataset(name, ...)`` is what configs and the CLI call; ``dataset_status()`` backs the
``fedbayes datasets`` command, which reports which datasets this machine can load.
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedbayes import protocol
from fedbayes.data import cifar, idx, leaf, sklearn_data, stackoverflow, synthetic, tff, user
from fedbayes.data.dataset import Dataset, DatasetNotFoundError, check_dataset
from fedbayes.data.partition import PartitionError
from fedbayes.errors import DataError, FedbayesError


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """A registered dataset.

    Attributes:
      name: registry key.
      description: one line on what the data is.
      how_to_get: how to make it available on this machine.
      loader: ``(data_dir, seed, **params) -> Dataset``.
      locate: ``(data_dir) -> (present, detail)``, without loading the data.
      params: the keyword parameters ``load_dataset`` accepts for it (besides ``fraction``).
    """

    name: str
    description: str
    how_to_get: str
    loader: Callable[..., Dataset]
    locate: Callable[[str | os.PathLike | None], tuple[bool, str]]
    params: tuple[str, ...] = ()


def _always(detail: str):
    return lambda data_dir: (True, detail)


def _locate_idx(find, instructions):
    def locate(data_dir):
        folder = find(data_dir)
        return (True, str(folder)) if folder is not None else (False, instructions())

    return locate


def _leaf_folder(data_dir) -> Path | None:
    if data_dir is not None:
        return Path(data_dir)
    env = os.environ.get(idx.ENV_VAR)
    return Path(env) / "leaf" if env else None


def _locate_leaf(data_dir):
    folder = _leaf_folder(data_dir)
    if folder is not None and (folder / "train").is_dir() and (folder / "test").is_dir():
        return True, str(folder)
    return False, f"pass data_dir or put it in ${idx.ENV_VAR}/leaf. {leaf.LEAF_INSTRUCTIONS}"


def _load_leaf(data_dir, seed, num_classes=None):
    folder = _leaf_folder(data_dir)
    if folder is None:
        raise DatasetNotFoundError(f"LEAF needs a folder: pass data_dir or set {idx.ENV_VAR} (its 'leaf' subfolder is used). {leaf.LEAF_INSTRUCTIONS}")
    return leaf.load_leaf(folder, name="leaf", num_classes=num_classes)


def _load_synthetic_leaf(data_dir, seed, num_clients=30, alpha=1.0, beta=1.0, **kwargs):
    return synthetic.synthetic_leaf(num_clients, alpha, beta, np.random.default_rng(seed), **kwargs)


def _load_least_squares(data_dir, seed, num_clients=10, dim=10, **kwargs):
    rng = np.random.default_rng(seed)
    return synthetic.federated_least_squares(num_clients, dim, rng, **kwargs)


def _files_folder(sub: str, files: tuple[str, ...], instructions: str):
    """``(folder_of, locate)`` of a dataset kept as files in ``data_dir``, or by default in
    ``$FEDBAYES_DATA/<sub>``."""

    def folder_of(data_dir) -> Path:
        if data_dir is not None:
            return Path(data_dir)
        env = os.environ.get(idx.ENV_VAR)
        if not env:
            raise DatasetNotFoundError(f"pass data_dir or set {idx.ENV_VAR} (its '{sub}' subfolder is used). {instructions}")
        return Path(env) / sub

    def locate(data_dir):
        try:
            folder = folder_of(data_dir)
        except DatasetNotFoundError as err:
            return False, str(err)
        missing = [f for f in files if not (folder / f).exists()]
        return (True, str(folder)) if not missing else (False, f"looked in {folder}: {', '.join(missing)} missing. {instructions}")

    return folder_of, locate


_TFF = "tff"
_emnist_folder, _locate_emnist = _files_folder(_TFF, ("fed_emnist_train.h5", "fed_emnist_test.h5"), tff.tff_instructions("fed_emnist"))
_fed_cifar_folder, _locate_fed_cifar = _files_folder(_TFF, ("fed_cifar100_train.h5", "fed_cifar100_test.h5"), tff.tff_instructions("fed_cifar100"))
_SO_FILES = ("stackoverflow_train.h5", "stackoverflow_test.h5", "stackoverflow.word_count")
_so_folder, _locate_so_nwp = _files_folder(_TFF, _SO_FILES, tff.tff_instructions("stackoverflow"))
_, _locate_so_lr = _files_folder(_TFF, (*_SO_FILES, "stackoverflow.tag_count"), tff.tff_instructions("stackoverflow"))
_cifar10_folder, _locate_cifar10 = _files_folder("cifar", ("cifar-10-batches-py",), cifar.CIFAR_INSTRUCTIONS)
_cifar100_folder, _locate_cifar100 = _files_folder("cifar", ("cifar-100-python",), cifar.CIFAR_INSTRUCTIONS)
_SO_PARAMS = ("vocab_size", "max_clients", "max_posts", "test_examples")


def _load_stackoverflow(task):
    def load(data_dir, seed, **params):
        return stackoverflow.load_stackoverflow(_so_folder(data_dir), task, seed=seed, **params)

    return load


def _load_files(data_dir, seed, path=None, test_path=None, label=None, client_column=None, test_fraction=0.2, num_classes=None):
    if path is None:
        raise ValueError("dataset 'files' needs data.path (.npz, .npy, .csv or .parquet)")
    return user.load_files(
        path, test_path=test_path, label=label, client_column=client_column, test_fraction=test_fraction, num_classes=num_classes,
        rng=protocol.test_split_rng(seed),
    )  # fmt: skip


DATASETS: dict[str, DatasetInfo] = {
    "fashion_mnist": DatasetInfo(
        name="fashion_mnist",
        description="Fashion-MNIST (Xiao et al. 2017): 28x28 clothing images, 10 classes, 60k/10k",
        how_to_get=idx.fashion_mnist_instructions(),
        loader=lambda data_dir, seed: idx.load_fashion_mnist(data_dir),
        locate=_locate_idx(idx.locate_fashion_mnist, idx.fashion_mnist_instructions),
    ),
    "mnist": DatasetInfo(
        name="mnist",
        description="MNIST (LeCun et al. 1998): 28x28 grey handwritten digits, 10 classes, 60k/10k",
        how_to_get=idx.mnist_instructions(),
        loader=lambda data_dir, seed: idx.load_mnist(data_dir),
        locate=_locate_idx(idx.locate_mnist, idx.mnist_instructions),
    ),
    "digits": DatasetInfo(
        name="digits",
        description="scikit-learn digits: 8x8 images, 10 classes, 1437/360 (stratified 80/20)",
        how_to_get="bundled with scikit-learn",
        loader=lambda data_dir, seed: sklearn_data.load_digits(),
        locate=_always("bundled with scikit-learn"),
    ),
    "breast_cancer": DatasetInfo(
        name="breast_cancer",
        description="scikit-learn breast cancer: 30 standardized features, 2 classes, 455/114",
        how_to_get="bundled with scikit-learn",
        loader=lambda data_dir, seed: sklearn_data.load_breast_cancer(),
        locate=_always("bundled with scikit-learn"),
    ),
    "leaf": DatasetInfo(
        name="leaf",
        description="a LEAF folder (FEMNIST, Shakespeare, ...) with its natural per-user partition",
        how_to_get=leaf.LEAF_INSTRUCTIONS,
        loader=_load_leaf,
        locate=_locate_leaf,
        params=("num_classes",),
    ),
    "synthetic_leaf": DatasetInfo(
        name="synthetic_leaf",
        description="Synthetic(alpha, beta) of Li et al. 2020 (FedProx), natural partition",
        how_to_get="generated on demand",
        loader=_load_synthetic_leaf,
        locate=_always("generated on demand"),
        params=("num_clients", "alpha", "beta", "dim", "num_classes", "sizes", "test_fraction", "iid"),
    ),
    "least_squares": DatasetInfo(
        name="least_squares",
        description="federated linear regression after FedPA App. A (make_regression per client)",
        how_to_get="generated on demand",
        loader=_load_least_squares,
        locate=_always("generated on demand"),
        params=(
            "num_clients",
            "dim",
            "num_examples",
            "heterogeneity",
            "noise",
            "n_informative",
            "test_fraction",
        ),
    ),
    "emnist": DatasetInfo(
        name="emnist",
        description="TFF's federated EMNIST: 28x28 characters by 3,400 writers, 62 classes (only_digits: 10); natural partition",
        how_to_get=tff.TFF_INSTRUCTIONS,
        loader=lambda data_dir, seed, only_digits=False: tff.load_fed_emnist(_emnist_folder(data_dir), only_digits),
        locate=_locate_emnist,
        params=("only_digits",),
    ),
    "fed_cifar100": DatasetInfo(
        name="fed_cifar100",
        description="TFF's federated CIFAR-100: 500 train / 100 test clients of 100 images by the Pachinko split; natural partition",
        how_to_get=tff.tff_instructions("fed_cifar100"),
        loader=lambda data_dir, seed: tff.load_fed_cifar100(_fed_cifar_folder(data_dir)),
        locate=_locate_fed_cifar,
    ),
    "cifar100": DatasetInfo(
        name="cifar100",
        description="CIFAR-100 Python batches, split over clients by the two-level Pachinko partition (500 / 100 clients); natural partition",
        how_to_get=cifar.CIFAR_INSTRUCTIONS,
        loader=lambda data_dir, seed, **params: cifar.load_cifar100(_cifar100_folder(data_dir), seed, **params),
        locate=_locate_cifar100,
        params=("num_clients", "test_clients"),
    ),
    "cifar10": DatasetInfo(
        name="cifar10",
        description="CIFAR-10 Python batches: 32x32 colour images, 10 classes, 50k/10k",
        how_to_get=cifar.CIFAR_INSTRUCTIONS,
        loader=lambda data_dir, seed: cifar.load_cifar10(_cifar10_folder(data_dir)),
        locate=_locate_cifar10,
    ),
    "stackoverflow_nwp": DatasetInfo(
        name="stackoverflow_nwp",
        description="TFF's StackOverflow, next-word prediction: 10k words + 4 special tokens, sequences of 20; one client per user",
        how_to_get=tff.tff_instructions("stackoverflow"),
        loader=_load_stackoverflow("next_word"),
        locate=_locate_so_nwp,
        params=(*_SO_PARAMS, "max_len"),
    ),
    "stackoverflow_lr": DatasetInfo(
        name="stackoverflow_lr",
        description="TFF's StackOverflow, tag prediction: bag of 10k words -> 500 tags, multi-label; one client per user",
        how_to_get=tff.tff_instructions("stackoverflow"),
        loader=_load_stackoverflow("multilabel"),
        locate=_locate_so_lr,
        params=(*_SO_PARAMS, "num_tags"),
    ),
    "files": DatasetInfo(
        name="files",
        description="your own data: features, labels and optionally client ids in .npz, .npy, CSV or Parquet files",
        how_to_get="your files: data.path (and data.test_path); docs: bring your own data and model",
        loader=_load_files,
        locate=_always("your files (data.path)"),
        params=("path", "test_path", "label", "client_column", "test_fraction", "num_classes"),
    ),
}
# Datasets read from files in data_dir: a data error names the folder.
FILE_BASED = ("leaf", "mnist", "fashion_mnist", "emnist", "fed_cifar100", "cifar100", "cifar10", "stackoverflow_nwp", "stackoverflow_lr")


# FEDBAYES_NO_SYSTEM_DATA=1 hides the system-wide dataset folders (Debian's /usr/share/datasets),
# as on a machine without the packages: `.ci/run` runs the test suite once that way.
NO_SYSTEM_DATA_ENV = "FEDBAYES_NO_SYSTEM_DATA"
if os.environ.get(NO_SYSTEM_DATA_ENV, "") not in ("", "0"):
    idx.FASHION_MNIST_SYSTEM_DIRS = ()


def _info(name: str) -> DatasetInfo:
    if name not in DATASETS:
        raise ValueError(f"dataset name must be one of {sorted(DATASETS)}, got {name!r}")
    return DATASETS[name]


def load_dataset(name: str, data_dir: str | os.PathLike | None = None, seed: int = 0, **params) -> Dataset:
    """Loads a registered dataset.

    Args:
      name: a key of ``DATASETS``.
      data_dir: the folder to read from (file-based datasets); see each loader's search order.
      seed: seeds generated datasets and the ``fraction`` subsample (``np.random.default_rng(seed)``
        for the generator; ``default_rng([seed, 1])`` for the subsample, so subsampling does not
        change which data is generated).
      **params: the dataset's own parameters (``DATASETS[name].params``), plus ``fraction`` in
        (0, 1]: keep a random fraction of the train set (Swaroop et al. 2025 (ADMM and Bayes) uses 0.1 for FMNIST).

    Raises:
      ValueError: unknown name or parameter (the message lists the allowed ones).
      DatasetNotFoundError: the files are not on this machine (the message says how to get them).
    """
    info = _info(name)
    fraction = params.pop("fraction", None)
    unknown = sorted(set(params) - set(info.params))
    if unknown:
        raise ValueError(f"dataset {name!r} got unknown parameter(s) {unknown}; allowed: {sorted(info.params + ('fraction',))}")
    if name in FILE_BASED or name == "files":
        dataset = _read(info, name, data_dir, seed, params)
    else:
        dataset = info.loader(data_dir, seed, **params)
    source = dataset.name if name == "files" else name  # the file's path
    check_dataset(dataset, str(data_dir) if data_dir is not None and name in FILE_BASED else source)
    if fraction is not None:
        dataset = dataset.subsample(fraction, protocol.subsample_rng(seed))
    return dataset


# What a loader meets in a damaged file that it did not name itself (numpy's and h5py's messages).
_UNREAD = (
    ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, ZeroDivisionError, EOFError, MemoryError,
    NotImplementedError, RuntimeError, SyntaxError, zipfile.BadZipFile, zlib.error,
)  # fmt: skip


def _read(info: DatasetInfo, name: str, data_dir, seed: int, params: dict) -> Dataset:
    """``info.loader``'s dataset; a failure the loader did not put in words is a
    :class:`DataError` naming the file or folder (never a config error, never a traceback)."""
    try:
        return info.loader(data_dir, seed, **params)
    except (FedbayesError, PartitionError):
        raise
    except _UNREAD as exc:
        where = params.get("path") if name == "files" else data_dir if data_dir is not None else info.locate(None)[1]
        raise DataError(f"{where}: cannot be read as dataset {name!r} ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None


def dataset_status(data_dir: str | os.PathLike | None = None) -> list[tuple[str, bool, str]]:
    """``(name, present, detail)`` for every registered dataset, without loading any.

    ``detail`` is the folder found, "bundled"/"generated", or how to get the data.
    """
    return [(name, *info.locate(data_dir)) for name, info in DATASETS.items()]
