"""One conformance suite over every dataset and partition in the registries: each dataset loads
(from small files in its real format, written here, where it is read from files), has the traits
its spec declares and is partitioned; each partition gives each client its own examples."""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from fedbayes.config.schema import DataConfig, RunConfig, brings_clients
from fedbayes.data import partitions, writers
from fedbayes.data import registry as datasets
from fedbayes.data.registry import check_traits, load_dataset
from fedbayes.runs.build import load_data, split_clients

IDX_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def _idx(folder: Path, rng) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    arrays = (
        rng.integers(0, 256, (40, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 40).astype(np.uint8),
        rng.integers(0, 256, (8, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 8).astype(np.uint8),
    )
    for name, array in zip(IDX_NAMES, arrays):
        header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        with gzip.open(folder / f"{name}.gz", "wb") as f:
            f.write(header + array.tobytes())
    return {"data_dir": folder}


def _leaf(folder: Path, rng) -> dict:
    for split, n in (("train", 6), ("test", 2)):
        users = {u: {"x": rng.random((n, 4)).tolist(), "y": rng.integers(0, 3, n).tolist()} for u in ("f_a", "f_b", "f_c")}
        (folder / split).mkdir(parents=True, exist_ok=True)
        blob = {"users": list(users), "num_samples": [n] * 3, "user_data": users}
        (folder / split / "part.json").write_text(json.dumps(blob))
    return {"data_dir": folder}


def _files(folder: Path, rng) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["client,f1,f2,label"] + [f"{i % 3},{rng.normal():.4f},{rng.normal():.4f},{i % 2}" for i in range(60)]
    (folder / "own.csv").write_text("\n".join(rows) + "\n")
    return {"path": str(folder / "own.csv"), "client_column": "client"}


# How each built-in dataset is made present on this machine: files in its real format, written
# here (the data cannot be fetched), or parameters of a generated or bundled one.
SOURCES = {
    "fashion_mnist": _idx,
    "mnist": _idx,
    "digits": lambda folder, rng: {},
    "breast_cancer": lambda folder, rng: {},
    "leaf": _leaf,
    "synthetic_leaf": lambda folder, rng: {"num_clients": 4},
    "least_squares": lambda folder, rng: {"num_clients": 4},
    "emnist": lambda folder, rng: {"data_dir": writers.write_fed_emnist(folder, rng)},
    "fed_cifar100": lambda folder, rng: {"data_dir": writers.write_fed_cifar100(folder, rng)},
    "cifar100": lambda folder, rng: {"data_dir": writers.write_cifar_python(folder, rng, num_train=60, num_test=20), "num_clients": 6, "test_clients": 2},
    "cifar10": lambda folder, rng: {"data_dir": writers.write_cifar_python(folder, rng, num_classes=10, num_train=50, num_test=10)},
    "stackoverflow_nwp": lambda folder, rng: {"data_dir": writers.write_stackoverflow(folder, rng), "vocab_size": 20, "max_len": 6},
    "stackoverflow_lr": lambda folder, rng: {"data_dir": writers.write_stackoverflow(folder, rng), "vocab_size": 20, "num_tags": 4},
    "files": _files,
}


def test_every_built_in_dataset_has_a_source_here():
    missing = [s.name for s in datasets.builtin_specs() if s.name not in SOURCES and not s.from_python]
    assert not missing, f"add a small source for {missing} to SOURCES"


@pytest.mark.parametrize("spec", datasets.specs(), ids=lambda s: s.name)
def test_a_dataset_loads_with_its_declared_traits_and_is_partitioned(spec, tmp_path):
    if spec.from_python:
        pytest.skip(f"{spec.name} is given from Python (run_experiment(config, out, data=...)), never loaded by name")
    if spec.name not in SOURCES:
        pytest.skip(f"{spec.name} is registered without a small source in this suite")
    params = SOURCES[spec.name](tmp_path / spec.name, np.random.default_rng(0))
    data_dir = params.pop("data_dir", None)
    dataset = load_dataset(spec.name, data_dir=data_dir, seed=0, **params)
    check_traits(spec, dataset)
    assert set(spec.params) >= set(spec.loader_params(DataConfig.model_validate({"dataset": spec.name, **_config_keys(spec, params)})))
    if spec.federated == "always" or (spec.client_ids_setting and params.get(spec.client_ids_setting)):
        assert dataset.client_ids is not None and len(np.unique(dataset.client_ids)) >= 2
    rng = np.random.default_rng(0)
    if dataset.client_ids is not None:
        _check_parts(partitions.get("natural").split(dataset.y_train, None, rng, client_ids=dataset.client_ids), dataset.num_train)
    if dataset.task == "classification":
        _check_parts(partitions.get("iid").split(dataset.y_train, 2, rng), dataset.num_train, 2)


def _config_keys(spec, params) -> dict:
    keys = {k: v for k, v in params.items() if k in spec.setting_keys or k == "num_clients"}
    if spec.name == "files":
        keys.setdefault("path", "x.csv")
    return keys


def _check_parts(parts, num_train: int, num_clients: int | None = None, whole: bool = True) -> None:
    """One int64 index array per client, no example twice; ``whole``: every example once."""
    if num_clients is not None:
        assert len(parts) == num_clients
    joined = np.concatenate(parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert len(np.unique(joined)) == len(joined) and joined.min() >= 0 and joined.max() < num_train
    if whole:
        assert len(joined) == num_train


@pytest.mark.parametrize("spec", partitions.specs(), ids=lambda s: s.name)
def test_a_partition_gives_each_client_its_own_examples(spec):
    name = "synthetic_leaf" if spec.needs_client_ids else "digits"
    dataset = load_dataset(name, num_clients=4) if spec.needs_client_ids else load_dataset(name)
    params = spec.params(DataConfig.model_validate({"dataset": name, "partition": spec.name}))
    parts = spec.split(dataset.y_train, 4, np.random.default_rng(0), client_ids=dataset.client_ids, **params)
    _check_parts(parts, dataset.num_train, 4, whole=spec.name != "two_level_dirichlet")  # its sizes are drawn: a few examples may be left out
    again = spec.split(dataset.y_train, 4, np.random.default_rng(0), client_ids=dataset.client_ids, **params)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))  # the seeded generator alone decides


@pytest.mark.parametrize("spec", [*datasets.builtin_specs(), *partitions.builtin_specs()], ids=lambda s: s.name)
def test_a_built_in_spec_s_keys_sit_flat_in_the_data_table_with_the_same_defaults(spec):
    fields = DataConfig.model_fields
    for key in spec.setting_keys:
        assert key in fields, f"{spec.name}: data.{key} is not documented in DataConfig"
        own = spec.settings.model_fields[key]
        assert own.get_default(call_default_factory=True) == fields[key].get_default(call_default_factory=True), key
        assert own.description == fields[key].description, key


@pytest.mark.parametrize("spec", [s for s in datasets.builtin_specs() if not s.from_python], ids=lambda s: s.name)
def test_an_unset_num_clients_is_the_number_of_clients_the_data_brings(spec, tmp_path):
    params = SOURCES[spec.name](tmp_path / spec.name, np.random.default_rng(0))
    data = {k: str(v) if isinstance(v, Path) else v for k, v in params.items() if k != "num_clients"}
    model = {"name": "linear"} if spec.task == "regression" else {}
    config = RunConfig.model_validate({"data": {"dataset": spec.name, **data}, "model": model, "server": {"clients_per_round": 2}})
    dataset = load_data(config)
    parts = split_clients(config, dataset)
    if brings_clients(spec, config.data.partition_spec, config.data):
        assert config.data.num_clients is None and len(parts) == len(np.unique(dataset.client_ids)) >= 2
    else:
        assert config.data.num_clients == 10 and len(parts) == 10
