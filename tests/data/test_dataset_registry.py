"""The dataset and partition registries: their errors, the config validated against them, the
default partition, and a dataset and a partition registered from this file that run from a TOML
config through ``fedbayes run``."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest
from pydantic import Field
from typer.testing import CliRunner

from fedbayes.config.schema import ConfigError, to_toml, validate
from fedbayes.data import partitions
from fedbayes.data import registry as datasets
from fedbayes.data.dataset import Dataset
from fedbayes.data.partitions import PartitionSpec
from fedbayes.data.registry import ClassCountSettings, DatasetSpec, DataSettings, settings_fields


# ----- a dataset and a partition, added from a test file ------------------------------------------
class BlobsSettings(DataSettings):
    """Gaussian blobs, one mean shift per client."""

    noise: float = Field(0.5, gt=0, description="blobs: the spread around each class mean")
    points: int = Field(40, ge=4, description="blobs: training points per client")


def load_blobs(data_dir, seed, num_clients=4, noise=0.5, points=40) -> Dataset:
    rng = np.random.default_rng(seed)
    means = np.array([[-1.0, -1.0], [1.0, 1.0]], np.float32)

    def draw(n_per_client):
        ids = np.repeat(np.arange(num_clients), n_per_client)
        y = rng.integers(0, 2, ids.size).astype(np.int32)
        x = (means[y] + 0.3 * ids[:, None] + noise * rng.normal(size=(ids.size, 2))).astype(np.float32)
        return x, y, ids.astype(np.int64)

    x, y, ids = draw(points)
    x_test, y_test, test_ids = draw(max(points // 4, 1))
    return Dataset("blobs", x, y, x_test, y_test, 2, "classification", ids, test_ids)


BLOBS = DatasetSpec(
    name="blobs",
    description="two Gaussian blobs per client, each client's shifted",
    how_to_get="generated on demand",
    loader=load_blobs,
    locate=lambda data_dir: (True, "generated on demand"),
    params=("num_clients", "noise", "points"),
    settings=BlobsSettings,
    config_params=lambda d: {"num_clients": d.num_clients, "noise": d.noise, "points": d.points},
    federated="always",
)


class ByLabelSettings(DataSettings):
    """Clients by label."""

    label_offset: int = Field(0, ge=0, description="by_label: added to the label before the client is taken modulo num_clients")


def split_by_label(labels, num_clients, rng, client_ids=None, label_offset=0):
    labels = np.asarray(labels)
    owner = (labels + label_offset) % num_clients
    return [np.flatnonzero(owner == k).astype(np.int64) for k in range(num_clients)]


BY_LABEL = PartitionSpec("by_label", "client k holds the labels (k - offset) mod num_clients", split_by_label, ByLabelSettings)


@pytest.fixture
def blobs():
    datasets.register(BLOBS)
    yield BLOBS
    datasets.unregister(BLOBS.name)


@pytest.fixture
def by_label():
    partitions.register(BY_LABEL)
    yield BY_LABEL
    partitions.unregister(BY_LABEL.name)


# ----- registry errors ---------------------------------------------------------------------------------
def test_register_get_and_unregister_a_dataset(blobs):
    assert datasets.get("blobs") is blobs and datasets.names()[-1] == "blobs" and blobs in datasets.specs()
    assert blobs not in datasets.builtin_specs()
    with pytest.raises(ValueError, match="dataset 'blobs' is already registered"):
        datasets.register(blobs)
    with pytest.raises(ValueError, match="dataset 'digits' is already registered"):
        datasets.register(DatasetSpec("digits", "", "", load_blobs, blobs.locate))
    with pytest.raises(ValueError, match="expected a DatasetSpec"):
        datasets.register(("blobs", load_blobs))
    with pytest.raises(ValueError, match="dataset 'digits' is built in and cannot be removed"):
        datasets.unregister("digits")
    datasets.unregister("blobs")
    with pytest.raises(ValueError, match="unknown dataset 'blobs'; allowed: fashion_mnist, mnist"):
        datasets.get("blobs")
    datasets.unregister("blobs")  # never registered (any more): no error
    datasets.register(blobs)


def test_register_get_and_unregister_a_partition(by_label):
    assert partitions.get("by_label") is by_label and partitions.names()[-1] == "by_label"
    with pytest.raises(ValueError, match="partition 'by_label' is already registered"):
        partitions.register(by_label)
    with pytest.raises(ValueError, match="expected a PartitionSpec"):
        partitions.register("by_label")
    with pytest.raises(ValueError, match="partition 'iid' is built in and cannot be removed"):
        partitions.unregister("iid")
    partitions.unregister("by_label")
    with pytest.raises(ValueError, match="unknown partition 'by_label'; allowed: iid, dirichlet"):
        partitions.get("by_label")
    partitions.register(by_label)


def test_a_spec_is_checked_when_declared():
    with pytest.raises(ValueError, match="federated must be one of always, optional, never"):
        DatasetSpec("x", "", "", load_blobs, BLOBS.locate, federated="sometimes")
    with pytest.raises(ValueError, match="task must be one of"):
        DatasetSpec("x", "", "", load_blobs, BLOBS.locate, task="ranking")
    with pytest.raises(ValueError, match="'path' is not a key of its settings"):
        DatasetSpec("x", "", "", load_blobs, BLOBS.locate, settings=BlobsSettings, exclusive=("path",))
    with pytest.raises(ValueError, match="settings must be an HParams subclass"):
        PartitionSpec("x", "", split_by_label, settings=dict)


# ----- the config, validated against the registries ------------------------------------------------------
def test_a_registered_dataset_s_keys_are_validated_flat_in_data(blobs):
    config = validate({"data": {"dataset": "blobs", "noise": 0.25, "num_clients": 4}, "server": {"clients_per_round": 2}})
    assert config.data.noise == 0.25 and config.data.points == 40  # an unset key of its own takes its default
    assert "noise = 0.25" in to_toml(config) and "points = 40" in to_toml(config)
    with pytest.raises(ConfigError, match=r"^config error: data.noise: Input should be greater than 0"):
        validate({"data": {"dataset": "blobs", "noise": 0}})
    with pytest.raises(ConfigError, match=r"^config error: data.noise: unknown key; allowed keys here: dataset, data_dir"):
        validate({"data": {"dataset": "digits", "noise": 0.25}})
    with pytest.raises(ConfigError, match=r"^config error: data.dataset: unknown dataset 'blobz'; allowed: .*, blobs$"):
        validate({"data": {"dataset": "blobz"}})


def test_a_registered_partition_s_keys_are_validated_flat_in_data(by_label):
    config = validate({"data": {"dataset": "digits", "partition": "by_label", "label_offset": 3}})
    assert config.data.label_offset == 3
    with pytest.raises(ConfigError, match=r"^config error: data.label_offset: Input should be greater than or equal to 0"):
        validate({"data": {"dataset": "digits", "partition": "by_label", "label_offset": -1}})
    with pytest.raises(ConfigError, match=r"^config error: data.label_offset: unknown key"):
        validate({"data": {"dataset": "digits", "label_offset": 1}})


@pytest.mark.parametrize(
    "data, partition",
    [
        ({"dataset": "digits"}, "iid"),
        ({"dataset": "synthetic_leaf"}, "natural"),
        ({"dataset": "least_squares"}, "natural"),
        ({"dataset": "emnist"}, "natural"),
        ({"dataset": "files", "path": "x.csv"}, "iid"),
        ({"dataset": "files", "path": "x.csv", "client_column": "client"}, "natural"),
        ({"dataset": "synthetic_leaf", "partition": "iid"}, "iid"),  # set explicitly, as every stored config has it
        ({"dataset": "arrays"}, "iid"),  # its client ids are known only once given
    ],
)
def test_the_default_partition_is_natural_where_the_data_comes_federated(data, partition):
    raw = {"data": data, "model": {"name": "linear" if data["dataset"] == "least_squares" else "mlp"}}
    config = validate(raw)
    assert config.data.partition == partition
    assert validate(tomllib.loads(to_toml(config))).data.partition == partition  # the stored config keeps its meaning


def test_keys_of_another_dataset_are_rejected_only_where_they_were():
    with pytest.raises(ConfigError, match=r"^config error: data.client_column: only dataset 'files' reads it; got dataset 'digits'$"):
        validate({"data": {"dataset": "digits", "client_column": "c"}})
    # Keys that today's configs set harmlessly stay accepted (alpha with iid, dim with digits).
    validate({"data": {"dataset": "digits", "partition": "iid", "alpha": 0.3, "dim": 5, "synthetic_alpha": 0.5}})


# ----- run from a TOML file ------------------------------------------------------------------------------------
def _run(tmp_path, text: str):
    from fedbayes.cli import app
    from fedbayes.runs.folder import read_metrics

    path = tmp_path / "run.toml"
    path.write_text(text)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["run", str(path), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return read_metrics(out / "metrics.jsonl"), tomllib.loads((out / "config.toml").read_text())


def test_a_registered_dataset_runs_from_a_toml_config(blobs, tmp_path):
    records, stored = _run(
        tmp_path,
        """
