"""Datasets by name: the dataset registry, one :class:`DatasetSpec` per dataset.

A spec holds the name used in configs (``[data] dataset = ...``), its loader and its locate
function, the :class:`~fedbayes.hparams.HParams` record of the config keys only it reads
(``settings``), how those keys become the loader's parameters, and its traits: whether it comes
federated (natural client ids), whether its examples are images, its task, whether it is read
from files, generated from the seed or the user's own data. The rest of the package reads these
traits, never a dataset's name. ``load_dataset(name,
...)`` is what configs and the CLI call; ``dataset_status()`` backs the ``fedbayes datasets``
command, which reports which datasets this machine can load.

A dataset added with :func:`register` validates and runs from a config file like a built-in one
(its own keys sit flat in ``[data]``), and the conformance suite
(``tests/data/test_dataset_conformance.py``) checks every registered dataset against its traits.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator
from pydantic.fields import FieldInfo

from fedbayes import protocol
from fedbayes.data import cifar, idx, leaf, sklearn_data, stackoverflow, synthetic, tff, user
from fedbayes.data.dataset import TASKS, Dataset, DatasetNotFoundError, check_dataset
from fedbayes.data.partition import PartitionError
from fedbayes.errors import DataError, FedbayesError
from fedbayes.hparams import HParams
from fedbayes.registries import Registry

__all__ = [
    "ARRAYS", "DATASETS", "DatasetInfo", "DatasetSpec", "DataSettings", "builtin_specs", "check_traits", "dataset_status", "get", "load_dataset", "names", "register",
    "setting", "settings_fields", "specs", "unregister",
]  # fmt: skip

FEDERATED = ("always", "optional", "never")


class DataSettings(HParams):
    """Base of a dataset's (or a partition's) own settings: the ``[data]`` keys only it reads."""

    section: ClassVar[str] = "data."


def setting(data: Any, key: str, default: Any = None) -> Any:
    """``key`` of a data config given as a record (attribute access) or as a raw mapping."""
    if isinstance(data, Mapping):
        return data.get(key, default)
    return getattr(data, key, default)


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    """A registered dataset.

    Attributes:
      name: registry key, the config's ``data.dataset``.
      description: one line on what the data is.
      how_to_get: how to make it available on this machine.
      loader: ``(data_dir, seed, **params) -> Dataset``.
      locate: ``(data_dir) -> (present, detail)``, without loading the data.
      params: the keyword parameters ``load_dataset`` accepts for it (besides ``fraction``).
      settings: the :class:`DataSettings` record of the ``[data]`` keys only this dataset reads
        (``None``: none); a config's values of these keys are validated through it.
      config_params: ``(data config) -> loader parameters``; ``None``: every key of ``settings``,
        passed under its own name.
      federated: ``"always"``: the data comes with its natural client ids (the natural partition
        is the default); ``"optional"``: it may (``client_ids_setting`` set, or data given from
        Python); ``"never"``.
      client_ids_setting: the key that gives the client ids of an ``"optional"`` dataset.
      image: the examples are images ``[H, W]`` or ``[H, W, C]``; ``None``: it depends on the files.
      task: one of :data:`fedbayes.data.dataset.TASKS`; ``None``: it depends on the files.
      tokens: the inputs are token ids (text), not features to scale.
      file_based: read from files in ``data_dir`` (a data error names the folder).
      from_python: given from Python (``run_experiment(config, out, data=...)``), never loaded.
      generated: made on demand from the run's seed, not read: the seed decides its examples, the
        test set's included.
      user_data: the user's own data, whose scale fedbayes does not know: ``data.standardize =
        "auto"`` scales it where its features' magnitudes differ by more than
        :data:`fedbayes.data.standardize.SCALE_RATIO`, and a Flower node gives it only from its own
        data file.
      exclusive: keys of ``settings`` that a config naming another dataset must leave unset.
      open_on_demand: ``(data_dir, seed, cache_clients, cache_bytes, **params) -> (dataset,
        federation)``: the dataset's test split and a
        :class:`~fedbayes.data.federation.GeneratedFederation` reading the training clients from
        the files when sampled (``data.on_demand``); ``None``: read into memory only.
    """

    name: str
    description: str
    how_to_get: str
    loader: Callable[..., Dataset]
    locate: Callable[[str | os.PathLike | None], tuple[bool, str]]
    params: tuple[str, ...] = ()
    settings: type[DataSettings] | None = None
    config_params: Callable[[Any], dict[str, Any]] | None = None
    federated: Literal["always", "optional", "never"] = "never"
    client_ids_setting: str | None = None
    image: bool | None = False
    task: str | None = "classification"
    tokens: bool = False
    file_based: bool = False
    from_python: bool = False
    generated: bool = False
    user_data: bool = False
    exclusive: tuple[str, ...] = ()
    open_on_demand: Callable[..., tuple[Dataset, Any]] | None = None

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise ValueError(f"DatasetSpec: name must be a non-empty string; got {self.name!r}")
        if self.settings is not None and not (isinstance(self.settings, type) and issubclass(self.settings, HParams)):
            raise ValueError(f"DatasetSpec {self.name!r}: settings must be an HParams subclass; got {self.settings!r}")
        if self.federated not in FEDERATED:
            raise ValueError(f"DatasetSpec {self.name!r}: federated must be one of {', '.join(FEDERATED)}; got {self.federated!r}")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"DatasetSpec {self.name!r}: task must be one of {', '.join(TASKS)} or None; got {self.task!r}")
        for key in (*self.exclusive, *((self.client_ids_setting,) if self.client_ids_setting else ())):
            if key not in self.setting_keys:
                raise ValueError(f"DatasetSpec {self.name!r}: {key!r} is not a key of its settings")

    @property
    def setting_keys(self) -> tuple[str, ...]:
        """The ``[data]`` keys only this dataset reads."""
        return tuple(self.settings.model_fields) if self.settings is not None else ()

    def loader_params(self, data: Any) -> dict[str, Any]:
        """The loader's parameters from a data config (``data.fraction`` aside)."""
        if self.config_params is not None:
            return self.config_params(data)
        return {key: setting(data, key) for key in self.setting_keys}

    @property
    def makes_clients(self) -> bool:
        """Its loader takes ``num_clients`` (one of its ``params``): it makes as many clients as
        the config asks for (a generated federation, a split of its own), so the data has no
        number of clients of its own."""
        return "num_clients" in self.params

    def comes_federated(self, data: Any) -> bool:
        """Whether the data, as ``data`` configures it, comes with natural client ids known before
        loading: the natural partition is then the default."""
        if self.federated == "always":
            return True
        return self.federated == "optional" and self.client_ids_setting is not None and setting(data, self.client_ids_setting) is not None


