"""Your own data: a :class:`~fedbayes.data.dataset.Dataset` from your files or your arrays.

A config reads it with ``data.dataset = "files"`` (``data.path``, ``data.test_path``, ...); Python
passes arrays to :func:`fedbayes.run_experiment` (``data=``), which :func:`from_arrays` turns into
the same :class:`Dataset`. Formats, told apart by the file's suffix:

* ``.npz``: an array of features ``x`` (``[N, ...]``, any example shape: a table, images), an
  array of labels (``y``, or the name ``data.label`` gives) and, optionally, an array of client ids
  (the name ``data.client_column`` gives).
* ``.npy``, ``.csv``, ``.parquet``: a table, one row per example. The label column is
  ``data.label`` (default ``"label"``), the client column ``data.client_column`` (optional) and
  every other column a feature. A CSV file has a header row; a plain two-dimensional ``.npy``
  array names its columns by index (``"0"``, ``"1"``, ...), a structured one by its fields.
  Parquet needs pyarrow (``pip install -e '.[parquet]'``).

Features (real numbers only: no complex, text or object values) become float32; labels are
integer classes ``0..C-1`` (``C``: ``data.num_classes``, else one more than the largest label, when
that leaves no more than half the classes empty, as LEAF's loader asks), never cast. A client column is the data's natural partition
(``data.partition = "natural"``): its values are mapped, in sorted order, to clients
``0..K-1``. The test split is ``data.test_path`` (the same format, with or without a client
column) or, without one, ``data.test_fraction`` of each client's rows held out by a generator
seeded by the run's seed (:func:`fedbayes.protocol.test_split_rng`).
Every failure is one line naming the file and what is wrong (:class:`~fedbayes.errors.DataError`,
exit code 3), and a bad value where it is as its reader would look for it (:func:`locator`): in a
CSV file by its row (the header is row 1) and column, in arrays and the other tables by the array's
or column's name and the example's index from 0, in the file's order (before any split).
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.errors import DataError

__all__ = ["FORMATS", "from_arrays", "load_files", "locator", "read_table"]

FORMATS = (".npz", ".npy", ".csv", ".parquet")
NPZ_FEATURES, NPZ_LABEL, TABLE_LABEL = "x", "y", "label"


def _columns_npy(path: Path) -> dict[str, np.ndarray]:
    a = np.load(path, allow_pickle=False)
    if a.dtype.names:
        return {name: np.asarray(a[name]) for name in a.dtype.names}
    if a.ndim != 2:
        raise DataError(f"{path}: a .npy table must be two-dimensional (rows x columns) or a structured array; got shape {a.shape}")
    return {str(j): a[:, j] for j in range(a.shape[1])}


def _columns_csv(path: Path) -> dict[str, np.ndarray]:
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    if not rows:
        raise DataError(f"{path}: the CSV file is empty; it needs a header row and one row per example")
    header, body = [h.strip() for h in rows[0]], rows[1:]
    twice = [name for name, n in Counter(header).items() if n > 1]
    if twice:
        raise DataError(f"{path}: column {twice[0]!r} appears {header.count(twice[0])} times in the header; column names must be unique")
    out: dict[str, np.ndarray] = {}
    for j, name in enumerate(header):
        try:
            out[name] = np.array([float(r[j]) for r in body], np.float64)
        except (ValueError, IndexError):
            bad = next(i for i, r in enumerate(body) if j >= len(r) or not _is_number(r[j]))
            value = body[bad][j] if j < len(body[bad]) else "(missing)"
            raise DataError(f"{path}: row {bad + 2}, column {name!r}: {value!r} is not a number; every column must be numeric") from None
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _columns_parquet(path: Path) -> dict[str, np.ndarray]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install -e '.[parquet]'") from None
    table = pq.read_table(path)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def read_table(path: str | Path) -> dict[str, np.ndarray]:
    """The columns of a ``.npy``, ``.csv`` or ``.parquet`` table (or the arrays of a ``.npz``), by name."""
    path = Path(path)
    if not path.is_file():
        raise DatasetNotFoundError(f"{path}: no such file (data.path and data.test_path name your own data files)")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                return {k: z[k] for k in z.files}
        if suffix == ".npy":
            return _columns_npy(path)
        if suffix == ".csv":
            return _columns_csv(path)
        if suffix == ".parquet":
            return _columns_parquet(path)
    except DataError:
        raise
    except Exception as exc:  # a parser's failure on a damaged file, whatever its kind (zipfile, numpy's header parser, pyarrow)
        raise DataError(f"{path}: cannot be read as {suffix[1:]} ({type(exc).__name__}: {' '.join(str(exc).split())[:160]})") from None
    raise DataError(f"{path}: unknown format {suffix or '(no suffix)'!r}; allowed: {', '.join(FORMATS)}")


Locate = Callable[[str, int], str]  # (array or column name, example index) -> where it is, for messages


def locator(source: str | Path, *, arrays: bool = False) -> Locate:
    """Where example ``i`` of an array or column is, as the one who wrote ``source`` would look for
    it: in a ``.csv`` file its row (the header is row 1, so example ``i`` is row ``i + 2``) and
    column; in a ``.npz`` file, in the other tables and in arrays (``arrays``: ``source`` only names
    them), the array or column and the example's index from 0."""
    suffix = "" if arrays else Path(str(source)).suffix.lower()
    if suffix == ".csv":
        return lambda name, i: f"{source}: row {i + 2}, column {name!r}"
    noun = "column" if suffix in (".npy", ".parquet") else "array"
    return lambda name, i: f"{source}: {noun} {name!r}, example {i}"


