"""The client side of a deployment: one client's round on its node, and its state on disk.

A SuperNode holds one client (its ``partition-id``) and its own examples
(:mod:`fedbayes.flower.nodedata`). For a train message the node builds the run's algorithm from
the config and data spec it carries (so the method and its hyperparameters are the
simulator's), checks its examples against that spec, and calls ``algorithm.client_update``
with the simulator's key and shuffles for
(seed, round, client) (:mod:`fedbayes.protocol`, :func:`fedbayes.data.batches.layout_orders`):
the same update the simulator computes for that client.

Client state (FedEP sites, ADMM/FedDyn/FedLap duals) is the state after the last round whose
reply the server *accepted*; the server says which round that is in every message (``base``;
-1: the initial ``client_init``). The node keeps each new state under its round, in
``context.state`` (the SuperNode's memory) and in its state folder
(``--node-config state-dir=...``, one ``.npz`` per client and round, written atomically), so
a restarted SuperNode continues from the state it had; a state the server rejected or never
received is simply never used as a base.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import protocol
from fedbayes.data.batches import ClientData, layout_orders
from fedbayes.flower.nodedata import check_examples, read_file, refuse_server_path
from fedbayes.sim.compiled import release_if_crowded

KEEP_ROUNDS = 4  # state files kept per client besides the base (a resumed server may go back this far)


class StateFolder:
    """One client's states by round in ``root/<run>/client_<id>/round_<r>.npz``."""

    def __init__(self, root: str | Path, run_key: str, client: int):
        self.dir = Path(root) / run_key / f"client_{client}"

    def path(self, round_idx: int) -> Path:
        return self.dir / f"round_{round_idx:06d}.npz"

    def rounds(self) -> list[int]:
        if not self.dir.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := re.fullmatch(r"round_(\d+)\.npz", p.name)))

    def save(self, round_idx: int, arrays: dict[str, np.ndarray], base: int) -> None:
        """Writes the state after ``round_idx`` atomically (temporary file, fsync, rename) and
        prunes all but the newest :data:`KEEP_ROUNDS` rounds and ``base``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(round_idx))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        keep = set(self.rounds()[-KEEP_ROUNDS:]) | {base, round_idx}
        for r in self.rounds():
            if r not in keep:
                self.path(r).unlink(missing_ok=True)

    def load(self, round_idx: int) -> dict[str, np.ndarray] | None:
        path = self.path(round_idx)
        if not path.is_file():
            return None
        with np.load(path) as z:
            return {k: z[k] for k in z.files}


def data_key(config) -> str:
    """What a client's data depends on: the data section, the seed and the attack (label flips)."""
    raw = config.model_dump(mode="json")
    text = json.dumps({k: raw[k] for k in ("data", "seed", "attack")}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def data_path(config, client: int, state_dir: str | Path) -> Path:
    return Path(state_dir) / "data" / data_key(config) / f"client_{client}.npz"


def _save_npz(path: Path, **arrays) -> Path:
    """Writes ``arrays`` to ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return path


def prepare_data(exp, state_dirs: dict[int, str | Path]) -> None:
    """Writes each client's examples (``{client: its node's state folder}``) into the node's
    cache from a built experiment: what a node without a ``data-file`` does on its first
    message, done once by a launcher that already has the data."""
    fed = exp.federation
    for client, state_dir in state_dirs.items():
        idx = fed.client_indices[client]
        _save_npz(data_path(exp.config, client, state_dir), x=np.asarray(fed.x[idx]), y=np.asarray(fed.y[idx]))


def write_client_file(exp, client: int, path: str | Path) -> Path:
    """Client ``client``'s examples of a built experiment as a node's own ``data-file`` (``x``, ``y``)."""
    idx = exp.federation.client_indices[client]
    return _save_npz(Path(path), x=np.asarray(exp.federation.x[idx]), y=np.asarray(exp.federation.y[idx]))


class Setup(NamedTuple):
    """One run's client on its node, built once per process (see :func:`node_setup`)."""

    algorithm: Any
    params: Any
    x: np.ndarray
    y: np.ndarray
    update: Any  # jax.jit(algorithm.client_update)
    broadcast: Any  # the broadcast's template (what the server's message is decoded against)


