r"""Where client states live between rounds: stacked host arrays, files on disk, or device memory.

Stateful algorithms (ADMM and FedDyn duals, FedEP/PVI sites, client optimizer state) keep one
pytree of fixed structure per client. A store holds ``K`` of them, indexed by client id, and
serves the two host steps of a round (docs/design.md, "One round, as data flows"): **gather** the
cohort's rows before the client update, **scatter** the new rows after it.

* :class:`MemoryStore`: one stacked host array ``[K, ...]`` per leaf; the pytree is what
  ``SimState.client_states`` holds. Scatter is pure (a new array per leaf), or in place with
  ``donate=True`` when the caller drops the old state, as the experiment loop does: stacked
  arrays cannot share untouched rows between versions, so a pure update must copy ``K`` rows.
* :class:`DiskStore`: one preallocated binary file per leaf, row ``k`` at byte ``k * row_bytes``;
  ``SimState.client_states`` holds the store object itself. Rows are moved with explicit
  ``preadv``/``pwrite`` calls (and ``copy_file_range`` for undo logs), never through a memory map,
  so the process's resident memory grows with the cohort, not with ``K`` x parameters (a mapping
  counts every touched page of the file in the resident set; docs/results/client_store.md).
* :class:`DeviceStore`: one stacked array ``[K, ...]`` per leaf in device memory, one copy per
  device (replicated); the pytree is what ``SimState.client_states`` holds. Its gather and
  scatter are traceable: the simulator runs them inside the round's program
  (:meth:`~fedbayes.sim.simulator.Simulator.device_store_program`), with the store donated so that
  the scatter updates it in place: no per-round transfers, the layout for a GPU.

All three are :class:`ClientStore`\ s.

A disk store is updated in place, so it must be **atomic per round and able to return to an
earlier round** (a run killed after round ``r`` resumes from its newest checkpoint ``c <= r``):

1. before round ``r``'s rows are written, an undo log ``undo_<r>.bin`` with the old rows of the
   touched ids is written to a temporary name, flushed and renamed into place;
2. the new rows are written and flushed;
3. the metadata file ``store.json`` (written atomically) records the committed round ``r + 1``.

The store's content at round ``t`` is therefore always the leaf files with every undo log of a
round ``>= t`` applied, newest first. :meth:`DiskStore.rollback` does exactly that (marking the
target in the metadata first, so a rollback that is itself killed finishes on the next open);
opening a store finishes any interrupted round or rollback. :meth:`DiskStore.checkpointed` drops
the logs a checkpoint makes unnecessary. One process writes a store at a time.

Damage is detected, never read: ``rowsums.bin`` holds a CRC-32 of every client's row of every
leaf, written with the rows in the same round (and undone with them, as one more file under the
undo logs); :meth:`DiskStore.gather` checks the rows it reads against it, and :meth:`DiskStore.open`
checks every file's size. A damaged, truncated or missing file raises :class:`StoreDamagedError`
with one line naming it (exit code 4 in the CLI).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import uuid
import zlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.errors import RunFolderError, one_line

__all__ = ["ClientStore", "DeviceStore", "DiskStore", "MemoryStore", "StoreDamagedError", "as_store"]

_FORMAT = "fedbayes-client-store/2"  # /2: per-row checksums in rowsums.bin
_META = "store.json"
_SUMS = "rowsums.bin"
_UNDO_MAGIC = b"FBUNDO1\n"
_UNDO = re.compile(r"^undo_(\d{6,})\.bin$")
_LEAF = re.compile(r"^leaf_(\d{5})\.bin$")
_INIT_CHUNK_BYTES = 32 << 20  # rows written per call when filling a new store


class StoreDamagedError(RunFolderError, ValueError):
    """A disk client store whose files are missing, truncated or do not match their checksums."""


def _row_sums(leaves: list[np.ndarray], n: int) -> np.ndarray:
    """CRC-32 of each of ``n`` rows of each leaf: ``[n, num_leaves]`` uint32."""
    out = np.zeros((n, len(leaves)), np.uint32)
    for i, leaf in enumerate(leaves):
        if np.size(leaf) == 0:
            continue
        flat = np.ascontiguousarray(leaf).reshape(n, -1).view(np.uint8)
        for j in range(n):
            out[j, i] = zlib.crc32(flat[j])
    return out


def _row_spec(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), np.dtype(dtype))


@runtime_checkable
class ClientStore(Protocol):
    """``K`` client states of one fixed structure, indexed by client id.

    ``round_idx`` is the caller's ``SimState.round``: a store updated in place (:class:`DiskStore`)
    checks it, a store that is a value ignores it. ``scatter`` returns the updated store, which
    is this one when updated in place (``donate=True``, or always for a :class:`DiskStore`).
    """

    @property
    def held(self) -> Any:
        """What ``SimState.client_states`` holds for this store."""
        ...

    def row_spec(self) -> Any:
        """Shape and dtype of one client's state."""
        ...

    def gather(self, ids: np.ndarray, round_idx: int | None = None) -> Any:
        """The states of clients ``ids`` (repeats allowed), stacked ``[len(ids), ...]`` per leaf."""
        ...

    def scatter(self, ids: np.ndarray, rows: Any, round_idx: int | None = None, *, donate: bool = False) -> ClientStore:
        """A store with ``rows[j]`` as client ``ids[j]``'s state."""
        ...