def _finite_features(x: np.ndarray, names: list[str], at: Locate) -> None:
    """Refuses a non-finite feature, located: ``names`` are the columns of a table's ``x`` (one per
    column), or one array's name for ``x`` of any example shape."""
    if x.dtype.kind != "f" or x.size == 0:
        return
    bad = ~np.isfinite(x.reshape(len(x), -1))
    if not bad.any():
        return
    i = int(np.argmax(bad.any(axis=1)))
    count = int(bad.any(axis=1).sum())
    if len(names) == 1:
        raise DataError(f"{at(names[0], i)}: a non-finite feature (NaN, Inf or empty); {count} such example(s)")
    j = int(np.argmax(bad[i]))
    raise DataError(f"{at(names[j], i)}: {x[i, j]} is not a finite number; features must be finite ({count} such example(s))")


def _split_columns(path: Path, columns: dict[str, np.ndarray], label: str | None, client: str | None):
    """``(x, y, client ids or None)`` from a file's columns, their values checked where the file
    holds them (:func:`locator`)."""
    npz = path.suffix.lower() == ".npz"
    label = label or (NPZ_LABEL if npz else TABLE_LABEL)
    for what, name in (("data.label", label), ("data.client_column", client)):
        if name is not None and name not in columns:
            raise DataError(f"{path}: {what} {name!r} is not {'an array' if npz else 'a column'} of it; it has {', '.join(columns)}")
    at = locator(path)
    y = _labels(columns[label], str(path), lambda i: at(label, i))
    ids = None if client is None else _client_ids(columns[client], len(y), str(path), lambda i: at(client, i))
    if npz:
        if NPZ_FEATURES not in columns:
            raise DataError(f"{path}: a .npz file holds its features as the array 'x'; it has {', '.join(columns)}")
        x = _features(columns[NPZ_FEATURES], str(path))
        _finite_features(x, [NPZ_FEATURES], at)
    else:
        names = [n for n in columns if n not in (label, client)]
        if not names:
            raise DataError(f"{path}: no feature columns besides the label {label!r}" + (f" and the client column {client!r}" if client else ""))
        bad = next((n for n in names if np.asarray(columns[n]).dtype.kind not in "biuf"), None)
        if bad is not None:
            raise DataError(f"{path}: column {bad!r} holds {np.asarray(columns[bad]).dtype} values; features must be real numbers")
        x = np.stack([np.asarray(columns[n], np.float64) for n in names], axis=1)
        _finite_features(x, names, at)
    return x, y, ids


MAX_LABEL = np.iinfo(np.int32).max  # class ids are int32


