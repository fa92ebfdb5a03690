"""The federated benchmarks' loaders (fedbayes.data.tff, .stackoverflow, .cifar, .pachinko) on
small files written here in each real format: TFF's HDF5 layout, StackOverflow's count files and
CIFAR's Python batches. Expected arrays are written out by hand."""

import json
import os
import pickle

import numpy as np
import pytest

from fedbayes.data import dataset_status, load_dataset, writers
from fedbayes.data.dataset import DatasetNotFoundError
from fedbayes.data.pachinko import pachinko
from fedbayes.data.partition import PartitionError
from fedbayes.data.stackoverflow import special_ids
from fedbayes.errors import DataError

h5py = pytest.importorskip("h5py")


def test_fed_emnist_keeps_writers_pixels_and_labels(tmp_path):
    pix = np.random.default_rng(0).random((5, 28, 28), dtype=np.float32)
    writers.write_tff(
        tmp_path / "fed_emnist_train.h5",
        {"f0002_01": {"pixels": pix[:2], "label": np.array([3, 61], np.int32)}, "f0001_00": {"pixels": pix[2:3], "label": np.array([7], np.int32)}},
    )
    writers.write_tff(tmp_path / "fed_emnist_test.h5", {"f0001_00": {"pixels": pix[3:5], "label": np.array([0, 9], np.int32)}})
    ds = load_dataset("emnist", tmp_path)
    assert (ds.num_classes, ds.feature_shape, ds.num_train, ds.num_test) == (62, (28, 28, 1), 3, 2)
    # writers in name order: f0001_00 is client 0, f0002_01 client 1; the test writer keeps its id
    np.testing.assert_array_equal(ds.client_ids, [0, 1, 1])
    np.testing.assert_array_equal(ds.y_train, [7, 3, 61])
    np.testing.assert_array_equal(ds.test_client_ids, [0, 0])
    np.testing.assert_array_equal(ds.x_train[1, ..., 0], pix[0])
    np.testing.assert_array_equal(ds.x_test[..., 0], pix[3:5])


def test_fed_emnist_digits_only_has_ten_classes(tmp_path):
    writers.write_fed_emnist(tmp_path, np.random.default_rng(1), num_clients=3, only_digits=True)
    ds = load_dataset("emnist", tmp_path, only_digits=True)
    assert ds.num_classes == 10 and len(np.unique(ds.client_ids)) == 3 and ds.y_train.max() < 10


def test_fed_cifar100_clients_and_raw_images(tmp_path):
    writers.write_fed_cifar100(tmp_path, np.random.default_rng(2), train_clients=5, test_clients=3, per_client=4)
    ds = load_dataset("fed_cifar100", tmp_path)
    assert (ds.num_train, ds.num_test, ds.feature_shape, ds.num_classes) == (20, 12, (32, 32, 3), 100)
    assert np.bincount(ds.client_ids).tolist() == [4] * 5
    with h5py.File(tmp_path / "fed_cifar100_train.h5") as f:
        first = f["examples/0/image"][()]
        labels = f["examples/0/label"][()]
    np.testing.assert_array_equal(ds.x_train[:4], first.astype(np.float32))
    np.testing.assert_array_equal(ds.y_train[:4], labels)


def _so_folder(tmp_path, posts, titles, tags, words=("a", "b", "c"), tag_counts=None):
    writers.write_tff(
        tmp_path / "stackoverflow_train.h5", {"u1": {"tokens": np.array(posts, object), "title": np.array(titles, object), "tags": np.array(tags, object)}}
    )
    writers.write_tff(
        tmp_path / "stackoverflow_test.h5",
        {"u2": {"tokens": np.array(posts[:1], object), "title": np.array(titles[:1], object), "tags": np.array(tags[:1], object)}},
    )
    (tmp_path / "stackoverflow.word_count").write_text("".join(f"{w} {100 - i}\n" for i, w in enumerate(words)))
    (tmp_path / "stackoverflow.tag_count").write_text(json.dumps(tag_counts or {"t1": 5, "t0": 9, "t2": 1}))
    return tmp_path