DatasetInfo = DatasetSpec  # the earlier name


def _declared_in(settings: type[HParams], key: str) -> type:
    """The class of ``settings``' bases (itself included) that declares ``key``."""
    return next(c for c in settings.__mro__ if key in inspect.get_annotations(c))


def settings_fields(specs) -> dict[str, FieldInfo]:
    """The ``[data]`` keys that the settings of ``specs`` (dataset or partition specs) declare,
    each once, in the specs' order: ``key -> field`` (its type, default, bounds, description).

    Raises:
      ValueError: two settings classes declare the same key (a key several specs read is
        declared once, in a base class their settings share, so that it means one thing).
    """
    fields: dict[str, FieldInfo] = {}
    owners: dict[str, type] = {}
    for spec in specs:
        for key, field in (spec.settings.model_fields if spec.settings is not None else {}).items():
            owner = _declared_in(spec.settings, key)
            if owners.setdefault(key, owner) is not owner:
                raise ValueError(
                    f"data.{key}: declared by both {owners[key].__qualname__} and {owner.__qualname__}; declare it once, in a base class both settings share"
                )
            fields.setdefault(key, field)
    return fields


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


def _open_stackoverflow(task):
    def open_(data_dir, seed, cache_clients, cache_bytes, **params):
        return stackoverflow.open_stackoverflow(_so_folder(data_dir), task, seed=seed, cache_clients=cache_clients, cache_bytes=cache_bytes, **params)

    return open_


