"""LEAF folders (Caldas et al. 2018, https://github.com/TalwalkarLab/leaf): FEMNIST, Shakespeare.

LEAF's preprocessing writes ``data/train/*.json`` and ``data/test/*.json``; each file is

    {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}

FEMNIST stores each ``x`` as 784 floats (a 28x28 image, 1.0 = white background) and ``y`` as an
int in 0..61. Shakespeare stores each ``x`` as an 80-character string and ``y`` as the next
character; characters map to ids through LEAF's 80-letter vocabulary (``ALL_LETTERS`` in LEAF's
``models/utils/language_utils.py``). The natural partition (one client per user) is kept in
``client_ids`` and ``test_client_ids``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.errors import BadInputError, DataError

# LEAF's Shakespeare vocabulary (models/utils/language_utils.py, ALL_LETTERS): 80 characters, the
# newline first. Token id = position in this string.
ALL_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
NUM_LETTERS = len(ALL_LETTERS)
_LETTER_IDS = {c: i for i, c in enumerate(ALL_LETTERS)}

LEAF_INSTRUCTIONS = (
    "Generate the data with LEAF's preprocessing (https://github.com/TalwalkarLab/leaf, e.g. "
    "`cd data/femnist && ./preprocess.sh -s niid --sf 0.05 -k 0 -t sample`) on a machine with "
    "network access, and pass the resulting `data` folder, which holds train/ and test/ with "
    "*.json files. fedbayes never downloads data."
)


def text_to_ids(text: str, where: str = "") -> np.ndarray:
    """Token ids of ``text`` in LEAF's 80-character vocabulary, int32 ``[len(text)]``.

    LEAF's own ``word_to_indices`` maps an unknown character to -1 (``str.find``), which would
    index the last embedding row silently; here an unknown character is an error.

    Raises:
      ValueError: a character is not in the vocabulary; the message names it and ``where``.
    """
    try:
        return np.fromiter((_LETTER_IDS[c] for c in text), dtype=np.int32, count=len(text))
    except KeyError as err:
        raise DataError(f"{where}character {err.args[0]!r} is not in LEAF's 80-character Shakespeare vocabulary (fedbayes.data.leaf.ALL_LETTERS)") from None


def _read_split(folder: Path, split: str) -> dict[str, tuple[list, list, str]]:
    """``{user: (xs, ys, file)}`` over every JSON file of one split, files in name order."""
    split_dir = folder / split
    if not split_dir.is_dir():
        raise DatasetNotFoundError(f"LEAF folder {folder} has no '{split}' subfolder. {LEAF_INSTRUCTIONS}")
    files = sorted(split_dir.glob("*.json"))
    if not files:
        raise DatasetNotFoundError(f"LEAF folder {split_dir} holds no *.json files. {LEAF_INSTRUCTIONS}")
    users: dict[str, tuple[list, list, str]] = {}
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                blob = json.load(f)  # NaN/Infinity parse; the finite checks name the user
        except (ValueError, UnicodeDecodeError, RecursionError) as err:  # JSONDecodeError is a ValueError
            raise DataError(f"{path}: not valid JSON ({' '.join(str(err).split())[:200]})") from None
        except OSError as err:
            raise DataError(f"{path}: cannot read it ({err.strerror or err})") from None
        if not isinstance(blob, dict) or not isinstance(blob.get("user_data"), dict):
            raise DataError(f"{path}: a LEAF file must be an object with a 'user_data' object")
        names = blob.get("users", list(blob["user_data"]))
        counts = blob.get("num_samples")
        if not isinstance(names, list) or not all(isinstance(u, (str, int)) for u in names):
            raise DataError(f"{path}: 'users' must be a list of user names")
        if counts is not None and (not isinstance(counts, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts)):
            raise DataError(f"{path}: 'num_samples' must be a list of integers")
        if counts is not None and len(counts) != len(names):
            raise DataError(f"{path}: 'users' has {len(names)} entries but 'num_samples' {len(counts)}")
        for i, user in enumerate(names):
            record = blob["user_data"].get(user)
            if not isinstance(record, dict) or "x" not in record or "y" not in record:
                raise DataError(f"{path}: user {user!r} has no 'x' and 'y' in 'user_data'")
            xs, ys = record["x"], record["y"]
            if not isinstance(xs, list) or not isinstance(ys, list):
                raise DataError(f"{path}: user {user!r}: 'x' and 'y' must be lists")
            if len(xs) != len(ys):
                raise DataError(f"{path}: user {user!r} has {len(xs)} x but {len(ys)} y")
            if counts is not None and counts[i] != len(ys):
                raise DataError(f"{path}: user {user!r} has num_samples {counts[i]} but {len(ys)} examples")
            old_x, old_y, _ = users.get(str(user), ([], [], str(path)))
            users[str(user)] = (old_x + list(xs), old_y + list(ys), str(path))
    return users


def _is_text(users: dict) -> bool | None:
    for xs, _, _ in users.values():
        if xs:
            return isinstance(xs[0], str)
    return None


def _text_arrays(users: dict, order: list[str]):
    xs, ys = [], []
    for user in order:
        ux, uy, path = users[user]
        where = f"{path}: user {user!r}: "
        for text in ux:
            if not isinstance(text, str):
                raise DataError(f"{where}mixes text and numeric x")
            xs.append(text_to_ids(text, where))
        for label in uy:
            if not isinstance(label, str) or len(label) != 1:
                raise DataError(f"{where}text y must be single characters, got {label!r}")
            ys.append(_LETTER_IDS.get(label, -1))
            if ys[-1] < 0:
                text_to_ids(label, where)  # raises with the message naming the character
    lengths = {len(x) for x in xs}
    if len(lengths) > 1:
        raise DataError(f"text x must all have one length (LEAF uses 80); found lengths {sorted(lengths)}")
    width = lengths.pop() if lengths else 0
    x = np.stack(xs) if xs else np.zeros((0, width), np.int32)
    return x.astype(np.int32), np.asarray(ys, dtype=np.int32)


def _numeric_arrays(users: dict, order: list[str]):
    xs, ys = [], []
    for user in order:
        ux, uy, path = users[user]
        if any(v is None or isinstance(v, bool) for v in uy):
            raise DataError(f"{path}: user {user!r}: y must be integer labels; found null or a boolean")
        try:
            x = np.asarray(ux, dtype=np.float32)
            y = np.asarray(uy, dtype=np.float64)
        except (ValueError, TypeError, OverflowError) as err:
            raise DataError(
                f"{path}: user {user!r}: x and y must be numeric arrays of one shape (null is not a number; {' '.join(str(err).split())[:120]})"
            ) from None
        if y.size and (y.ndim != 1 or not np.isfinite(y).all() or np.any(y != np.round(y)) or np.any(y < 0) or np.any(y >= 2**31)):
            bad = y.reshape(-1)[~(np.isfinite(y) & (y == np.round(y)) & (y >= 0) & (y < 2**31)).reshape(-1)] if y.ndim == 1 else y.reshape(-1)
            raise DataError(
                f"{path}: user {user!r}: y must be non-negative integer labels, one per example; got {float(bad[0])!r}"
                + ("" if y.ndim == 1 else f" in shape {list(y.shape)}")
            )
        if x.size and not np.isfinite(x).all():
            bad = int(np.argmax(~np.isfinite(x.reshape(len(x), -1)).all(axis=1)))
            raise DataError(f"{path}: user {user!r}, example {bad}: a non-finite feature (NaN, Inf, null or out of float32 range)")
        if len(uy) == 0:
            continue
        if x.ndim < 2 or x.shape[0] != len(uy):
            raise DataError(f"{path}: user {user!r}: x must be a list of feature vectors (got shape {x.shape})")
        xs.append(x)
        ys.append(y.astype(np.int32))
    if not xs:
        return np.zeros((0, 0), np.float32), np.zeros((0,), np.int32)
    shapes = {x.shape[1:] for x in xs}
    if len(shapes) > 1:
        raise DataError(f"numeric x must all have one shape; found {sorted(shapes)}")
    x = np.concatenate(xs)
    if x.shape[1:] == (784,):
        x = x.reshape(-1, 28, 28, 1)  # FEMNIST: a flattened 28x28 image, stored NHWC
    return x, np.concatenate(ys)


def _label_owner(train: dict, test: dict, label: int) -> str:
    """ "file: user 'u'" of the first example with ``label`` (train first)."""
    for users in (train, test):
        for user in sorted(users):
            ux, uy, path = users[user]
            if any(v == label for v in uy):
                return f"{path}: user {user!r}"
    return "LEAF data"


def _client_ids(users: dict, order: list[str], ids: dict[str, int]) -> np.ndarray:
    return np.concatenate([np.full(len(users[u][1]), ids[u], dtype=np.int64) for u in order] or [np.zeros(0, np.int64)])


def load_leaf(folder: str | os.PathLike, name: str = "leaf", num_classes: int | None = None) -> Dataset:
    """Loads a LEAF-format folder (``folder/train/*.json`` and ``folder/test/*.json``).

    Users are sorted by name and numbered 0, 1, ... over the union of train and test users, so a
    user has the same id in both splits. Numeric ``x`` becomes float32 (784-long rows reshaped to
    ``[28, 28, 1]``); string ``x`` becomes int32 token ids via ``ALL_LETTERS``.

    Args:
      folder: the LEAF ``data`` folder holding ``train/`` and ``test/``.
      name: the dataset name to record.
      num_classes: numeric labels only; default ``max label + 1`` over both splits. Text data always
        has ``NUM_LETTERS`` = 80 classes.

    Raises:
      DatasetNotFoundError: the folder, a split folder, or its JSON files are missing.
      ValueError: a file is malformed (the message names the file), labels exceed ``num_classes``,
        or a character is outside the vocabulary.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetNotFoundError(f"LEAF folder {folder} does not exist. {LEAF_INSTRUCTIONS}")
    train, test = _read_split(folder, "train"), _read_split(folder, "test")
    kinds = {k for k in (_is_text(train), _is_text(test)) if k is not None}
    if len(kinds) > 1:
        raise DataError(f"{folder}: train and test disagree on whether x is text or numeric")
    text = kinds == {True}
    ids = {user: i for i, user in enumerate(sorted(set(train) | set(test)))}
    train_order, test_order = sorted(train), sorted(test)
    arrays = _text_arrays if text else _numeric_arrays
    x_train, y_train = arrays(train, train_order)
    x_test, y_test = arrays(test, test_order)
    if x_train.shape[0] == 0:
        raise DataError(f"{folder}: the train split holds no examples")
    if x_test.shape[0] == 0:
        raise DataError(f"{folder}: the test split holds no examples")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(f"{folder}: train examples have {x_train.shape[1:]} features but test examples {x_test.shape[1:]}")
    if text:
        if num_classes not in (None, NUM_LETTERS):
            raise BadInputError(f"config error: data.num_classes: LEAF text has {NUM_LETTERS} classes; got {num_classes}")
        num_classes = NUM_LETTERS
    else:
        observed = int(max(y_train.max(), y_test.max(initial=0))) + 1
        present = len(np.union1d(y_train, y_test))
        if num_classes is None and observed > 2 * present:
            where = _label_owner(train, test, observed - 1)
            raise DataError(
                f"{where}: label {observed - 1} would make {observed} classes of which only {present} occur; "
                "set data.num_classes to declare the classes if this is intended"
            )
        if num_classes is None:
            num_classes = observed
        elif observed > num_classes:
            raise DataError(f"{_label_owner(train, test, observed - 1)}: label {observed - 1} is outside the declared num_classes = {num_classes}")
    return Dataset(
        name=name,
        x_train=x_train,
        y_train=y_train,
        x_test=x_test,
        y_test=y_test,
        num_classes=num_classes,
        task="classification",
        client_ids=_client_ids(train, train_order, ids),
        test_client_ids=_client_ids(test, test_order, ids),
    )
