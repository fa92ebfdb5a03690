"""Tests for fedbayes.data sources: IDX, scikit-learn sets, LEAF folders, synthetic federations,
the Dataset container and the registry. Every file-based loader is tested on small files written
here; the real Fashion-MNIST test runs only where Debian's package is installed."""

import dataclasses
import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

from fedbayes.data import (
    ALL_LETTERS,
    DATASETS,
    NUM_LETTERS,
    Dataset,
    DatasetNotFoundError,
    dataset_status,
    federated_least_squares,
    label_skew,
    least_squares_optima,
    load_breast_cancer,
    load_dataset,
    load_digits,
    load_fashion_mnist,
    load_leaf,
    load_mnist,
    natural,
    read_idx,
    synthetic_leaf,
    synthetic_leaf_client,
)
from fedbayes.data import idx as idx_module

IDX_CODES = {
    np.uint8: 0x08,
    np.int8: 0x09,
    np.int16: 0x0B,
    np.int32: 0x0C,
    np.float32: 0x0D,
    np.float64: 0x0E,
}
IDX_NAMES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
SYSTEM_FMNIST = Path("/usr/share/datasets/fashion-mnist")


def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """Writes ``array`` as an IDX file by hand (header with struct, big-endian payload)."""
    code = IDX_CODES[array.dtype.type]
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    payload = array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as f:
            f.write(header + payload)
    else:
        path.write_bytes(header + payload)
    return path


