"""The Flower ``ClientApp`` and ``ServerApp`` of fedbayes (``fedbayes.flower.apps:clientapp``,
``fedbayes.flower.apps:serverapp``).

ClientApp (on every SuperNode; ``--node-config "partition-id=i num-partitions=K
state-dir=DIR"``): a ``query`` message answers the node's partition; a ``train`` message runs
the client's update (:mod:`fedbayes.flower.node`) and replies with the message and its info
(packed together as ``reply``: inline in the ``meta`` config record when small,
:func:`fedbayes.flower.codec.put`) and the example count and times (``meta``).

ServerApp (run config, see :data:`RUN_CONFIG`): ``config`` (the run's TOML file, on the
SuperLink's machine), ``out`` (the run folder), ``resume``, and the failure settings of
:class:`fedbayes.flower.rounds.Settings`. It runs :func:`fedbayes.runs.loop.run_experiment`
with :class:`~fedbayes.flower.rounds.FlowerRounds` in place of the simulator, and writes
``flower_status.json`` in the run folder: ``{"ok": true}`` or the error's one line and exit code.
"""

from __future__ import annotations

import functools
import json
import os
import time
import tomllib
from pathlib import Path

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

STATUS_FILE = "flower_status.json"
SERVER_LOG = "flower_server.log"
TIMES_FILE = "flower_times.jsonl"  # per round: where its time went (fedbayes.flower.rounds.round_times)

# The ServerApp's run config: key -> default (the app's pyproject.toml [tool.flwr.app.config]).
RUN_CONFIG = {
    "config": "",
    "out": "",
    "resume": False,
    "min-nodes": 0,
    "node-timeout": 120.0,
    "reply-timeout": 120.0,
    "on-missing": "skip",
    "poll-interval": 0.05,
}

clientapp = ClientApp()
serverapp = ServerApp()


def _node_partition(node_config) -> tuple[int, int]:
    try:
        return int(node_config["partition-id"]), int(node_config["num-partitions"])
    except (KeyError, ValueError, TypeError):
        raise ValueError("this SuperNode needs --node-config 'partition-id=<i> num-partitions=<K>'") from None


@clientapp.query()
def query(msg: Message, context: Context) -> Message:
    part, total = _node_partition(context.node_config)
    return Message(RecordDict({"partition": ConfigRecord({"partition-id": part, "num-partitions": total})}), reply_to=msg)


