"""Atomic checkpoints of a simulation: server state, client store and run metadata in one ``.npz``.

A checkpoint is written to a temporary name, flushed to disk and renamed into place, so a run
killed at any moment leaves either the previous complete checkpoint or the new one, never a torn
file (docs/design.md, "State that persists"). Leaves are stored in the pytree's flatten order and
restored into a template of the same structure, which is checked leaf by leaf.

A :class:`~fedbayes.store.DiskStore` is not copied into the checkpoint: the checkpoint records
which store (path, id) and its round; the store's undo logs from before that round are then
dropped, and loading rolls the store back to that round (``fedbayes.store``).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fedbayes.simulate import SimState
from fedbayes.store import DiskStore

_NAME = re.compile(r"^round_(\d{6,})\.npz$")


def checkpoint_path(directory: str | Path, round_idx: int) -> Path:
    return Path(directory) / f"round_{round_idx:06d}.npz"


def save_checkpoint(directory: str | Path, state: SimState, meta: dict[str, Any], keep: int = 2) -> Path:
    """Atomically writes ``state`` (after ``state.round`` rounds) and ``meta``; keeps the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.ndarray] = {}
    store = state.client_states if isinstance(state.client_states, DiskStore) else None
    if store is not None:
        if store.round != state.round:
            raise ValueError(f"save_checkpoint: the client store is at round {store.round}, the state at round {state.round}")
        meta = {**meta, "client_store": store.describe()}
    for prefix, t in (("server", state.server_state), ("client", () if store is not None else state.client_states)):
        for i, leaf in enumerate(jax.tree.leaves(t)):
            if _is_key(leaf):  # typed PRNG keys are stored as their raw key data
                leaf = jax.random.key_data(leaf)
            arrays[f"{prefix}_{i:05d}"] = np.asarray(leaf)
    arrays["meta"] = np.frombuffer(json.dumps({**meta, "round": state.round}).encode(), dtype=np.uint8)
    final = checkpoint_path(directory, state.round)
    tmp = final.with_name(final.name + ".tmp")
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    if store is not None:
        store.checkpointed(state.round)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


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


def _is_key(leaf) -> bool:
    return isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def _restore(template, arrays, prefix: str, path: Path):
    leaves, treedef = jax.tree.flatten(template)
    stored = sorted(k for k in arrays.files if k.startswith(prefix + "_"))
    if len(stored) != len(leaves):
        raise ValueError(f"{path}: checkpoint has {len(stored)} {prefix} arrays, the run expects {len(leaves)}; was it written by another config?")
    out = []
    for k, leaf in zip(stored, leaves):
        a = arrays[k]
        if _is_key(leaf):
            want = jax.random.key_data(leaf)
            if a.shape != want.shape or a.dtype != want.dtype:
                raise ValueError(f"{path}: {prefix} key {k} has shape {a.shape} {a.dtype}, the run expects {want.shape} {want.dtype}")
            out.append(jax.random.wrap_key_data(a, impl=jax.random.key_impl(leaf)))
            continue
        if a.shape != np.shape(leaf):
            raise ValueError(f"{path}: {prefix} array {k} has shape {a.shape}, the run expects {np.shape(leaf)}")
        if a.dtype != np.asarray(leaf).dtype:
            raise ValueError(f"{path}: {prefix} array {k} has dtype {a.dtype}, the run expects {np.asarray(leaf).dtype}")
        out.append(a)
    return jax.tree.unflatten(treedef, out)


def load_checkpoint(path: str | Path, template: SimState) -> tuple[SimState, dict[str, Any]]:
    """Restores a :class:`SimState` shaped like ``template``; returns it and the stored metadata.

    When ``template`` holds a :class:`~fedbayes.store.DiskStore`, it must be the store the
    checkpoint recorded (same id); it is rolled back to the checkpoint's round and returned.
    """
    path = Path(path)
    with np.load(path) as arrays:
        meta = json.loads(arrays["meta"].tobytes().decode())
        server = _restore(template.server_state, arrays, "server", path)
        store, recorded = template.client_states, meta.get("client_store")
        if isinstance(store, DiskStore):
            if recorded is None:
                raise ValueError(f"{path}: checkpoint holds the client states in memory, the run expects a disk client store")
            if recorded["uuid"] != store.uuid:
                raise ValueError(f"{path}: checkpoint belongs to the client store {recorded['path']} (id {recorded['uuid']}), not to {store.path}")
            store.rollback(int(meta["round"]))
            clients = store
        else:
            if recorded is not None:
                raise ValueError(f"{path}: checkpoint refers to a disk client store at {recorded['path']}, the run keeps client states in memory")
            clients = _restore(template.client_states, arrays, "client", path)
            clients = jax.tree.map(np.array, clients)  # host copies
    return SimState(round=int(meta["round"]), server_state=server, client_states=clients), meta
