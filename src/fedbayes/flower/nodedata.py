"""A node's own data and code: the node decides them, never the server.

The node's configuration (``flower-supernode --node-config "..."``, or a TOML file it names with
``node-toml=PATH``, whose keys are the same) says where its examples are:

* ``data-file = PATH``: the node's own files: a ``.npz`` with arrays ``x`` (features, one row per
  example) and ``y`` (labels), or a ``.csv`` with a header row whose ``label`` column (or the
  column ``label-column`` names) holds the labels and every other column a feature;
* ``dataset = NAME`` and optionally ``data-dir = PATH``: a fedbayes dataset read from the node's
  own folder; the node takes partition ``partition-id`` of it, split as the run's config says
  (``data.partition``, ``data.seed``): the examples the simulator gives that client;
* neither: the dataset the run's config names, by its registry name, read from fedbayes's
  default location on the node (datasets that ship with a library, such as scikit-learn's,
  need no files).

and which user model code it may import: ``model-modules = SPEC[,SPEC...]``, each spec exactly as
a config's ``model.module`` gives it (``package.module:Class`` or ``path/to/file.py:Class``).

The server's config says *what* the run is (method and hyperparameters, a registry model by name
and its shape arguments, the partition scheme, the round schedule) and is checked against the
node's examples (:func:`check_examples`). It never says *where* a node's data is nor which code
it runs: :func:`accept_run_config` refuses, in one line and before the config is validated (which
would import a user module) or any file is read, a config naming a path (``data.data_dir``,
``data.path``, ``data.test_path``, ``store_dir``), another dataset than the node's ``dataset``,
your own data (a dataset whose spec has the ``user_data`` trait: ``files``, ``arrays``) on a node
without a ``data-file``, and a ``model.module`` the node's ``model-modules`` does not name. The
refusal is the ClientApp's error, which the server logs and counts as a rejected reply.
"""

from __future__ import annotations

import csv
import tomllib
from pathlib import Path

import numpy as np

KEYS = ("data-file", "dataset", "data-dir", "label-column", "model-modules")
SERVER_PATHS = (("data", "data_dir"), ("data", "path"), ("data", "test_path"), (None, "store_dir"))  # a server may name none of these


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


def allowed_modules(source: dict[str, str]) -> list[str]:
    """The user model modules the node's ``model-modules`` names (comma-separated)."""
    return [m.strip() for m in source.get("model-modules", "").split(",") if m.strip()]


def accept_run_config(raw: dict, source: dict[str, str]) -> dict:
    """The server's raw (unvalidated) run config as this node runs it, or :class:`NodeDataError`.

    Refuses a path the server names (:data:`SERVER_PATHS`; ``data.path`` may only be the node's
    own ``data-file``), another dataset than the node's, your own data (a dataset with the
    ``user_data`` trait: ``files``, ``arrays``) on a node without a ``data-file``, and a
    ``model.module`` outside the node's ``model-modules``. For a dataset that reads ``data.path``
    (``files``), ``data.path`` becomes the node's ``data-file``. Nothing is read or imported.
    """
    own = source.get("data-file")
    sections = {None: raw, **{k: v for k, v in raw.items() if isinstance(v, dict)}}
    for section, key in SERVER_PATHS:
        value = sections.get(section, {}).get(key)
        if value is not None and not (key == "path" and own is not None and str(value) == own):
            name = f"{section}.{key}" if section else key
            raise NodeDataError(
                f"this node refuses the run's {name} = {value!r}: a node's data comes from its own configuration (node config data-file, or dataset and data-dir)"
            )
    data = sections.get("data", {})
    dataset = data.get("dataset", "fashion_mnist")
    if "dataset" in source and source["dataset"] != dataset:
        raise NodeDataError(f"this node holds dataset {source['dataset']!r}; the run is configured for {dataset!r}")
    from fedbayes.data import registry as data_registry  # here: it imports jax, which a node's first check need not

    spec = data_registry.get(dataset) if isinstance(dataset, str) and dataset in data_registry.names() else None
    if spec is not None and spec.user_data and own is None:
        raise NodeDataError(
            f"this node refuses the run's data.dataset = {dataset!r}: that is data a node holds itself, and this node has no data-file in its configuration"
        )
    module = sections.get("model", {}).get("module")
    if module is not None and str(module) not in allowed_modules(source):
        raise NodeDataError(
            f"this node refuses the run's model.module = {module!r}: a node imports only a model module its own configuration names (node config model-modules; it names {allowed_modules(source) or 'none'})"
        )
    if spec is not None and "path" in spec.setting_keys:
        return {**raw, "data": {**data, "path": own}}
    return raw