def _compilation_cache(state_dir: Path) -> None:
    """The node's XLA cache when its environment does not set one (``fedbayes deploy`` and the
    warm executor set ``JAX_COMPILATION_CACHE_DIR`` before any import: JAX takes the setting at
    a process's first compile, so one set here only works if nothing compiled before)."""
    import jax

    jax.config.update("jax_compilation_cache_dir", str(state_dir / "jax_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


@functools.lru_cache(maxsize=8)
def _config(text: str, source: str):
    """The validated run config of a message's TOML as this node accepts it
    (:func:`fedbayes.flower.nodedata.accept_run_config`, before validation imports anything;
    parsed once per text and node source in a warm process)."""
    from fedbayes.config.schema import ConfigError, validate
    from fedbayes.flower.nodedata import accept_run_config

    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config error: the run's config is not TOML ({exc})") from None
    return validate(accept_run_config(raw, json.loads(source)))


def train_reply(content: RecordDict, node_config, state: RecordDict, sent_at: float | None = None) -> RecordDict:
    """The reply content to a train message (no Flower process needed: tests call it).
    ``sent_at``: the message's creation time (Unix seconds), for the times in the reply's meta."""
    start, wall = time.perf_counter(), time.time()
    import jax

    from fedbayes.flower.codec import decode, encode, packed, put, take, to_arrays
    from fedbayes.flower.node import StateFolder, client_update, node_setup
    from fedbayes.flower.nodedata import node_source

    part, _ = _node_partition(node_config)
    meta = content.config_records["fedbayes"]
    r, client, base, run_key = int(meta["round"]), int(meta["client"]), int(meta["base"]), str(meta["run"])
    if client != part:
        raise ValueError(f"this node holds partition {part}; the message is for client {client}")
    state_dir = Path(str(node_config.get("state-dir") or Path.home() / ".fedbayes" / "flower"))
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _compilation_cache(state_dir)
    source = node_source(node_config)
    config = _config(str(meta["config"]), json.dumps(source, sort_keys=True))
    spec = json.loads(str(meta["spec"]))
    setup = node_setup(config, client, state_dir, spec, source)
    broadcast = decode(take(content, "broadcast", "fedbayes"), setup.broadcast)
    template = setup.algorithm.client_init(setup.params)
    stateful = bool(jax.tree.leaves(template))
    folder = StateFolder(state_dir, run_key, client)
    record_key = lambda rnd: f"fedbayes:{run_key}:{client}:{rnd}"  # noqa: E731
    cstate = template
    if stateful and base >= 0:
        held = state.array_records.get(record_key(base)) if record_key(base) in state else None
        arrays = held if held is not None else folder.load(base)
        if arrays is None:
            raise RuntimeError(f"client {client}: no state of round {base} in the node's memory or in {folder.dir}; the node lost its state")
        cstate = decode(arrays, template)
    update_start = time.perf_counter()
    message, new_state, info = jax.block_until_ready(client_update(setup, config.seed, r, client, broadcast, cstate))
    update = time.perf_counter() - update_start
    if stateful:
        folder.save(r, to_arrays(new_state), base)
        for k in [k for k in state if k.startswith(f"fedbayes:{run_key}:{client}:") and k not in (record_key(base), record_key(r))]:
            del state[k]
        state[record_key(r)] = encode(new_state)
    times = {"update": update, "handler": time.perf_counter() - start, "handler-end": time.time()}
    if sent_at is not None:
        times["to-node"] = wall - sent_at
    reply_meta = {"num_examples": int(len(setup.y)), "pid": os.getpid(), **{f"seconds-{k}": float(v) for k, v in times.items()}}
    # message and info packed together, inline in the meta record where small (codec.put): Flower
    # sends every object as one HTTP request on each of the reply's three hops
    reply = RecordDict({"meta": ConfigRecord(reply_meta)})
    put(reply, "reply", packed(to_arrays({"message": message, "info": info})), "meta")
    return reply


@clientapp.train()
def train(msg: Message, context: Context) -> Message:
    return Message(train_reply(msg.content, context.node_config, context.state, msg.metadata.created_at), reply_to=msg)


def _settings(rc):
    from fedbayes.flower.rounds import Settings

    return Settings(
        min_nodes=int(rc.get("min-nodes", 0)),
        node_timeout=float(rc.get("node-timeout", 120.0)),
        reply_timeout=float(rc.get("reply-timeout", 120.0)),
        on_missing=str(rc.get("on-missing", "skip")),
        poll_interval=float(rc.get("poll-interval", 0.05)),
    )


def run_server(grid, run_config) -> dict:
    """Runs (or resumes) the configured experiment over ``grid``; returns its summary."""
    from fedbayes.config.schema import load_config
    from fedbayes.flower.internals import shorten_server_pulls
    from fedbayes.flower.rounds import FlowerRounds, GridTransport
    from fedbayes.runs.loop import run_experiment

    settings = _settings(run_config)
    config = load_config(str(run_config["config"]))
    shorten_server_pulls()  # the replies' objects: a short retry instead of Flower's 1 s (internals.short_object_pulls)
    transport = GridTransport(grid, settings.poll_interval)
    times = Path(str(run_config["out"])) / TIMES_FILE
    return run_experiment(
        config,
        str(run_config["out"]),
        resume=bool(run_config.get("resume", False)),
        overwrite=True,
        rounds=lambda exp: FlowerRounds(exp, transport, settings, times_file=times),
    )


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    import logging

    from fedbayes.errors import exit_code_for, one_line

    out = Path(str(context.run_config.get("out") or "."))
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / SERVER_LOG)  # what the rounds saw: nodes, rejections, missing replies
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flower_log = logging.getLogger("fedbayes.flower")
    flower_log.addHandler(handler)
    flower_log.setLevel(logging.INFO)
    status = out / STATUS_FILE
    status.unlink(missing_ok=True)
    try:
        run_server(grid, context.run_config)
    except BaseException as exc:
        status.write_text(json.dumps({"ok": False, "error": one_line(exc), "exit_code": exit_code_for(exc), "type": type(exc).__name__}) + "\n")
        raise
    status.write_text(json.dumps({"ok": True}) + "\n")


__all__ = ["ArrayRecord", "RUN_CONFIG", "STATUS_FILE", "clientapp", "main", "run_server", "serverapp", "train_reply"]
