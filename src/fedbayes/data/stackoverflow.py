"""TFF's StackOverflow (``tff.simulation.datasets.stackoverflow``), read locally, preprocessed as
Reddi et al. 2021's code did for next-word prediction and tag prediction (the tasks of
Al-Shedivat et al. 2021, Table 3, and Guo et al. 2023, Table 3).

Files (in one folder): ``stackoverflow_train.h5`` and ``stackoverflow_test.h5`` (TFF's layout,
:mod:`fedbayes.data.tff`; per user ``tokens``, ``title`` and ``tags`` byte strings, tags joined
by ``|``), ``stackoverflow.word_count`` (lines ``word count``, most frequent first) and
``stackoverflow.tag_count`` (a JSON object ``{tag: count}``).

**Next-word prediction** (``task = "next_word"``): the vocabulary is the ``vocab_size`` (10,000)
most frequent words; ids are padding 0, the words ``1..V`` in frequency order, then
out-of-vocabulary ``V+1``, begin ``V+2`` and end ``V+3`` (one OOV bucket). Each post's
``tokens`` become ``[bos] + words[:max_len]``, then ``eos`` when the post had fewer than
``max_len`` words, padded with 0 to ``max_len + 1``; the
input is all but the last id and the target all but the first (``max_len`` = 20).

**Tag prediction** (``task = "multilabel"``): the features are the bag of words of ``tokens``
and ``title`` joined, each word's count over the post's number of words (OOV words count in the
denominator and are dropped: TFF's mean of one-hots without the OOV column), over the
``vocab_size`` most frequent words; the targets are 0/1 over the ``num_tags`` (500) most
frequent tags (others dropped).

A user is a client. The full training set (342,477 users, 135M posts) does not fit in memory as
these arrays: :func:`load_stackoverflow` reads the first ``max_clients`` users in name order;
:func:`open_stackoverflow` reads every user's posts on demand, only for the users sampled.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset
from fedbayes.data.federation import GeneratedFederation
from fedbayes.data.ondemand import OnDemandClients
from fedbayes.data.tff import client_sizes, read_client, read_clients, tff_file
from fedbayes.errors import DataError

__all__ = [
    "MAX_LEN",
    "NUM_TAGS",
    "VOCAB_SIZE",
    "bag_of_words",
    "load_stackoverflow",
    "open_stackoverflow",
    "read_tag_counts",
    "read_word_counts",
    "special_ids",
    "tag_targets",
    "token_sequences",
]

VOCAB_SIZE = 10_000
NUM_TAGS = 500
MAX_LEN = 20


def special_ids(vocab_size: int) -> dict[str, int]:
    """The special token ids next to a vocabulary of ``vocab_size`` words."""
    return {"pad": 0, "oov": vocab_size + 1, "bos": vocab_size + 2, "eos": vocab_size + 3}


def read_word_counts(path: Path, vocab_size: int) -> list[str]:
    """The first ``vocab_size`` words of TFF's ``stackoverflow.word_count`` (most frequent first).

    Raises:
      DataError: a line is not ``word count``, or the file holds fewer words (the message names
        the file and the line).
    """
    words: list[str] = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(f"{path}: line {number} is not UTF-8 text: {raw[:80]!r}") from None
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise DataError(f"{path}: line {number} is not 'word count': {line.strip()[:80]!r}")
            words.append(parts[0])
            if len(words) == vocab_size:
                return words
    raise DataError(f"{path}: holds {len(words)} words, fewer than the vocabulary size {vocab_size}")


def read_tag_counts(path: Path, num_tags: int) -> list[str]:
    """The ``num_tags`` most frequent tags of TFF's ``stackoverflow.tag_count`` (a JSON object;
    ties keep the file's order, as Python's stable sort in TFF's loader)."""
    try:
        with open(path, encoding="utf-8") as f:
            counts = json.load(f)
    except ValueError as err:
        raise DataError(f"{path}: not valid JSON ({' '.join(str(err).split())[:120]})") from None
    if not isinstance(counts, dict) or not all(isinstance(v, int) for v in counts.values()):
        raise DataError(f"{path}: must be a JSON object of tag counts {{tag: count}}")
    if len(counts) < num_tags:
        raise DataError(f"{path}: holds {len(counts)} tags, fewer than num_tags = {num_tags}")
    return [tag for tag, _ in sorted(counts.items(), key=lambda item: item[1], reverse=True)[:num_tags]]