def test_stackoverflow_next_word_ids_by_hand(tmp_path):
    folder = _so_folder(tmp_path, ["a x b", "a a a a a"], ["", ""], ["t0", "t1"])
    ds = load_dataset("stackoverflow_nwp", folder, vocab_size=2, max_len=4)
    # vocabulary a=1, b=2; pad 0, oov 3, bos 4, eos 5
    assert special_ids(2) == {"pad": 0, "oov": 3, "bos": 4, "eos": 5} and ds.num_classes == 6 and ds.task == "next_word"
    np.testing.assert_array_equal(ds.x_train, [[4, 1, 3, 2], [4, 1, 1, 1]])
    np.testing.assert_array_equal(ds.y_train, [[1, 3, 2, 5], [1, 1, 1, 1]])  # a truncated post has no eos
    short = load_dataset("stackoverflow_nwp", folder, vocab_size=2, max_len=6)
    np.testing.assert_array_equal(short.y_train[0], [1, 3, 2, 5, 0, 0])  # padded with 0
    assert load_dataset("stackoverflow_nwp", folder, vocab_size=2, max_len=4, max_posts=1).num_train == 1


def test_stackoverflow_tag_bag_of_words_by_hand(tmp_path):
    folder = _so_folder(tmp_path, ["a x b", "c c"], ["a", "b"], ["t1|zz", "t0|t1|t2"])
    ds = load_dataset("stackoverflow_lr", folder, vocab_size=2, num_tags=2)
    # words of tokens + title: "a x b a" -> a 2/4, b 1/4; "c c b" -> b 1/3 (c is not in the 2-word vocabulary)
    np.testing.assert_allclose(ds.x_train, [[0.5, 0.25], [0.0, 1 / 3]], rtol=1e-6)
    # the two most frequent tags are t0 (9) then t1 (5)
    np.testing.assert_array_equal(ds.y_train, [[0, 1], [1, 1]])
    assert ds.task == "multilabel" and ds.num_classes == 2 and ds.feature_shape == (2,)


def test_stackoverflow_caps_clients_and_subsamples_test(tmp_path):
    writers.write_stackoverflow(tmp_path, np.random.default_rng(3), num_clients=5, posts_per_client=(2, 3), vocab=12, tags=4)
    full = load_dataset("stackoverflow_lr", tmp_path, vocab_size=12, num_tags=4)
    capped = load_dataset("stackoverflow_lr", tmp_path, vocab_size=12, num_tags=4, max_clients=2, test_examples=3, seed=1)
    assert len(np.unique(full.client_ids)) == 5 and len(np.unique(capped.client_ids)) == 2
    assert capped.num_test == 3 and full.num_test > 3


def test_cifar100_python_batches_with_pachinko_clients(tmp_path):
    writers.write_cifar_python(tmp_path, np.random.default_rng(4), num_train=60, num_test=20)
    with open(tmp_path / "cifar-100-python" / "train", "rb") as f:
        raw = pickle.load(f, encoding="bytes")
    ds = load_dataset("cifar100", tmp_path, num_clients=6, test_clients=2)
    assert (ds.num_train, ds.num_test, ds.feature_shape) == (60, 20, (32, 32, 3))
    assert np.bincount(ds.client_ids).tolist() == [10] * 6 and set(ds.test_client_ids) == {6, 7}
    # channel planes become the last axis: pixel (0, 1) of the first image is bytes 1, 1025, 2049
    first = np.flatnonzero(np.all(raw[b"data"].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1) == ds.x_train[0], axis=(1, 2, 3)))
    assert first.size and ds.y_train[0] == raw[b"fine_labels"][first[0]]
    row = raw[b"data"][first[0]]
    np.testing.assert_array_equal(ds.x_train[0, 0, 1], [row[1], row[1025], row[2049]])