def _labels(y: np.ndarray, where: str, at: Callable[[int], str]) -> np.ndarray:
    """``y`` as int32 classes; ``where`` names the source, ``at(i)`` locates example ``i``."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise DataError(f"{where}: labels must be one per example (shape [N]); got shape {y.shape}")
    if y.dtype.kind not in "iuf":
        raise DataError(f"{where}: labels must be integer classes 0..C-1; got {y.dtype} values")
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(y) | (y != np.round(y)) | (y < 0) | (y > MAX_LABEL)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise DataError(f"{at(i)}: label {y[i]} is not a class 0..C-1 (labels must be integers from 0 to {MAX_LABEL})")
    return y.astype(np.int32)


def _features(x, where: str) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind not in "biuf":
        raise DataError(f"{where}: features must be real numbers; got {x.dtype} values")
    if x.ndim >= 2 and x.shape[0] and np.prod(x.shape[1:]) == 0:
        raise DataError(f"{where}: the examples have no features (shape {x.shape})")
    return x


def _client_ids(ids: np.ndarray | None, n: int, where: str, at: Callable[[int], str]) -> np.ndarray | None:
    if ids is None:
        return None
    ids = np.asarray(ids)
    if ids.shape != (n,):
        raise DataError(f"{where}: the client column must hold one id per example ({n}); got shape {ids.shape}")
    if ids.dtype.kind == "f" and not np.all(np.isfinite(ids)):
        i = int(np.argmax(~np.isfinite(ids)))
        raise DataError(f"{at(i)}: client id {ids[i]} is not finite")
    if ids.dtype.kind not in "biufUS":
        raise DataError(f"{where}: client ids must be numbers or strings; got {ids.dtype} values")
    return ids


def _num_classes(y: np.ndarray, y_test: np.ndarray, num_classes: int | None, where: str) -> int:
    """``num_classes``, or one more than the largest label when no more than half the classes
    that makes are missing (a stray large label must be declared, as LEAF's loader asks)."""
    largest = int(max(y.max(initial=0), y_test.max(initial=0)))
    if num_classes is not None:
        if largest >= num_classes:
            raise DataError(f"{where}: label {largest} is outside the declared num_classes = {num_classes}")
        return num_classes
    present = len(np.union1d(y, y_test))
    if largest + 1 > 2 * present:
        raise DataError(
            f"{where}: label {largest} would make {largest + 1} classes of which only {present} occur; "
            "set data.num_classes to declare the classes if this is intended"
        )
    return largest + 1


def from_arrays(
    x,
    y,
    *,
    x_test=None,
    y_test=None,
    client_ids=None,
    test_client_ids=None,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    rng: np.random.Generator | None = None,
    name: str = "arrays",
) -> Dataset:
    """A classification :class:`Dataset` from arrays.

    Args:
      x: ``[N, ...]`` features (cast to float32).
      y: ``[N]`` integer labels ``0..C-1``.
      x_test: ``[N_test, ...]`` the test split's features; without them, ``test_fraction`` of each
        client's examples (of all of them without client ids) is held out, drawn by ``rng``.
      y_test: ``[N_test]`` the test split's labels (with ``x_test``).
      client_ids: ``[N]`` the natural partition (any sortable ids; mapped in sorted order to
        ``0..K-1``, the test split's ids by the same map).
      test_client_ids: ``[N_test]`` the test split's client ids (optional).
      num_classes: ``C``; default one more than the largest label of either split.
      rng: the generator of the held-out test split (needed only without ``x_test``).
      name: the dataset's name in messages.

    Raises:
      DataError: arrays that do not align, labels that are not classes, a split left empty.
    """
    at = locator(name, arrays=True)  # by the names run_experiment's data= gives them
    x = _features(x, name)
    y = _labels(y, name, lambda i: at("y", i))
    if x.ndim < 2 or x.shape[0] != y.shape[0]:
        raise DataError(f"{name}: features must be [N, ...] with one row per label ({y.shape[0]}); got shape {x.shape}")
    if len(y) == 0:
        raise DataError(f"{name}: holds no examples")
    _finite_features(x, ["x"], at)
    ids = _client_ids(client_ids, len(y), name, lambda i: at("client_ids", i))
    if (x_test is None) != (y_test is None):
        raise DataError(f"{name}: give both x_test and y_test, or neither (then test_fraction of the examples is held out)")
    if ids is not None:
        keys, ids = np.unique(ids, return_inverse=True)
        ids = ids.astype(np.int64)
    test_ids = None
    if x_test is None:
        if not 0.0 < test_fraction < 1.0:
            raise DataError(f"{name}: test_fraction must be in (0, 1) when no test split is given; got {test_fraction}")
        if rng is None:
            raise ValueError("from_arrays: rng is needed to hold out the test split")
        test = _held_out(ids if ids is not None else np.zeros(len(y), np.int64), test_fraction, rng)
        train = np.setdiff1d(np.arange(len(y)), test)
        x_test, y_test = x[test], y[test]
        test_ids = None if ids is None else ids[test]
        x, y, ids = x[train], y[train], None if ids is None else ids[train]
    else:
        x_test = _features(x_test, f"{name} (test)")
        y_test = _labels(y_test, f"{name} (test)", lambda i: at("y_test", i))
        _finite_features(x_test, ["x_test"], at)
        tid = _client_ids(test_client_ids, len(y_test), f"{name} (test)", lambda i: at("test_client_ids", i))
        if tid is not None and ids is not None:
            pos = np.searchsorted(keys, tid)
            unknown = (pos >= len(keys)) | (keys[np.minimum(pos, len(keys) - 1)] != tid)
            if unknown.any():
                raise DataError(f"{name} (test): client {tid[np.argmax(unknown)].item()!r} has no training examples")
            test_ids = pos.astype(np.int64)
    classes = _num_classes(y, y_test, num_classes, name)
    if classes < 2:
        raise DataError(f"{name}: a classifier needs at least 2 classes; the labels hold {classes}")
    return Dataset(
        name=name,
        x_train=np.asarray(x, np.float32),
        y_train=y,
        x_test=np.asarray(x_test, np.float32),
        y_test=y_test,
        num_classes=classes,
        task="classification",
        client_ids=ids,
        test_client_ids=test_ids,
    )


def _held_out(groups: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of ``round(fraction * n_k)`` examples of each group ``k`` (each keeping at least one)."""
    out = []
    for k in np.unique(groups):
        members = np.flatnonzero(groups == k)
        take = min(int(round(fraction * len(members))), len(members) - 1)
        out.append(rng.choice(members, size=take, replace=False))
    return np.sort(np.concatenate(out)).astype(np.int64)


def load_files(
    path: str | Path,
    *,
    test_path: str | Path | None = None,
    label: str | None = None,
    client_column: str | None = None,
    test_fraction: float = 0.2,
    num_classes: int | None = None,
    rng: np.random.Generator | None = None,
) -> Dataset:
    """A :class:`Dataset` from your files (the formats of the module docstring).

    Args:
      path: the training file (the whole data set when there is no ``test_path``).
      test_path: the test file, in the same layout.
      label: the label column or array (default ``"y"`` in a ``.npz``, ``"label"`` in a table).
      client_column: the client column or array (the natural partition); ``None``: none.
      test_fraction: without ``test_path``, the share of each client's rows held out for testing.
      num_classes: the number of classes (default: from the labels).
      rng: the generator of the held-out test split.
    """
    path = Path(path)
    x, y, ids = _split_columns(path, read_table(path), label, client_column)
    test: dict = {}
    if test_path is not None:
        test_path = Path(test_path)
        test_columns = read_table(test_path)
        client_test = client_column if client_column in test_columns else None
        x_test, y_test, ids_test = _split_columns(test_path, test_columns, label, client_test)
        test = dict(x_test=x_test, y_test=y_test, test_client_ids=ids_test)
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{test_path}: its examples have shape {x_test.shape[1:]}, those of {path} {x.shape[1:]}; they must match")
    return from_arrays(x, y, client_ids=ids, test_fraction=test_fraction, num_classes=num_classes, rng=rng, name=str(path), **test)
