"""Your own data (fedbayes.data.user): each format written by the test, then read back."""

from __future__ import annotations

import numpy as np
import pytest

from fedbayes import protocol
from fedbayes.data.user import from_arrays, load_files
from fedbayes.errors import DataError


def _table(n=60, features=3, clients=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).round(3)
    y = rng.integers(0, 3, size=n)
    client = np.arange(n) % clients * 10 + 5  # ids 5, 15, 25, 35: mapped to 0..3
    return x, y, client


def _write_csv(path, x, y, client):
    header = ",".join(["client", "label", *(f"f{i}" for i in range(x.shape[1]))])
    np.savetxt(path, np.column_stack([client, y, x]), delimiter=",", header=header, comments="", fmt="%.6g")


def _check(ds, x, y, client, test_fraction=0.25):
    n_test = sum(int(round(test_fraction * (client == c).sum())) for c in np.unique(client))
    assert ds.num_test == n_test and ds.num_train == len(y) - n_test
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32 and ds.num_classes == 3
    assert sorted(np.unique(ds.client_ids)) == [0, 1, 2, 3] and sorted(np.unique(ds.test_client_ids)) == [0, 1, 2, 3]
    # every example lands in exactly one split, with its own label and its client
    rows = {tuple(np.round(r, 3)): (int(lab), int(c)) for r, lab, c in zip(x, y, client)}
    ids = np.unique(client)
    for xs, ys, cs in ((ds.x_train, ds.y_train, ds.client_ids), (ds.x_test, ds.y_test, ds.test_client_ids)):
        for r, lab, c in zip(xs, ys, cs):
            assert rows[tuple(np.round(r.astype(np.float64), 3))] == (int(lab), int(ids[c]))


def test_csv_npy_npz_and_parquet_give_the_same_split(tmp_path):
    x, y, client = _table()
    _write_csv(tmp_path / "d.csv", x, y, client)
    np.save(tmp_path / "plain.npy", np.column_stack([client, y, x]))
    rec = np.zeros(len(y), dtype=[("client", "i8"), ("label", "i8"), ("a", "f8"), ("b", "f8"), ("c", "f8")])
    rec["client"], rec["label"], rec["a"], rec["b"], rec["c"] = client, y, x[:, 0], x[:, 1], x[:, 2]
    np.save(tmp_path / "rec.npy", rec)
    np.savez(tmp_path / "d.npz", x=x, y=y, owner=client)
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"client": client, "label": y, **{f"f{i}": x[:, i] for i in range(3)}}), tmp_path / "d.parquet")
    kw = dict(test_fraction=0.25)
    loaded = [
        load_files(tmp_path / "d.csv", client_column="client", rng=protocol.test_split_rng(3), **kw),
        load_files(tmp_path / "plain.npy", label="1", client_column="0", rng=protocol.test_split_rng(3), **kw),
        load_files(tmp_path / "rec.npy", client_column="client", rng=protocol.test_split_rng(3), **kw),
        load_files(tmp_path / "d.npz", client_column="owner", rng=protocol.test_split_rng(3), **kw),
        load_files(tmp_path / "d.parquet", client_column="client", rng=protocol.test_split_rng(3), **kw),
    ]
    for ds in loaded:
        _check(ds, x, y, client)
        np.testing.assert_allclose(ds.x_test, loaded[0].x_test, atol=1e-6)  # the same seed holds out the same rows
        np.testing.assert_array_equal(ds.y_train, loaded[0].y_train)
    other = load_files(tmp_path / "d.csv", client_column="client", rng=protocol.test_split_rng(4), **kw)
    assert not np.array_equal(other.y_test, loaded[0].y_test) or not np.allclose(other.x_test, loaded[0].x_test)


def test_a_test_file_and_images_in_a_npz(tmp_path):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "train.npz", x=rng.random((20, 4, 4, 1)), y=np.arange(20) % 5, client=np.arange(20) % 2)
    np.savez(tmp_path / "test.npz", x=rng.random((6, 4, 4, 1)), y=np.arange(6) % 5)
    ds = load_files(tmp_path / "train.npz", test_path=tmp_path / "test.npz", client_column="client")
    assert ds.feature_shape == (4, 4, 1) and ds.num_train == 20 and ds.num_test == 6 and ds.num_classes == 5
    assert ds.test_client_ids is None and np.bincount(ds.client_ids).tolist() == [10, 10]


