"""The server side of a deployment: rounds over Flower nodes, as the simulator runs them.

:class:`FlowerRounds` is a :class:`fedbayes.protocol.Runner`, as the simulator is, inside
:func:`fedbayes.runs.loop.run_experiment` (``init``, ``place``, ``run_round``,
``server_params``), so a deployed run writes the same run folder as ``fedbayes run``
(metrics.jsonl, clients.jsonl, checkpoints, resume, model.npz, summary.json). One round:

1. the cohort of :func:`fedbayes.protocol.sample_cohort` (the simulator's);
2. one train message per cohort client, to the node holding its partition: the encoded
   broadcast (inline in the message's config record when small, :func:`broadcast_payload`), the round, the client id, the config (TOML text), the data's spec
   (:func:`data_spec`, JSON) and ``base``, the last round
   whose reply from this client the server accepted (the node continues from its state after
   that round; -1: ``client_init``);
3. replies are collected until all arrive or ``reply_timeout`` seconds pass (a node that
   restarts during the round is found again and sent the message anew); each reply is decoded
   against the expected message (:mod:`fedbayes.flower.codec`): a malformed one, or a node's
   error (a ClientApp exception), is *rejected* and logged with the client and node id;
4. :func:`fedbayes.protocol.server_step` with the aggregator of
   :func:`fedbayes.runs.build.make_server_aggregator` and the simulator's server key: messages
   failing ``message_ok`` (NaN, a non-positive precision) are rejected there; rejected and
   missing clients get weight zero; :func:`fedbayes.protocol.finish_round` ends the round as the
   simulator does (a round in which no reply is accepted leaves the server state as it was).

Missing replies are counted (``dropped`` in metrics.jsonl and clients.jsonl);
``on_missing = "fail"`` stops the run instead. Rejected replies are counted as in the simulator
(``rejected``); ``server.fail_fast`` stops the run on the first.

The per-client bookkeeping the server needs to resume (each client's ``base``) is the
``client_states`` of the :class:`~fedbayes.protocol.SimState`, so the checkpoint holds it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, RecordDict

from fedbayes import protocol, tree
from fedbayes.config.schema import ConfigError, to_toml
from fedbayes.errors import BadInputError, FedbayesError
from fedbayes.flower.codec import INLINE_BYTES, MalformedMessage, decode, pack, packed, put, take, to_arrays
from fedbayes.flower.fastnode import Rhythm
from fedbayes.protocol import RoundInfo, SimState
from fedbayes.sim.simulator import client_data_template

log = logging.getLogger("fedbayes.flower")

ON_MISSING = ("skip", "fail")
DISCOVER_EVERY = 2.0  # seconds between looks for new (restarted) nodes during a round


class FederationError(FedbayesError):
    """The federation cannot run the round: too few nodes, a missing reply under
    ``on_missing = "fail"``, a node holding a partition the run does not have (exit code 3)."""

    exit_code = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """How a deployed round treats time and failures (the Flower app's run config)."""

    min_nodes: int = 0  # nodes (distinct partitions) to wait for before the first round; 0: all clients
    node_timeout: float = 120.0  # seconds to wait for them, then fail
    reply_timeout: float = 120.0  # seconds a round waits for its replies
    on_missing: str = "skip"  # skip: aggregate the replies that came; fail: stop the run
    poll_interval: float = 0.05  # seconds between pulls

    def __post_init__(self):
        if self.on_missing not in ON_MISSING:
            raise BadInputError(f"flower: on-missing must be one of {', '.join(ON_MISSING)}; got {self.on_missing!r}")
        for name in ("node_timeout", "reply_timeout", "poll_interval"):
            if not getattr(self, name) > 0:
                raise BadInputError(f"flower: {name.replace('_', '-')} must be > 0 seconds; got {getattr(self, name)}")
        if self.min_nodes < 0:
            raise BadInputError(f"flower: min-nodes must be >= 0; got {self.min_nodes}")


class Reply(NamedTuple):
    """What came back for one client: the node's id and its content, or the node's error, and
    when the server had it (Unix seconds)."""

    node_id: int
    content: RecordDict | None
    error: str | None = None
    received_at: float | None = None


# A transport: (round, {client: content factory}, timeout) -> {client: Reply}; plus wait_for_nodes.
Transport = Any


def run_key(config) -> str:
    """The name of a run's client states on the nodes: the config without the keys a resume may
    change without touching client states (``rounds``, ``eval_every``, ``checkpoint_every``)."""
    import hashlib
    import json

    raw = {k: v for k, v in config.model_dump(mode="json").items() if k not in ("rounds", "eval_every", "checkpoint_every")}
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def data_spec(exp) -> dict:
    """What a node's examples must fit (:func:`fedbayes.flower.nodedata.check_examples`) and what
    it builds the run's algorithm from: the data's shapes, classes, task and dtypes, and every
    client's example count (the algorithm's ``FederationInfo``)."""
    d, fed = exp.dataset, exp.federation
    if exp.config.data.on_demand:
        raise ConfigError("config error: data.on_demand: a Flower deployment hands each node its users' examples from memory; unset it (simulation only)")
    return {
        "num_classes": int(d.num_classes),
        "feature_shape": [int(n) for n in d.feature_shape],
        "task": str(d.task),
        "x_dtype": np.dtype(fed.x.dtype).name,
        "y_dtype": np.dtype(fed.y.dtype).name,
        "sizes": [int(n) for n in fed.sizes],
    }


def sent_config(config) -> str:
    """The config text a train message carries: the run's, without its paths (``data.data_dir``,
    ``data.path``, ``data.test_path``, ``store_dir``: where the server's own copies are; a node's
    data is the node's business, and a node refuses a message that names a path,
    :func:`fedbayes.flower.nodedata.accept_run_config`)."""
    data = config.data.model_copy(update={"data_dir": None, "path": None, "test_path": None})
    return to_toml(config.model_copy(update={"data": data, "store_dir": None}))


def round_times(round_idx: int, seconds: float, replies: dict[int, Reply]) -> dict:
    """Where a deployed round's time went, from the nodes' reports: per reply, the node's update
    (``update``), its whole handler (``handler``: decode, state, update, encode), the message's
    way to the node's handler (``to_node``: the server's push, the SuperLink, the SuperNode's
    polls, the executor's poll and pull) and the reply's way back (``from_node``); medians and
    maxima over the round's replies. ``to_node`` and ``from_node`` compare the server's clock with
    the node's: across machines they include the clocks' offset."""
    cols: dict[str, list[float]] = {"update": [], "handler": [], "to_node": [], "from_node": []}
    for reply in replies.values():
        meta = reply.content.config_records.get("meta") if reply.content is not None else None
        if meta is None or "seconds-update" not in meta:
            continue
        cols["update"].append(float(meta["seconds-update"]))
        cols["handler"].append(float(meta["seconds-handler"]))
        if "seconds-to-node" in meta:
            cols["to_node"].append(float(meta["seconds-to-node"]))
        if reply.received_at is not None:
            cols["from_node"].append(reply.received_at - float(meta["seconds-handler-end"]))
    out: dict[str, Any] = {"round": round_idx, "seconds": seconds, "replies": len(cols["update"])}
    for k, v in cols.items():
        if v:
            out[f"{k}_median"], out[f"{k}_max"] = float(np.median(v)), float(np.max(v))
    return out


INLINE_ROUND_BYTES = 64 * 1024 * 1024  # at most this much inline broadcast per round (all copies)


def broadcast_payload(data: bytes, copies: int) -> bytes | ArrayRecord:
    """How a round's broadcast travels: inline in every train message (``data``: one object a hop
    instead of three) while each copy is at most :data:`~fedbayes.flower.codec.INLINE_BYTES` and
    all ``copies`` together at most :data:`INLINE_ROUND_BYTES` (the SuperLink holds each message
    until its node pulls it); otherwise as one packed record that every message shares, which
    Flower stores and pushes once."""
    if len(data) <= INLINE_BYTES and len(data) * copies <= INLINE_ROUND_BYTES:
        return data
    return pack(data)


def check_deployable(config) -> None:
    """Rejects settings that only the simulator has, naming the field."""
    s = config.server
    if s.dropout > 0:
        raise BadInputError("config error: server.dropout: simulated client failures are simulator-only; a deployment has real ones (set 0)")
    if s.deadline is not None:
        raise BadInputError("config error: server.deadline: simulated stragglers are simulator-only; a deployment uses the reply time-out")
    if config.attack.fraction > 0 and config.attack.kind != "label_flip":
        raise BadInputError(
            "config error: attack.kind: message attacks are simulator-only (the simulator rewrites messages); use label_flip or attack.fraction = 0"
        )


class FlowerRounds:
    """Runs rounds of ``exp``'s algorithm over a transport: a :class:`~fedbayes.protocol.Runner`."""

    counts_dropped = True  # missing replies are counted as `dropped`

    def __init__(self, exp, transport: Transport, settings: Settings = Settings(), times_file: str | Path | None = None):
        check_deployable(exp.config)
        self.exp = exp
        self.config = exp.config
        self.algorithm, self.aggregator = exp.algorithm, exp.aggregator  # no Simulator: the server holds no data
        self.transport = transport
        self.settings = settings
        self.seed = exp.config.seed
        self.num_clients = exp.federation.num_clients
        self.config_text = sent_config(exp.config)
        # JSON in the message's one config record: a record of its own is one more object per hop
        self.spec = json.dumps(data_spec(exp), sort_keys=True)
        self.times_file = None if times_file is None else Path(times_file)  # one line per round: round_times
        self.run_key = run_key(exp.config)
        fed = exp.federation
        alg = self.algorithm
        data = client_data_template(
            fed.x.shape[1:], fed.x.dtype, fed.y.dtype, epochs=alg.local_epochs, batch_size=alg.local_batch_size, y_shape=fed.y.shape[1:]
        )
        templates = protocol.message_templates(alg, exp.params, data)  # what the replies are decoded against
        self.message_spec, self.info_spec = templates.message, templates.info
        self._step = jax.jit(lambda s, m, w, k: protocol.server_step(k, self.algorithm, s, m, w, self.aggregator))
        self._waited = False

    # ----- the simulator's interface ----------------------------------------------------------
    def init(self, params, *, resume: bool = False) -> SimState:
        server_state = self.place(self.algorithm.server_init(protocol.server_init_key(self.seed), params))
        return SimState(0, server_state, {"base": np.full(self.num_clients, -1, np.int64)})

    def place(self, server_state):
        return jax.tree.map(jnp.asarray, server_state)

    def server_params(self, state: SimState):
        return self.algorithm.server_params(state.server_state)

    def message_bytes(self, state: SimState) -> tuple[int, int]:
        """``(down, up)`` bytes of one broadcast and of one reply's message (what a round counts)."""
        return tree.tree_bytes(jax.eval_shape(self.algorithm.broadcast, state.server_state)), tree.tree_bytes(self.message_spec)

    # ----- one round --------------------------------------------------------------------------
    def request(self, round_idx: int, client: int, base: int, broadcast: bytes | ArrayRecord) -> Callable[[], RecordDict]:
        """The train message's content: the broadcast inline in its config record when ``broadcast``
        is bytes (one object a hop), else the round's one shared record (:func:`broadcast_payload`)."""
        meta = {"round": round_idx, "client": client, "base": base, "run": self.run_key, "config": self.config_text, "seed": self.seed, "spec": self.spec}

        def content() -> RecordDict:
            out = RecordDict({"fedbayes": ConfigRecord(dict(meta))})
            if isinstance(broadcast, bytes):
                put(out, "broadcast", broadcast, "fedbayes", inline=True)
            else:
                out.array_records["broadcast"] = broadcast
            return out

        return content

    def _decode(self, reply: Reply):
        """``(message, info, num_examples)`` of a reply, or raises MalformedMessage."""
        if reply.error is not None:
            raise MalformedMessage(f"the node reported an error: {reply.error}")
        content = reply.content
        if "meta" not in content.config_records:
            raise MalformedMessage("the reply has no 'meta' record")
        both = decode(take(content, "reply", "meta"), {"message": self.message_spec, "info": self.info_spec})
        message, info = both["message"], both["info"]
        meta = content.config_records["meta"]
        n = meta.get("num_examples")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise MalformedMessage(f"num_examples must be a positive integer; got {n!r}")
        return message, info, n

    def run_round(self, state: SimState, *, donate: bool = False) -> tuple[SimState, RoundInfo]:
        s = self.settings
        if not self._waited:
            self.transport.wait_for_nodes(s.min_nodes or self.num_clients, s.node_timeout, self.num_clients)
            self._waited = True
        r = state.round
        cohort = protocol.sample_cohort(self.seed, r, self.num_clients, self.config.server.clients_per_round)
        broadcast_tree = self.algorithm.broadcast(state.server_state)
        broadcast = broadcast_payload(packed(to_arrays(broadcast_tree)), len(cohort))
        base = np.asarray(state.client_states["base"])
        requests = {int(c): self.request(r, int(c), int(base[c]), broadcast) for c in cohort}
        started = time.monotonic()
        replies = self.transport.exchange(r, requests, s.reply_timeout)
        if self.times_file is not None:
            with open(self.times_file, "a") as f:
                f.write(json.dumps(round_times(r + 1, time.monotonic() - started, replies)) + "\n")  # numbered as metrics.jsonl: 1 is the first

        m = len(cohort)
        zero_message = jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), self.message_spec)
        messages, infos = [], []
        num_examples = np.zeros(m, np.int32)
        received = np.zeros(m, np.bool_)
        bad = np.zeros(m, np.bool_)
        bytes_up = 0
        for i, c in enumerate(cohort):
            reply = replies.get(int(c))
            message, info = zero_message, None
            if reply is not None:
                received[i] = True
                try:
                    message, info, num_examples[i] = self._decode(reply)
                    bytes_up += tree.tree_bytes(message)
                except MalformedMessage as exc:
                    bad[i] = True
                    message, info = zero_message, None
                    log.warning("round %d: client %d (node %d): reply rejected: %s", r, c, reply.node_id, exc)
            messages.append(message)
            infos.append(info)
        missing = cohort[~received]
        if len(missing):
            log.warning("round %d: no reply from clients %s within %.0f s", r, missing.tolist(), s.reply_timeout)
            if s.on_missing == "fail":
                raise FederationError(f"round {r}: no reply from clients {missing.tolist()} within {s.reply_timeout:g} s (on-missing = fail)")
        weights = protocol.client_weights(num_examples, self.config.server.weighting)
        weights = np.where(received & ~bad, weights, 0.0).astype(np.float32)
        stacked = tree.stack([jax.tree.map(jnp.asarray, x) for x in messages])
        new_server, ok, server_info = self._step(state.server_state, stacked, jnp.asarray(weights), protocol.server_key(self.seed, r))
        ok = np.asarray(ok)
        rejected_mask = received & ~ok
        rejected = cohort[rejected_mask]
        for c in cohort[received & ~bad & ~ok]:
            log.warning("round %d: client %d (node %d): reply rejected: message_ok failed (non-finite or invalid values)", r, c, replies[int(c)].node_id)
        new_base = base.copy()
        new_base[cohort[ok]] = r
        clients: dict[str, np.ndarray] = {"client": cohort, "num_examples": num_examples, "accepted": ok}
        for name, spec in jax.tree_util.tree_flatten_with_path(self.info_spec)[0]:
            key = "/".join(str(getattr(p, "key", p)) for p in name)
            fill = np.nan if np.issubdtype(spec.dtype, np.floating) else 0
            clients[key] = np.array([fill if info is None else np.asarray(_at(info, name)) for info in infos], dtype=spec.dtype)
        clients["dropped"] = ~received
        clients["late"] = np.zeros(m, np.bool_)
        server = {k: np.asarray(v).item() for k, v in server_info.items()}
        new_server, info = protocol.finish_round(
            state.server_state,
            new_server,
            ok,
            round_idx=r,
            cohort=cohort,
            rejected=rejected,
            fail_fast=self.config.server.fail_fast,
            bytes_up=bytes_up,
            bytes_down=tree.tree_bytes(broadcast_tree) * m,
            clients=clients,
            server=server,
            dropped=missing,
            late=missing[:0],
            algorithm=self.algorithm,
        )
        return SimState(r + 1, new_server, {"base": new_base}), info

    def rounds(self, state: SimState, stop: int, *, donate: bool = True, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[SimState, RoundInfo]]:
        """Runs rounds ``state.round .. stop - 1`` one at a time, yielding ``(state, info)`` after
        each (each round waits for its replies, so there is nothing to pipeline); ``keep`` is
        accepted for the :class:`~fedbayes.protocol.Runner` interface: no round consumes the state
        of the one before."""
        del keep
        while state.round < stop:
            state, info = self.run_round(state, donate=donate)
            jax.block_until_ready(state.server_state)
            yield state, info