name = "blobs"
rounds = 2
[data]
dataset = "blobs"
num_clients = 4
noise = 0.3
[model]
name = "logreg"
[server]
clients_per_round = 2
[algorithm]
name = "fedavg"
""",
    )
    assert [r["round"] for r in records] == [0, 1, 2] and all(np.isfinite(r["accuracy"]) for r in records)
    assert stored["data"]["partition"] == "natural" and stored["data"]["noise"] == 0.3 and stored["data"]["points"] == 40
    assert validate(stored).data.noise == 0.3  # the run folder's config loads again (resume)


def test_a_registered_partition_runs_from_a_toml_config(by_label, tmp_path):
    records, stored = _run(
        tmp_path,
        """
name = "by_label"
rounds = 1
[data]
dataset = "digits"
num_clients = 5
partition = "by_label"
label_offset = 2
[model]
name = "logreg"
[server]
clients_per_round = 5
[algorithm]
name = "fedavg"
""",
    )
    assert [r["round"] for r in records] == [0, 1]
    assert stored["data"]["partition"] == "by_label" and stored["data"]["label_offset"] == 2


def test_a_registered_partition_splits_as_its_function_says(by_label):
    from fedbayes.runs.build import load_data, split_clients

    config = validate({"data": {"dataset": "digits", "num_clients": 5, "partition": "by_label", "label_offset": 2}, "server": {"clients_per_round": 5}})
    dataset = load_data(config)
    parts = split_clients(config, dataset)
    assert len(parts) == 5 and sum(map(len, parts)) == dataset.num_train
    for k, part in enumerate(parts):
        assert set(((dataset.y_train[part] + 2) % 5).tolist()) == {k}


def test_a_key_two_settings_classes_declare_is_refused_and_a_shared_base_is_one_key():
    class Mine(DataSettings):
        num_classes: int | None = Field(None, ge=1, description="mine: another meaning")

    class Shared(ClassCountSettings):
        noise: float = Field(0.5, gt=0)

    def spec(name, settings):
        return DatasetSpec(name, "d", "h", loader=lambda d, s: None, locate=lambda d: (True, ""), settings=settings)

    leaf = datasets.get("leaf")
    assert list(settings_fields([leaf, spec("shared", Shared)])) == ["num_classes", "noise"]
    with pytest.raises(ValueError, match="data.num_classes: declared by both ClassCountSettings and .*Mine"):
        settings_fields([leaf, spec("mine", Mine)])


def test_a_dataset_that_takes_num_clients_makes_its_clients():
    assert [s.name for s in datasets.builtin_specs() if s.makes_clients] == ["synthetic_leaf", "least_squares", "cifar100"]