def _load_files(data_dir, seed, path=None, test_path=None, label=None, client_column=None, test_fraction=0.2, num_classes=None):
    if path is None:
        raise ValueError("dataset 'files' needs data.path (.npz, .npy, .csv or .parquet)")
    return user.load_files(
        path, test_path=test_path, label=label, client_column=client_column, test_fraction=test_fraction, num_classes=num_classes,
        rng=protocol.test_split_rng(seed),
    )  # fmt: skip


# ----- the built-in datasets' own settings: each key is declared once, here (a key several datasets
# read, in a base class their settings share); the config's DataConfig takes its fields from them.


class ClassCountSettings(DataSettings):
    """The declared number of classes, of data whose labels may not show every class."""

    num_classes: int | None = Field(None, ge=1, description="leaf (numeric labels), files, arrays: the declared number of classes; default from the labels")


class DimSettings(DataSettings):
    """The feature dimension of a generated problem."""

    dim: int = Field(60, ge=1, description="synthetic problems: feature dimension")


class FilesSettings(ClassCountSettings):
    """Your own data (``dataset = "files"``; :mod:`fedbayes.data.user`): .npz, .npy, .csv or .parquet."""

    path: str | None = Field(None, description="files: the data file (.npz, .npy, .csv, .parquet); relative paths from the current folder")
    test_path: str | None = Field(None, description="files: the test file, same layout; unset: test_fraction of each client's rows is held out")
    label: str | None = Field(None, description="files: the label column (a .npz: the label array); default 'label' (a .npz: 'y')")
    client_column: str | None = Field(None, description="files: the column (a .npz: the array) of client ids, the natural partition (partition = natural)")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="files, arrays: the share held out for testing when there is no test file")

    @model_validator(mode="after")
    def _path_given(self) -> FilesSettings:
        if self.path is None:
            raise ValueError("data.path: dataset 'files' reads your own file; set data.path (.npz, .npy, .csv or .parquet)")
        return self


class LeafSettings(ClassCountSettings):
    """A LEAF folder."""


class SyntheticLeafSettings(DimSettings):
    """Synthetic(alpha, beta) of Li et al. 2020 (FedProx); ``data.num_clients`` clients are generated."""

    synthetic_alpha: float = Field(1.0, ge=0, description="synthetic_leaf: model heterogeneity")
    synthetic_beta: float = Field(1.0, ge=0, description="synthetic_leaf: feature heterogeneity")


class LeastSquaresSettings(DimSettings):
    """Federated least squares (FedPA App. A); ``data.num_clients`` clients are generated."""


class EmnistSettings(DataSettings):
    """TFF's federated EMNIST."""

    only_digits: bool = Field(False, description="emnist: TFF's digits-only files (10 classes) instead of the 62 classes")


class Cifar100Settings(DataSettings):
    """CIFAR-100's Python batches split by the Pachinko partition over ``data.num_clients`` train clients."""

    test_clients: int = Field(100, ge=1, description="cifar100 (Python batches): test clients of the Pachinko split")


class StackOverflowSettings(DataSettings):
    """TFF's StackOverflow, both tasks."""

    vocab_size: int = Field(10_000, ge=1, description="stackoverflow_*: the most frequent words kept")
    max_clients: int | None = Field(None, ge=1, description="stackoverflow_*: read only the first train users (all when unset)")
    max_posts: int | None = Field(None, ge=1, description="stackoverflow_*: the first posts of each user (Al-Shedivat et al. 2021, NWP: 128); all when unset")
    test_examples: int | None = Field(None, ge=1, description="stackoverflow_*: a random subsample of the test posts (Guo et al. 2023: 10000)")


