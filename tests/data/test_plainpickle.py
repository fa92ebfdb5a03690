"""Plain-data pickles (fedbayes.data.plainpickle): NumPy arrays, lists and strings load; a pickle
that names any other callable is refused before it runs, naming the file."""

import os
import pickle

import numpy as np
import pytest

from fedbayes.data.plainpickle import load_plain
from fedbayes.errors import DataError


class _Shell:
    """Runs a shell command when unpickled."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _ShellThenBatch:
    """Runs a shell command, then returns a valid batch (``eval`` of the batch's text)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (eval, (f"__import__('os').system({self.command!r}) and None or {{b'data': [], b'labels': []}}",))


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_arrays_lists_and_strings_round_trip(tmp_path, protocol):
    blob = {
        b"data": np.arange(12, dtype=np.uint8).reshape(3, 4),
        b"labels": [1, 2, 3],
        b"batch_label": b"training batch 1 of 5",
        "names": ["a", "b"],
        b"scalar": np.int64(7),
        b"floats": np.linspace(0, 1, 5),
    }
    path = tmp_path / "batch"
    path.write_bytes(pickle.dumps(blob, protocol=protocol))
    out = load_plain(path)
    assert set(out) == set(blob)
    np.testing.assert_array_equal(out[b"data"], blob[b"data"])
    np.testing.assert_array_equal(out[b"floats"], blob[b"floats"])
    assert out[b"labels"] == [1, 2, 3] and out[b"batch_label"] == blob[b"batch_label"] and out["names"] == ["a", "b"] and out[b"scalar"] == 7


def test_numpy_1_names_of_cifar_batches_load(tmp_path):
    # CIFAR's own batches (NumPy 1, Python 2) name numpy.core.multiarray._reconstruct
    raw = pickle.dumps({b"data": np.ones((2, 3072), np.uint8)}, protocol=2)
    assert b"numpy._core.multiarray\n_reconstruct" in raw
    path = tmp_path / "data_batch_1"
    path.write_bytes(raw.replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n"))
    assert load_plain(path)[b"data"].shape == (2, 3072)


@pytest.mark.parametrize("payload", [_Shell, _ShellThenBatch])
def test_a_pickle_that_runs_code_is_refused_and_runs_nothing(tmp_path, payload):
    marker = tmp_path / "PWNED"
    path = tmp_path / "data_batch_1"
    path.write_bytes(pickle.dumps(payload(f"touch {marker}"), protocol=2))
    with pytest.raises(DataError) as err:
        load_plain(path)
    message = str(err.value)
    assert str(path) in message and "refused" in message and "\n" not in message
    assert not marker.exists()


def test_codecs_encode_admits_latin1_only(tmp_path):
    path = tmp_path / "b"
    path.write_bytes(pickle.dumps(b"\xff\x00", protocol=2))
    assert load_plain(path) == b"\xff\x00"
    path.write_bytes(pickle.dumps(b"\xff", protocol=2).replace(b"latin1", b"rot_13"))
    with pytest.raises(DataError, match="not a plain bytes value"):
        load_plain(path)


@pytest.mark.parametrize("cut", [0, 1, 10, -1])
def test_truncated_or_garbage_pickles_are_one_line_data_errors(tmp_path, cut):
    raw = pickle.dumps({b"data": np.zeros((2, 3), np.uint8)}, protocol=4)
    path = tmp_path / "b"
    path.write_bytes(raw[:cut] if cut else b"garbage")
    with pytest.raises(DataError) as err:
        load_plain(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