def write_mnist_like(folder: Path, rng, num_train=12, num_test=5, gz=(True, False, True, False)):
    """Four small IDX files; returns the arrays written (train x, train y, test x, test y)."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = (
        rng.integers(0, 256, (num_train, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, num_train).astype(np.uint8),
        rng.integers(0, 256, (num_test, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, num_test).astype(np.uint8),
    )
    for name, array, zipped in zip(IDX_NAMES, arrays, gz):
        write_idx(folder / name, array, zipped)
    return arrays


def check_mnist_like(ds: Dataset, arrays) -> None:
    x_train, y_train, x_test, y_test = arrays
    assert ds.x_train.shape == (x_train.shape[0], 28, 28, 1) and ds.x_train.dtype == np.float32
    assert ds.y_train.dtype == np.int32 and ds.num_classes == 10 and ds.task == "classification"
    np.testing.assert_array_equal(ds.x_train[..., 0], x_train.astype(np.float32) / 255)
    np.testing.assert_array_equal(ds.x_test[..., 0], x_test.astype(np.float32) / 255)
    np.testing.assert_array_equal(ds.y_train, y_train)
    np.testing.assert_array_equal(ds.y_test, y_test)


# ----------------------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_read_idx_round_trip(tmp_path, gz, dtype):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
    path = write_idx(tmp_path / "a-idx3", array, gz)
    back = read_idx(path)
    assert back.dtype == np.dtype(dtype) and back.dtype.isnative
    np.testing.assert_array_equal(back, array)


def test_read_idx_one_dimensional_labels(tmp_path):
    labels = np.array([0, 9, 3, 255], dtype=np.uint8)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "l-idx1", labels, gz=True)), labels)


def test_read_idx_rejects_bad_files(tmp_path):
    bad_magic = tmp_path / "bad"
    bad_magic.write_bytes(b"\x01\x00\x08\x01" + struct.pack(">I", 2) + b"\x00\x00")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(bad_magic)
    bad_code = tmp_path / "code"
    bad_code.write_bytes(b"\x00\x00\x07\x01" + struct.pack(">I", 2) + b"\x00\x00")
    with pytest.raises(ValueError, match="unknown IDX element type 0x07"):
        read_idx(bad_code)
    truncated = tmp_path / "short"
    truncated.write_bytes(b"\x00\x00\x08\x02" + struct.pack(">II", 3, 3) + b"\x00" * 8)
    with pytest.raises(ValueError, match="9 bytes of data"):
        read_idx(truncated)


def test_load_fashion_mnist_from_data_dir(tmp_path):
    arrays = write_mnist_like(tmp_path / "fm", np.random.default_rng(1))
    check_mnist_like(load_fashion_mnist(tmp_path / "fm"), arrays)


def test_load_fashion_mnist_from_env_subfolder(tmp_path, monkeypatch):
    folder = tmp_path / "data" / "fashion-mnist"
    arrays = write_mnist_like(folder, np.random.default_rng(2), gz=(False,) * 4)
    monkeypatch.setenv("FEDBAYES_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(idx_module, "FASHION_MNIST_SYSTEM_DIRS", ())
    ds = load_fashion_mnist()
    check_mnist_like(ds, arrays)
    assert ds.name == "fashion_mnist"


def test_load_fashion_mnist_from_env_folder_itself(tmp_path, monkeypatch):
    arrays = write_mnist_like(tmp_path / "flat", np.random.default_rng(3), gz=(True,) * 4)
    monkeypatch.setenv("FEDBAYES_DATA", str(tmp_path / "flat"))
    monkeypatch.setattr(idx_module, "FASHION_MNIST_SYSTEM_DIRS", ())
    check_mnist_like(load_fashion_mnist(), arrays)


def test_missing_fashion_mnist_says_how_to_get_it(tmp_path, monkeypatch):
    missing = tmp_path / "missing"
    with pytest.raises(DatasetNotFoundError) as info:
        load_fashion_mnist(missing)
    message = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in message and "FEDBAYES_DATA" in message
    assert str(missing) in message and "train-images-idx3-ubyte" in message
    assert isinstance(info.value, FileNotFoundError)

    monkeypatch.setenv("FEDBAYES_DATA", str(tmp_path / "empty"))
    monkeypatch.setattr(idx_module, "FASHION_MNIST_SYSTEM_DIRS", (str(tmp_path / "nosystem"),))
    with pytest.raises(DatasetNotFoundError, match="nosystem") as info:
        load_fashion_mnist()
    assert str(tmp_path / "empty" / "fashion-mnist") in str(info.value)


def test_incomplete_folder_is_not_found(tmp_path):
    write_mnist_like(tmp_path / "fm", np.random.default_rng(4))
    (tmp_path / "fm" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(DatasetNotFoundError):
        load_fashion_mnist(tmp_path / "fm")


def test_load_mnist_from_env_and_missing(tmp_path, monkeypatch):
    arrays = write_mnist_like(tmp_path / "data" / "mnist", np.random.default_rng(5))
    monkeypatch.setenv("FEDBAYES_DATA", str(tmp_path / "data"))
    ds = load_mnist()
    check_mnist_like(ds, arrays)
    assert ds.name == "mnist"
    monkeypatch.delenv("FEDBAYES_DATA")
    with pytest.raises(DatasetNotFoundError, match="FEDBAYES_DATA is not set"):
        load_mnist()


@pytest.mark.skipif(
    not SYSTEM_FMNIST.is_dir() or os.environ.get("FEDBAYES_NO_SYSTEM_DATA", "") not in ("", "0"),
    reason="dataset-fashion-mnist is not installed (or hidden by FEDBAYES_NO_SYSTEM_DATA)",
)
def test_real_fashion_mnist(monkeypatch):
    monkeypatch.delenv("FEDBAYES_DATA", raising=False)
    ds = load_fashion_mnist()
    assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
    assert ds.x_train.dtype == np.float32 and 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
    np.testing.assert_array_equal(np.bincount(ds.y_train), np.full(10, 6000))
    np.testing.assert_array_equal(np.bincount(ds.y_test), np.full(10, 1000))


# ------------------------------------------------------------------------------- scikit-learn


def test_digits():
    ds = load_digits()
    assert ds.x_train.shape == (1437, 8, 8, 1) and ds.x_test.shape == (360, 8, 8, 1)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
    assert ds.x_train.min() == 0.0 and ds.x_train.max() == 1.0
    assert ds.num_classes == 10 and set(np.unique(ds.y_test)) == set(range(10))
    again = load_digits()
    np.testing.assert_array_equal(ds.x_train, again.x_train)
    np.testing.assert_array_equal(ds.y_test, again.y_test)


def test_breast_cancer_uses_train_statistics():
    from sklearn.datasets import load_breast_cancer as raw_loader
    from sklearn.model_selection import train_test_split

    ds = load_breast_cancer()
    assert ds.x_train.shape == (455, 30) and ds.x_test.shape == (114, 30)
    assert ds.x_train.dtype == np.float32 and ds.num_classes == 2
    # float32 features of order 1: means and stds are exact to about 1e-6.
    np.testing.assert_allclose(ds.x_train.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(ds.x_train.std(axis=0), 1.0, atol=1e-5)
    raw = raw_loader()
    train, test, _, _ = train_test_split(raw.data, raw.target, test_size=0.2, stratify=raw.target, random_state=0)
    expected = (test - train.mean(axis=0)) / train.std(axis=0)
    np.testing.assert_allclose(ds.x_test, expected, rtol=1e-5, atol=1e-5)
    assert np.abs(ds.x_test.mean(axis=0)).max() > 1e-3  # test statistics were not used
    # Stratified: the positive rate of the two parts differs by less than one example's worth.
    assert abs(ds.y_train.mean() - ds.y_test.mean()) < 1 / 114
    np.testing.assert_array_equal(ds.x_test, load_breast_cancer().x_test)


# ----------------------------------------------------------------------------------------- LEAF


def write_leaf(folder: Path, split: str, filename: str, users: dict) -> None:
    (folder / split).mkdir(parents=True, exist_ok=True)
    blob = {
        "users": list(users),
        "num_samples": [len(v["y"]) for v in users.values()],
        "user_data": users,
    }
    (folder / split / filename).write_text(json.dumps(blob))


def test_leaf_numeric_femnist_style(tmp_path):
    rng = np.random.default_rng(0)

    def user(n, labels):
        return {"x": rng.random((n, 784)).round(3).tolist(), "y": labels}

    bob, alice, carol = user(3, [1, 4, 0]), user(2, [2, 2]), user(1, [7])
    write_leaf(tmp_path, "train", "b.json", {"f_bob": bob})
    write_leaf(tmp_path, "train", "a.json", {"f_carol": carol, "f_alice": alice})
    alice_test, dave_test = user(1, [3]), user(2, [5, 1])
    write_leaf(tmp_path, "test", "t.json", {"f_dave": dave_test, "f_alice": alice_test})
    ds = load_leaf(tmp_path, name="femnist")
    assert ds.name == "femnist" and ds.x_train.shape == (6, 28, 28, 1)
    assert ds.x_train.dtype == np.float32
    assert ds.num_classes == 8  # max label 7 + 1
    # Users sorted by name over both splits: alice 0, bob 1, carol 2, dave 3.
    np.testing.assert_array_equal(ds.client_ids, [0, 0, 1, 1, 1, 2])
    np.testing.assert_array_equal(ds.y_train, [2, 2, 1, 4, 0, 7])
    np.testing.assert_array_equal(ds.test_client_ids, [0, 3, 3])
    np.testing.assert_array_equal(ds.y_test, [3, 5, 1])
    np.testing.assert_allclose(ds.x_train[2].reshape(-1), np.float32(bob["x"][0]))
    assert ds.client_ids.dtype == np.int64
    assert load_leaf(tmp_path, num_classes=62).num_classes == 62
    with pytest.raises(ValueError, match="user .f_carol.: label 7 is outside the declared num_classes = 5"):
        load_leaf(tmp_path, num_classes=5)


def test_leaf_numeric_features_keep_their_shape(tmp_path):
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": [[1.0, 2.0, 3.0]], "y": [1]}})
    write_leaf(tmp_path, "test", "a.json", {"u": {"x": [[4.0, 5.0, 6.0]], "y": [0]}})
    ds = load_leaf(tmp_path)
    assert ds.feature_shape == (3,) and ds.num_classes == 2


def test_leaf_text_shakespeare_style(tmp_path):
    assert NUM_LETTERS == 80 and ALL_LETTERS[0] == "\n" and ALL_LETTERS[-1] == "}"
    line = ("To be, or not to be: that is the question!\n" * 2)[:80]
    write_leaf(tmp_path, "train", "s.json", {"HAMLET": {"x": [line, line[::-1]], "y": ["W", "a"]}})
    write_leaf(tmp_path, "test", "s.json", {"HAMLET": {"x": [line], "y": ["}"]}})
    ds = load_leaf(tmp_path)
    assert ds.x_train.shape == (2, 80) and ds.x_train.dtype == np.int32 and ds.num_classes == 80
    assert "".join(ALL_LETTERS[i] for i in ds.x_train[0]) == line
    np.testing.assert_array_equal(ds.y_train, [ALL_LETTERS.index("W"), ALL_LETTERS.index("a")])
    np.testing.assert_array_equal(ds.y_test, [79])
    np.testing.assert_array_equal(ds.test_client_ids, [0])


def test_leaf_unknown_character_is_an_error(tmp_path):
    write_leaf(tmp_path, "train", "s.json", {"u": {"x": ["ab~d"], "y": ["e"]}})
    write_leaf(tmp_path, "test", "s.json", {"u": {"x": ["abcd"], "y": ["e"]}})
    with pytest.raises(ValueError, match="'~'.*vocabulary") as info:
        load_leaf(tmp_path)
    assert "s.json" in str(info.value)


def test_leaf_malformed_files_are_named(tmp_path):
    write_leaf(tmp_path, "test", "ok.json", {"u": {"x": [[1.0]], "y": [0]}})
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "broken.json").write_text('{"users": ["u"], ')
    with pytest.raises(ValueError, match="broken.json.*not valid JSON"):
        load_leaf(tmp_path)
    (tmp_path / "train" / "broken.json").write_text(json.dumps({"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": [[1.0]], "y": [0]}}}))
    with pytest.raises(ValueError, match="broken.json.*num_samples 2"):
        load_leaf(tmp_path)


def test_leaf_missing_folders(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="does not exist"):
        load_leaf(tmp_path / "nothing")
    write_leaf(tmp_path, "train", "a.json", {"u": {"x": [[1.0]], "y": [0]}})
    with pytest.raises(DatasetNotFoundError, match="'test'"):
        load_leaf(tmp_path)


# ------------------------------------------------------------------------------------ Synthetic


def test_synthetic_leaf_is_deterministic_and_seed_dependent():
    a = synthetic_leaf(5, 0.5, 0.5, np.random.default_rng(3))
    b = synthetic_leaf(5, 0.5, 0.5, np.random.default_rng(3))
    c = synthetic_leaf(5, 0.5, 0.5, np.random.default_rng(4))
    for field in ("x_train", "y_train", "x_test", "y_test", "client_ids", "test_client_ids"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert a.num_train != c.num_train or not np.array_equal(a.x_train, c.x_train)
    assert a.x_train.dtype == np.float32 and a.y_train.dtype == np.int32
    assert a.feature_shape == (60,)


@pytest.mark.parametrize("iid", [False, True])
def test_synthetic_leaf_equals_its_clients(iid):
    sizes = [7, 50, 13, 1]
    rng = np.random.default_rng(0)
    ds = synthetic_leaf(4, 1.0, 1.0, rng, sizes=sizes, seed=123, iid=iid, dim=8, num_classes=5)
    for k, size in enumerate(sizes):
        x, y = synthetic_leaf_client(k, 123, 1.0, 1.0, size, dim=8, num_classes=5, iid=iid)
        num_test = min(round(0.2 * size), size - 1)
        np.testing.assert_array_equal(ds.x_train[ds.client_ids == k], x[: size - num_test])
        np.testing.assert_array_equal(ds.y_train[ds.client_ids == k], y[: size - num_test])
        np.testing.assert_array_equal(ds.x_test[ds.test_client_ids == k], x[size - num_test :])
        np.testing.assert_array_equal(ds.y_test[ds.test_client_ids == k], y[size - num_test :])
    assert ds.num_train + ds.num_test == sum(sizes)
    np.testing.assert_array_equal(np.bincount(ds.client_ids), [6, 40, 10, 1])


def test_synthetic_leaf_default_sizes_are_leaf_lognormal():
    ds = synthetic_leaf(200, 0.0, 0.0, np.random.default_rng(0), dim=2)
    sizes = np.bincount(ds.client_ids) + np.bincount(ds.test_client_ids, minlength=200)
    assert sizes.min() >= 50  # int(lognormal) + 50
    # Heavy tail: lognormal(4, 2) has median e^4 = 55 and mean e^6 = 403.
    assert np.median(sizes) < 150 < sizes.mean()


def test_synthetic_leaf_input_covariance_and_heterogeneity():
    x, _ = synthetic_leaf_client(0, 5, 0.0, 0.0, 20000, iid=True)
    # Sigma_jj = j^-1.2; 20000 samples give variance estimates within about 1% (3 sigma: 3%).
    np.testing.assert_allclose(x.var(axis=0), np.arange(1, 61) ** -1.2, rtol=0.05)
    np.testing.assert_allclose(x.mean(axis=0), 0.0, atol=0.05)
    # Clients of Synthetic(1, 1) have different models, so their label mixes differ more than
    # those of Synthetic-IID, averaged over clients.
    sizes = [400] * 10
    het = synthetic_leaf(10, 1.0, 1.0, np.random.default_rng(0), sizes=sizes)
    same = synthetic_leaf(10, 1.0, 1.0, np.random.default_rng(0), sizes=sizes, iid=True)
    skew = {name: label_skew(ds.y_train, natural(ds.client_ids), 10) for name, ds in (("het", het), ("iid", same))}
    assert skew["het"] > 2 * skew["iid"], skew


def test_synthetic_leaf_rejects_bad_parameters():
    with pytest.raises(ValueError, match="num_clients"):
        synthetic_leaf(0, 1.0, 1.0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="sizes"):
        synthetic_leaf(2, 1.0, 1.0, np.random.default_rng(0), sizes=[3])
    with pytest.raises(ValueError, match="alpha and beta"):
        synthetic_leaf_client(0, 0, -1.0, 1.0, 5)


def test_least_squares_shapes_and_determinism():
    ds = federated_least_squares(4, 6, np.random.default_rng(0), num_examples=[30, 40, 50, 60])
    assert ds.task == "regression" and ds.num_classes == 0
    assert ds.x_train.shape == (180, 7)
    assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.float32
    np.testing.assert_array_equal(ds.x_train[:, -1], 1.0)  # the appended column of ones
    np.testing.assert_array_equal(np.bincount(ds.client_ids), [30, 40, 50, 60])
    np.testing.assert_array_equal(np.bincount(ds.test_client_ids), [6, 8, 10, 12])
    again = federated_least_squares(4, 6, np.random.default_rng(0), num_examples=[30, 40, 50, 60])
    np.testing.assert_array_equal(ds.y_train, again.y_train)
    np.testing.assert_array_equal(ds.x_test, again.x_test)


def test_least_squares_optima_have_zero_gradient():
    ds = federated_least_squares(5, 10, np.random.default_rng(1), num_examples=100, noise=1.0)
    global_opt, client_opts = least_squares_optima(ds)
    x, y = ds.x_train.astype(np.float64), ds.y_train.astype(np.float64)
    # Gradient of the summed loss 0.5 * ||X theta - y||^2, relative to its size at theta = 0.
    scale = np.linalg.norm(x.T @ y)
    assert np.linalg.norm(x.T @ (x @ global_opt - y)) < 1e-10 * scale
    for k, opt in enumerate(client_opts):
        xk, yk = x[ds.client_ids == k], y[ds.client_ids == k]
        assert np.linalg.norm(xk.T @ (xk @ opt - yk)) < 1e-10 * np.linalg.norm(xk.T @ yk)
    # Independent problems (heterogeneity 1): the client optima are far apart.
    assert np.linalg.norm(client_opts[0] - client_opts[1]) > 10.0
    # The global optimum is the precision-weighted mean of client optima (Al-Shedivat et al. 2021 (FedPA) Eq. 3).
    precisions = [x[ds.client_ids == k].T @ x[ds.client_ids == k] for k in range(5)]
    weighted = sum(p @ m for p, m in zip(precisions, client_opts))
    product_mean = np.linalg.solve(sum(precisions), weighted)
    np.testing.assert_allclose(product_mean, global_opt, rtol=1e-8, atol=1e-8)


def test_least_squares_without_heterogeneity_shares_one_optimum():
    ds = federated_least_squares(3, 5, np.random.default_rng(2), num_examples=40, heterogeneity=0.0)
    global_opt, client_opts = least_squares_optima(ds)
    # Noise 0 and one common model: every client's optimum is that model (float32 data: ~1e-5).
    expected = np.broadcast_to(global_opt, client_opts.shape)
    np.testing.assert_allclose(client_opts, expected, rtol=1e-4, atol=1e-3)
    assert np.abs(global_opt[-1]) < 1e-3  # bias 0, as in Al-Shedivat et al. 2021 (FedPA)
    with pytest.raises(ValueError, match="heterogeneity"):
        federated_least_squares(3, 5, np.random.default_rng(2), heterogeneity=1.5)
    with pytest.raises(ValueError, match="client_ids"):
        least_squares_optima(load_breast_cancer())


# ------------------------------------------------------------------------------------- Dataset


def toy_dataset(n=100) -> Dataset:
    x = np.arange(n, dtype=np.float32)[:, None]
    return Dataset(
        name="toy",
        x_train=x,
        y_train=(np.arange(n) % 3).astype(np.int32),
        x_test=x[:5],
        y_test=np.zeros(5, np.int32),
        num_classes=3,
        task="classification",
        client_ids=np.arange(n, dtype=np.int64) // 10,
    )


def test_subsample_keeps_client_ids_aligned():
    ds = toy_dataset()
    sub = ds.subsample(0.1, np.random.default_rng(0))
    assert sub.num_train == 10 and sub.num_test == 5
    rows = sub.x_train[:, 0].astype(np.int64)
    assert len(np.unique(rows)) == 10 and np.all(np.diff(rows) > 0)
    np.testing.assert_array_equal(sub.client_ids, rows // 10)
    np.testing.assert_array_equal(sub.y_train, rows % 3)
    other = ds.subsample(0.1, np.random.default_rng(1))
    assert not np.array_equal(other.x_train, sub.x_train)
    np.testing.assert_array_equal(ds.subsample(0.1, np.random.default_rng(0)).x_train, sub.x_train)
    with pytest.raises(ValueError, match="fraction"):
        ds.subsample(0.0, np.random.default_rng(0))


def test_dataset_validates_its_arrays():
    ds = toy_dataset()
    assert ds.feature_shape == (1,) and "num_train=100" in repr(ds)
    with pytest.raises(ValueError, match="do not align"):
        dataclasses.replace(ds, y_train=ds.y_train[:-1])
    with pytest.raises(ValueError, match="client ids"):
        dataclasses.replace(ds, client_ids=ds.client_ids[:-1])
    with pytest.raises(ValueError, match="task"):
        dataclasses.replace(ds, task="ranking")
    with pytest.raises(ValueError, match="num_classes must be 0"):
        dataclasses.replace(ds, task="regression")
    with pytest.raises(dataclasses.FrozenInstanceError):
        ds.name = "other"


# ------------------------------------------------------------------------------------ Registry


def test_registry_names_and_errors():
    assert set(DATASETS) == {
        "fashion_mnist",
        "mnist",
        "digits",
        "breast_cancer",
        "leaf",
        "synthetic_leaf",
        "least_squares",
        "emnist",
        "fed_cifar100",
        "cifar100",
        "cifar10",
        "stackoverflow_nwp",
        "stackoverflow_lr",
        "files",
    }
    with pytest.raises(ValueError, match="must be one of.*breast_cancer"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="unknown parameter.*'alhpa'.*allowed"):
        load_dataset("synthetic_leaf", alhpa=1.0)


def test_load_dataset_generated_and_bundled():
    a = load_dataset("synthetic_leaf", seed=1, num_clients=3, sizes=[10, 20, 30], alpha=0.0)
    b = load_dataset("synthetic_leaf", seed=1, num_clients=3, sizes=[10, 20, 30], alpha=0.0)
    np.testing.assert_array_equal(a.x_train, b.x_train)
    assert a.num_train == 48
    half = load_dataset("digits", fraction=0.5, seed=3)
    assert half.num_train == 718 and half.num_test == 360
    ls = load_dataset("least_squares", num_clients=2, dim=3, num_examples=20)
    assert ls.x_train.shape == (40, 4)


def test_load_dataset_file_based(tmp_path, monkeypatch):
    arrays = write_mnist_like(tmp_path / "mnist", np.random.default_rng(6))
    check_mnist_like(load_dataset("mnist", data_dir=tmp_path), arrays)
    write_leaf(tmp_path / "leaf", "train", "a.json", {"u": {"x": [[1.0, 2.0]], "y": [3]}})
    write_leaf(tmp_path / "leaf", "test", "a.json", {"u": {"x": [[1.0, 2.0]], "y": [0]}})
    monkeypatch.setenv("FEDBAYES_DATA", str(tmp_path))
    assert load_dataset("leaf", num_classes=10).num_classes == 10
    status = {name: (present, detail) for name, present, detail in dataset_status()}
    assert set(status) == set(DATASETS)
    assert status["mnist"] == (True, str(tmp_path / "mnist"))
    assert status["leaf"] == (True, str(tmp_path / "leaf"))
    assert status["digits"][0] and status["least_squares"][0]
    monkeypatch.setattr(idx_module, "FASHION_MNIST_SYSTEM_DIRS", (str(tmp_path / "none"),))
    present, detail = dict((n, (p, d)) for n, p, d in dataset_status())["fashion_mnist"]
    assert not present and "apt-get" in detail


def test_an_idx_header_announcing_more_than_int64_bytes_is_named_exactly(tmp_path):
    path = tmp_path / "huge-idx3"
    path.write_bytes(bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**31, 2**16, 2**16))
    with pytest.raises(ValueError, match=r"huge-idx3: IDX header announces shape \(2147483648, 65536, 65536\) \(9223372036854775808 bytes of data\)"):
        read_idx(path)