class StackOverflowNWPSettings(StackOverflowSettings):
    """StackOverflow next-word prediction."""

    max_len: int = Field(20, ge=1, description="stackoverflow_nwp: words per sequence")


class StackOverflowLRSettings(StackOverflowSettings):
    """StackOverflow tag prediction."""

    num_tags: int = Field(500, ge=1, description="stackoverflow_lr: the most frequent tags kept")


def _load_arrays(data_dir, seed, **params):
    raise ValueError("dataset 'arrays' is given from Python: run_experiment(config, out, data=...)")


DATASETS: dict[str, DatasetSpec] = {
    "fashion_mnist": DatasetSpec(
        name="fashion_mnist",
        description="Fashion-MNIST (Xiao et al. 2017): 28x28 clothing images, 10 classes, 60k/10k",
        how_to_get=idx.fashion_mnist_instructions(),
        loader=lambda data_dir, seed: idx.load_fashion_mnist(data_dir),
        locate=_locate_idx(idx.locate_fashion_mnist, idx.fashion_mnist_instructions),
        image=True,
        file_based=True,
    ),
    "mnist": DatasetSpec(
        name="mnist",
        description="MNIST (LeCun et al. 1998): 28x28 grey handwritten digits, 10 classes, 60k/10k",
        how_to_get=idx.mnist_instructions(),
        loader=lambda data_dir, seed: idx.load_mnist(data_dir),
        locate=_locate_idx(idx.locate_mnist, idx.mnist_instructions),
        image=True,
        file_based=True,
    ),
    "digits": DatasetSpec(
        name="digits",
        description="scikit-learn digits: 8x8 images, 10 classes, 1437/360 (stratified 80/20)",
        how_to_get="bundled with scikit-learn",
        loader=lambda data_dir, seed: sklearn_data.load_digits(),
        locate=_always("bundled with scikit-learn"),
        image=True,
    ),
    "breast_cancer": DatasetSpec(
        name="breast_cancer",
        description="scikit-learn breast cancer: 30 standardized features, 2 classes, 455/114",
        how_to_get="bundled with scikit-learn",
        loader=lambda data_dir, seed: sklearn_data.load_breast_cancer(),
        locate=_always("bundled with scikit-learn"),
    ),
    "leaf": DatasetSpec(
        name="leaf",
        description="a LEAF folder (FEMNIST, Shakespeare, ...) with its natural per-user partition",
        how_to_get=leaf.LEAF_INSTRUCTIONS,
        loader=_load_leaf,
        locate=_locate_leaf,
        params=("num_classes",),
        settings=LeafSettings,
        federated="always",
        image=None,
        file_based=True,
    ),
    "synthetic_leaf": DatasetSpec(
        name="synthetic_leaf",
        description="Synthetic(alpha, beta) of Li et al. 2020 (FedProx), natural partition",
        how_to_get="generated on demand",
        loader=_load_synthetic_leaf,
        locate=_always("generated on demand"),
        params=("num_clients", "alpha", "beta", "dim", "num_classes", "sizes", "test_fraction", "iid"),
        settings=SyntheticLeafSettings,
        config_params=lambda d: dict(num_clients=d.num_clients, alpha=d.synthetic_alpha, beta=d.synthetic_beta, dim=d.dim),
        federated="always",
        generated=True,
    ),
    "least_squares": DatasetSpec(
        name="least_squares",
        description="federated linear regression after FedPA App. A (make_regression per client)",
        how_to_get="generated on demand",
        loader=_load_least_squares,
        locate=_always("generated on demand"),
        params=("num_clients", "dim", "num_examples", "heterogeneity", "noise", "n_informative", "test_fraction"),
        settings=LeastSquaresSettings,
        config_params=lambda d: dict(num_clients=d.num_clients, dim=d.dim),
        federated="always",
        task="regression",
        generated=True,
    ),
    "emnist": DatasetSpec(
        name="emnist",
        description="TFF's federated EMNIST: 28x28 characters by 3,400 writers, 62 classes (only_digits: 10); natural partition",
        how_to_get=tff.TFF_INSTRUCTIONS,
        loader=lambda data_dir, seed, only_digits=False: tff.load_fed_emnist(_emnist_folder(data_dir), only_digits),
        locate=_locate_emnist,
        params=("only_digits",),
        settings=EmnistSettings,
        federated="always",
        image=True,
        file_based=True,
    ),
    "fed_cifar100": DatasetSpec(
        name="fed_cifar100",
        description="TFF's federated CIFAR-100: 500 train / 100 test clients of 100 images by the Pachinko split; natural partition",
        how_to_get=tff.tff_instructions("fed_cifar100"),
        loader=lambda data_dir, seed: tff.load_fed_cifar100(_fed_cifar_folder(data_dir)),
        locate=_locate_fed_cifar,
        federated="always",
        image=True,
        file_based=True,
    ),
    "cifar100": DatasetSpec(
        name="cifar100",
        description="CIFAR-100 Python batches, split over clients by the two-level Pachinko partition (500 / 100 clients); natural partition",
        how_to_get=cifar.CIFAR_INSTRUCTIONS,
        loader=lambda data_dir, seed, **params: cifar.load_cifar100(_cifar100_folder(data_dir), seed, **params),
        locate=_locate_cifar100,
        params=("num_clients", "test_clients"),
        settings=Cifar100Settings,
        config_params=lambda d: {"num_clients": d.num_clients, "test_clients": d.test_clients},
        federated="always",
        image=True,
        file_based=True,
    ),
    "cifar10": DatasetSpec(
        name="cifar10",
        description="CIFAR-10 Python batches: 32x32 colour images, 10 classes, 50k/10k",
        how_to_get=cifar.CIFAR_INSTRUCTIONS,
        loader=lambda data_dir, seed: cifar.load_cifar10(_cifar10_folder(data_dir)),
        locate=_locate_cifar10,
        image=True,
        file_based=True,
    ),
    "stackoverflow_nwp": DatasetSpec(
        name="stackoverflow_nwp",
        description="TFF's StackOverflow, next-word prediction: 10k words + 4 special tokens, sequences of 20; one client per user",
        how_to_get=tff.tff_instructions("stackoverflow"),
        loader=_load_stackoverflow("next_word"),
        open_on_demand=_open_stackoverflow("next_word"),
        locate=_locate_so_nwp,
        params=(*_SO_PARAMS, "max_len"),
        settings=StackOverflowNWPSettings,
        federated="always",
        task="next_word",
        tokens=True,
        file_based=True,
    ),
    "stackoverflow_lr": DatasetSpec(
        name="stackoverflow_lr",
        description="TFF's StackOverflow, tag prediction: bag of 10k words -> 500 tags, multi-label; one client per user",
        how_to_get=tff.tff_instructions("stackoverflow"),
        loader=_load_stackoverflow("multilabel"),
        open_on_demand=_open_stackoverflow("multilabel"),
        locate=_locate_so_lr,
        params=(*_SO_PARAMS, "num_tags"),
        settings=StackOverflowLRSettings,
        federated="always",
        task="multilabel",
        file_based=True,
    ),
    "files": DatasetSpec(
        name="files",
        description="your own data: features, labels and optionally client ids in .npz, .npy, CSV or Parquet files",
        how_to_get="your files: data.path (and data.test_path); docs: bring your own data and model",
        loader=_load_files,
        locate=_always("your files (data.path)"),
        params=("path", "test_path", "label", "client_column", "test_fraction", "num_classes"),
        settings=FilesSettings,
        federated="optional",
        client_ids_setting="client_column",
        image=None,
        file_based=True,
        user_data=True,
        exclusive=("path", "test_path", "label", "client_column"),
    ),
}
# Your arrays, given from Python (fedbayes.run_experiment(config, out, data=...)): never loaded by name.
ARRAYS = DatasetSpec(
    name="arrays",
    description="your arrays, given from Python: run_experiment(config, out, data=...)",
    how_to_get="pass a Dataset from Python",
    loader=_load_arrays,
    locate=_always("given from Python"),
    federated="optional",
    image=None,
    task=None,
    from_python=True,
    user_data=True,
)
# Datasets read from files in data_dir: a data error names the folder.
FILE_BASED = tuple(name for name, spec in DATASETS.items() if spec.file_based and name != "files")
_BUILTIN: dict[str, DatasetSpec] = {**DATASETS, ARRAYS.name: ARRAYS}


