"""The client side of a deployment: one client's round on its node, and its state on disk.

A SuperNode holds one client (its ``partition-id``). For a train message the node rebuilds the
run's algorithm from the config it carries (:func:`fedbayes.runs.build.build_experiment`, so
the method, its hyperparameters and the data partition are the simulator's), takes its own
partition, and calls ``algorithm.client_update`` with the simulator's key and shuffles for
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
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import protocol
from fedbayes.data.batches import ClientData, layout_orders

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


def prepare_data(exp, state_dirs: dict[int, str | Path]) -> None:
    """Writes each client's examples (``{client: its node's state folder}``) from a built
    experiment: what a node does on its first message, done once by a launcher that already has
    the data (``fedbayes deploy``)."""
    d, fed = exp.dataset, exp.federation
    meta = json.dumps({"num_classes": d.num_classes, "feature_shape": list(d.feature_shape), "task": d.task})
    for client, state_dir in state_dirs.items():
        idx = fed.client_indices[client]
        path = data_path(exp.config, client, state_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=np.asarray(fed.x[idx]), y=np.asarray(fed.y[idx]), sizes=np.asarray(fed.sizes), meta=np.array(meta))
        os.replace(tmp, path)


def node_setup(config, client: int, state_dir: str | Path, store_dir: str | Path | None = None):
    """``(algorithm, params, x, y)`` of client ``client`` on its node.

    The client's examples (its partition, as the simulator draws it) and the data's shape are
    cached in ``state_dir/data/<key>/client_<id>.npz`` the first time (loading and partitioning
    the dataset); later messages build the algorithm from the cache alone
    (:func:`fedbayes.runs.build.build_algorithm_and_aggregator`), which spares each message's fresh
    ClientApp process the dataset's loaders.
    """
    from fedbayes.algorithms.base import FederationInfo
    from fedbayes.runs.build import DataSpec, build_algorithm_and_aggregator, build_experiment, build_model
    from fedbayes.runs.resume import config_hash

    memo = (config_hash(config), client, str(state_dir))
    if memo in _SETUPS:  # a process that handles several messages (tests) builds once
        return _SETUPS[memo]
    path = data_path(config, client, state_dir)
    if not path.is_file():
        prepare_data(build_experiment(config, store_dir=Path(state_dir) / "unused_store"), {client: state_dir})
    with np.load(path) as z:
        x, y, sizes = z["x"], z["y"], z["sizes"]
        meta = json.loads(str(z["meta"]))
    spec = DataSpec(meta["num_classes"], tuple(meta["feature_shape"]), x.dtype, meta["task"])
    model = build_model(config, spec)
    algorithm, _ = build_algorithm_and_aggregator(config, FederationInfo.from_sizes(sizes), spec, model)
    _SETUPS[memo] = (algorithm, model.params, x, y)
    return _SETUPS[memo]


_SETUPS: dict = {}
_UPDATES: dict = {}


def client_update(algorithm, seed: int, round_idx: int, client: int, message, client_state, x, y):
    """Client ``client``'s update in round ``round_idx`` on its own examples ``x, y`` (in the
    order of its partition), with the simulator's key and epoch shuffles."""
    n = len(y)
    order, offsets, _ = layout_orders(seed, round_idx, [client], [np.arange(n)], algorithm.local_epochs, algorithm.local_batch_size)
    data = ClientData(jnp.asarray(x), jnp.asarray(y), jnp.asarray(order), jnp.int32(offsets[0]), jnp.int32(n))
    key = protocol.client_key(seed, round_idx, client)
    if id(algorithm) not in _UPDATES:  # algorithms are kept alive by _SETUPS, so ids are not reused
        _UPDATES[id(algorithm)] = jax.jit(algorithm.client_update)
    return _UPDATES[id(algorithm)](key, message, client_state, data)