MAX_SETUPS = 8  # runs (config, client, data) a long-lived process keeps built, least recently used dropped


def node_examples(config, client: int, state_dir: str | Path, source: dict[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """Client ``client``'s examples from the node's own source (:mod:`fedbayes.flower.nodedata`).

    A dataset (the node's ``dataset`` and ``data-dir``, or the run's dataset from fedbayes's
    default location) is loaded and partitioned once, as the simulator does, and the client's
    examples cached in ``state_dir/data/<key>/client_<id>.npz``: later messages and processes
    read the cache alone, which spares them the dataset's loaders."""
    from fedbayes.runs.build import build_experiment

    if "data-file" in source:
        return read_file(source["data-file"], source.get("label-column", "label"))
    if "data-dir" in source:
        config = config.model_copy(update={"data": config.data.model_copy(update={"data_dir": source["data-dir"]})})
    path = data_path(config, client, state_dir)
    if not path.is_file():
        prepare_data(build_experiment(config, store_dir=Path(state_dir) / "unused_store"), {client: state_dir})
    with np.load(path) as z:
        return z["x"], z["y"]


def node_setup(config, client: int, state_dir: str | Path, spec: dict, source: dict[str, str] | None = None) -> Setup:
    """Client ``client``'s :class:`Setup` on its node: its examples from the node's own
    ``source`` (:func:`node_examples`), checked against the run's data ``spec`` (the server's:
    feature shape, classes, task, dtypes, every client's size), and the run's algorithm built
    from ``config`` and ``spec`` (:func:`fedbayes.runs.build.build_algorithm_and_aggregator`), its
    client update jitted. A long-lived process (:mod:`fedbayes.flower.executor`) keeps the last
    :data:`MAX_SETUPS` built, keyed by the config's hash, the client and the data source.
    """
    from fedbayes.algorithms.base import FederationInfo
    from fedbayes.runs.build import DataSpec, build_algorithm_and_aggregator, build_model
    from fedbayes.runs.resume import config_hash

    source = source or {}
    refuse_server_path(config, source)
    memo = (config_hash(config), client, str(state_dir), json.dumps(source, sort_keys=True), json.dumps(spec, sort_keys=True))
    if memo in _SETUPS:
        _SETUPS.move_to_end(memo)
        return _SETUPS[memo]
    x, y = node_examples(config, client, state_dir, source)
    x, y = check_examples(x, y, spec, source.get("data-file", f"client {client}'s examples"))
    release_if_crowded()  # a warm node builds run after run: its compiled programs stay below the mapping cap
    dspec = DataSpec(int(spec["num_classes"]), tuple(spec["feature_shape"]), np.dtype(spec["x_dtype"]), str(spec["task"]))
    model = build_model(config, dspec)
    algorithm, _ = build_algorithm_and_aggregator(config, FederationInfo.from_sizes(spec["sizes"]), dspec, model)
    broadcast = protocol.message_templates(algorithm, model.params).broadcast
    _SETUPS[memo] = Setup(algorithm, model.params, x, y, jax.jit(algorithm.client_update), broadcast)
    while len(_SETUPS) > MAX_SETUPS:
        _SETUPS.popitem(last=False)
    return _SETUPS[memo]


_SETUPS: OrderedDict = OrderedDict()


def kept_setups() -> list[Setup]:
    """The :class:`Setup`\\ s this process keeps built (:func:`node_setup`), least recently used first."""
    return list(_SETUPS.values())


def clear_setups() -> None:
    """Forgets every kept :class:`Setup` (the next message of each run builds its own again)."""
    _SETUPS.clear()


def client_update(setup: Setup, seed: int, round_idx: int, client: int, message, client_state):
    """Client ``client``'s update in round ``round_idx`` on its own examples (in the order of its
    partition), with the simulator's key and epoch shuffles."""
    n = len(setup.y)
    alg = setup.algorithm
    order, offsets, _ = layout_orders(seed, round_idx, [client], [np.arange(n)], alg.local_epochs, alg.local_batch_size)
    data = ClientData(jnp.asarray(setup.x), jnp.asarray(setup.y), jnp.asarray(order), jnp.int32(offsets[0]), jnp.int32(n))
    return setup.update(protocol.client_key(seed, round_idx, client), message, client_state, data)