_REGISTRY = Registry.of("dataset", DatasetSpec, _BUILTIN)


def register(spec: DatasetSpec) -> DatasetSpec:
    """Adds a dataset; a config naming it (``[data] dataset = ...``, its own keys flat beside
    the others) then validates and runs like a built-in one.

    Raises:
      ValueError: the name is taken, or ``spec`` is not a :class:`DatasetSpec`.
    """
    return _REGISTRY.register(spec)


def unregister(name: str) -> None:
    """Removes a dataset added by :func:`register` (a name never registered is no error).

    Raises:
      ValueError: ``name`` is built in (built-in datasets stay).
    """
    _REGISTRY.unregister(name)


def get(name: str) -> DatasetSpec:
    """The spec of ``name``; an unknown name raises ``ValueError`` listing the known ones."""
    return _REGISTRY.get(name)


def names() -> tuple[str, ...]:
    """Every registered name, built-in ones first."""
    return _REGISTRY.names()


def specs() -> tuple[DatasetSpec, ...]:
    """Every registered spec."""
    return _REGISTRY.specs()


def builtin_specs() -> tuple[DatasetSpec, ...]:
    """The datasets that ship with fedbayes."""
    return _REGISTRY.builtin_specs()


# FEDBAYES_NO_SYSTEM_DATA=1 hides the system-wide dataset folders (Debian's /usr/share/datasets),
# as on a machine without the packages: `.ci/run` runs the test suite once that way.
NO_SYSTEM_DATA_ENV = "FEDBAYES_NO_SYSTEM_DATA"
if os.environ.get(NO_SYSTEM_DATA_ENV, "") not in ("", "0"):
    idx.FASHION_MNIST_SYSTEM_DIRS = ()


