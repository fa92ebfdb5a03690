"""The round simulator: sample a cohort, run its clients together in one ``jit``, update the server.

One round (docs/design.md, "One round, as data flows"):

1. **Sample** ``M`` clients uniformly without replacement from a generator seeded by
   (seed, round), in ``O(M)`` (Floyd's algorithm): round time does not grow with ``K``.
2. **Gather**: draw each client's epoch shuffles on the host and lay the cohort out in one flat
   order buffer of positions (:mod:`fedbayes.data.batches`: no per-client padding, the buffer's
   tail padded to a size class, under 20%); positions index the training set, which sits on every
   device once, or, for an on-demand federation (:class:`GeneratedFederation`), the cohort's
   freshly generated (or read, :mod:`fedbayes.data.ondemand`) data; the next round's cohort is
   then handed to the federation's ``prefetch``, to be read while this round trains. Gather the cohort's client states from the host store.
3. **Broadcast** the server message.
4. **Client update**, in one ``jit``, in one of two layouts behind one interface:

   * ``"sequential"`` (default on CPU): the cohort is split over the local devices with
     ``shard_map``; each device runs its clients one after another (``lax.map``), each client with
     its own trip count, so there is no padding waste. Clients are balanced over devices on the
     host each round, longest first.
   * ``"vmap"``: the cohort is split over the devices the same way, and each device runs its
     clients under ``jax.vmap``; each client's loop is masked past its own step count, so every
     client takes exactly its steps.

   Client ``k`` always uses the key :func:`fedbayes.protocol.client_key` and the shuffles of
   :func:`fedbayes.protocol.shuffle_rng`: results do not depend on the cohort, its order, padding,
   the layout or the device split.
5. **Server step** (:func:`fedbayes.protocol.server_step`, fused into the same program): validate
   each message (``algorithm.message_ok``; a rejected client gets weight zero and keeps its old
   state; the count is reported), aggregate (the algorithm's rule, or the ``aggregator`` given),
   update the server. An algorithm whose ``server_on_one_device`` is set validates in the
   round's program and aggregates and updates in a program of its own on the first device
   (:meth:`Simulator.server_program`).
6. **Scatter** new client states back to the store (:mod:`fedbayes.sim.store`: stacked host arrays,
   or a :class:`~fedbayes.sim.store.DiskStore` for federations whose states do not fit in memory),
   or, with ``store="device"``, keep the store in device memory (replicated on every device),
   gathered and scattered inside the round's program (:meth:`Simulator.device_store_program`):
   no per-round transfers, which is also the layout for a GPU.

A round is three steps (:meth:`Simulator.prepare_round` on the host, :meth:`Simulator.launch`,
:meth:`Simulator.complete`); :meth:`Simulator.run_round` runs them in turn and
:meth:`Simulator.rounds` pipelines them (round ``r + 1`` prepared and launched while round ``r``
runs), with bitwise the same results.

Set ``XLA_FLAGS=--xla_force_host_platform_device_count=<cores>`` before JAX starts to get one XLA
device per core (the CLI does this); with one device both layouts still work.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fedbayes import protocol, tree
from fedbayes.algorithms.base import Algorithm
from fedbayes.data.batches import ClientData, layout_orders, num_local_steps, size_class
from fedbayes.data.federation import AnyFederation, GeneratedFederation
from fedbayes.protocol import WEIGHTINGS, RoundInfo, SimState
from fedbayes.sim.scenario import Scenario
from fedbayes.sim.store import DeviceStore, DiskStore, MemoryStore, as_store

log = logging.getLogger(__name__)

# XLA:CPU (jax 0.10) hands dots and reductions to YNNPACK by default. Its reductions over a short
# axis (the mean over FedEP's SG-MCMC samples) are far slower than XLA's own loops, so the round
# keeps YNNPACK for dots only (docs/results/bench.md, "A slow XLA:CPU reduction, and the fix in
# the round").
_CPU_ROUND_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


@functools.cache
def round_compiler_options(platform: str) -> dict[str, str] | None:
    """XLA options of the compiled round on ``platform``: ``None`` (XLA's defaults) except on CPU,
    and also there when this XLA does not know the option (checked once by a tiny compile)."""
    if platform != "cpu":
        return None
    try:
        jax.jit(lambda: 0, compiler_options=_CPU_ROUND_OPTIONS).lower().compile()
    except Exception:  # an XLA without YNNPACK fusions: nothing to restrict
        return None
    return dict(_CPU_ROUND_OPTIONS)


__all__ = ["LaunchedRound", "PreparedRound", "RoundArgs", "Simulator", "client_data_template", "lpt_assign", "round_compiler_options"]

LAYOUTS = ("auto", "sequential", "vmap")
STORES = ("memory", "disk", "device")
_AXIS = "clients"


def lpt_assign(costs: np.ndarray, num_devices: int) -> list[list[int]]:
    """Longest-processing-time-first assignment with equal slot counts per device.

    Items go, longest first, to the least-loaded device that still has a free slot; every device
    gets ``ceil(n / num_devices)`` slots at most, so the cohort's padded shape (and the compiled
    round) is the same every round, whatever the sizes.
    """
    capacity = -(-len(costs) // num_devices)
    loads = np.zeros(num_devices)
    groups: list[list[int]] = [[] for _ in range(num_devices)]
    for i in np.argsort(-costs, kind="stable"):
        open_devices = [d for d in range(num_devices) if len(groups[d]) < capacity]
        d = min(open_devices, key=lambda j: loads[j])
        groups[d].append(int(i))
        loads[d] += costs[i]
    return groups


def client_data_template(feature_shape, x_dtype, y_dtype, *, epochs: int, batch_size: int, y_shape: tuple[int, ...] = ()):
    """Shapes of the :class:`~fedbayes.data.batches.ClientData` of a client holding one batch of
    examples, laid out alone (:func:`~fedbayes.data.batches.layout_orders`: ``epochs`` shuffles
    of its examples, then one batch of slack, in a buffer of the next size class).

    A client's message and info have the model's shapes, not the data's, so any client's data
    gives the same templates; this is the smallest that takes full steps. ``y_shape``: one
    example's target shape (``()`` for labels; a row for multi-label and next-word targets).
    """
    n = batch_size
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return ClientData(
        x=jax.ShapeDtypeStruct((n, *feature_shape), x_dtype),
        y=jax.ShapeDtypeStruct((n, *y_shape), y_dtype),
        order=jax.ShapeDtypeStruct((size_class(epochs * n + batch_size),), jnp.int32),
        offset=scalar,
        num_examples=scalar,
    )


class Simulator:
    """Runs rounds of a federated :class:`Algorithm` on a federation.

    Args:
      algorithm: the federated method.
      federation: a :class:`Federation` (pooled data, on the devices once) or a
        :class:`GeneratedFederation` (each cohort's data generated on demand).
      clients_per_round: cohort size ``M`` (``1 <= M <= K``).
      seed: root seed; cohorts and every client's randomness derive from it.
      weighting: ``"examples"`` (``q_k`` proportional to ``n_k``) or ``"uniform"``.
      layout: ``"sequential"``, ``"vmap"`` or ``"auto"`` (sequential on CPU, vmap elsewhere).
      devices: devices to shard the cohort over (default: all local devices).
      fail_fast: raise on the first rejected client message instead of dropping it.
      store: where client states live: ``"memory"`` (stacked host arrays), ``"disk"`` (a
        :class:`~fedbayes.sim.store.DiskStore` in ``store_dir``, for large federations) or
        ``"device"`` (stacked arrays in device memory, one copy per device, updated in place by
        the round's program; for stores that fit there).
      store_dir: the disk store's folder (needed with ``store="disk"``).
      aggregator: an :data:`fedbayes.aggregators.Aggregator` replacing the algorithm's own rule
        (e.g. a robust rule or one that adds DP noise); ``None`` keeps the algorithm's.
      scenario: client failures, stragglers and message attacks
        (:class:`~fedbayes.sim.scenario.Scenario`); a failed or late client sends nothing and
        keeps its state, as a padding slot does; an attacker's message is replaced before the
        server step. Default: none of them.
      fuse: at most this many rounds run in one compiled program in :meth:`rounds`
        (:meth:`fused_program`) where nothing on the host depends on a round's result: a
        stateless method or a device store, a pooled federation, a server step in the round's
        program (not ``server_on_one_device``), between the rounds the caller ``keep``s. Bitwise
        the same results on the CPU (to float32 rounding on a GPU, where XLA fuses the scanned
        round differently); 1 (default): one program per round.

    Attributes:
      replicated, sharded: the shardings of the round's inputs over the devices, whole on every
        device and split by slot (the client axis).
    """

    counts_dropped = False  # clients fail only as the config asks (server.dropout, server.deadline)

    def __init__(
        self,
        algorithm: Algorithm,
        federation: AnyFederation,
        *,
        clients_per_round: int,
        seed: int = 0,
        weighting: str = "examples",
        layout: str = "auto",
        devices: Sequence[jax.Device] | None = None,
        fail_fast: bool = False,
        store: str = "memory",
        store_dir: str | None = None,
        aggregator=None,
        scenario: Scenario = Scenario(),
        fuse: int = 1,
    ):
        k = federation.num_clients
        if not (isinstance(fuse, int) and fuse >= 1):
            raise ValueError(f"fuse must be an integer >= 1 (rounds per compiled program); got {fuse!r}")
        if store not in STORES:
            raise ValueError(f"store must be one of {', '.join(STORES)}; got {store!r}")
        if store == "disk" and store_dir is None:
            raise ValueError("store='disk' needs store_dir, the folder of the client store")
        if not 1 <= clients_per_round <= k:
            raise ValueError(f"clients_per_round must be between 1 and the number of clients ({k}); got {clients_per_round}")
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}; got {weighting!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
        sizes = np.asarray(federation.sizes, dtype=np.int64)
        if np.any(sizes <= 0):
            raise ValueError(f"every client needs at least one example; got empty clients {np.flatnonzero(sizes <= 0)[:10].tolist()}")
        self.algorithm = algorithm
        self.federation = federation
        self.clients_per_round = clients_per_round
        self.weighting = weighting
        self.fail_fast = fail_fast
        self.seed = seed
        self.sizes = sizes
        self.store = store
        self.store_dir = store_dir
        self.aggregator = aggregator
        scenario.check()
        self.scenario = scenario
        self.fuse = fuse
        self.is_attacker = scenario.attacker_mask(k)
        devices = list(devices) if devices is not None else jax.local_devices()
        if layout == "auto":
            layout = "sequential" if devices[0].platform == "cpu" else "vmap"
        self.layout = layout
        self.mesh = Mesh(np.array(devices), (_AXIS,))
        self.num_devices = len(devices)
        self.replicated = NamedSharding(self.mesh, P())
        self.sharded = NamedSharding(self.mesh, P(_AXIS))
        self.generated = isinstance(federation, GeneratedFederation)
        if self.generated:
            self.x = self.y = None
        else:
            self.x = jax.device_put(federation.x, self.replicated)
            self.y = jax.device_put(federation.y, self.replicated)
        options = round_compiler_options(devices[0].platform)
        self._round_fn = jax.jit(self.round_program, compiler_options=options)
        # The device store's round, with and without the store donated (updated in place).
        self._device_round_fns = {
            donate: jax.jit(self.device_store_program, compiler_options=options, donate_argnums=(1,) if donate else ()) for donate in (False, True)
        }
        # Several rounds in one program (:meth:`fused_program`), with and without the store donated.
        self._fused_fns = {donate: jax.jit(self.fused_program, compiler_options=options, donate_argnums=(1,) if donate else ()) for donate in (False, True)}
        self._message_bytes: tuple[int, int] | None = None
        # The server step as a program of its own on the first device (Algorithm.server_on_one_device)
        self.server_apart = bool(algorithm.server_on_one_device) and self.num_devices > 1
        self._server_fn = jax.jit(self.server_program, compiler_options=options)

    # ----- state -----------------------------------------------------------------------------
    def init(self, params, *, resume: bool = False) -> SimState:
        """Initial state: ``server_init`` and every client's ``client_init`` in the client store.

        ``resume=True`` opens an existing disk store instead of writing it anew (a checkpoint's
        :func:`~fedbayes.runs.checkpoint.load_checkpoint` then rolls it back to its round); the memory
        store ignores it. Stateless algorithms keep ``()`` whatever the store.
        """
        server_state = self.place(self.algorithm.server_init(protocol.server_init_key(self.seed), params))
        template = self.algorithm.client_init(params)
        k = self.federation.num_clients
        if self.store == "disk" and jax.tree.leaves(template):
            client_states = (DiskStore.open(self.store_dir, template, k) if resume else DiskStore.create(self.store_dir, template, k)).held
        else:
            client_states = MemoryStore.create(template, k).held
            if self.store == "device" and jax.tree.leaves(template):
                client_states = DeviceStore.place(client_states, self.replicated).held
        return SimState(round=0, server_state=server_state, client_states=client_states)

    def place(self, server_state):
        """Puts a server state on the devices as the round returns it (replicated), so that the
        compiled round is reused from the first call on."""
        return jax.device_put(server_state, self.replicated)

    def server_params(self, state: SimState):
        return self.algorithm.server_params(state.server_state)

    # ----- cohort ----------------------------------------------------------------------------
    def sample_cohort(self, round_idx: int) -> np.ndarray:
        """Uniform sample without replacement of ``M`` client ids for ``round_idx`` (sorted)."""
        return protocol.sample_cohort(self.seed, round_idx, self.federation.num_clients, self.clients_per_round)

    def layout_cohort(self, cohort: np.ndarray) -> np.ndarray:
        """Orders the cohort into equal per-device blocks; ``-1`` marks padding slots."""
        d = self.num_devices
        if self.layout == "sequential" and d > 1:
            groups = lpt_assign(self.sizes[cohort].astype(np.float64), d)
        else:
            per = -(-len(cohort) // d)
            groups = [list(range(i * per, min((i + 1) * per, len(cohort)))) for i in range(d)]
        width = max(len(g) for g in groups)
        slots = np.full((d, width), -1, dtype=np.int64)
        for i, g in enumerate(groups):
            slots[i, : len(g)] = cohort[g] if len(g) else []
        return slots.reshape(-1)

    def _cohort_data(self, slots: np.ndarray):
        """Pooled features for the cohort and each slot's positions in them.

        A pooled federation returns its device-resident arrays and the clients' own indices; a
        generated one generates the cohort's clients, concatenates them and pads the tail to a
        size class (so that shapes, and compiles, repeat).
        """
        if not self.generated:
            return self.x, self.y, [self.federation.client_indices[c] if c >= 0 else np.zeros(0, np.int64) for c in slots], 0.0
        fed = self.federation
        xs, ys, positions, used = [], [], [], 0
        for cid in slots:
            if cid < 0:
                positions.append(np.zeros(0, np.int64))
                continue
            x, y = fed.client_data(int(cid))
            xs.append(np.asarray(x, fed.x_dtype))
            ys.append(np.asarray(y, fed.y_dtype))
            positions.append(np.arange(used, used + len(y)))
            used += len(y)
        total = size_class(used)
        x = np.zeros((total, *fed.feature_shape), fed.x_dtype)
        y = np.zeros((total, *fed.y_shape), fed.y_dtype)
        x[:used] = np.concatenate(xs)
        y[:used] = np.concatenate(ys)
        x, y = jax.device_put((x, y), self.replicated)
        return x, y, positions, 1.0 - used / total

    def gather(self, round_idx: int, slots: np.ndarray):
        """Host side of a round: ``(x, y, order, offsets, num_examples, weights, padding)`` of
        the slots (see :meth:`layout_cohort`)."""
        real = slots >= 0
        x, y, positions, feature_waste = self._cohort_data(slots)
        epochs, batch = self.algorithm.local_epochs, self.algorithm.local_batch_size
        # A generated cohort's feature buffer already has a size class; tying the order buffer's
        # length to it keeps one shape (one compile) per class instead of one per pair of classes.
        length = epochs * x.shape[0] + batch if self.generated else None
        order, offsets, used = layout_orders(self.seed, round_idx, slots, positions, epochs, batch, length)
        num_examples = np.where(real, self.sizes[np.where(real, slots, 0)], 0).astype(np.int32)
        weights = protocol.client_weights(num_examples, self.weighting)
        padding = max(feature_waste, 1.0 - used / len(order))
        return x, y, order, offsets, num_examples, weights, padding

    # ----- the compiled round ----------------------------------------------------------------
    def _client_fn(self, message, round_idx, x, y, order):
        algorithm, round_key = self.algorithm, protocol.client_round_key(self.seed, round_idx)

        def one(cid, cstate, offset, n):
            key = jax.random.fold_in(round_key, cid)  # = protocol.client_key(seed, round_idx, cid)
            return algorithm.client_update(key, message, cstate, ClientData(x, y, order, offset, n))

        return one

    def client_phase(self, message, client_states, client_ids, offsets, num_examples, round_idx, x, y, order):
        """The cohort's client updates in the simulator's layout: ``(messages, new states, infos)``,
        each split by slot over the devices. No step of it crosses devices."""
        vmapped = self.layout == "vmap"

        def per_device(message, round_idx, x, y, order, cids, cstates, offs, n):
            one = self._client_fn(message, round_idx, x, y, order)
            if vmapped:
                return jax.vmap(one)(cids, cstates, offs, n)
            return jax.lax.map(lambda a: one(*a), (cids, cstates, offs, n))

        # Both layouts split the cohort by hand (shard_map). Under a vmap over the whole sharded
        # cohort, every client loop's stopping test became an all-reduce across the devices, and
        # XLA:CPU, running a collective that did not wait for the loops beside them on as few
        # threads as devices, deadlocked (docs/design.md, "Using every core"). Here each device
        # loops over its own clients only, until its own longest client is done.
        # check_vma=False: with it, gradients w.r.t. the replicated broadcast would be summed
        # over devices and clients would no longer be independent (docs/design.md).
        return jax.shard_map(
            per_device,
            mesh=self.mesh,
            in_specs=(P(), P(), P(), P(), P(), P(_AXIS), P(_AXIS), P(_AXIS), P(_AXIS)),
            out_specs=(P(_AXIS), P(_AXIS), P(_AXIS)),
            check_vma=False,
        )(message, round_idx, x, y, order, client_ids, client_states, offsets, num_examples)

    def round_program(self, server_state, client_states, client_ids, offsets, num_examples, weights, round_idx, x, y, order, attackers=None):
        """The compiled round (:meth:`run_round` calls it jitted): the cohort's client updates in
        the simulator's layout (:meth:`client_phase`), the attack on the ``attackers`` slots'
        messages (when the simulator has one), then :func:`fedbayes.protocol.server_step`. Returns
        the new server state, the new client states (every slot's; only accepted rows are written
        back), the acceptance flags, the clients' info and the server's info. With the server step
        apart (``server_on_one_device``): an :class:`Apart` (the messages and weights) in place of
        the new server state and an empty server info, which :meth:`launch` completes with
        :meth:`server_program`."""
        algorithm = self.algorithm
        message = algorithm.broadcast(server_state)
        messages, new_states, infos = self.client_phase(message, client_states, client_ids, offsets, num_examples, round_idx, x, y, order)
        if self.scenario.attack is not None:
            messages = self.scenario.attack(messages, attackers, message)
        if self.server_apart:  # validated here; aggregated and updated by server_program after it
            return Apart(messages, weights), new_states, protocol.accepted(algorithm, server_state, messages, weights), infos, {}
        server_key = protocol.server_key(self.seed, round_idx)
        new_server, ok, server_info = protocol.server_step(server_key, algorithm, server_state, messages, weights, self.aggregator)
        new_server = protocol.keep_unless_accepted(ok, new_server, server_state, algorithm)  # no accepted message: nothing learned
        # A rejected client keeps its old state: run_round writes back only the accepted rows
        # (no select over every client's state here, one pass less over the cohort's states).
        return new_server, new_states, ok, infos, server_info

    def server_program(self, server_key, server_state, messages, weights):
        """The server step of an algorithm whose ``server_on_one_device`` is set, compiled on its
        own and run on the first device after the round's program (:meth:`_server_apart`):
        ``(new server state, server info)``, the state kept when no message is accepted.

        Split over the devices as the cohort is, a server step that is a loop of small steps
        (FedLap-Func's 500 Adam steps over the cohort's memory points) ends every step in a
        cross-device reduction, each device waiting for the other; one device alone, in a program
        of its own, uses every core through XLA's intra-op threads, and the round is faster
        (docs/results/bench.md, "FedLap-Func's server on one device"). (Inside the round's program
        the first device alone gets one core: XLA does not split the operations of a program of
        several devices over threads.)"""
        new, ok, info = protocol.server_step(server_key, self.algorithm, server_state, messages, weights, self.aggregator)
        return protocol.keep_unless_accepted(ok, new, server_state, self.algorithm), info

    def _server_apart(self, server_state, round_idx: int, outputs):
        """``outputs`` of a round's program whose server step runs apart: the server step run on
        the first device (dispatched, not waited for), its new state replicated as the round's
        program returns it."""
        apart, new_states, ok, infos, _ = outputs
        first = self.mesh.devices.flat[0]
        key = jax.device_put(protocol.server_key(self.seed, round_idx), first)
        state, messages, weights = jax.device_put((server_state, apart.messages, apart.weights), first)
        new_server, info = self._server_fn(key, state, messages, weights)
        return jax.device_put(new_server, self.replicated), new_states, ok, infos, info

    def cohort_states(self, state: SimState, prepared: PreparedRound):
        """The client states of ``prepared``'s slots on the devices, split by slot (a padding slot
        reads client 0's), as the round's client phase takes them; ``state`` is not changed."""
        safe = np.where(prepared.slots >= 0, prepared.slots, 0)
        if self.store == "device" and jax.tree.leaves(state.client_states):
            return DeviceStore.place(state.client_states, self.replicated).gather(jax.device_put(safe, self.sharded))
        return self._put_states(as_store(state.client_states), safe, state.round)

    def num_compiled_rounds(self) -> int:
        """How many programs the round has compiled so far (one per size class of the cohort's
        order buffer; a fixed cohort shape compiles once)."""
        return self._round_fn._cache_size()

    def message_bytes(self, state: SimState) -> tuple[int, int]:
        """``(down, up)`` bytes of one broadcast message and one client message."""
        if self._message_bytes is None:
            fed = self.federation
            if self.generated:
                feature_shape, x_dtype, y_dtype = fed.feature_shape, fed.x_dtype, fed.y_dtype
            else:
                feature_shape, x_dtype, y_dtype = self.x.shape[1:], self.x.dtype, self.y.dtype
            alg = self.algorithm
            y_shape = fed.y_shape if self.generated else self.y.shape[1:]
            data = client_data_template(feature_shape, x_dtype, y_dtype, epochs=alg.local_epochs, batch_size=alg.local_batch_size, y_shape=y_shape)
            t = protocol.message_templates(alg, None, data, server_state=state.server_state, client_state=as_store(state.client_states).row_spec())
            self._message_bytes = (tree.tree_bytes(t.broadcast), tree.tree_bytes(t.message))
        return self._message_bytes

    def failed_clients(self, round_idx: int, cohort: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(dropped, late)``: boolean masks over the (sorted) cohort of the clients that fail
        this round and of those that miss the deadline (:meth:`Scenario.failed_clients`)."""
        alg = self.algorithm
        return self.scenario.failed_clients(self.seed, round_idx, cohort, lambda c: num_local_steps(self.sizes[c], alg.local_batch_size, alg.local_epochs))

    def _put_states(self, store, ids: np.ndarray, round_idx: int):
        """The states of the clients in slots ``ids`` on the devices, sharded by slot.

        From a memory store each device's block is gathered straight from the stacked host arrays
        (one copy, no assembled cohort array in between; docs/results/bench.md, "What changed, and
        what each change measured").
        """
        if isinstance(store, MemoryStore):

            def leaf(a):
                return jax.make_array_from_callback((len(ids), *a.shape[1:]), self.sharded, lambda index: a[ids[index[0]]])

            return jax.tree.map(leaf, store.states)
        return jax.tree.map(lambda a: jax.device_put(a, self.sharded), store.gather(ids, round_idx))

    def _write_back(self, store, slots: np.ndarray, keep: np.ndarray, new_states, round_idx: int, donate: bool):
        """Writes the new states of the slots marked ``keep`` to the store; returns what
        ``SimState.client_states`` holds next.

        A memory store is written device block by device block from zero-copy host views of each
        device's shard (no assembled copy of the cohort's states); a disk store gets one scatter
        per round (its undo log is per round).
        """
        if not isinstance(store, MemoryStore):
            rows = np.flatnonzero(keep)
            new_rows = jax.tree.map(lambda a: np.asarray(a)[rows], new_states)
            return store.scatter(slots[rows], new_rows, round_idx, donate=donate).held
        leaves, treedef = jax.tree.flatten(new_states)
        width = len(slots) // self.num_devices  # slots come in equal per-device blocks
        bounds = [(i * width, (i + 1) * width) for i in range(self.num_devices)]

        def blocks_of(a):
            if a.sharding.is_equivalent_to(self.sharded, a.ndim):
                views = {shard.index[0].indices(len(slots))[:2]: np.asarray(shard.data) for shard in a.addressable_shards}
                return [views[b] for b in bounds]
            host = np.asarray(a)  # laid out otherwise (e.g. replicated): slice one host copy
            return [host[start:stop] for start, stop in bounds]

        per_leaf = [blocks_of(a) for a in leaves]
        owned = donate  # once copied (donate=False), later blocks may write in place
        for b, (start, stop) in enumerate(bounds):
            arrays = [blocks[b] for blocks in per_leaf]
            sel = keep[start:stop]
            if not sel.any():
                continue
            rows = arrays if sel.all() else [r[sel] for r in arrays]
            store = store.scatter(slots[start:stop][sel], treedef.unflatten(rows), round_idx, donate=owned)
            owned = True
        if not owned:  # nothing written: still a store of its own, as a pure update promises
            store = MemoryStore(jax.tree.map(np.copy, store.states))
        return store.held

    # ----- one round in three steps: prepare (host), launch (device, asynchronous), complete ----
    def prepare_round(self, round_idx: int) -> PreparedRound:
        """The host work of round ``round_idx``, which does not depend on any state: the cohort,
        its layout over the devices, failures, every client's epoch shuffles in one order buffer,
        and the round's inputs put on the devices (asynchronously)."""
        cohort = self.sample_cohort(round_idx)
        all_slots = self.layout_cohort(cohort)
        dropped, late = self.failed_clients(round_idx, cohort)
        failed_ids = cohort[dropped | late]
        # A failed client runs as a padding slot: no data, weight zero, its state not written back.
        slots = np.where(np.isin(all_slots, failed_ids), -1, all_slots) if len(failed_ids) else all_slots
        x, y, order, offsets, num_examples, weights, padding = self.gather(round_idx, slots)
        if self.generated and self.federation.prefetch is not None:
            # the next cohort is known from the keys alone: read it while this round trains
            self.federation.prefetch(self.sample_cohort(round_idx + 1))
        real = slots >= 0
        safe = np.where(real, slots, 0)
        # One batched transfer of the per-slot inputs (and the order buffer, replicated).
        per_slot = {"client_ids": safe.astype(np.int32), "offsets": offsets, "num_examples": num_examples, "weights": weights}
        if self.scenario.attack is not None:
            per_slot["attackers"] = np.where(real, self.is_attacker[safe], False)
        if self.store == "device":
            per_slot["real"] = real
        placed = jax.device_put([*per_slot.values(), order], [self.sharded] * len(per_slot) + [self.replicated])
        on_devices = dict(zip(per_slot, placed))
        args = RoundArgs(
            client_ids=on_devices["client_ids"],
            offsets=on_devices["offsets"],
            num_examples=on_devices["num_examples"],
            weights=on_devices["weights"],
            round_idx=np.int32(round_idx),
            x=x,
            y=y,
            order=placed[-1],
            attackers=on_devices.get("attackers"),
        )
        return PreparedRound(round_idx, cohort, all_slots, slots, dropped, late, num_examples, float(padding), args, on_devices.get("real"))

    def launch(self, state: SimState, prepared: PreparedRound, *, donate: bool = False) -> LaunchedRound:
        """Starts the compiled round ``prepared`` on ``state`` and returns without waiting for it
        (JAX dispatches asynchronously); ``state.server_state`` may itself still be computing.

        The client states are gathered here: from a memory store, the rows are copied now (so a
        later write to other rows cannot change them); a device store is passed whole and, with
        ``donate=True``, updated in place by the round (``state.client_states`` is then no longer
        usable)."""
        if prepared.round != state.round:
            raise ValueError(f"the prepared round is {prepared.round} but the state is at round {state.round}")
        if self.store == "device" and jax.tree.leaves(state.client_states):
            fn = self._device_round_fns[bool(donate)]
            store = DeviceStore.place(state.client_states, self.replicated).held
            outputs = fn(state.server_state, store, prepared.real, *prepared.args)
        else:
            store = as_store(state.client_states)
            safe = np.where(prepared.slots >= 0, prepared.slots, 0)
            outputs = self._round_fn(state.server_state, self._put_states(store, safe, prepared.round), *prepared.args)
        if self.server_apart:
            outputs = self._server_apart(state.server_state, prepared.round, outputs)
        return LaunchedRound(prepared, outputs)

    def complete(self, state: SimState, launched: LaunchedRound, *, donate: bool = False) -> tuple[SimState, RoundInfo]:
        """Waits for ``launched`` (started on ``state``), ends the round
        (:func:`fedbayes.protocol.finish_round`: ``fail_fast``, the server state kept when no message
        was accepted), writes the accepted clients' new states back and returns the next state and
        what the round did."""
        p = launched.prepared
        round_idx, cohort, all_slots, slots, num_examples = p.round, p.cohort, p.all_slots, p.slots, p.num_examples
        new_server, new_cstates, ok, client_info, server_info = launched.outputs
        ok, client_info, server_info = jax.device_get((ok, client_info, server_info))  # one batched transfer
        real = slots >= 0
        rejected = slots[real & ~ok]
        if len(rejected):
            log.warning("round %d: rejected messages from clients %s", round_idx, rejected.tolist())
        down, up = self.message_bytes(state)
        m = len(cohort)
        steps = num_local_steps(num_examples, self.algorithm.local_batch_size, self.algorithm.local_epochs)
        step_waste = 0.0
        if self.layout == "vmap" and steps.max() > 0:
            step_waste = float(1.0 - steps.sum() / (len(slots) * steps.max()))
        # Per-client facts in cohort order (slots hold the cohort in device blocks, -1 for padding).
        order_in_cohort = np.argsort(np.where(all_slots >= 0, all_slots, np.iinfo(np.int64).max), kind="stable")[:m]
        clients = {"client": all_slots[order_in_cohort], "num_examples": num_examples[order_in_cohort], "accepted": (real & ok)[order_in_cohort]}
        clients.update({k: np.asarray(v)[order_in_cohort] for k, v in client_info.items()})
        if self.scenario.fails_clients:
            clients["num_examples"] = self.sizes[cohort].astype(num_examples.dtype)  # a failed client still holds its data
            clients["dropped"], clients["late"] = p.dropped, p.late
        server = {k: np.asarray(v).item() for k, v in server_info.items()}
        succeeded = m - int(np.sum(p.dropped | p.late))
        # the round's program has already applied the no-accepted-message policy (keep_unless_accepted)
        new_server, info = protocol.finish_round(
            new_server,
            new_server,
            ok,
            round_idx=round_idx,
            cohort=cohort,
            rejected=rejected,
            fail_fast=self.fail_fast,
            bytes_up=up * succeeded,  # failed clients upload nothing (they still got the broadcast)
            bytes_down=down * m,
            padding_waste=p.padding,
            step_waste=step_waste,
            clients=clients,
            server=server,
            dropped=cohort[p.dropped],
            late=cohort[p.late],
        )
        client_states = state.client_states
        if not jax.tree.leaves(client_states):
            pass
        elif self.store == "device":
            client_states = new_cstates  # rejected clients and padding slots were not written
        else:
            # Rejected clients and padding slots keep their state.
            client_states = self._write_back(as_store(client_states), slots, real & ok, new_cstates, round_idx, donate)
        return SimState(round_idx + 1, new_server, client_states), info

    def run_round(self, state: SimState, *, donate: bool = False) -> tuple[SimState, RoundInfo]:
        """Runs round ``state.round`` and returns the next state and what happened.

        With a memory store, pure: ``state`` (its client store included) is left as it was, at the
        price of copying the store; ``donate=True`` updates the store in place instead, for callers
        that drop ``state``. A disk store is always updated in place (atomically, see
        :mod:`fedbayes.sim.store`), so only its newest state can be continued; a device store is
        updated in place with ``donate=True`` (``state.client_states`` is then deleted).
        """
        launched = self.launch(state, self.prepare_round(state.round), donate=donate)
        return self.complete(state, launched, donate=donate)

    def rounds(self, state: SimState, stop: int, *, donate: bool = True, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[SimState, RoundInfo]]:
        """Runs rounds ``state.round .. stop - 1`` pipelined, yielding ``(state, info)`` after each.

        Results are bitwise those of calling :meth:`run_round` in a loop (the same programs on the
        same inputs); only the order of host and device work changes. While round ``r`` runs on
        the devices, round ``r + 1``'s host work (:meth:`prepare_round`: cohort, shuffles, order
        buffer, transfers) is done, and round ``r + 1`` is launched before round ``r``'s results
        are waited for, so the devices find it queued: its server state is round ``r``'s output,
        still being computed. The early launch is skipped when round ``r + 1`` reads a client
        state that round ``r`` writes on the host (a memory store, overlapping cohorts), with a
        disk store (its undo log is per round), and after a round for which ``keep(r)`` holds.

        ``keep(r)``: whether the caller needs round ``r``'s yielded state intact until it resumes
        the iteration (to checkpoint it: with a device store and ``donate=True`` the next launch
        consumes the store). Between other rounds the caller may still read the yielded server
        state; its client store may already be in use by the next round.
        """
        keep = keep or (lambda r: False)
        if state.round >= stop:
            return
        stateful = bool(jax.tree.leaves(state.client_states))
        if self.fuse > 1 and not self.generated and not self.server_apart and (not stateful or self.store == "device"):
            yield from self._fused_rounds(state, stop, donate, keep)
            return
        launched = self.launch(state, self.prepare_round(state.round), donate=donate)
        while True:
            r = state.round
            upcoming = self.prepare_round(r + 1) if r + 1 < stop else None
            early = None
            if upcoming is not None and not keep(r) and self._may_launch_early(launched.prepared, upcoming, stateful):
                ahead = SimState(r + 1, launched.outputs[0], launched.outputs[1] if self.store == "device" else state.client_states)
                early = self.launch(ahead, upcoming, donate=donate)
            state, info = self.complete(state, launched, donate=donate)
            yield state, info
            if upcoming is None:
                return
            launched = early if early is not None else self.launch(state, upcoming, donate=donate)

    def _may_launch_early(self, current: PreparedRound, upcoming: PreparedRound, stateful: bool) -> bool:
        """Whether ``upcoming`` may start before ``current``'s client states are written back."""
        if self.store == "device" or not stateful:
            return True
        if self.store == "disk":
            return False
        written = current.slots[current.slots >= 0]
        read = np.where(upcoming.slots >= 0, upcoming.slots, 0)  # a padding slot reads row 0
        return not np.intersect1d(written, read).size

    # ----- rounds fused into one program --------------------------------------------------------
    def _blocks(self, start: int, stop: int, keep: Callable[[int], bool]) -> Iterator[list[PreparedRound]]:
        """Rounds ``start .. stop - 1`` prepared on the host and cut into blocks: at most
        :attr:`fuse` rounds, one order-buffer shape (one compiled program per block length), a
        block ending at every round the caller ``keep``s."""
        block: list[PreparedRound] = []
        for r in range(start, stop):
            p = self.prepare_round(r)
            if block and p.args.order.shape != block[0].args.order.shape:
                yield block
                block = []
            block.append(p)
            if len(block) == self.fuse or keep(r):
                yield block
                block = []
        if block:
            yield block

    def _launch_block(self, state: SimState, block: list[PreparedRound], donate: bool):
        """Starts ``block`` on ``state``: one round as :meth:`launch` does, several as one
        :meth:`fused_program`; returns ``(final server state, final client states, a function
        that waits for the block and returns its rounds as launched rounds)`` without waiting."""
        if len(block) == 1:
            launched = self.launch(state, block[0], donate=donate)
            stateful_device = self.store == "device" and bool(jax.tree.leaves(state.client_states))
            new_states = launched.outputs[1] if stateful_device else state.client_states
            return launched.outputs[0], new_states, lambda: [launched]
        if block[0].round != state.round:
            raise ValueError(f"the prepared round is {block[0].round} but the state is at round {state.round}")
        device_store = self.store == "device" and bool(jax.tree.leaves(state.client_states))

        def stacked(field):
            values = [getattr(p.args, field) for p in block]
            return None if values[0] is None else jnp.stack(values)

        fields = ("client_ids", "offsets", "num_examples", "weights")
        per_slot = [stacked(f) for f in fields]
        real = jnp.stack([p.real for p in block]) if device_store else None
        rounds = jax.device_put(np.array([p.round for p in block], np.int32), self.replicated)
        a = block[0].args
        store = DeviceStore.place(state.client_states, self.replicated).held if device_store else ()
        fn = self._fused_fns[bool(donate) and device_store]
        servers, final, new_store, ok, infos, server_info = fn(
            state.server_state, store, real, *per_slot, rounds, a.x, a.y, stacked("order"), stacked("attackers")
        )
        new_states = new_store if device_store else state.client_states

        def rounds_of_block() -> list[LaunchedRound]:
            host = jax.device_get((ok, infos, server_info))  # waits for the block
            launched = []
            for i, p in enumerate(block):
                ok_i, infos_i, server_i = jax.tree.map(lambda v, i=i: v[i], host)
                launched.append(LaunchedRound(p, (jax.tree.map(lambda v, i=i: v[i], servers), new_states, ok_i, infos_i, server_i)))
            return launched

        return final, new_states, rounds_of_block

    def _fused_rounds(self, state: SimState, stop: int, donate: bool, keep: Callable[[int], bool]) -> Iterator[tuple[SimState, RoundInfo]]:
        """:meth:`rounds` with :attr:`fuse` > 1: blocks of rounds (:meth:`_blocks`) each in one
        program, the next block launched before the current one's rounds are yielded unless the
        caller keeps its last round."""
        blocks = self._blocks(state.round, stop, keep)
        block = next(blocks)
        final, new_states, launched = self._launch_block(state, block, donate)
        while True:
            upcoming = next(blocks, None)
            early = None
            if upcoming is not None and not keep(block[-1].round):
                early = self._launch_block(SimState(block[-1].round + 1, final, new_states), upcoming, donate)
            for one in launched():
                state, info = self.complete(state, one, donate=donate)
                yield state, info
            if upcoming is None:
                return
            block = upcoming
            final, new_states, launched = early if early is not None else self._launch_block(state, block, donate)

    def fused_program(self, server_state, store, real, client_ids, offsets, num_examples, weights, rounds, x, y, order, attackers=None):
        """Several rounds in one program: :meth:`round_program` (or, with a device store,
        :meth:`device_store_program`) under ``lax.scan`` over the rounds' stacked inputs (a
        leading axis of rounds on every per-round input; ``x`` and ``y`` shared). Returns every
        round's server state (stacked), the last one, the store after the last round, and every
        round's acceptance flags, clients' info and server's info (stacked)."""

        def one_round(carry, inputs):
            server, st = carry
            real_r, cids, offs, n, w, r, o, att = inputs
            if jax.tree.leaves(st):
                server, st, ok, infos, server_info = self.device_store_program(server, st, real_r, cids, offs, n, w, r, x, y, o, att)
            else:
                server, _, ok, infos, server_info = self.round_program(server, st, cids, offs, n, w, r, x, y, o, att)
            return (server, st), (server, ok, infos, server_info)

        xs = (real, client_ids, offsets, num_examples, weights, rounds, order, attackers)
        (final, store), (servers, ok, infos, server_info) = jax.lax.scan(one_round, (server_state, store), xs)
        return servers, final, store, ok, infos, server_info

    # ----- the device-resident store -----------------------------------------------------------
    def device_store_program(self, server_state, store, real, client_ids, *rest):
        """:meth:`round_program` with the client store on the devices
        (:class:`~fedbayes.sim.store.DeviceStore`): each device gathers its slots' rows from the
        (replicated) store inside the program, and the accepted clients' new states are scattered
        back into it (padding slots and rejected clients are not written: their rows are sent out
        of bounds and dropped). The store is donated by :meth:`launch` with ``donate=True``, so
        the scatter updates it in place."""
        device_store = DeviceStore(store)
        states = jax.lax.with_sharding_constraint(device_store.gather(client_ids), self.sharded)
        new_server, new_states, ok, infos, server_info = self.round_program(server_state, states, client_ids, *rest)
        rows = jnp.where(real & ok, client_ids, device_store.num_clients)
        new_store = device_store.scatter(rows, new_states).held
        return new_server, jax.lax.with_sharding_constraint(new_store, self.replicated), ok, infos, server_info


class Apart(NamedTuple):
    """What the round's program hands to :meth:`Simulator.server_program` when the server step
    runs apart: the cohort's messages (stacked, split over the devices) and weights."""

    messages: object
    weights: jax.Array


class RoundArgs(NamedTuple):
    """The compiled round's inputs after the server and client states (:meth:`Simulator.round_program`),
    on the devices: per slot (split over the devices) ``client_ids``, ``offsets`` (where each
    client's epochs start in ``order``), ``num_examples``, ``weights`` and, with a message attack,
    ``attackers``; for the whole cohort the round, the features and targets, and the order buffer."""

    client_ids: jax.Array
    offsets: jax.Array
    num_examples: jax.Array
    weights: jax.Array
    round_idx: np.int32
    x: jax.Array
    y: jax.Array
    order: jax.Array
    attackers: jax.Array | None = None


class PreparedRound(NamedTuple):
    """A round's host work (:meth:`Simulator.prepare_round`): what :meth:`Simulator.launch` and
    :meth:`Simulator.complete` need besides the state."""

    round: int
    cohort: np.ndarray
    all_slots: np.ndarray  # the cohort in device blocks, -1 for padding
    slots: np.ndarray  # as all_slots, with failed clients as padding too
    dropped: np.ndarray
    late: np.ndarray
    num_examples: np.ndarray
    padding: float
    args: RoundArgs  # the compiled round's inputs after the client states, on the devices
    real: jax.Array | None = None  # the device store's round: which slots hold a client, on the devices


class LaunchedRound(NamedTuple):
    """A round started on the devices (:meth:`Simulator.launch`): its outputs may still be computing."""

    prepared: PreparedRound
    outputs: tuple  # (server state, client states, accepted flags, clients' info, server's info)
