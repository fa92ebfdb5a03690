"""A node's own data: where a SuperNode's examples come from is the node's setting, never the server's.

The node's configuration (``flower-supernode --node-config "..."``, or a TOML file it names with
``node-toml=PATH``, whose keys are the same) says where its examples are:

* ``data-file = PATH``: the node's own files: a ``.npz`` with arrays ``x`` (features, one row per
  example) and ``y`` (labels), or a ``.csv`` with a header row whose ``label`` column (or the
  column ``label-column`` names) holds the labels and every other column a feature;
* ``dataset = NAME`` and optionally ``data-dir = PATH``: a fedbayes dataset read from the node's
  own folder; the node takes partition ``partition-id`` of it, split as the run's config says
  (``data.partition``, ``data.seed``): the examples the simulator gives that client;
* neither: the dataset the run's config names, read from fedbayes's default location (datasets
  that ship with a library, such as scikit-learn's, need no files).

The server's config says *what* the run is (model, method, partition scheme, the data's
shapes) and is checked against the node's examples: their feature shape and labels must fit
the model the server built (:func:`check_examples`). It never says *where* a node's data is: a
train message whose config names ``data.data_dir`` is refused with one line
(:func:`refuse_server_path`), and so is one that names another dataset than the node's
``dataset``.
"""

from __future__ import annotations

import csv
import tomllib
from pathlib import Path

import numpy as np

KEYS = ("data-file", "dataset", "data-dir", "label-column")


class NodeDataError(ValueError):
    """The node's data does not fit the run, or the run tries to choose it."""


def node_source(node_config) -> dict[str, str]:
    """The node's data keys (:data:`KEYS`) from its node config and the node TOML it names."""
    source = {}
    if node_config.get("node-toml"):
        path = Path(str(node_config["node-toml"])).expanduser()
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise NodeDataError(f"node-toml {path}: {exc}") from None
        unknown = sorted(set(raw) - set(KEYS))
        if unknown:
            raise NodeDataError(f"node-toml {path}: unknown key {unknown[0]!r}; allowed: {', '.join(KEYS)}")
        source.update({k: str(raw[k]) for k in KEYS if k in raw})
    source.update({k: str(node_config[k]) for k in KEYS if node_config.get(k) not in (None, "")})
    if "data-file" in source and "dataset" in source:
        raise NodeDataError("node config: give data-file or dataset, not both")
    return source


def refuse_server_path(config, source: dict[str, str]) -> None:
    """Raises :class:`NodeDataError` when the run's config tries to choose the node's data."""
    d = config.data
    if d.data_dir is not None:
        raise NodeDataError(
            f"this node refuses the run's data.data_dir = {d.data_dir!r}: a node's data comes from its own configuration (node config data-file, or dataset and data-dir)"
        )
    if "dataset" in source and source["dataset"] != d.dataset:
        raise NodeDataError(f"this node holds dataset {source['dataset']!r}; the run is configured for {d.dataset!r}")


def read_file(path: str | Path, label_column: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of a node's own ``.npz`` (arrays ``x``, ``y``) or ``.csv`` (a header row; labels
    in ``label_column``, features in every other column)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NodeDataError(f"data-file {path}: no such file")
    if path.suffix == ".npz":
        with np.load(path) as z:
            if "x" not in z.files or "y" not in z.files:
                raise NodeDataError(f"data-file {path}: needs arrays 'x' and 'y'; has {', '.join(z.files) or 'none'}")
            return z["x"], z["y"]
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        if not rows or label_column not in rows[0]:
            raise NodeDataError(f"data-file {path}: the header has no column {label_column!r} (label-column)")
        j = rows[0].index(label_column)
        try:
            table = np.array([[float(v) for v in row] for row in rows[1:]], np.float64)
        except ValueError as exc:
            raise NodeDataError(f"data-file {path}: {exc}") from None
        if table.ndim != 2 or len(table) == 0:
            raise NodeDataError(f"data-file {path}: no examples")
        return np.delete(table, j, axis=1), table[:, j]
    raise NodeDataError(f"data-file {path}: allowed: a .npz (arrays x, y) or a .csv with a header")


def check_examples(x: np.ndarray, y: np.ndarray, spec, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``x, y`` in the dtypes of the run, after checking them against the run's data ``spec``
    (``feature_shape``, ``num_classes``, ``task``, ``x_dtype``, ``y_dtype``), naming ``where``."""
    if x.shape[1:] != tuple(spec["feature_shape"]) or len(x) != len(y) or len(y) == 0:
        raise NodeDataError(
            f"{where}: {len(x)} examples of features {list(x.shape[1:])} and {len(y)} labels; the run's model takes features {list(spec['feature_shape'])}"
        )
    if not np.all(np.isfinite(x)):
        raise NodeDataError(f"{where}: non-finite features")
    if spec["task"] == "classification":
        if not np.all(y == np.round(y)) or y.min() < 0 or y.max() >= spec["num_classes"]:
            raise NodeDataError(f"{where}: labels must be integers in [0, {spec['num_classes']}) for the run's model; got {y.min()} to {y.max()}")
    return x.astype(spec["x_dtype"]), y.astype(spec["y_dtype"])