def refuse_server_path(config, source: dict[str, str]) -> None:
    """Raises :class:`NodeDataError` when a validated run config chooses the node's data or code
    (:func:`accept_run_config`'s rules)."""
    accept_run_config(config.model_dump(mode="json"), source)


def read_file(path: str | Path, label_column: str = "label") -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of a node's own ``.npz`` (arrays ``x``, ``y``) or ``.csv`` (a header row; labels
    in ``label_column``, features in every other column)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise NodeDataError(f"data-file {path}: no such file")
    if path.suffix == ".npz":
        try:
            with np.load(path, allow_pickle=False) as z:
                if "x" not in z.files or "y" not in z.files:
                    raise NodeDataError(f"data-file {path}: needs arrays 'x' and 'y'; has {', '.join(z.files) or 'none'}")
                x, y = z["x"], z["y"]
        except Exception as exc:  # a parser's failure on a damaged file, whatever its kind
            if isinstance(exc, NodeDataError):
                raise
            raise NodeDataError(f"data-file {path}: cannot be read as npz ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
        bad = next((k for k, a in (("x", x), ("y", y)) if a.dtype.kind not in "biuf"), None)
        if bad is not None:
            raise NodeDataError(f"data-file {path}: {bad} must hold real numbers; got {(x if bad == 'x' else y).dtype} values")
        return x, y
    if path.suffix == ".csv":
        try:
            with open(path, newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
        except (UnicodeDecodeError, csv.Error) as exc:
            raise NodeDataError(f"data-file {path}: not a CSV text file ({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
        if not rows or label_column not in rows[0]:
            raise NodeDataError(f"data-file {path}: the header has no column {label_column!r} (label-column)")
        j = rows[0].index(label_column)
        header = rows[0]
        for i, row in enumerate(rows[1:]):
            if len(row) != len(header):
                raise NodeDataError(f"data-file {path}: row {i + 2} has {len(row)} values, the header {len(header)}")
            bad = next((k for k, v in enumerate(row) if not _is_number(v)), None)
            if bad is not None:
                # row and column as fedbayes.data.user.locator words a CSV's (not imported: it would start JAX)
                raise NodeDataError(f"data-file {path}: row {i + 2}, column {header[bad]!r}: {row[bad]!r} is not a number")
        table = np.array([[float(v) for v in row] for row in rows[1:]], np.float64)
        if table.ndim != 2 or len(table) == 0:
            raise NodeDataError(f"data-file {path}: no examples")
        return np.delete(table, j, axis=1), table[:, j]
    raise NodeDataError(f"data-file {path}: allowed: a .npz (arrays x, y) or a .csv with a header")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_examples(x: np.ndarray, y: np.ndarray, spec, where: str) -> tuple[np.ndarray, np.ndarray]:
    """``x, y`` in the dtypes of the run, after checking them against the run's data ``spec``
    (``feature_shape``, ``num_classes``, ``task``, ``x_dtype``, ``y_dtype``), naming ``where``."""
    if x.ndim < 1 or y.ndim < 1 or x.shape[1:] != tuple(spec["feature_shape"]) or len(x) != len(y) or len(y) == 0:
        raise NodeDataError(
            f"{where}: {len(x)} examples of features {list(x.shape[1:])} and {len(y)} labels; the run's model takes features {list(spec['feature_shape'])}"
        )
    if not np.all(np.isfinite(x)):
        raise NodeDataError(f"{where}: non-finite features")
    if spec["task"] == "classification":
        if y.ndim != 1:
            raise NodeDataError(f"{where}: labels must be one per example (shape [n]); got shape {list(y.shape)}")
        if not np.all(y == np.round(y)) or y.min() < 0 or y.max() >= spec["num_classes"]:
            raise NodeDataError(f"{where}: labels must be integers in [0, {spec['num_classes']}) for the run's model; got {y.min()} to {y.max()}")
    return x.astype(spec["x_dtype"]), y.astype(spec["y_dtype"])