def test_cifar10_python_batches(tmp_path):
    writers.write_cifar_python(tmp_path, np.random.default_rng(5), num_classes=10, num_train=50, num_test=10)
    ds = load_dataset("cifar10", tmp_path)
    assert (ds.num_train, ds.num_test, ds.num_classes, ds.client_ids) == (50, 10, 10, None)


class _Shell:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_cifar_batch_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    writers.write_cifar_python(tmp_path, np.random.default_rng(5), num_classes=10, num_train=50, num_test=10)
    marker = tmp_path / "PWNED"
    batch = tmp_path / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({b"data": _Shell(f"touch {marker}"), b"labels": []}))
    with pytest.raises(DataError, match="data_batch_1: refused: not a plain-data pickle .*posix.system") as err:
        load_dataset("cifar10", tmp_path)
    assert err.value.exit_code == 3 and not marker.exists()


def _batch(n=4, data=None, **labels):
    return {b"data": np.zeros((n, 3072), np.uint8) if data is None else data, **{k.encode(): v for k, v in labels.items()}}


@pytest.mark.parametrize(
    "blob,needle",
    [
        (_batch(data=np.full((4, 3072), 300.0), labels=[0] * 4), "data must be an integer array of pixels 0..255; got float64"),
        (_batch(data=np.full((4, 3072), 256, np.int64), labels=[0] * 4), "pixel 256 outside 0..255"),
        (_batch(data=np.full((4, 3072), -1, np.int64), labels=[0] * 4), "pixel -1 outside 0..255"),
        (_batch(data=np.zeros((4, 3071), np.uint8), labels=[0] * 4), "data must be [n, 3072]; got (4, 3071)"),
        (_batch(labels=[0, 1, 2, 2**32 + 1]), "labels label 4294967297 outside 0..9"),
        (_batch(labels=[0, 1, 2, 10]), "labels label 10 outside 0..9"),
        (_batch(labels=[0, 1, 2, -1]), "labels label -1 outside 0..9"),
        (_batch(labels=[0, 1, 2, 1.7]), "labels must be integer labels; got 1.7"),
        (_batch(labels=np.zeros((4, 2), np.int64)), "labels must be integer labels, one per row"),
        (_batch(labels=[0, 1]), "one label per row needed"),
        (_batch(), "no 'labels' entry"),
        ([1, 2], "a pickled list, not a dict"),
    ],
)
def test_cifar_pixels_and_labels_are_checked_never_cast(tmp_path, blob, needle):
    writers.write_cifar_python(tmp_path, np.random.default_rng(5), num_classes=10, num_train=50, num_test=10)
    (tmp_path / "cifar-10-batches-py" / "data_batch_2").write_bytes(pickle.dumps(blob))
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path)
    assert "data_batch_2: " in str(err.value) and needle in str(err.value), err.value


def test_cifar100_coarse_labels_are_bounded_by_twenty(tmp_path):
    writers.write_cifar_python(tmp_path, np.random.default_rng(4), num_train=20, num_test=10)
    (tmp_path / "cifar-100-python" / "test").write_bytes(pickle.dumps(_batch(fine_labels=[99] * 4, coarse_labels=[20] * 4)))
    with pytest.raises(DataError, match="test: coarse_labels label 20 outside 0..19"):
        load_dataset("cifar100", tmp_path, num_clients=2, test_clients=2)


