"""Pickles of plain data, read without running code.

``pickle.load`` calls whatever callable a file names (``os.system`` through ``__reduce__``).
:func:`load_plain` admits only what a pickled dict of NumPy arrays, lists, numbers and strings
needs: NumPy's array and scalar reconstruction, ``numpy.dtype`` and the Latin-1 encoding that
Python 3 uses for ``bytes`` at protocol 2. Any other global, such as ``os.system``, is refused
before it is called, as a :class:`~fedbayes.errors.DataError` naming the file.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np

from fedbayes.errors import DataError

__all__ = ["load_plain"]


class _Refused(pickle.UnpicklingError):
    """A global or persistent id outside the allow-list."""


def _latin1(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as protocol 2 pickles ``bytes``: Latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _Refused(f"_codecs.encode({type(text).__name__}, {encoding!r}) is not a plain bytes value")
    return text.encode("latin1")


# The reconstructors NumPy itself names in its pickles, taken from NumPy's own __reduce__.
_RECONSTRUCT = np.zeros(0).__reduce__()[0]
_FROMBUFFER = np.zeros(1).__reduce_ex__(5)[0]
_SCALAR = np.int64(0).__reduce__()[0]

_ALLOWED = {
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
    ("numpy.core.multiarray", "scalar"): _SCALAR,
    ("numpy._core.multiarray", "scalar"): _SCALAR,
    ("numpy.core.numeric", "_frombuffer"): _FROMBUFFER,
    ("numpy._core.numeric", "_frombuffer"): _FROMBUFFER,
    ("_codecs", "encode"): _latin1,
}


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        found = _ALLOWED.get((module, name))
        if found is None:
            raise _Refused(f"it names {module}.{name}, which a data file may not call")
        return found

    def persistent_load(self, pid):
        raise _Refused("it holds a persistent id, which a data file may not use")


def load_plain(path: str | Path, encoding: str = "bytes") -> object:
    """The object pickled in ``path``, admitting only plain data (see the module docstring).

    Args:
      path: the pickle file.
      encoding: how Python 2 ``str`` values are read (``"bytes"``, as CIFAR's batches need).

    Raises:
      DataError: the file names a callable outside the allow-list, or is not a complete pickle;
        the message names the file.
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return _PlainUnpickler(io.BytesIO(raw), encoding=encoding).load()
    except _Refused as err:
        raise DataError(f"{path}: refused: not a plain-data pickle ({err})") from None
    except Exception as err:  # what the unpickler or NumPy's reconstruction raises on a damaged file
        raise DataError(f"{path}: not a readable pickle ({type(err).__name__}: {' '.join(str(err).split())[:100]})") from None
