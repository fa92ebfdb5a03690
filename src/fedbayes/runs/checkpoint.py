"""Atomic checkpoints of a simulation: server state, client store and run metadata in one ``.npz``.

A checkpoint is written to a temporary name, flushed to disk and renamed into place, so a run
killed at any moment leaves either the previous complete checkpoint or the new one, never a torn
file (docs/design.md, "State that persists"). Leaves are stored by tree path
(:func:`fedbayes.tree.to_named_arrays`: ``server/<path>`` and ``client/<path>``, as ``model.npz`` and
the Flower codec name them) and restored into a template of the same structure, which is checked
name by name, shape and dtype. Checkpoints written before the tree-path format (leaves keyed by
flatten index, ``server_00000``, ...) still load (:func:`_restore_by_index`).

A :class:`~fedbayes.sim.store.DiskStore` is not copied into the checkpoint: the checkpoint records
which store (path, id) and its round; the store's undo logs from before that round are then
dropped, and loading rolls the store back to that round (``fedbayes.sim.store``).

Checkpoints check themselves: each holds a SHA-256 of all its other entries (``checksum``), and
its metadata holds the run's resolved config and its hash and every metric record written so far.
:func:`find_resume_checkpoint` verifies the newest and falls back to the newest intact one (a
damaged file is renamed ``*.damaged`` and named in one line); the disk store keeps the undo logs
every kept checkpoint needs, so the older one is usable too.

Beside the state, a checkpoint carries what the run's other files need to be rebuilt exactly on
resume (``extra``: arrays stored as ``extra/<name>``): the bytes of ``clients.jsonl`` so far and the
health checks' running state (:mod:`fedbayes.runs.health`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedbayes import tree as tree_lib
from fedbayes.errors import RunFolderError, one_line
from fedbayes.protocol import SimState
from fedbayes.runs import folder
from fedbayes.runs.folder import write_atomic
from fedbayes.runs.strictjson import loads_strict, sanitize
from fedbayes.sim.store import DiskStore

CHECKSUM = "checksum"
EXTRA = "extra/"  # the prefix of the arrays a run keeps beside its state (load_checkpoint's meta["extra"])


class CheckpointError(RunFolderError, ValueError):
    """A checkpoint that cannot be used: damaged, or not shaped like the run (exit code 4)."""


def _digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over every entry's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(arrays):
        if k == CHECKSUM:
            continue
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


_NAME = folder.CHECKPOINT_NAME


def checkpoint_path(directory: str | Path, round_idx: int) -> Path:
    return Path(directory) / folder.checkpoint_name(round_idx)


def save_checkpoint(directory: str | Path, state: SimState, meta: dict[str, Any], keep: int = 2, extra: dict[str, np.ndarray] | None = None) -> Path:
    """Atomically writes ``state`` (after ``state.round`` rounds), ``meta`` and the ``extra`` arrays
    (what the run's other files are rebuilt from); keeps the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    store = state.client_states if isinstance(state.client_states, DiskStore) else None
    if store is not None:
        if store.round != state.round:
            raise ValueError(f"save_checkpoint: the client store is at round {store.round}, the state at round {state.round}")
        meta = {**meta, "client_store": store.describe()}
    for prefix, t in (("server", state.server_state), ("client", () if store is not None else state.client_states)):
        arrays.update(tree_lib.to_named_arrays(t, prefix))  # typed PRNG keys as their raw key data
    arrays.update({EXTRA + k: np.asarray(v) for k, v in (extra or {}).items()})
    meta, _ = sanitize({**meta, "round": state.round})  # strict JSON; records carry their own flags
    arrays["meta"] = np.frombuffer(json.dumps(meta, allow_nan=False).encode(), dtype=np.uint8)
    arrays[CHECKSUM] = np.frombuffer(_digest(arrays).encode(), dtype=np.uint8)
    final = write_atomic(checkpoint_path(directory, state.round), lambda f: np.savez(f, **arrays), durable=True)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    if store is not None:  # keep the undo logs every kept checkpoint needs (a fallback target too)
        kept = [checkpoint_round(p) for p in list_checkpoints(directory)]
        store.checkpointed(min([r for r in kept if r <= state.round], default=state.round))
    return final


def checkpoint_round(path: str | Path) -> int:
    m = _NAME.match(Path(path).name)
    if m is None:
        raise ValueError(f"{path}: not a checkpoint file name (round_NNNNNN.npz)")
    return int(m.group(1))


def read_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Reads every entry of a checkpoint and verifies it: the zip, the checksum, the metadata.

    Raises:
      CheckpointError: the file is unreadable, truncated, or its contents do not match the
        checksum; the one-line message names the file and what is wrong.
    """
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except Exception as exc:  # BadZipFile, EOFError, OSError, zlib.error, ValueError: all mean damaged
        raise CheckpointError(f"{path}: damaged checkpoint ({type(exc).__name__}: {one_line(exc)})") from None
    if CHECKSUM not in arrays or "meta" not in arrays:
        raise CheckpointError(f"{path}: damaged checkpoint (no {CHECKSUM if 'meta' in arrays else 'meta'} entry)")
    if arrays[CHECKSUM].tobytes().decode("ascii", "replace") != _digest(arrays):
        raise CheckpointError(f"{path}: damaged checkpoint (contents do not match its checksum)")
    try:
        meta = loads_strict(arrays.pop("meta").tobytes().decode())
        int(meta["round"])
    except Exception as exc:
        raise CheckpointError(f"{path}: damaged checkpoint metadata ({type(exc).__name__}: {one_line(exc)})") from None
    arrays.pop(CHECKSUM)
    return arrays, meta


def find_resume_checkpoint(directory: str | Path, warn: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]] | None:
    """The newest intact checkpoint in ``directory`` and its metadata, or None if there is none.

    Damaged checkpoints newer than it are renamed ``<name>.damaged`` (kept for inspection, no
    longer counted) and reported through ``warn`` in one line.

    Raises:
      CheckpointError: checkpoints exist but none is intact.
    """
    found = list_checkpoints(directory)
    damaged: list[tuple[Path, str]] = []
    for path in reversed(found):
        try:
            _, meta = read_checkpoint(path)
        except CheckpointError as exc:
            damaged.append((path, str(exc)))
            continue
        for bad, reason in damaged:
            os.replace(bad, bad.with_name(bad.name + ".damaged"))
            warn(f"warning: {reason}; resuming from the older {path.name} (the damaged file is kept as {bad.name}.damaged)")
        return path, meta
    if damaged:
        reasons = "; ".join(reason for _, reason in damaged)
        raise CheckpointError(f"no intact checkpoint to resume from: {reasons}")
    return None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first (temporary files are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | Path) -> Path | None:
    ckpts = list_checkpoints(directory)
    return ckpts[-1] if ckpts else None


_LEGACY = re.compile(r"^(server|client)_\d{5}$")  # the flatten-index keys of the first format


def _restore(template, arrays, prefix: str, path: Path):
    """The ``prefix`` tree of ``template``'s structure: by tree path, or by flatten index for a
    checkpoint written in the first format."""
    if any(_LEGACY.match(k) for k in arrays):
        return _restore_by_index(template, arrays, prefix, path)
    error = lambda message: CheckpointError(f"{path}: the checkpoint's {prefix} arrays do not fit the run: {message}; was it written by another config?")  # noqa: E731
    return tree_lib.from_named_arrays(arrays, template, prefix, error=error)


def _restore_by_index(template, arrays, prefix: str, path: Path):
    """A checkpoint of the first format: leaves stored in flatten order as ``<prefix>_00000``, ..."""
    leaves, treedef = jax.tree.flatten(template)
    stored = sorted(k for k in arrays if k.startswith(prefix + "_"))
    if len(stored) != len(leaves):
        raise CheckpointError(f"{path}: checkpoint has {len(stored)} {prefix} arrays, the run expects {len(leaves)}; was it written by another config?")
    out = []
    for k, leaf in zip(stored, leaves):
        a = arrays[k]
        if tree_lib.is_prng_key(leaf):
            want = jax.random.key_data(leaf)
            if a.shape != want.shape or a.dtype != want.dtype:
                raise CheckpointError(f"{path}: {prefix} key {k} has shape {a.shape} {a.dtype}, the run expects {want.shape} {want.dtype}")
            out.append(jax.random.wrap_key_data(a, impl=jax.random.key_impl(leaf)))
            continue
        if a.shape != np.shape(leaf):
            raise CheckpointError(f"{path}: {prefix} array {k} has shape {a.shape}, the run expects {np.shape(leaf)}")
        if a.dtype != np.asarray(leaf).dtype:
            raise CheckpointError(f"{path}: {prefix} array {k} has dtype {a.dtype}, the run expects {np.asarray(leaf).dtype}")
        out.append(a)
    return jax.tree.unflatten(treedef, out)


def load_checkpoint(path: str | Path, template: SimState) -> tuple[SimState, dict[str, Any]]:
    """Restores a :class:`SimState` shaped like ``template``; returns it and the stored metadata,
    with the checkpoint's extra arrays by name under ``meta["extra"]``.

    When ``template`` holds a :class:`~fedbayes.sim.store.DiskStore`, it must be the store the
    checkpoint recorded (same id); it is rolled back to the checkpoint's round and returned.
    """
    path = Path(path)
    arrays, meta = read_checkpoint(path)
    server = _restore(template.server_state, arrays, "server", path)
    store, recorded = template.client_states, meta.get("client_store")
    if isinstance(store, DiskStore):
        if recorded is None:
            raise CheckpointError(f"{path}: checkpoint holds the client states in memory, the run expects a disk client store")
        if recorded["uuid"] != store.uuid:
            raise CheckpointError(f"{path}: checkpoint belongs to the client store {recorded['path']} (id {recorded['uuid']}), not to {store.path}")
        store.rollback(int(meta["round"]))
        clients = store
    else:
        if recorded is not None:
            raise CheckpointError(f"{path}: checkpoint refers to a disk client store at {recorded['path']}, the run keeps client states in memory")
        clients = _restore(template.client_states, arrays, "client", path)
        clients = jax.tree.map(np.array, clients)  # host copies
    meta["extra"] = extra_arrays(arrays)
    return SimState(round=int(meta["round"]), server_state=server, client_states=clients), meta


def extra_arrays(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The extra arrays of a checkpoint's entries (:func:`read_checkpoint`), by name."""
    return {k[len(EXTRA) :]: v for k, v in arrays.items() if k.startswith(EXTRA)}