def test_pachinko_two_levels():
    fine = np.repeat(np.arange(100), 50)
    coarse = fine // 5
    parts = pachinko(fine, coarse, 50, np.random.default_rng(0))
    assert [len(p) for p in parts] == [100] * 50
    assert len(np.unique(np.concatenate(parts))) == 5000  # a true partition: every example once
    # Dir(0.1) over 20 coarse labels puts most of a client on a few of them; Dir(10) over a coarse
    # label's 5 fine labels spreads it evenly inside (while examples last).
    top_coarse = np.mean([np.bincount(coarse[p], minlength=20).max() / 100 for p in parts[:25]])
    assert top_coarse > 0.4
    flat = pachinko(fine, coarse, 50, np.random.default_rng(0), alpha=1e3)
    assert np.mean([np.bincount(coarse[p], minlength=20).max() / 100 for p in flat[:25]]) < 0.15
    inside = [np.bincount(fine[p][coarse[p] == np.bincount(coarse[p]).argmax()] % 5, minlength=5) for p in parts[:10]]
    assert np.mean([(c > 0).sum() for c in inside]) >= 4  # the client's main coarse label uses most of its fine labels
    again = pachinko(fine, coarse, 50, np.random.default_rng(0))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_pachinko_exhausts_fine_labels_and_renormalises():
    # one coarse label of two fine labels with 3 and 1 examples: the second runs out, the rest come from the first
    parts = pachinko(np.array([0, 0, 0, 1]), np.array([0, 0, 0, 0]), 2, np.random.default_rng(0))
    assert sorted(np.concatenate(parts).tolist()) == [0, 1, 2, 3]
    with pytest.raises(PartitionError, match="need 10 examples"):
        pachinko(np.zeros(4, int), np.zeros(4, int), 2, np.random.default_rng(0), examples_per_client=5)


def test_missing_and_damaged_files_name_the_file(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="fed_emnist_train.h5 is missing") as err:
        load_dataset("emnist", tmp_path)
    assert err.value.exit_code == 3
    (tmp_path / "fed_emnist_train.h5").write_bytes(b"not hdf5")
    (tmp_path / "fed_emnist_test.h5").write_bytes(b"not hdf5")
    with pytest.raises(DataError, match="fed_emnist_train.h5: not a readable HDF5 file"):
        load_dataset("emnist", tmp_path)
    writers.write_tff(tmp_path / "fed_emnist_train.h5", {"w": {"pixels": np.zeros((1, 28, 28), np.float32)}})
    with pytest.raises(DataError, match="client 'w' has no label"):
        load_dataset("emnist", tmp_path)
    (tmp_path / "cifar-100-python").mkdir()
    (tmp_path / "cifar-100-python" / "train").write_bytes(b"garbage")
    with pytest.raises(DataError, match="train: not a readable pickle"):
        load_dataset("cifar100", tmp_path)
    _so_folder(tmp_path, ["a"], ["b"], ["t0"])
    (tmp_path / "stackoverflow.word_count").write_text("a 3\nbroken\n")
    with pytest.raises(DataError, match="line 2 is not 'word count'"):
        load_dataset("stackoverflow_nwp", tmp_path, vocab_size=2)


def test_datasets_status_says_where_it_looked(tmp_path):
    writers.write_fed_cifar100(tmp_path, np.random.default_rng(6))
    status = {name: (present, detail) for name, present, detail in dataset_status(tmp_path)}
    assert status["fed_cifar100"] == (True, str(tmp_path))
    assert not status["emnist"][0] and f"looked in {tmp_path}" in status["emnist"][1] and "fed_emnist_train.h5" in status["emnist"][1]
    assert not status["stackoverflow_lr"][0] and "stackoverflow.tag_count" in status["stackoverflow_lr"][1]


def _emnist(tmp_path, train, test=None):
    good = {"w0": {"pixels": np.full((3, 28, 28), 0.5, np.float32), "label": np.array([0, 1, 2], np.int32)}}
    writers.write_tff(tmp_path / "fed_emnist_train.h5", {**good, **train})
    writers.write_tff(tmp_path / "fed_emnist_test.h5", test or good)