class MemoryStore:
    """Client states as one stacked host array ``[K, ...]`` per leaf.

    Args:
      states: a pytree of numpy arrays sharing the leading client axis (``()`` when stateless).
    """

    def __init__(self, states: Any):
        self.states = states

    @classmethod
    def create(cls, template: Any, num_clients: int) -> MemoryStore:
        """Every client starts from ``template`` (one client's state)."""
        return cls(jax.tree.map(lambda a: np.repeat(np.asarray(a)[None], num_clients, axis=0), template))

    @property
    def held(self) -> Any:
        """What ``SimState.client_states`` holds for this store: the stacked pytree."""
        return self.states

    def row_spec(self) -> Any:
        """Shape and dtype of one client's state."""
        return jax.tree.map(lambda a: _row_spec(np.shape(a)[1:], a.dtype), self.states)

    def gather(self, ids: np.ndarray, round_idx: int | None = None) -> Any:
        """The states of clients ``ids`` (repeats allowed), stacked: a fresh copy."""
        del round_idx  # a memory store is a value: any version can be read
        return jax.tree.map(lambda a: a[ids], self.states)

    def scatter(self, ids: np.ndarray, rows: Any, round_idx: int | None = None, *, donate: bool = False) -> MemoryStore:
        """A store with ``rows[j]`` as client ``ids[j]``'s state.

        ``donate=False`` leaves this store as it was (each leaf is copied, ``K`` rows);
        ``donate=True`` writes into this store's arrays: only for callers that drop the old state.
        """
        del round_idx

        def put(store, new):
            if not donate or not store.flags.writeable:
                store = store.copy()
            store[ids] = np.asarray(new)
            return store

        return MemoryStore(jax.tree.map(put, self.states, rows))