def _info(name: str) -> DatasetSpec:
    if name not in names() or get(name).from_python:
        raise ValueError(f"dataset name must be one of {sorted(n for n in names() if not get(n).from_python)}, got {name!r}")
    return get(name)


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
    if info.file_based:
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
    return [(spec.name, *spec.locate(data_dir)) for spec in specs() if not spec.from_python]


def check_traits(spec: DatasetSpec, dataset: Dataset) -> None:
    """Raises :class:`DataError` where a loaded dataset is not what its spec declares (task,
    client ids, images); the conformance suite runs it on every registered dataset."""
    if spec.task is not None and dataset.task != spec.task:
        raise DataError(f"dataset {spec.name!r}: its spec declares a {spec.task} task; the loader gave {dataset.task}")
    if spec.federated == "always" and dataset.client_ids is None:
        raise DataError(f"dataset {spec.name!r}: its spec says it comes federated; the loader gave no client ids")
    if spec.federated == "never" and dataset.client_ids is not None:
        raise DataError(f"dataset {spec.name!r}: its spec says it has no client ids; the loader gave some")
    if spec.image is not None and spec.image != (len(dataset.feature_shape) in (2, 3)):
        raise DataError(f"dataset {spec.name!r}: its spec says image={spec.image}; the loader gave features of shape {tuple(dataset.feature_shape)}")
