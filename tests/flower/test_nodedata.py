"""A node's trust rules (fedbayes.flower.nodedata.accept_run_config): the server names no path,
no dataset of the node's own, and no module the node does not list. Needs no flwr."""

import sys
import tomllib

import numpy as np
import pytest

from fedbayes.config.schema import validate
from fedbayes.flower.nodedata import NodeDataError, accept_run_config, node_source, refuse_server_path

RUN = """
rounds = 1
[data]
dataset = "breast_cancer"
num_clients = 3
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 16
[server]
clients_per_round = 3
[algorithm]
name = "fedavg"
"""


def _raw(**sections) -> dict:
    raw = tomllib.loads(RUN)
    for section, values in sections.items():
        if section == "top":
            raw.update(values)
        else:
            raw.setdefault(section, {}).update(values)
    return raw


@pytest.mark.parametrize(
    "sections,needle",
    [
        ({"data": {"data_dir": "/srv/secret"}}, "data.data_dir = '/srv/secret'"),
        ({"data": {"dataset": "files", "path": "/etc/secret.csv"}}, "data.path = '/etc/secret.csv'"),
        ({"data": {"dataset": "files", "path": "mine.npz", "test_path": "/etc/secret.csv"}}, "data.test_path = '/etc/secret.csv'"),
        ({"top": {"store_dir": "/var/other"}}, "store_dir = '/var/other'"),
    ],
)
def test_a_path_the_server_names_is_refused_in_one_line(sections, needle):
    with pytest.raises(NodeDataError) as err:
        accept_run_config(_raw(**sections), {"data-file": "mine.npz"})
    assert str(err.value).startswith(f"this node refuses the run's {needle}: a node's data comes from its own configuration")
    assert "\n" not in str(err.value)


def test_own_data_needs_the_nodes_data_file_and_becomes_it():
    with pytest.raises(NodeDataError, match="data.dataset = 'files': that is data a node holds itself, and this node has no data-file"):
        accept_run_config(_raw(data={"dataset": "files"}), {})
    with pytest.raises(NodeDataError, match="data.dataset = 'arrays'"):
        accept_run_config(_raw(data={"dataset": "arrays"}), {"dataset": "arrays"})
    accepted = accept_run_config(_raw(data={"dataset": "files"}), {"data-file": "/node/mine.npz"})
    assert accepted["data"]["path"] == "/node/mine.npz"
    # the node's own file may be named back to it
    assert accept_run_config(_raw(data={"dataset": "files", "path": "/node/mine.npz"}), {"data-file": "/node/mine.npz"})["data"]["path"] == "/node/mine.npz"


def test_a_node_pinned_to_a_dataset_refuses_another():
    with pytest.raises(NodeDataError, match="this node holds dataset 'wine'; the run is configured for 'breast_cancer'"):
        accept_run_config(_raw(), {"dataset": "wine"})
    assert accept_run_config(_raw(), {"dataset": "breast_cancer"}) == _raw()
    assert accept_run_config(_raw(), {}) == _raw()  # a registry dataset by name, from the node's default location


def test_a_module_is_imported_only_when_the_node_lists_it(tmp_path):
    evil = tmp_path / "evil_model.py"
    marker = tmp_path / "IMPORTED"
    evil.write_text(
        f"open({str(marker)!r}, 'w').close()\nimport flax.linen as nn\nclass Net(nn.Module):\n    @nn.compact\n    def __call__(self, x):\n        return nn.Dense(2)(x)\n"
    )
    spec = f"{evil}:Net"
    raw = _raw(model={"module": spec, "name": "module"})
    for source in ({}, {"data-file": "mine.npz"}, {"model-modules": "pkg.other:Net"}):
        with pytest.raises(
            NodeDataError,
            match=r"this node refuses the run's model.module = '.*evil_model.py:Net': a node imports only a model module its own configuration names",
        ):
            accept_run_config(raw, source)
    assert not marker.exists() and "evil_model" not in sys.modules
    assert accept_run_config(raw, {"model-modules": f"pkg.other:Net, {spec}"}) == raw


def test_the_allow_list_and_a_node_toml_are_the_nodes_keys(tmp_path):
    toml = tmp_path / "node.toml"
    toml.write_text('data-file = "mine.npz"\nmodel-modules = "pkg.mod:Net"\n')
    assert node_source({"node-toml": str(toml)}) == {"data-file": "mine.npz", "model-modules": "pkg.mod:Net"}


def test_a_validated_config_is_held_to_the_same_rules():
    config = validate(_raw())
    refuse_server_path(config, {})
    with_dir = config.model_copy(update={"data": config.data.model_copy(update={"data_dir": "/srv/x"})})
    with pytest.raises(NodeDataError, match="data.data_dir = '/srv/x'"):
        refuse_server_path(with_dir, {})


def test_a_damaged_or_object_data_file_is_one_line(tmp_path):
    from fedbayes.flower.nodedata import read_file

    good = tmp_path / "good.npz"
    np.savez(good, x=np.zeros((50, 3), np.float32), y=np.zeros(50))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[:200])
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}] * 3, object), y=np.zeros(3))
    cplx = tmp_path / "complex.npz"
    np.savez(cplx, x=np.zeros((3, 2)) + 1j, y=np.zeros(3))
    for path, needle in ((cut, "cannot be read as npz"), (obj, "cannot be read as npz"), (cplx, "x must hold real numbers; got complex128")):
        with pytest.raises(NodeDataError) as err:
            read_file(path)
        assert str(err.value).startswith(f"data-file {path}: ") and needle in str(err.value), err.value
    bad = tmp_path / "latin.csv"
    bad.write_bytes(b"label,a\n0,\xff\n")
    with pytest.raises(NodeDataError, match="latin.csv: not a CSV text file"):
        read_file(bad)
    for text, needle in (
        ("label,a\n0,1\n1,x\n", "t.csv: row 3, column 'a': 'x' is not a number"),
        ("label,a\n0,1\n1\n", "t.csv: row 3 has 1 values, the header 2"),
    ):
        (tmp_path / "t.csv").write_text(text)
        with pytest.raises(NodeDataError, match=needle):
            read_file(tmp_path / "t.csv")  # as fedbayes.data.user words it for the simulator's files


def test_labels_of_the_wrong_shape_are_refused():
    from fedbayes.flower.nodedata import check_examples

    spec = {"feature_shape": [3], "num_classes": 2, "task": "classification", "x_dtype": "float32", "y_dtype": "int32"}
    with pytest.raises(NodeDataError, match=r"mine.npz: labels must be one per example \(shape \[n\]\); got shape \[4, 2\]"):
        check_examples(np.zeros((4, 3)), np.zeros((4, 2)), spec, "mine.npz")
