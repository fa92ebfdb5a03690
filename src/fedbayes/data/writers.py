"""Files in the federated benchmarks' own formats, filled with random data: TFF's HDF5 layout
(:mod:`fedbayes.data.tff`), StackOverflow's count files and CIFAR's Python batches.

For tests (the loaders are checked on files written here, in the real formats, since the data
cannot be fetched) and for measuring what a paper's table costs on synthetic files of the real
shapes (``scripts/papers_gpu.py``). Sizes are arguments; the content is random.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

__all__ = ["write_cifar_python", "write_fed_cifar100", "write_fed_emnist", "write_stackoverflow", "write_tff"]


def write_tff(path: str | os.PathLike, clients: Mapping[str, dict[str, np.ndarray]] | Iterable[tuple[str, dict[str, np.ndarray]]]) -> Path:
    """Writes ``/examples/<client>/<feature>`` datasets (TFF's layout); byte-string features as
    variable-length strings. ``clients``: a mapping, or ``(name, features)`` pairs (a generator
    writes a file larger than memory, one client at a time)."""
    import h5py

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with h5py.File(path, "w") as f:
        examples = f.create_group("examples")
        for name, features in clients.items() if isinstance(clients, Mapping) else clients:
            group = examples.create_group(name)
            for key, value in features.items():
                value = np.asarray(value)
                if value.dtype.kind in "SUO":
                    group.create_dataset(
                        key, data=np.asarray([v if isinstance(v, bytes) else str(v).encode() for v in value], dtype=object), dtype=h5py.string_dtype()
                    )
                else:
                    group.create_dataset(key, data=value)
    return path


def _sizes(rng: np.random.Generator, num_clients: int, per_client: int | tuple[int, int]) -> np.ndarray:
    if isinstance(per_client, int):
        return np.full(num_clients, per_client)
    return rng.integers(per_client[0], per_client[1] + 1, num_clients)


def write_fed_emnist(folder, rng: np.random.Generator, num_clients: int = 4, per_client=(3, 6), only_digits: bool = False) -> Path:
    """``fed_emnist(_digitsonly)_{train,test}.h5`` with writers ``f0000_00``..; pixels in [0, 1]."""
    stem = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
    classes = 10 if only_digits else 62
    for split in ("train", "test"):
        sizes = _sizes(rng, num_clients, per_client)
        clients = {
            f"f{i:04d}_{i % 100:02d}": {"pixels": rng.random((n, 28, 28), dtype=np.float32), "label": rng.integers(0, classes, n).astype(np.int32)}
            for i, n in enumerate(sizes)
        }
        write_tff(Path(folder) / f"{stem}_{split}.h5", clients)
    return Path(folder)


def write_fed_cifar100(folder, rng: np.random.Generator, train_clients: int = 4, test_clients: int = 2, per_client: int = 5) -> Path:
    """``fed_cifar100_{train,test}.h5``: uint8 images, fine and coarse labels."""
    for split, k in (("train", train_clients), ("test", test_clients)):
        clients = {}
        for i in range(k):
            fine = rng.integers(0, 100, per_client)
            clients[str(i)] = {
                "image": rng.integers(0, 256, (per_client, 32, 32, 3), dtype=np.uint8),
                "label": fine.astype(np.int64),
                "coarse_label": (fine // 5).astype(np.int64),
            }
        write_tff(Path(folder) / f"fed_cifar100_{split}.h5", clients)
    return Path(folder)


def write_stackoverflow(
    folder, rng: np.random.Generator, num_clients: int = 4, posts_per_client=(2, 4), vocab: int = 30, tags: int = 8, words_per_post=(3, 25)
) -> Path:
    """``stackoverflow_{train,test}.h5`` with ``vocab`` words ``w0, w1, ...`` (counts falling with
    the index, so ``w0`` is the most frequent) and ``tags`` tags ``t0, t1, ...``; posts draw their
    words from twice the vocabulary (half of them out of vocabulary) and one to three tags from
    twice the tags. Also writes ``stackoverflow.word_count`` and ``stackoverflow.tag_count``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stackoverflow.word_count", "w", encoding="utf-8") as f:
        f.writelines(f"w{i} {10 * (2 * vocab - i)}\n" for i in range(2 * vocab))
    with open(folder / "stackoverflow.tag_count", "w", encoding="utf-8") as f:
        json.dump({f"t{i}": 10 * (2 * tags - i) for i in range(2 * tags)}, f)
    for split in ("train", "test"):
        clients = {}
        for i, n in enumerate(_sizes(rng, num_clients, posts_per_client)):
            posts = [" ".join(f"w{w}" for w in rng.integers(0, 2 * vocab, rng.integers(words_per_post[0], words_per_post[1] + 1))) for _ in range(n)]
            titles = [" ".join(f"w{w}" for w in rng.integers(0, 2 * vocab, 3)) for _ in range(n)]
            post_tags = ["|".join(f"t{t}" for t in rng.choice(2 * tags, rng.integers(1, 4), replace=False)) for _ in range(n)]
            clients[f"{i:08d}"] = {"tokens": np.array(posts, object), "title": np.array(titles, object), "tags": np.array(post_tags, object)}
        write_tff(folder / f"stackoverflow_{split}.h5", clients)
    return folder


def _pickle(path: Path, blob: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump(blob, f)


def write_cifar_python(folder, rng: np.random.Generator, num_classes: int = 100, num_train: int = 200, num_test: int = 50) -> Path:
    """CIFAR's Python batches: ``cifar-100-python/{train,test}`` (fine label ``c``, coarse
    ``c // 5``) or ``cifar-10-batches-py/{data_batch_1..5,test_batch}``."""
    folder = Path(folder)

    def batch(n):
        fine = rng.integers(0, num_classes, n)
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        if num_classes == 100:
            return {b"data": data, b"fine_labels": fine.tolist(), b"coarse_labels": (fine // 5).tolist()}
        return {b"data": data, b"labels": fine.tolist()}

    if num_classes == 100:
        _pickle(folder / "cifar-100-python" / "train", batch(num_train))
        _pickle(folder / "cifar-100-python" / "test", batch(num_test))
    else:
        for i in range(1, 6):
            _pickle(folder / "cifar-10-batches-py" / f"data_batch_{i}", batch(num_train // 5))
        _pickle(folder / "cifar-10-batches-py" / "test_batch", batch(num_test))
    return folder