class DeviceStore:
    """Client states as one stacked device array ``[K, ...]`` per leaf, replicated on the devices.

    Gather and scatter are traceable (``jnp.take`` and ``.at[].set``), so they run inside a
    compiled round; a row id out of ``[0, K)`` in :meth:`scatter` is dropped, which is how a
    round leaves padding slots and rejected clients unwritten.

    Args:
      states: a pytree of arrays sharing the leading client axis.
    """

    def __init__(self, states: Any):
        self.states = states

    @classmethod
    def place(cls, client_states: Any, sharding) -> DeviceStore:
        """The store on the devices with ``sharding`` (replicated): host arrays (a fresh store, a
        restored checkpoint) are put there once; arrays already laid out so are kept."""

        def put(a):
            if isinstance(a, jax.Array) and a.sharding.is_equivalent_to(sharding, a.ndim):
                return a
            return jax.device_put(np.asarray(a), sharding)

        return cls(jax.tree.map(put, client_states))

    @property
    def held(self) -> Any:
        """What ``SimState.client_states`` holds for this store: the stacked device arrays."""
        return self.states

    @property
    def num_clients(self) -> int:
        return jax.tree.leaves(self.states)[0].shape[0]

    def row_spec(self) -> Any:
        """Shape and dtype of one client's state."""
        return jax.tree.map(lambda a: _row_spec(np.shape(a)[1:], a.dtype), self.states)

    def gather(self, ids, round_idx: int | None = None) -> Any:
        """The states of clients ``ids`` (repeats allowed), stacked (traceable)."""
        del round_idx  # a device store is a value
        return jax.tree.map(lambda s: jnp.take(s, ids, axis=0), self.states)

    def scatter(self, ids, rows: Any, round_idx: int | None = None, *, donate: bool = False) -> DeviceStore:
        """A store with ``rows[j]`` as client ``ids[j]``'s state, ids outside ``[0, K)`` dropped
        (traceable; in place when the caller's program donates the store)."""
        del round_idx, donate  # XLA updates in place when the store's buffers are donated
        return DeviceStore(jax.tree.map(lambda s, n: s.at[ids].set(n.astype(s.dtype), mode="drop"), self.states, rows))


def as_store(client_states: Any) -> MemoryStore | DiskStore:
    """The store behind ``SimState.client_states``: a :class:`DiskStore` is its own value; any
    other pytree is the stacked arrays of a :class:`MemoryStore` (wrapped, not copied)."""
    return client_states if isinstance(client_states, DiskStore) else MemoryStore(client_states)


# ----- file helpers ----------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes, durable: bool) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(path.parent)


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short read at byte {offset + done}")
        done += n