def _text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def token_sequences(posts, word_ids: dict[str, int], max_len: int = MAX_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Next-word inputs and targets, int32 ``[n, max_len]`` each, from the posts' token strings."""
    vocab_size = len(word_ids)
    special = special_ids(vocab_size)
    ids = np.zeros((len(posts), max_len + 1), np.int32)
    for i, post in enumerate(posts):
        words = _text(post).split()[:max_len]
        row = [special["bos"], *(word_ids.get(w, special["oov"]) for w in words)]
        if len(words) < max_len:  # a truncated post has no end token (Reddi et al.'s to_ids)
            row.append(special["eos"])
        ids[i, : len(row)] = row
    return ids[:, :-1], ids[:, 1:]


def bag_of_words(posts, titles, word_ids: dict[str, int]) -> np.ndarray:
    """float32 ``[n, V]``: each in-vocabulary word's count in ``tokens + " " + title`` over the
    post's number of words (word ids here are 0-based: the word of rank r is column r - 1)."""
    x = np.zeros((len(posts), len(word_ids)), np.float32)
    for i, (post, title) in enumerate(zip(posts, titles)):
        words = f"{_text(post)} {_text(title)}".split()
        for w in words:
            j = word_ids.get(w)
            if j is not None:
                x[i, j - 1] += 1.0
        if words:
            x[i] /= len(words)
    return x


def tag_targets(tags, tag_ids: dict[str, int]) -> np.ndarray:
    """float32 0/1 ``[n, T]`` of the known tags of each post (``|``-separated)."""
    y = np.zeros((len(tags), len(tag_ids)), np.float32)
    for i, joined in enumerate(tags):
        for tag in _text(joined).split("|"):
            j = tag_ids.get(tag)
            if j is not None:
                y[i, j] = 1.0
    return y


def _texts(path: Path, client: str, feature: str, values) -> list[str]:
    """A client's ``feature`` as text: byte strings (or str) decoded as UTF-8, anything else refused."""
    values = np.asarray(values)
    if values.ndim != 1 or not all(isinstance(v, (bytes, str)) for v in values):
        raise DataError(
            f"{path}: client {client!r}: {feature} must be text (one byte string per post); got {values.dtype} values of shape {list(values.shape)}"
        )
    out = []
    for i, v in enumerate(values):
        try:
            out.append(v.decode("utf-8") if isinstance(v, bytes) else str(v))
        except UnicodeDecodeError:
            raise DataError(f"{path}: client {client!r}: {feature} of post {i} is not UTF-8 text: {v[:60]!r}") from None
    return out


def _features(task: str) -> tuple[str, ...]:
    return ("tokens",) if task == "next_word" else ("tokens", "title", "tags")


def _examples(path: Path, task: str, words: dict[str, int], tags: dict[str, int], max_len: int):
    """``(client name, {feature: array}) -> (x, y)``: one user's posts as the task's examples."""

    def transform(name: str, arrays: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        a = {k: _texts(path, name, k, v) for k, v in arrays.items()}
        if task == "next_word":
            return token_sequences(a["tokens"], words, max_len)
        return bag_of_words(a["tokens"], a["title"], words), tag_targets(a["tags"], tags)

    return transform


def _rows(path: Path, task: str, words: dict[str, int], tags: dict[str, int], max_len: int, limit: int | None, max_posts: int | None = None):
    transform = _examples(path, task, words, tags, max_len)
    xs, ys, names = [], [], []
    for name, a in read_clients(path, _features(task), limit):
        x, y = transform(name, {k: v[:max_posts] for k, v in a.items()})
        xs.append(x)
        ys.append(y)
        names.append(name)
    if not names or sum(len(y) for y in ys) == 0:
        raise DataError(f"{path}: holds no posts")
    return xs, ys, names


def load_stackoverflow(
    folder: str | os.PathLike,
    task: str,
    *,
    vocab_size: int = VOCAB_SIZE,
    num_tags: int = NUM_TAGS,
    max_len: int = MAX_LEN,
    max_clients: int | None = None,
    max_posts: int | None = None,
    test_examples: int | None = None,
    seed: int = 0,
) -> Dataset:
    """StackOverflow for ``task`` ``"next_word"`` or ``"multilabel"`` (tag prediction).

    Args:
      folder: holds the two ``.h5`` files and the word (and, for tags, tag) counts.
      vocab_size: the most frequent words kept (10,000).
      num_tags: the most frequent tags kept (500; tag prediction).
      max_len: words per sequence (20; next-word prediction).
      max_clients: read only the first train users in name order (all when None).
      max_posts: keep each user's first posts (Al-Shedivat et al. 2021's NWP: 128; all when None).
      test_examples: evaluate on this many test posts drawn at random without replacement
        (``default_rng([seed, 29])``; Guo et al. 2023 use 10,000), all when None.

    Raises:
      DatasetNotFoundError: a file is missing (named). DataError: a file is damaged (named).
    """
    train_path, test_path, words, tags = _vocabularies(folder, task, vocab_size, num_tags)
    xs, ys, names = _rows(train_path, task, words, tags, max_len, max_clients, max_posts)
    txs, tys, tnames = _rows(test_path, task, words, tags, max_len, None)
    ids = {n: i for i, n in enumerate(names)}
    for n in tnames:
        ids.setdefault(n, len(ids))
    x_test, y_test = np.concatenate(txs), np.concatenate(tys)
    test_ids = np.concatenate([np.full(len(y), ids[n], np.int64) for n, y in zip(tnames, tys)])
    if test_examples is not None and test_examples < len(y_test):
        keep = _test_sample(len(y_test), test_examples, seed)
        x_test, y_test, test_ids = x_test[keep], y_test[keep], test_ids[keep]
    return Dataset(
        name=f"stackoverflow_{'nwp' if task == 'next_word' else 'lr'}",
        x_train=np.concatenate(xs),
        y_train=np.concatenate(ys),
        x_test=x_test,
        y_test=y_test,
        num_classes=vocab_size + 4 if task == "next_word" else num_tags,
        task=task,
        client_ids=np.concatenate([np.full(len(y), ids[n], np.int64) for n, y in zip(names, ys)]),
        test_client_ids=test_ids,
    )


def _vocabularies(folder, task: str, vocab_size: int, num_tags: int):
    """The two ``.h5`` paths and the word (and tag) ids, from TFF's count files, which are read
    line by line (words) or as one small JSON object (tags): no post is read to count them."""
    if task not in ("next_word", "multilabel"):
        raise ValueError(f"StackOverflow task must be next_word or multilabel, got {task!r}")
    train_path, test_path = tff_file(folder, "stackoverflow_train.h5"), tff_file(folder, "stackoverflow_test.h5")
    words = {w: i + 1 for i, w in enumerate(read_word_counts(tff_file(folder, "stackoverflow.word_count"), vocab_size))}
    tags = {} if task == "next_word" else {t: i for i, t in enumerate(read_tag_counts(tff_file(folder, "stackoverflow.tag_count"), num_tags))}
    return train_path, test_path, words, tags


def _test_sample(total: int, test_examples: int, seed: int) -> np.ndarray:
    """The test posts kept (sorted positions in the test file's posts, in name order)."""
    return np.sort(np.random.default_rng([seed, 29]).choice(total, test_examples, replace=False))


def open_stackoverflow(
    folder: str | os.PathLike,
    task: str,
    *,
    vocab_size: int = VOCAB_SIZE,
    num_tags: int = NUM_TAGS,
    max_len: int = MAX_LEN,
    max_clients: int | None = None,
    max_posts: int | None = None,
    test_examples: int | None = None,
    seed: int = 0,
    cache_clients: int = 64,
    cache_bytes: int | None = 2**30,
) -> tuple[Dataset, GeneratedFederation]:
    """StackOverflow as :func:`load_stackoverflow` reads it, with the training users read on
    demand (:class:`~fedbayes.data.ondemand.OnDemandClients`): ``(dataset, federation)``, the
    dataset holding the test split only (no training rows) and the federation each sampled
    user's examples, the same arrays :func:`load_stackoverflow` gives that user.

    Memory: per training user its name and number of posts; the test split reads only the users
    holding one of the ``test_examples`` posts drawn (the same draw as :func:`load_stackoverflow`),
    and of them only those posts. ``cache_clients`` and ``cache_bytes`` bound the users held
    (:class:`~fedbayes.data.ondemand.ClientCache`).
    """
    train_path, test_path, words, tags = _vocabularies(folder, task, vocab_size, num_tags)
    transform = _examples(train_path, task, words, tags, max_len)
    clients = OnDemandClients(
        train_path, _features(task), transform, limit=max_clients, max_examples=max_posts, max_clients=cache_clients, max_bytes=cache_bytes
    )
    x_test, y_test, test_ids = _test_split(test_path, task, words, tags, max_len, clients.names, test_examples, seed)
    x_shape, dtype = ((max_len,), np.int32) if task == "next_word" else ((len(words),), np.float32)
    y_shape = (max_len,) if task == "next_word" else (len(tags),)
    dataset = Dataset(
        name=f"stackoverflow_{'nwp' if task == 'next_word' else 'lr'}",
        x_train=np.zeros((0, *x_shape), dtype),
        y_train=np.zeros((0, *y_shape), y_test.dtype),
        x_test=x_test,
        y_test=y_test,
        num_classes=vocab_size + 4 if task == "next_word" else num_tags,
        task=task,
        client_ids=np.zeros(0, np.int64),
        test_client_ids=test_ids,
    )
    federation = GeneratedFederation(
        sizes=clients.sizes,
        client_data=clients.client_data,
        feature_shape=x_shape,
        x_dtype=dtype,
        y_dtype=y_test.dtype,
        y_shape=y_shape,
        prefetch=clients.prefetch,
        source=clients,
    )
    return dataset, federation


def _test_split(path: Path, task: str, words, tags, max_len: int, train_names: np.ndarray, test_examples: int | None, seed: int):
    """``(x, y, client ids)`` of the test posts :func:`load_stackoverflow` keeps, reading only the
    users that hold them. Client ids: a train user's, else new ids after the train users in
    name order (as :func:`load_stackoverflow` numbers them)."""
    names, sizes = client_sizes(path, _features(task))
    ends = np.cumsum(sizes)
    total = int(ends[-1])
    if total == 0:
        raise DataError(f"{path}: holds no posts")
    keep = _test_sample(total, test_examples, seed) if test_examples is not None and test_examples < total else np.arange(total)
    at = np.minimum(np.searchsorted(train_names, names), len(train_names) - 1)
    known = train_names[at] == names
    ids = np.where(known, at, len(train_names) + np.cumsum(~known) - 1)
    owner = np.searchsorted(ends, keep, side="right")
    transform = _examples(path, task, words, tags, max_len)
    xs, ys, cids = [], [], []
    for user in np.unique(owner):
        rows = keep[owner == user] - (ends[user] - sizes[user])
        name = names[user].decode()
        arrays = read_client(path, name, _features(task), rows=int(rows[-1]) + 1)
        x, y = transform(name, {k: v[rows] for k, v in arrays.items()})
        xs.append(x)
        ys.append(y)
        cids.append(np.full(len(rows), ids[user], np.int64))
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(cids)
