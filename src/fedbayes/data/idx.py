"""IDX files (LeCun's MNIST format) and the two image datasets stored in it: Fashion-MNIST, MNIST.

Nothing is downloaded (docs/design.md, "Data on this machine"). Fashion-MNIST comes from Debian's
``dataset-fashion-mnist`` package (``/usr/share/datasets/fashion-mnist``) or a folder the user
names; MNIST only from a folder the user names.

IDX layout (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT"): two zero bytes, one byte
for the element type, one byte for the number of dimensions ``ndim``, then ``ndim`` big-endian
uint32 sizes, then the elements in C order, big-endian.
"""

from __future__ import annotations

import gzip
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.errors import DataError

# IDX element-type codes -> big-endian numpy dtypes.
IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

ENV_VAR = "FEDBAYES_DATA"
FASHION_MNIST_SYSTEM_DIRS: tuple[str, ...] = ("/usr/share/datasets/fashion-mnist",)
FASHION_MNIST_SUBDIRS = ("fashion-mnist", "fashion_mnist")
MNIST_SUBDIRS = ("mnist",)

# The four files of an MNIST-style dataset, in the order (train x, train y, test x, test y).
IDX_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads one IDX file, gzipped or raw, into a native-endian numpy array.

    Compression is detected from the gzip magic bytes, not the file name.

    Raises:
      DataError: the file is unreadable, a damaged gzip file, not IDX, of an unknown type code,
        truncated, or holds non-finite floats; the one-line message names the file.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rb") as f:
            raw = f.read()
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataError(f"{path}: damaged gzip file ({type(exc).__name__}: {' '.join(str(exc).split())})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise DataError(f"{path}: not an IDX file (the first two bytes must be zero)")
    code, ndim = raw[2], raw[3]
    if code not in IDX_DTYPES:
        known = ", ".join(f"0x{c:02X}" for c in IDX_DTYPES)
        raise DataError(f"{path}: unknown IDX element type 0x{code:02X} (known: {known})")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise DataError(f"{path}: truncated IDX header ({ndim} dimensions announced)")
    shape = struct.unpack(f">{ndim}I", raw[4:header_len])
    dtype = IDX_DTYPES[code]
    expected = math.prod(shape) * dtype.itemsize  # Python integers: a damaged header's product does not wrap
    if len(raw) - header_len != expected:
        raise DataError(f"{path}: IDX header announces shape {shape} ({expected} bytes of data) but the file holds {len(raw) - header_len} bytes")
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    if dtype.kind == "f" and not np.isfinite(data).all():
        raise DataError(f"{path}: holds {int((~np.isfinite(data)).sum())} non-finite values (NaN or Inf)")
    return data.astype(dtype.newbyteorder("="))


def _find_file(folder: Path, stem: str) -> Path | None:
    """The file for ``stem`` in ``folder``: raw or ``.gz``, with ``-idx`` or ``.idx`` spelling."""
    dotted = stem.replace("-idx", ".idx")
    for name in (stem, stem + ".gz", dotted, dotted + ".gz"):
        candidate = folder / name
        if candidate.is_file():
            return candidate
    return None


def _idx_folder_files(folder: Path) -> list[Path] | None:
    """The four IDX files in ``folder`` if all are there, else None."""
    found = [_find_file(folder, stem) for stem in IDX_FILES]
    return None if any(f is None for f in found) else found


def _candidates(data_dir, subdirs, system_dirs) -> list[Path]:
    """Folders to search, in order: data_dir (and its subfolders) alone when given; else
    ``$FEDBAYES_DATA``'s named subfolders then the folder itself, then the system folders."""
    if data_dir is not None:
        base = Path(data_dir)
        return [base] + [base / s for s in subdirs]
    folders = []
    env = os.environ.get(ENV_VAR)
    if env:
        base = Path(env)
        folders += [base / s for s in subdirs] + [base]
    folders += [Path(d) for d in system_dirs]
    return folders


def locate_fashion_mnist(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder holding the four Fashion-MNIST IDX files, or None (see ``load_fashion_mnist``)."""
    for folder in _candidates(data_dir, FASHION_MNIST_SUBDIRS, FASHION_MNIST_SYSTEM_DIRS):
        if _idx_folder_files(folder) is not None:
            return folder
    return None


def locate_mnist(data_dir: str | os.PathLike | None = None) -> Path | None:
    """The folder holding the four MNIST IDX files, or None (see ``load_mnist``)."""
    for folder in _candidates(data_dir, MNIST_SUBDIRS, ()):
        if _idx_folder_files(folder) is not None:
            return folder
    return None


def fashion_mnist_instructions() -> str:
    """How to get Fashion-MNIST onto this machine."""
    return (
        "Install it with `apt-get install dataset-fashion-mnist` (Debian; files go to "
        f"/usr/share/datasets/fashion-mnist), or set {ENV_VAR} to a folder holding the four IDX files "
        f"{', '.join(IDX_FILES)} (each raw or .gz), directly or in a 'fashion-mnist' subfolder."
    )


def mnist_instructions() -> str:
    """How to get MNIST onto this machine."""
    return (
        f"Pass data_dir, or set {ENV_VAR} to a folder holding the four IDX files "
        f"{', '.join(IDX_FILES)} (each raw or .gz) in an 'mnist' subfolder or directly. "
        "fedbayes never downloads data."
    )


def _load_idx_dataset(name: str, folder: Path) -> Dataset:
    files = _idx_folder_files(folder)
    if files is None:
        raise DatasetNotFoundError(f"{folder} does not hold the four IDX files {IDX_FILES}")
    x_train, y_train, x_test, y_test = (read_idx(f) for f in files)
    for path, images in ((files[0], x_train), (files[2], x_test)):
        if images.ndim != 3 or images.dtype != np.uint8:
            raise DataError(f"{path}: expected uint8 images [N, H, W], got {images.dtype} {images.shape}")
    for path, labels in ((files[1], y_train), (files[3], y_test)):
        if labels.ndim != 1:
            raise DataError(f"{path}: expected labels of shape [N], got shape {labels.shape}")
        if labels.size == 0:
            raise DataError(f"{path}: holds no labels (an empty split)")
        if labels.max() > 9:
            i = int(np.argmax(labels > 9))
            raise DataError(f"{path}: label {labels[i]} at position {i} is outside the 10 classes 0..9")
    for (xp, images), (yp, labels) in (((files[0], x_train), (files[1], y_train)), ((files[2], x_test), (files[3], y_test))):
        if len(images) != len(labels):
            raise DataError(f"{xp}: holds {len(images)} images but {yp} holds {len(labels)} labels")

    def images(a):
        # Divide in place: one 188 MB float32 array for Fashion-MNIST's train set instead of two
        # (a fresh process pays for every new page; 0.4-1.0 s -> 0.4 s, same values).
        x = a.astype(np.float32)
        x /= np.float32(255.0)
        return x[..., None]

    return Dataset(
        name=name,
        x_train=images(x_train),
        y_train=y_train.astype(np.int32),
        x_test=images(x_test),
        y_test=y_test.astype(np.int32),
        num_classes=10,
        task="classification",
    )


def load_fashion_mnist(data_dir: str | os.PathLike | None = None) -> Dataset:
    """Fashion-MNIST (Xiao et al. 2017) from local IDX files.

    Search order: ``data_dir`` (and its ``fashion-mnist``/``fashion_mnist`` subfolder) when given,
    and nothing else, so that a wrong explicit folder is an error rather than a silent fall-back;
    otherwise ``$FEDBAYES_DATA``'s ``fashion-mnist``/``fashion_mnist`` subfolder, then
    ``$FEDBAYES_DATA`` itself, then ``/usr/share/datasets/fashion-mnist`` (Debian's
    ``dataset-fashion-mnist``).

    Returns:
      Images as float32 in [0, 1], shape ``[N, 28, 28, 1]`` (NHWC); int32 labels; 10 classes.
      60,000 train and 10,000 test examples for the real data.

    Raises:
      DatasetNotFoundError: no searched folder holds the four files; the message lists the folders
        and how to get the data.
    """
    folders = _candidates(data_dir, FASHION_MNIST_SUBDIRS, FASHION_MNIST_SYSTEM_DIRS)
    folder = locate_fashion_mnist(data_dir)
    if folder is None:
        searched = ", ".join(str(f) for f in folders) or "(none)"
        raise DatasetNotFoundError(f"Fashion-MNIST not found; searched: {searched}. {fashion_mnist_instructions()}")
    return _load_idx_dataset("fashion_mnist", folder)


def load_mnist(data_dir: str | os.PathLike | None = None) -> Dataset:
    """MNIST (LeCun et al. 1998) from local IDX files; there is no system default.

    Search order: ``data_dir`` (and its ``mnist`` subfolder) when given, and nothing else;
    otherwise ``$FEDBAYES_DATA/mnist``, then ``$FEDBAYES_DATA`` itself.

    Returns:
      Images as float32 in [0, 1], shape ``[N, 28, 28, 1]``; int32 labels; 10 classes.

    Raises:
      DatasetNotFoundError: no searched folder holds the four files.
    """
    folders = _candidates(data_dir, MNIST_SUBDIRS, ())
    folder = locate_mnist(data_dir)
    if folder is None:
        searched = ", ".join(str(f) for f in folders) or f"(none: {ENV_VAR} is not set)"
        raise DatasetNotFoundError(f"MNIST not found; searched: {searched}. {mnist_instructions()}")
    return _load_idx_dataset("mnist", folder)