def _pwrite_all(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


_copy_file_range_ok = hasattr(os, "copy_file_range")


def _copy(src: int, dst: int, count: int, src_offset: int, dst_offset: int) -> None:
    """Copies bytes between files in the kernel where it can (no user-space buffer)."""
    global _copy_file_range_ok
    while count > 0 and _copy_file_range_ok:
        try:
            n = os.copy_file_range(src, dst, count, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            _copy_file_range_ok = False
            break
        if n <= 0:
            raise OSError(errno.EIO, f"short copy at byte {src_offset}")
        count, src_offset, dst_offset = count - n, src_offset + n, dst_offset + n
    if count > 0:
        buf = memoryview(bytearray(min(count, 4 << 20)))
        while count > 0:
            part = buf[: min(count, len(buf))]
            _pread_into(src, part, src_offset)
            _pwrite_all(dst, part, dst_offset)
            count, src_offset, dst_offset = count - len(part), src_offset + len(part), dst_offset + len(part)


class DiskStore:
    """Client states on disk: one preallocated file per leaf, atomic per round, able to roll back.

    Build one with :meth:`create` (fills every client with ``template``) or :meth:`open`. See the
    module docstring for the layout and the write protocol.

    Args (of :meth:`create` and :meth:`open`):
      path: the store's folder.
      template: one client's state (its structure, row shapes and dtypes; values for ``create``).
      num_clients: ``K``.
      durable: ``fsync`` files and folder at every commit point (default). Without it a killed
        process still resumes correctly (the page cache survives it); a power loss may not.
    """

    def __init__(self, path: Path, treedef, specs: list[jax.ShapeDtypeStruct], meta: dict, durable: bool):
        self.path = path
        self.treedef = treedef
        self.specs = specs
        self.num_clients = int(meta["num_clients"])
        self.uuid = str(meta["uuid"])
        self.durable = durable
        self._round = int(meta["round"])
        self._row_bytes = [int(np.prod(s.shape, dtype=np.int64)) * s.dtype.itemsize for s in specs]
        self._fds: list[int] = []
        try:
            for i in range(len(specs)):
                self._fds.append(os.open(self.leaf_path(i), os.O_RDWR))
            # The row checksums are one more "leaf" to the undo logs: logged and undone with the rows.
            self._fds.append(os.open(path / _SUMS, os.O_RDWR))
        except FileNotFoundError as exc:
            self.close()
            raise StoreDamagedError(f"{exc.filename}: missing from the client store {path} (the store is damaged)") from None
        self._row_bytes.append(4 * len(specs))
        for fd, nbytes, name in zip(self._fds, self._row_bytes, [self.leaf_path(i) for i in range(len(specs))] + [path / _SUMS]):
            size = os.fstat(fd).st_size
            if size != nbytes * self.num_clients:
                self.close()
                raise StoreDamagedError(
                    f"{name}: holds {size} bytes, the client store needs {nbytes * self.num_clients} "
                    f"({self.num_clients} clients x {nbytes} bytes); the store is damaged (truncated?)"
                )
        self._dirty = False  # a write failed in this process: recover before the next operation

    # ----- construction --------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | Path, template: Any, num_clients: int, *, durable: bool = True) -> DiskStore:
        """A new store at ``path`` (an old store there is replaced) with every client at
        ``template``, written in chunks of rows so ``[K, ...]`` is never built in memory."""
        path = Path(path)
        leaves, treedef = jax.tree.flatten(template)
        if not leaves:
            raise ValueError("DiskStore: the client state has no arrays; stateless algorithms need no store")
        if num_clients < 1:
            raise ValueError(f"DiskStore: num_clients must be >= 1; got {num_clients}")
        made = not path.exists()
        path.mkdir(parents=True, exist_ok=True)
        (path / _META).unlink(missing_ok=True)  # first: an interrupted create leaves no valid store
        cls._remove_files(path)
        try:
            meta = cls._write_new(path, leaves, num_clients, durable)
        except BaseException:  # a full disk, an interrupt: nothing half-made stays behind
            cls._remove_files(path)
            if made:
                with contextlib.suppress(OSError):
                    path.rmdir()  # empty unless someone else put something there
            raise
        specs = [_row_spec(np.shape(a), np.asarray(a).dtype) for a in leaves]
        return cls(path, treedef, specs, meta, durable)

    @staticmethod
    def _remove_files(path: Path) -> None:
        """Removes a store's data files from ``path`` (leaves, checksums, undo logs, temporaries)."""
        for p in path.iterdir():
            if p.name.endswith(".tmp") or _UNDO.match(p.name) or _LEAF.match(p.name) or p.name == _SUMS:
                p.unlink(missing_ok=True)

    @staticmethod
    def _write_new(path: Path, leaves: list, num_clients: int, durable: bool) -> dict:
        """Writes a new store's files (every client at the template ``leaves``); returns its metadata."""
        rows = [np.asarray(leaf) for leaf in leaves]
        specs = [_row_spec(r.shape, r.dtype) for r in rows]
        sums = _row_sums([r[None] for r in rows], 1)
        rows = rows + [sums[0]]
        for i, row in enumerate(rows):
            row_bytes = row.nbytes
            name = f"leaf_{i:05d}.bin" if i < len(specs) else _SUMS
            fd = os.open(path / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                size = row_bytes * num_clients
                if size:
                    try:
                        os.posix_fallocate(fd, 0, size)  # reserves the space now: no ENOSPC mid-run
                    except OSError as exc:
                        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                            raise  # the disk cannot hold the store: say so now, not mid-run
                        os.ftruncate(fd, size)  # a file system without fallocate
                if row_bytes and np.any(np.ascontiguousarray(row).reshape(-1).view(np.uint8)):
                    per = max(1, _INIT_CHUNK_BYTES // row_bytes)
                    chunk = np.ascontiguousarray(np.broadcast_to(row, (min(per, num_clients), *row.shape)))
                    flat = memoryview(chunk.reshape(-1).view(np.uint8))
                    for start in range(0, num_clients, per):
                        n = min(per, num_clients - start)
                        _pwrite_all(fd, flat[: n * row_bytes], start * row_bytes)
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
        meta = {
            "format": _FORMAT,
            "uuid": uuid.uuid4().hex,
            "num_clients": int(num_clients),
            "leaves": [{"shape": list(s.shape), "dtype": s.dtype.str} for s in specs],
            "round": 0,
            "rollback_to": None,
        }
        _write_atomic(path / _META, json.dumps(meta).encode(), durable)
        return meta

    @classmethod
    def open(cls, path: str | Path, template: Any, num_clients: int | None = None, *, durable: bool = True) -> DiskStore:
        """The store at ``path``, checked against ``template`` (and ``num_clients``), with any
        round or rollback that was interrupted finished first."""
        path = Path(path)
        meta = cls._read_meta(path)
        leaves, treedef = jax.tree.flatten(template)
        specs = [_row_spec(np.shape(a), np.asarray(a).dtype) for a in leaves]
        stored = [_row_spec(d["shape"], np.dtype(d["dtype"])) for d in meta["leaves"]]
        if [(s.shape, s.dtype) for s in stored] != [(s.shape, s.dtype) for s in specs]:
            raise ValueError(
                f"{path}: the client store holds rows {[(s.shape, str(s.dtype)) for s in stored]}, "
                f"the run expects {[(s.shape, str(s.dtype)) for s in specs]}; was it written by another config?"
            )
        if num_clients is not None and int(meta["num_clients"]) != num_clients:
            raise ValueError(f"{path}: the client store holds {meta['num_clients']} clients, the run expects {num_clients}")
        store = cls(path, treedef, specs, meta, durable)
        store._recover()
        store.verify()
        return store

    def verify(self) -> None:
        """Checks every row of every leaf against its checksum (reads the whole store once, in
        chunks; done when a store is opened, i.e. on resume).

        Raises:
          StoreDamagedError: the first damaged row, naming the file and the client.
        """
        per = max(1, _INIT_CHUNK_BYTES // max(1, sum(self._row_bytes)))
        for start in range(0, self.num_clients, per):
            ids = np.arange(start, min(self.num_clients, start + per))
            leaves = []
            for fd, spec, nbytes in zip(self._fds, self.specs, self._row_bytes):
                rows = np.empty((len(ids), *spec.shape), spec.dtype)
                if nbytes:
                    _pread_into(fd, memoryview(rows.reshape(-1).view(np.uint8)), start * nbytes)
                leaves.append(rows)
            self._verify(ids, leaves)

    @staticmethod
    def _read_meta(path: Path) -> dict:
        try:
            meta = json.loads((path / _META).read_text())
        except FileNotFoundError:
            raise StoreDamagedError(f"{path / _META}: missing; no complete client store here (deleted, or its creation was interrupted)") from None
        except (ValueError, UnicodeDecodeError, OSError) as exc:
            raise StoreDamagedError(f"{path / _META}: unreadable ({type(exc).__name__}); the client store is damaged") from None
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else None
            raise StoreDamagedError(f"{path / _META}: not a {_FORMAT} client store (format {found!r})")
        missing = {"uuid", "num_clients", "leaves", "round"} - set(meta)
        if missing:
            raise StoreDamagedError(f"{path / _META}: damaged (no {', '.join(sorted(missing))})")
        return meta

    def close(self) -> None:
        """Closes the leaf files; the store stays on disk and can be opened again."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"DiskStore({str(self.path)!r}, num_clients={self.num_clients}, round={self._round})"

    # ----- the interface the simulator uses --------------------------------------------------
    @property
    def round(self) -> int:
        """The round whose client states the store holds (0 after ``create``)."""
        return self._round

    @property
    def held(self) -> DiskStore:
        """What ``SimState.client_states`` holds for this store: the store itself."""
        return self

    def row_spec(self) -> Any:
        return jax.tree.unflatten(self.treedef, list(self.specs))

    def gather(self, ids: np.ndarray, round_idx: int | None = None) -> Any:
        """The states of clients ``ids`` (repeats allowed) read from disk: ``[len(ids), ...]`` per leaf.

        ``round_idx`` (the caller's ``SimState.round``) must equal :attr:`round`: an older state
        cannot be continued from a store that has moved on (roll it back first).
        """
        self._ready(round_idx)
        ids = self._ids(ids, unique=False)
        out = []
        for fd, spec, nbytes in zip(self._fds, self.specs, self._row_bytes):
            rows = np.empty((len(ids), *spec.shape), spec.dtype)
            if nbytes and len(ids):
                flat = rows.reshape(len(ids), -1).view(np.uint8)
                for j in np.argsort(ids, kind="stable"):  # ascending offsets
                    _pread_into(fd, memoryview(flat[j]), int(ids[j]) * nbytes)
            out.append(rows)
        self._verify(ids, out)
        return jax.tree.unflatten(self.treedef, out)

    def _verify(self, ids: np.ndarray, leaves: list[np.ndarray]) -> None:
        """The rows just read match the checksums written with them."""
        if not len(ids):
            return
        stored = np.empty((len(ids), len(self.specs)), np.uint32)
        flat = stored.view(np.uint8)
        nbytes = self._row_bytes[-1]
        for j, cid in enumerate(ids):
            _pread_into(self._fds[-1], memoryview(flat[j]), int(cid) * nbytes)
        bad = np.argwhere(_row_sums(leaves, len(ids)) != stored)
        if len(bad):
            j, i = bad[0]
            raise StoreDamagedError(
                f"{self.leaf_path(int(i))}: client {int(ids[j])}'s row does not match its checksum in {self.path / _SUMS}; the client store is damaged"
            )

    def scatter(self, ids: np.ndarray, rows: Any, round_idx: int | None = None, *, donate: bool = True) -> DiskStore:
        """Writes ``rows[j]`` as client ``ids[j]``'s state and commits round ``round + 1``.

        Atomic: a process killed at any point leaves a store that opens at round ``round`` or at
        ``round + 1``, never in between. Always in place (``donate`` is accepted for the common
        interface); returns ``self``.
        """
        del donate
        self._ready(round_idx)
        ids = self._ids(ids, unique=True)
        leaves = self._rows(rows, len(ids))
        r = self._round
        self._dirty = True
        self.write_undo_log(r, ids)
        self._write_leaf_rows(ids, leaves)
        self._commit(r + 1)
        self._dirty = False
        return self

    # ----- rollback and checkpoints ----------------------------------------------------------
    def undo_rounds(self) -> list[int]:
        """Rounds whose undo logs are on disk (the store can roll back to any of them), ascending."""
        return sorted(int(m.group(1)) for p in self.path.iterdir() if (m := _UNDO.match(p.name)))

    def rollback(self, to_round: int) -> None:
        """Returns the store to the client states it held at round ``to_round``.

        Applies the undo logs of rounds ``round - 1`` down to ``to_round``, newest first, and
        deletes them. Raises if a log that is needed was pruned (see :meth:`checkpointed`).
        """
        self._check_live()
        if self._dirty:
            self._recover()
        if not 0 <= to_round <= self._round:
            raise ValueError(f"{self.path}: cannot roll the client store back from round {self._round} to round {to_round}")
        missing = sorted(set(range(to_round, self._round)) - set(self.undo_rounds()))
        if missing:
            raise StoreDamagedError(
                f"{self.path}: cannot roll the client store back to round {to_round}: the undo logs of rounds {missing} "
                "were pruned (only rounds since the newest checkpoint can be restored)"
            )
        self._rollback(to_round)

    def checkpointed(self, round_idx: int) -> None:
        """A checkpoint of round ``round_idx`` is complete: deletes the undo logs of earlier rounds,
        which only a return to before that checkpoint would need."""
        self._check_live()
        if round_idx > self._round:
            raise ValueError(f"{self.path}: a checkpoint of round {round_idx} but the client store is at round {self._round}")
        for r in self.undo_rounds():
            if r < round_idx:
                (self.path / f"undo_{r:06d}.bin").unlink(missing_ok=True)

    def describe(self) -> dict:
        """What a checkpoint records instead of the rows: where the store is, which one, which round."""
        return {"kind": "disk", "path": str(self.path.resolve()), "uuid": self.uuid, "round": self._round}

    # ----- internals -------------------------------------------------------------------------
    def leaf_path(self, i: int) -> Path:
        """The file of leaf ``i`` (row ``k`` at byte ``k * row_bytes[i]``)."""
        return self.path / f"leaf_{i:05d}.bin"

    def _check_live(self) -> None:
        """The files on disk are still this store at this round (not replaced or moved on by
        another :class:`DiskStore` object)."""
        if not self._fds and self.specs:
            raise ValueError(f"{self.path}: the client store is closed")
        meta = self._read_meta(self.path)
        if meta["uuid"] != self.uuid:
            raise ValueError(f"{self.path}: the client store on disk was replaced by another one (created anew)")
        if not self._dirty and (meta["round"] != self._round or meta.get("rollback_to") is not None):
            raise ValueError(f"{self.path}: the client store was changed by another DiskStore object (round {meta['round']}, here {self._round})")

    def _ready(self, round_idx: int | None) -> None:
        self._check_live()
        if self._dirty:
            self._recover()
        if round_idx is not None and round_idx != self._round:
            raise ValueError(
                f"{self.path}: the client store holds round {self._round}, the state asks for round {round_idx}; a disk "
                f"store is updated in place, so only its newest state continues (DiskStore.rollback({round_idx}) returns to an "
                "earlier round)"
            )

    def _ids(self, ids, unique: bool) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_clients):
            raise IndexError(f"client ids must be in [0, {self.num_clients}); got {ids.min()}..{ids.max()}")
        if unique and len(np.unique(ids)) != len(ids):
            raise ValueError("scatter: client ids must be distinct")
        return ids

    def _rows(self, rows, n: int) -> list[np.ndarray]:
        leaves, treedef = jax.tree.flatten(rows)
        if treedef != self.treedef:
            raise ValueError(f"scatter: rows have structure {treedef}, the store holds {self.treedef}")
        out = []
        for leaf, spec in zip(leaves, self.specs):
            a = np.asarray(leaf)
            if a.shape != (n, *spec.shape):
                raise ValueError(f"scatter: a leaf of shape {a.shape}, expected {(n, *spec.shape)}")
            if not np.can_cast(a.dtype, spec.dtype, "same_kind"):
                raise ValueError(f"scatter: a leaf of dtype {a.dtype} cannot be stored as {spec.dtype}")
            out.append(np.ascontiguousarray(a, dtype=spec.dtype))
        return out

    # ----- the steps of a round's scatter and of a rollback --------------------------------------
    # Public so that a test can stop a process between them (a crash): :meth:`scatter` is
    # write_undo_log, write_rows, then the metadata; :meth:`rollback` applies undo logs newest first.
    @property
    def row_bytes(self) -> list[int]:
        """Bytes of one client's row in each leaf file, then in ``rowsums.bin``."""
        return list(self._row_bytes)

    def write_undo_log(self, r: int, ids: np.ndarray) -> None:
        """Step 1 of round ``r``'s scatter: the old rows of ``ids`` in ``undo_<r>.bin``, renamed
        into place only once complete."""
        header = json.dumps({"round": r, "ids": ids.tolist(), "row_bytes": self._row_bytes}).encode()
        final = self.path / f"undo_{r:06d}.bin"
        tmp = final.with_name(final.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            head = _UNDO_MAGIC + len(header).to_bytes(8, "little") + header
            _pwrite_all(fd, memoryview(head), 0)
            pos = len(head)
            for src, nbytes in zip(self._fds, self._row_bytes):
                for cid in ids:
                    _copy(src, fd, nbytes, int(cid) * nbytes, pos)
                    pos += nbytes
            if self.durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        if self.durable:
            _fsync_dir(self.path)

    def write_rows(self, ids: np.ndarray, rows: Any) -> None:
        """Step 2 of a scatter: ``rows[j]`` written in place as client ``ids[j]``'s row, with its
        checksums (the metadata still names the round before: an open undoes them)."""
        ids = self._ids(ids, unique=True)
        self._write_leaf_rows(ids, self._rows(rows, len(ids)))

    def _write_leaf_rows(self, ids: np.ndarray, leaves: list[np.ndarray]) -> None:
        order = np.argsort(ids, kind="stable")
        leaves = leaves + [_row_sums(leaves, len(ids))]  # the checksums are written with the rows
        for fd, leaf, nbytes in zip(self._fds, leaves, self._row_bytes):
            if not nbytes or not len(ids):
                continue
            flat = leaf.reshape(len(ids), -1).view(np.uint8)
            for j in order:
                _pwrite_all(fd, memoryview(flat[j]), int(ids[j]) * nbytes)
            if self.durable:
                os.fsync(fd)

    def _commit(self, round_idx: int, rollback_to: int | None = None) -> None:
        """Step 3 (and rollback's marks): the metadata, atomically."""
        meta = {
            "format": _FORMAT,
            "uuid": self.uuid,
            "num_clients": self.num_clients,
            "leaves": [{"shape": list(s.shape), "dtype": s.dtype.str} for s in self.specs],
            "round": round_idx,
            "rollback_to": rollback_to,
        }
        _write_atomic(self.path / _META, json.dumps(meta).encode(), self.durable)
        self._round = round_idx

    def apply_undo_log(self, r: int) -> None:
        """One step of a rollback: the rows saved by round ``r``'s undo log written back."""
        path = self.path / f"undo_{r:06d}.bin"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise StoreDamagedError(f"{path}: missing; the client store cannot return to round {r}") from None
        try:
            fixed = bytearray(len(_UNDO_MAGIC) + 8)
            try:
                _pread_into(fd, memoryview(fixed), 0)
                if bytes(fixed[: len(_UNDO_MAGIC)]) != _UNDO_MAGIC:
                    raise ValueError("no undo-log header")
                size = int.from_bytes(fixed[len(_UNDO_MAGIC) :], "little")
                if size > os.fstat(fd).st_size:
                    raise ValueError("header longer than the file")
                header = bytearray(size)
                _pread_into(fd, memoryview(header), len(fixed))
                info = json.loads(header.decode())
                if info["row_bytes"] != self._row_bytes or info["round"] != r:
                    raise ValueError("it does not match the store")
                if os.fstat(fd).st_size != len(fixed) + size + len(info["ids"]) * sum(self._row_bytes):
                    raise ValueError("truncated")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise StoreDamagedError(f"{path}: damaged undo log ({one_line(exc)})") from None
            pos = len(fixed) + size
            for dst, nbytes in zip(self._fds, self._row_bytes):
                for cid in info["ids"]:
                    _copy(fd, dst, nbytes, pos, int(cid) * nbytes)
                    pos += nbytes
                if self.durable:
                    os.fsync(dst)
        finally:
            os.close(fd)

    def _rollback(self, to_round: int) -> None:
        pending = [r for r in self.undo_rounds() if r >= to_round]
        if not pending and self._round == to_round:
            return
        self._dirty = True
        self._commit(self._round, rollback_to=to_round)  # an interrupted rollback finishes on open
        for r in sorted(pending, reverse=True):
            self.apply_undo_log(r)
            (self.path / f"undo_{r:06d}.bin").unlink()
        if self.durable:
            _fsync_dir(self.path)
        self._commit(to_round)
        self._dirty = False

    def _recover(self) -> None:
        """Finishes what a killed process (or a failed write here) left: a round whose undo log
        exists but whose metadata was not committed is undone; a rollback is completed."""
        meta = self._read_meta(self.path)
        self._round = int(meta["round"])
        target = meta.get("rollback_to")
        self._rollback(self._round if target is None else int(target))
        for p in self.path.glob("*.tmp"):
            p.unlink(missing_ok=True)
        self._dirty = False