@pytest.mark.parametrize(
    "client, needle",
    [
        ({"pixels": np.zeros((2, 28, 28), np.float32), "label": np.array([1.7, 1.0])}, "client 'w1': label 1.7 is not a class 0..61"),
        ({"pixels": np.zeros((2, 28, 28), np.float32), "label": np.array([62, 1])}, "client 'w1': label 62 is not a class 0..61"),
        ({"pixels": np.array([["a"] * 784] * 2, object).reshape(2, 28, 28), "label": np.array([0, 1])}, "client 'w1': pixels must be real numbers; got object"),
        ({"pixels": np.zeros((2, 10, 10), np.float32), "label": np.array([0, 1])}, "client 'w1': images of shape [10, 10]; this dataset's are [28, 28]"),
        ({"pixels": np.zeros((2, 28, 28), np.float32), "label": np.zeros((2, 2), np.int32)}, "client 'w1': labels must be one integer per example"),
        ({"pixels": np.full((2, 28, 28), 255.0, np.float32), "label": np.array([0, 1])}, "client 'w1': pixel 255.0 outside 0..1"),
    ],
)
def test_emnist_pixels_and_labels_are_checked_never_cast(tmp_path, client, needle):
    _emnist(tmp_path, {"w1": client})
    with pytest.raises(DataError) as err:
        load_dataset("emnist", tmp_path)
    assert str(err.value).startswith(str(tmp_path / "fed_emnist_train.h5")) and needle in str(err.value), err.value
    assert err.value.exit_code == 3


def test_a_tff_client_that_is_not_a_group_is_one_line(tmp_path):
    import h5py

    _emnist(tmp_path, {})
    with h5py.File(tmp_path / "fed_emnist_test.h5", "a") as f:
        f["examples"].create_dataset("w9", data=np.zeros(3))
    with pytest.raises(DataError, match=r"fed_emnist_test.h5: client 'w9' is a Dataset, not a group of features"):
        load_dataset("emnist", tmp_path)


@pytest.mark.parametrize(
    "client, needle",
    [
        ({"image": np.zeros((2, 32, 32, 3), np.uint8), "label": np.array([2**32 + 3, 1], np.int64)}, "label 4294967299 is not a class 0..99"),
        ({"image": np.zeros((2, 32, 32), np.uint8), "label": np.array([0, 1], np.int64)}, "images of shape [32, 32]; this dataset's are [32, 32, 3]"),
        ({"image": np.full((2, 32, 32, 3), 300, np.int64), "label": np.array([0, 1], np.int64)}, "pixel 300 outside 0..255"),
    ],
)
def test_fed_cifar100_pixels_and_labels_are_checked_never_cast(tmp_path, client, needle):
    writers.write_fed_cifar100(tmp_path, np.random.default_rng(2), train_clients=2, test_clients=2, per_client=4)
    writers.write_tff(tmp_path / "fed_cifar100_test.h5", {"c0": client})
    with pytest.raises(DataError) as err:
        load_dataset("fed_cifar100", tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'fed_cifar100_test.h5'}: client 'c0': ") and needle in str(err.value), err.value


def test_stackoverflow_tokens_must_be_text_and_counts_utf8(tmp_path):
    _so_folder(tmp_path, ["a b", "c"], ["", ""], ["t0", "t1"])
    writers.write_tff(
        tmp_path / "stackoverflow_train.h5", {"u1": {"tokens": np.array([1, 2]), "title": np.array(["", ""], object), "tags": np.array(["t0", "t1"], object)}}
    )
    with pytest.raises(DataError, match=r"stackoverflow_train.h5: client 'u1': tokens must be text \(one byte string per post\); got int64"):
        load_dataset("stackoverflow_nwp", tmp_path, vocab_size=2)
    _so_folder(tmp_path, ["a b", "c"], ["", ""], ["t0", "t1"])
    (tmp_path / "stackoverflow.word_count").write_bytes(b"a 3\n\xff\xfe 2\n")
    with pytest.raises(DataError, match=r"stackoverflow.word_count: line 2 is not UTF-8 text"):
        load_dataset("stackoverflow_nwp", tmp_path, vocab_size=2)
