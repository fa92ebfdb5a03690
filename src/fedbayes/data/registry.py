"""Datasets by name: one place for loaders, descriptions and how to get each one.

``load_dataset(name, ...)`` is what configs and the CLI call; ``dataset_status()`` backs the
``fedbayes datasets`` command, which reports which datasets this machine can load.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedbayes import protocol
from fedbayes.data import idx, leaf, sklearn_data, synthetic, user
from fedbayes.data.dataset import Dataset, DatasetNotFoundError, check_dataset


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
    "files": DatasetInfo(
        name="files",
        description="your own data: features, labels and optionally client ids in .npz, .npy, CSV or Parquet files",
        how_to_get="your files: data.path (and data.test_path); docs: bring your own data and model",
        loader=_load_files,
        locate=_always("your files (data.path)"),
        params=("path", "test_path", "label", "client_column", "test_fraction", "num_classes"),
    ),
}


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
    dataset = info.loader(data_dir, seed, **params)
    source = dataset.name if name == "files" else name  # the file's path
    check_dataset(dataset, str(data_dir) if data_dir is not None and name in ("leaf", "mnist", "fashion_mnist") else source)
    if fraction is not None:
        dataset = dataset.subsample(fraction, protocol.subsample_rng(seed))
    return dataset


def dataset_status(data_dir: str | os.PathLike | None = None) -> list[tuple[str, bool, str]]:
    """``(name, present, detail)`` for every registered dataset, without loading any.

    ``detail`` is the folder found, "bundled"/"generated", or how to get the data.
    """
    return [(name, *info.locate(data_dir)) for name, info in DATASETS.items()]