def _at(tree_, path):
    for p in path:
        tree_ = tree_[getattr(p, "key", getattr(p, "idx", None))]
    return tree_


# ----- the Flower transport ---------------------------------------------------------------------
def _unavailable(reply) -> bool:
    """An error the SuperLink makes for a message whose node went away (not a ClientApp's)."""
    from fedbayes.flower.internals import unavailable_codes

    return int(reply.error.code) in unavailable_codes()


class GridTransport:
    """Sends a round's messages through a Flower ``Grid`` and pulls the replies.

    Nodes are found with ``grid.get_node_ids()`` and asked once for their ``partition-id`` (a
    query message); when two nodes claim a partition, the newest wins (a restarted SuperNode
    comes back with a new node id). Discovery runs on every poll, so a message to a node that
    went away is sent again to the node that took its place within the same round.
    """

    def __init__(self, grid, poll_interval: float = 0.2, clock=time.monotonic, sleep=time.sleep):
        self.grid = grid
        self.poll = poll_interval
        self.clock, self.sleep = clock, sleep
        # the first pull of a round's replies waits half the shortest of the last rounds' times
        # to the first reply (fastnode.Rhythm): polled every 50 ms, 5 pulls a heavy-MLP round
        self.rhythm = Rhythm(clock=clock)
        self.partition_of: dict[int, int] = {}  # node id -> partition
        self.node_of: dict[int, int] = {}  # partition -> node id
        self.queries: dict[str, int] = {}  # query message id -> node id
        self.gone: set[int] = set()  # nodes the SuperLink reported unavailable: never asked again
        self.num_partitions: int | None = None

    def message(self, content: RecordDict, node_id: int, kind: str, group: str):
        """The Flower ``Message`` of ``content`` to node ``node_id`` (``kind``: its message type)."""
        from flwr.app import Message

        return Message(content, dst_node_id=node_id, message_type=kind, group_id=group)

    def discover(self) -> None:
        nodes = [int(n) for n in self.grid.get_node_ids()]
        asked = set(self.queries.values()) | set(self.partition_of) | self.gone
        new = [n for n in nodes if n not in asked]
        if new:
            ids = self.grid.push_messages([self.message(RecordDict({"q": ConfigRecord({})}), n, "query", "discover") for n in new])
            self.queries.update({mid: n for mid, n in zip(ids, new) if mid})
        if not self.queries:
            return
        for reply in self.grid.pull_messages(list(self.queries)):
            node = self.queries.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.has_error():
                log.warning("node %d: query failed: %s", node, reply.error.reason)
                if _unavailable(reply):
                    self.gone.add(node)
                continue
            c = reply.content.config_records["partition"]
            part, total = int(c["partition-id"]), int(c["num-partitions"])
            if self.num_partitions is not None and not 0 <= part < self.num_partitions:
                raise FederationError(f"node {node} holds partition-id {part}; the run has clients 0..{self.num_partitions - 1} (node-config partition-id)")
            if self.num_partitions is not None and total != self.num_partitions:
                raise FederationError(
                    f"node {node} has num-partitions = {total}; the run has data.num_clients = {self.num_partitions} (node-config num-partitions)"
                )
            old = self.node_of.get(part)
            self.partition_of[node] = part
            self.node_of[part] = node
            if old is not None and old != node:
                log.warning("partition %d: node %d replaces node %d", part, node, old)
            else:
                log.info("node %d holds partition %d", node, part)

    def _lost(self, node: int) -> None:
        """Forgets a node the SuperLink reported unavailable (a replacement may join)."""
        self.gone.add(node)
        part = self.partition_of.pop(node, None)
        if part is not None and self.node_of.get(part) == node:
            del self.node_of[part]

    def wait_for_nodes(self, count: int, timeout: float, num_partitions: int) -> None:
        self.num_partitions = num_partitions
        end = self.clock() + timeout
        while True:
            self.discover()
            if len(self.node_of) >= count:
                return
            if self.clock() > end:
                raise FederationError(
                    f"{len(self.node_of)} of the {count} nodes needed (min-nodes) joined within {timeout:g} s (node-timeout); partitions seen: {sorted(self.node_of)}"
                )
            self.sleep(self.poll)

    def exchange(self, round_idx: int, requests: dict[int, Callable[[], RecordDict]], timeout: float) -> dict[int, Reply]:
        end = self.clock() + timeout
        sent: dict[int, int] = {}  # client -> node it was last sent to
        owner: dict[str, tuple[int, int]] = {}  # message id -> (client, node it went to)
        replies: dict[int, Reply] = {}
        next_discovery = self.clock()
        first_wait = self.rhythm.idle()  # no reply comes sooner than the nodes' updates: pull later
        while True:
            if self.clock() >= next_discovery:  # new nodes are rare: look every DISCOVER_EVERY s, pull every poll
                self.discover()
                next_discovery = self.clock() + DISCOVER_EVERY
            pending = [c for c in requests if c not in replies]
            push = [(c, self.node_of[c]) for c in pending if c in self.node_of and sent.get(c) != self.node_of[c]]
            if push:
                ids = self.grid.push_messages([self.message(requests[c](), n, "train", str(round_idx)) for c, n in push])
                for (c, n), mid in zip(push, ids):
                    if mid:
                        owner[mid], sent[c] = (c, n), n
            waiting = [mid for mid, (c, _) in owner.items() if c not in replies]
            if waiting and first_wait > 0:
                self.sleep(first_wait)
                first_wait = 0.0
            if waiting:
                for reply in self.grid.pull_messages(waiting):
                    self.rhythm.busy()
                    mid = reply.metadata.reply_to_message_id
                    c, node = owner.get(mid, (None, None))
                    if c is None or c in replies:
                        continue
                    if reply.has_error() and _unavailable(reply):
                        del owner[mid]  # asked once: the SuperLink answers this for as long as it is asked
                        # The node is gone (missed heartbeats): not the client's answer. Wait for a
                        # replacement holding its partition until the time-out; else it is missing.
                        log.warning("round %d: client %d: node %d is unavailable", round_idx, c, node)
                        self._lost(node)
                        continue
                    if self.node_of.get(c) not in (None, node):
                        continue  # a replaced node's late answer: the replacement's counts
                    if reply.has_error():
                        replies[c] = Reply(node, None, " ".join(str(reply.error.reason).split()), time.time())
                    else:
                        replies[c] = Reply(node, reply.content, None, time.time())
            if len(replies) == len(requests) or self.clock() > end:
                return replies
            self.sleep(self.poll)
