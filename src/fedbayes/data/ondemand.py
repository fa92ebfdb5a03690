"""Clients read from a file on demand: only the sampled clients' examples are ever in memory.

A federation of TFF's full StackOverflow (342,477 users, 135M posts; tag prediction's bag of
words is 40 kB a post) cannot be held as arrays. :class:`OnDemandClients` keeps per client only
its name (a short byte string) and its number of examples, and reads a client's examples from
the HDF5 file (TFF's layout, :mod:`fedbayes.data.tff`) when the simulator asks for them:

* **cache**: the clients read last, least recently used first out, at most ``max_clients`` of
  them and at most ``max_bytes`` of their arrays (a client larger than that is returned, not
  kept);
* **prefetch**: the simulator samples each round's cohort from explicit keys
  (:func:`fedbayes.protocol.sample_cohort`), so the next round's cohort is known while the current
  one trains; :meth:`OnDemandClients.prefetch` reads it into the cache on one background thread
  (h5py serialises file access, so one thread is all it can use). A read that fails there fails
  again, with its message, when the client is asked for.

What a client's arrays are is the caller's ``transform(name, {feature: array}) -> (x, y)``: the
bytes read and the examples returned are the same as the in-memory loader's for that client.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from fedbayes.data.tff import client_sizes, read_client
from fedbayes.errors import DataError

__all__ = ["ClientCache", "OnDemandClients"]

Transform = Callable[[str, dict[str, np.ndarray]], tuple[np.ndarray, np.ndarray]]


class ClientCache:
    """A least-recently-used cache of clients' ``(x, y)`` arrays, bounded in clients and bytes,
    filled by ``read(client)`` on a miss or ahead of time by :meth:`prefetch`; thread-safe.

    Args:
      read: ``client id -> (x, y)``.
      max_clients: at most this many clients held (>= 1).
      max_bytes: at most this many bytes of arrays held; ``None``: no bound but ``max_clients``.
    """

    def __init__(self, read: Callable[[int], tuple[np.ndarray, np.ndarray]], max_clients: int, max_bytes: int | None = None):
        if max_clients < 1 or (max_bytes is not None and max_bytes < 1):
            raise ValueError(f"need max_clients >= 1 and max_bytes >= 1 (or None); got {max_clients}, {max_bytes}")
        self.read, self.max_clients, self.max_bytes = read, max_clients, max_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._bytes = 0
        self._pending: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.reads = 0  # clients read from the file so far (hits are not reads)

    def held(self) -> list[int]:
        """The clients held now, least recently used first."""
        with self._lock:
            return list(self._held)

    @property
    def num_bytes(self) -> int:
        """Bytes of the arrays held now."""
        return self._bytes

    def get(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """``client``'s ``(x, y)``: from the cache, from a prefetch under way, or read now."""
        with self._lock:
            if client in self._held:
                self._held.move_to_end(client)
                return self._held[client]
            pending = self._pending.get(client)
        if pending is not None:
            return pending.result()  # a failed prefetch raises its error here
        return self._load(client)

    def prefetch(self, clients: Iterable[int]) -> None:
        """Reads ``clients`` into the cache on the background thread (those held or under way are
        skipped); returns at once."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="fedbayes-prefetch")
            for c in map(int, clients):
                if c not in self._held and c not in self._pending:
                    self._pending[c] = self._pool.submit(self._load, c)

    def wait(self) -> None:
        """Blocks until every prefetch under way is done (errors stay for :meth:`get`)."""
        with self._lock:
            pending = list(self._pending.values())
        for f in pending:
            f.exception()

    def _load(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            value = self.read(client)
        finally:
            with self._lock:
                self._pending.pop(client, None)
        size = sum(int(a.nbytes) for a in value)
        with self._lock:
            self.reads += 1
            if client not in self._held and (self.max_bytes is None or size <= self.max_bytes):
                while self._held and (len(self._held) >= self.max_clients or (self.max_bytes is not None and self._bytes + size > self.max_bytes)):
                    _, old = self._held.popitem(last=False)
                    self._bytes -= sum(int(a.nbytes) for a in old)
                self._held[client] = value
                self._bytes += size
        return value


class OnDemandClients:
    """The clients of a TFF HDF5 file, read on demand through a :class:`ClientCache`.

    Client ``k`` is the ``k``-th name in sorted order (the in-memory loaders' numbering); with
    ``limit`` only the first ``limit`` names are clients. Opening reads every client's number of
    examples (``len`` of its first feature; ``max_examples`` caps it) and nothing else.

    Args:
      path: the ``.h5`` file.
      features: the datasets each client group holds.
      transform: ``(client name, {feature: array}) -> (x, y)``; it sees at most ``max_examples``
        rows of each feature.
      limit: only the first clients in name order.
      max_examples: each client's first examples only (``None``: all).
      max_clients, max_bytes: the cache's bounds.

    Raises:
      DataError: the file is not TFF's layout, or a client lacks a feature or holds no examples
        (named), at opening; a client damaged otherwise, when it is read.
    """

    def __init__(
        self,
        path: str | Path,
        features: tuple[str, ...],
        transform: Transform,
        *,
        limit: int | None = None,
        max_examples: int | None = None,
        max_clients: int = 64,
        max_bytes: int | None = None,
    ):
        self.path, self.features, self.transform, self.max_examples = Path(path), features, transform, max_examples
        self.names, sizes = client_sizes(self.path, features, limit)
        if not sizes.all():  # a client takes at least one step: the simulator needs an example
            raise DataError(f"{self.path}: client {self.names[np.argmin(sizes)].decode()!r} holds no examples")
        self.sizes = sizes if max_examples is None else np.minimum(sizes, max_examples)
        self.cache = ClientCache(self._read, max_clients, max_bytes)
        self._file = None
        self._file_lock = threading.Lock()

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    def _read(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        name = self.names[client].decode()
        with self._file_lock:  # one open handle, shared by the main and the prefetch thread
            arrays = read_client(self.path, name, self.features, rows=self.max_examples, handle=self._handle())
        return self.transform(name, arrays)

    def _handle(self):
        if self._file is None:
            import h5py

            self._file = h5py.File(self.path, "r")
        return self._file

    def client_data(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        """Client ``client``'s ``(x, y)`` (:meth:`ClientCache.get`)."""
        return self.cache.get(int(client))

    def prefetch(self, clients: Iterable[int]) -> None:
        """Starts reading ``clients`` in the background (:meth:`ClientCache.prefetch`)."""
        self.cache.prefetch(clients)
