"""Randomly damaged files in every format the loaders read (fedbayes.data.registry.load_dataset):
each load gives a dataset that passes the loaders' checks, or one line naming the file or its
folder with exit code 3, never another exception."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data import write_leaf, write_mnist_like

from fedbayes.data import load_dataset, writers
from fedbayes.errors import FedbayesError


def _files_npz(folder: Path) -> tuple[Path, dict]:
    rng = np.random.default_rng(0)
    np.savez(folder / "d.npz", x=rng.normal(size=(24, 3)), y=rng.integers(0, 3, 24), c=np.arange(24) % 4)
    return folder / "d.npz", {"name": "files", "path": str(folder / "d.npz"), "client_column": "c"}


def _files_npy(folder: Path) -> tuple[Path, dict]:
    rng = np.random.default_rng(1)
    np.save(folder / "d.npy", np.column_stack([rng.normal(size=(24, 3)), rng.integers(0, 3, 24)]))
    return folder / "d.npy", {"name": "files", "path": str(folder / "d.npy"), "label": "3"}


def _files_csv(folder: Path) -> tuple[Path, dict]:
    rng = np.random.default_rng(2)
    rows = ["a,b,label"] + [f"{rng.normal():.3f},{rng.normal():.3f},{rng.integers(0, 3)}" for _ in range(24)]
    (folder / "d.csv").write_text("\n".join(rows) + "\n")
    return folder / "d.csv", {"name": "files", "path": str(folder / "d.csv")}


def _cifar(folder: Path) -> tuple[Path, dict]:
    writers.write_cifar_python(folder, np.random.default_rng(3), num_classes=10, num_train=20, num_test=6)
    return folder / "cifar-10-batches-py" / "data_batch_2", {"name": "cifar10", "data_dir": str(folder)}


def _emnist(folder: Path) -> tuple[Path, dict]:
    writers.write_fed_emnist(folder, np.random.default_rng(4), num_clients=3, per_client=(2, 3))
    return folder / "fed_emnist_train.h5", {"name": "emnist", "data_dir": str(folder)}


def _stackoverflow_words(folder: Path) -> tuple[Path, dict]:
    writers.write_stackoverflow(folder, np.random.default_rng(5), num_clients=3, posts_per_client=(1, 2))
    return folder / "stackoverflow.word_count", {"name": "stackoverflow_nwp", "data_dir": str(folder), "vocab_size": 5}


def _leaf(folder: Path) -> tuple[Path, dict]:
    users = {f"u{i}": {"x": [[float(i), 1.0], [2.0, float(i)]], "y": [i % 2, 1]} for i in range(3)}
    write_leaf(folder, "train", "a.json", users)
    write_leaf(folder, "test", "a.json", users)
    return folder / "train" / "a.json", {"name": "leaf", "data_dir": str(folder)}


def _idx(folder: Path) -> tuple[Path, dict]:
    write_mnist_like(folder, np.random.default_rng(6))
    return next(p for p in sorted(folder.iterdir()) if p.name.startswith("train-images")), {"name": "mnist", "data_dir": str(folder)}


FORMATS = {f.__name__.lstrip("_"): f for f in (_files_npz, _files_npy, _files_csv, _cifar, _emnist, _stackoverflow_words, _leaf, _idx)}


def _load(spec: dict):
    spec = dict(spec)
    name, data_dir = spec.pop("name"), spec.pop("data_dir", None)
    return load_dataset(name, data_dir, **spec)


def test_every_pristine_format_loads():
    for make in FORMATS.values():
        with tempfile.TemporaryDirectory() as tmp:
            _, spec = make(Path(tmp))
            assert _load(spec).num_train > 0


damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0.0, 1.0)),
    st.tuples(st.just("overwrite"), st.floats(0.0, 1.0), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.floats(0.0, 1.0), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("text"), st.sampled_from(["", "\x00", "nan", "-1", "1e999", "4294967297", "\xff\xfe", '{"a": [1, 2', "label,label\n1,1\n"])),
)


def _damage(path: Path, how) -> None:
    raw = path.read_bytes()
    kind, *args = how
    if kind == "truncate":
        raw = raw[: int(args[0] * len(raw))]
    elif kind == "overwrite":
        at = int(args[0] * len(raw))
        raw = raw[:at] + args[1] + raw[at + len(args[1]) :]
    elif kind == "insert":
        at = int(args[0] * len(raw))
        raw = raw[:at] + args[1] + raw[at:]
    else:
        raw = args[0].encode("utf-8", "surrogateescape") if isinstance(args[0], str) else args[0]
    path.write_bytes(raw)


@pytest.mark.parametrize("fmt", list(FORMATS))
@settings(max_examples=30, deadline=None, derandomize=True)
@given(how=damage)
def test_a_damaged_file_loads_cleanly_or_is_one_line_naming_it_with_exit_3(fmt, how):
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        path, spec = FORMATS[fmt](folder)
        _damage(path, how)
        try:
            ds = _load(spec)
        except FedbayesError as exc:
            message = str(exc)
            assert exc.exit_code == 3, (fmt, how, message)
            assert "\n" not in message and str(folder) in message, (fmt, how, message)
        else:
            assert ds.num_train > 0 and ds.num_test > 0
        shutil.rmtree(folder, ignore_errors=True)


def test_a_damaged_json_leaf_label_is_named(tmp_path):
    users = {"u0": {"x": [[1.0, 2.0]], "y": [2**40]}}
    write_leaf(tmp_path, "train", "a.json", users)
    write_leaf(tmp_path, "test", "a.json", {"u0": {"x": [[1.0, 2.0]], "y": [0]}})
    with pytest.raises(FedbayesError) as err:
        load_dataset("leaf", tmp_path)
    assert err.value.exit_code == 3 and "a.json: user 'u0'" in str(err.value) and "got 1099511627776.0" in str(err.value), err.value
    json.loads((tmp_path / "train" / "a.json").read_text())  # the file itself is valid JSON