@pytest.mark.parametrize(
    "content, kwargs, message",
    [
        ("label,a\n0,1\n1,x\n", {}, "row 3, column 'a': 'x' is not a number"),
        ("y,a\n0,1\n1,2\n", {}, "data.label 'label' is not a column of it; it has y, a"),
        ("label,a\n0,1\n1,2\n", {"client_column": "site"}, "data.client_column 'site' is not a column"),
        ("label,a\n0,1\n1.5,2\n", {}, "row 3, column 'label': label 1.5 is not a class"),
        ("label,a,b\n0,1,2\n1,2,3\n0,inf,3\n1,nan,1\n", {}, "row 4, column 'a': inf is not a finite number; features must be finite (2 such example(s))"),
        ("client,label,a\n0,0,1\nnan,1,2\n", {"client_column": "client"}, "row 3, column 'client': client id nan is not finite"),
        ("label\n0\n1\n", {}, "no feature columns besides the label"),
    ],
)
def test_bad_files_are_one_line_naming_the_file(tmp_path, content, kwargs, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(DataError, match="d.csv") as err:
        load_files(path, test_fraction=0.5, rng=np.random.default_rng(0), **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_unknown_format_and_missing_features_array(tmp_path):
    (tmp_path / "d.txt").write_text("1")
    with pytest.raises(DataError, match="unknown format '.txt'; allowed: .npz, .npy, .csv, .parquet"):
        load_files(tmp_path / "d.txt")
    np.savez(tmp_path / "d.npz", features=np.zeros((3, 2)), y=np.zeros(3))
    with pytest.raises(DataError, match="holds its features as the array 'x'; it has features, y"):
        load_files(tmp_path / "d.npz")


def test_from_arrays_maps_test_client_ids_and_refuses_unknown_ones():
    x, y = np.zeros((6, 2)), np.array([0, 1, 0, 1, 0, 1])
    ds = from_arrays(x, y, client_ids=np.array(["b", "a", "b", "a", "c", "c"]), x_test=x[:2], y_test=y[:2], test_client_ids=np.array(["c", "a"]))
    assert ds.client_ids.tolist() == [1, 0, 1, 0, 2, 2] and ds.test_client_ids.tolist() == [2, 0]
    with pytest.raises(DataError, match="client 'z' has no training examples"):
        from_arrays(x, y, client_ids=np.array(["b", "a", "b", "a", "c", "c"]), x_test=x[:1], y_test=y[:1], test_client_ids=np.array(["z"]))


def _npz(path, **arrays):
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    "arrays, kwargs, message",
    [
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 2**32])}, {}, "d.npz: array 'y', example 3: label 4294967296 is not a class"),
        ({"x": np.array([[0.0], [1.0], [np.nan], [2.0]]), "y": np.array([0, 1, 0, 1])}, {}, "d.npz: array 'x', example 2: a non-finite feature"),
        (
            {"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 3_000_000])},
            {},
            "label 3000000 would make 3000001 classes of which only 3 occur; set data.num_classes",
        ),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 5])}, {"num_classes": 3}, "label 5 is outside the declared num_classes = 3"),
        ({"x": np.zeros((4, 2)) + 1j, "y": np.array([0, 1, 0, 1])}, {}, "features must be real numbers; got complex128"),
        ({"x": np.zeros((4, 0)), "y": np.array([0, 1, 0, 1])}, {}, "the examples have no features (shape (4, 0))"),
        ({"x": np.zeros((0, 2)), "y": np.zeros(0, np.int64)}, {}, "holds no examples"),
        ({"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 1]) + 0j}, {}, "labels must be integer classes 0..C-1; got complex128"),
        ({"x": np.zeros((4, 2)), "y": np.zeros((4, 2), np.int64)}, {}, "labels must be one per example (shape [N]); got shape (4, 2)"),
        (
            {"x": np.zeros((4, 2)), "y": np.array([0, 1, 0, 1]), "c": np.array([1.0, np.nan, 1.0, 2.0])},
            {"client_column": "c"},
            "d.npz: array 'c', example 1: client id nan is not finite",
        ),
    ],
)
def test_npz_labels_and_features_are_checked_never_coerced(tmp_path, arrays, kwargs, message):
    path = _npz(tmp_path / "d.npz", **arrays)
    with pytest.raises(DataError) as err:
        load_files(path, test_fraction=0.5, rng=np.random.default_rng(0), **kwargs)
    assert str(err.value).startswith(str(path)) and message in str(err.value) and "\n" not in str(err.value), err.value


@pytest.mark.parametrize(
    "content, message",
    [
        ("label,f,f,f\n0,1,2,3\n1,4,5,6\n", "column 'f' appears 3 times in the header; column names must be unique"),
        ("label,a\n", "holds no examples"),
        ("label,a\n0,1\n4294967297,2\n", "row 3, column 'label': label 4294967297.0 is not a class"),
        ("label,a\n0,1\n1,2\n3000000,1\n", "label 3000000 would make 3000001 classes"),
    ],
)
def test_csv_columns_and_labels_are_checked(tmp_path, content, message):
    path = tmp_path / "d.csv"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        load_files(path, test_fraction=0.5, rng=np.random.default_rng(0))
    assert str(err.value).startswith(str(path)) and message in str(err.value), err.value


def test_a_truncated_or_object_npz_is_one_line_naming_the_file(tmp_path):
    good = _npz(tmp_path / "good.npz", x=np.zeros((40, 3)), y=np.arange(40) % 2)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    obj = tmp_path / "obj.npz"
    np.savez(obj, x=np.array([{"a": 1}] * 4, object), y=np.zeros(4))
    for path in (cut, obj):
        with pytest.raises(DataError) as err:
            load_files(path, rng=np.random.default_rng(0))
        assert str(err.value).startswith(f"{path}: cannot be read as npz"), err.value


def test_a_bad_value_is_located_as_its_source_holds_it(tmp_path):
    """By the row and column of a CSV file, else by the array or column and the example's index
    from 0, in the order given (before the test split is drawn)."""
    table = np.array([[0, 1.0, 2.0], [1, 3.0, np.nan], [0, 1.0, 1.0]])
    np.save(tmp_path / "t.npy", table)
    with pytest.raises(DataError, match=r"t\.npy: column '2', example 1: nan is not a finite number"):
        load_files(tmp_path / "t.npy", label="0", rng=np.random.default_rng(0))
    x, y = np.zeros((6, 2)), np.array([0, 1, 0, 1, 0, 1])
    x[4, 1] = np.inf
    with pytest.raises(DataError, match="arrays: array 'x', example 4: a non-finite feature"):
        from_arrays(x, y, rng=np.random.default_rng(0))
    with pytest.raises(DataError, match="arrays: array 'y_test', example 1: label -1 is not a class"):
        from_arrays(x[:4], y[:4], x_test=x[:2], y_test=np.array([0, -1]))
