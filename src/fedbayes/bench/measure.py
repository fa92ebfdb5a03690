"""In-process measurement: what a benchmark worker times, importable and callable directly.

:func:`measure_federated` times a federated workload's rounds; :func:`measure_limit` times the
compute limit (central ``jit``-compiled training of the same examples); :func:`measure_paired`
times several federated workloads with their rounds interleaved. Each returns raw timings, which
:mod:`fedbayes.bench.report` turns into the reported entries. The timings mean what
:mod:`fedbayes.bench` says only in a fresh process laid out as :mod:`fedbayes.bench.protocol`
lays its workers out; the tests call these in-process on tiny sizes.

No JAX at top level (it is imported by the functions that run).
"""

from __future__ import annotations

import functools
import os
import resource
import time
from collections.abc import Callable, Sequence
from typing import Any

from fedbayes.bench.workloads import (
    WORKLOADS,
    BenchError,
    BenchSettings,
    FederatedWorkload,
    LimitWorkload,
    build_simulator,
    load_data,
    model_and_trainer,
    steady_rounds,
    workload_epochs,
    workload_partition,
)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def measure_paired(names: Sequence[str], settings: BenchSettings, rounds: int | None = None, block: int = 5) -> dict[str, Any]:
    """Times federated workloads in this one process, their rounds interleaved in blocks.

    Every workload is built and compiled (two rounds), then passes each run a block of ``block``
    pipelined rounds (as run_experiment runs them) of every workload in turn, until each has run
    ``rounds`` (default: the first workload's :func:`steady_rounds`). Paired blocks saw the same
    machine state, so the ratio of their times is far less noisy than a ratio of separate
    processes' medians (a fresh process's throughput varies from process to process:
    docs/results/bench.md, "Repeatability"). A block waits for its last round, so workloads never overlap.

    Returns:
      ``{"round_s": {name: [seconds per round of each block]}, "examples": {name: [examples per
      round of each block]}}``.
    """
    import jax

    workloads = [WORKLOADS.get(n) for n in names]
    if not all(isinstance(w, FederatedWorkload) for w in workloads):
        raise BenchError(f"paired timing takes federated workloads only; got {list(names)}")
    dataset = load_data(settings)
    runs = []
    for w in workloads:
        sim, state = build_simulator(w, settings, dataset)
        for _ in range(2):
            state, _ = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        runs.append([sim, state])
    times: dict[str, list[float]] = {n: [] for n in names}
    examples: dict[str, list[float]] = {n: [] for n in names}
    total = rounds or steady_rounds(workloads[0], settings)
    for start in range(0, total, block):
        n = min(block, total - start)
        for w, run in zip(workloads, runs):
            sim, state = run
            count = 0
            t0 = time.perf_counter()
            for state, info in sim.rounds(state, state.round + n, donate=True):
                count += int(sim.federation.sizes[info.cohort].sum()) * workload_epochs(w, settings)
            jax.block_until_ready(state.server_state)
            times[w.name].append((time.perf_counter() - t0) / n)
            examples[w.name].append(count / n)
            run[1] = state
    return {"kind": "paired", "round_s": times, "examples": examples}


def measure_federated(
    workload: FederatedWorkload,
    settings: BenchSettings,
    *,
    spawn_time: float | None = None,
    profile_top: int = 0,
    on_round: Callable[[int, int], None] = lambda done, total: None,
) -> dict[str, Any]:
    """Runs a federated workload in this process and returns its raw timings.

    Args:
      workload: what to run.
      settings: shared settings (dataset, model, rounds).
      spawn_time: ``time.time()`` just before this process was started; ``startup_s`` counts
        from it (``None``: from this call, imports excluded).
      profile_top: when positive, the steady rounds run under ``cProfile`` and the result holds
        that many functions with the most own time (``profile``); the timings are then slowed by
        the profiler.
      on_round: ``on_round(done, total)`` after the first round (``done = 0``), after each timed
        round (its time taken before the call) and once the measurements after them (the own
        limit, the device probes) are done: ``total`` is the timed rounds plus one.

    Returns:
      ``first_round_s``, ``round_s`` (list, steady rounds), ``examples``, ``padding_waste`` and
      ``step_waste`` (lists, per steady round, the last two as the simulator reports them),
      ``startup_s``, ``startup_parts``, ``peak_rss_mb`` and a description of the layout.
    """
    t_enter = time.time()
    import jax
    import numpy as np

    import fedbayes.sim.simulator  # noqa: F401  (imports counted before the data step, as before)

    t_imported = time.time()
    dataset = load_data(settings)
    parts = workload_partition(workload, settings, dataset)
    t_data = time.time()
    sim, state = build_simulator(workload, settings, dataset, parts)
    federation, epochs = sim.federation, workload_epochs(workload, settings)
    t_built = time.time()
    # donate=True: the bench drops each old state, as run_experiment does (a stateful method's
    # memory store is then updated in place instead of copied every round).
    state, _ = sim.run_round(state, donate=True)
    jax.block_until_ready(state.server_state)
    t_first = time.time()
    if sim.fuse > 1:  # compile the fused program before the clock starts
        for state, _ in sim.rounds(state, state.round + sim.fuse, donate=True):
            pass
        jax.block_until_ready(state.server_state)

    sizes = federation.sizes
    times, examples, padding, step_waste = [], [], [], []
    rejected = 0
    profiler = None
    if profile_top > 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    # Pipelined, as run_experiment runs them: a round's time is from the previous round's results
    # to its own (the host work it overlaps with its predecessor is not counted twice).
    total = steady_rounds(workload, settings)
    on_round(0, total + 1)
    t0 = time.perf_counter()
    for state, info in sim.rounds(state, state.round + total, donate=True):
        t1 = time.perf_counter()
        times.append(t1 - t0)
        examples.append(int(sizes[np.asarray(info.cohort)].sum()) * epochs)
        padding.append(float(info.padding_waste))
        step_waste.append(float(info.step_waste))
        rejected += len(info.rejected)
        on_round(len(times), total + 1)  # the worker's report is throttled: microseconds, in the next round's time
        t0 = t1
    jax.block_until_ready(state.server_state)
    if profiler is not None:
        profiler.disable()
    if sim.fuse > 1:  # a block's rounds arrive together: each gets the block's mean
        times = _block_means(times, sim.fuse)
    own = measure_own_limit(sim, state, settings.own_limit_blocks, min(settings.own_limit_rounds, steady_rounds(workload, settings)))
    state = own.pop("state")
    # Each device's busy time in the client phase of a few more rounds (probes, not timed above).
    busy = [device_busy_times(sim, state._replace(round=state.round + i)).tolist() for i in range(settings.idle_probes)]
    start = spawn_time if spawn_time is not None else t_enter
    out: dict[str, Any] = {
        "kind": "federated",
        "first_round_s": t_first - t_built,
        "round_s": times,
        "examples": examples,
        "padding_waste": padding,
        "step_waste": step_waste,
        "startup_s": t_first - start,
        "startup_parts": {
            "interpreter_and_imports_s": t_imported - start,
            "data_s": t_data - t_imported,
            "build_s": t_built - t_data,
            "first_round_s": t_first - t_built,
        },
        "peak_rss_mb": peak_rss_mb(),
        "device_busy_s": busy,
        **own,
        "rejected": rejected,
        "store": sim.store,
        "layout": sim.layout,
        "devices": len(jax.local_devices()),
        "device_kind": jax.local_devices()[0].device_kind,
        "num_clients": workload.num_clients,
        "clients_per_round": workload.clients_per_round,
        "epochs": epochs,
        "algorithm": workload.algorithm,
        "partition": workload.partition if workload.partition != "dirichlet" else f"dirichlet({workload.alpha:g})",
        "client_sizes": {"min": int(sizes.min()), "median": float(np.median(sizes)), "max": int(sizes.max())},
    }
    if profiler is not None:
        out["profile"] = _profile_rows(profiler, profile_top, sum(times))
    on_round(total + 1, total + 1)
    return out


def _block_means(times: list[float], size: int) -> list[float]:
    """``times`` with each consecutive block of ``size`` replaced by its mean."""
    out = []
    for i in range(0, len(times), size):
        block = times[i : i + size]
        out += [sum(block) / len(block)] * len(block)
    return out


def measure_own_limit(sim, state, blocks: int, rounds: int) -> dict[str, Any]:
    """The simulator's rounds against their own limit (:mod:`fedbayes.bench.own_limit`), interleaved
    in ``blocks`` pairs of blocks of ``rounds`` rounds each: the simulator's rounds pipelined (as
    run_experiment runs them), then the same round indices as plain rounds (each prepared on the
    host before its clock starts), so that each pair saw the same machine state.

    Returns:
      ``own_limit_sim_s`` and ``own_limit_plain_s`` (seconds per round of each block, in pairs)
      and ``state`` (the simulator's state after its rounds).
    """
    import jax

    from fedbayes.bench.own_limit import first_device_state, plain_round, prepare_plain_round

    sim_s, plain_s = [], []
    for state, _ in sim.rounds(state, state.round + rounds, donate=True):  # a block of this length compiled
        pass
    server = first_device_state(sim, state.server_state)
    server = plain_round(sim, server, prepare_plain_round(sim, state, state.round))  # compiles
    for _ in range(blocks):
        start = state.round
        t0 = time.perf_counter()
        for state, _ in sim.rounds(state, start + rounds, donate=True):
            pass
        jax.block_until_ready(state.server_state)
        sim_s.append((time.perf_counter() - t0) / rounds)
        spent = 0.0
        for r in range(start, start + rounds):
            inputs = prepare_plain_round(sim, state, r)
            t0 = time.perf_counter()
            server = plain_round(sim, server, inputs)
            spent += time.perf_counter() - t0
        plain_s.append(spent / rounds)
    return {"own_limit_sim_s": sim_s, "own_limit_plain_s": plain_s, "state": state}


@functools.lru_cache(maxsize=4)
def _client_phase_program(sim):
    """The simulator's client phase alone, jitted with the round's XLA options (compiled on first use)."""
    import jax

    from fedbayes.sim.simulator import round_compiler_options

    algorithm = sim.algorithm
    return jax.jit(
        lambda server_state, *a: jax.tree.leaves(sim.client_phase(algorithm.broadcast(server_state), *a)[0]),
        compiler_options=round_compiler_options(sim.mesh.devices.flat[0].platform),
    )


def device_busy_times(sim, state):
    """Seconds each device of ``sim`` (a :class:`~fedbayes.sim.simulator.Simulator`) spends on its
    share of round ``state.round``'s client updates: ``[num_devices]``.

    A probe, run apart from the round: the client phase alone
    (:meth:`~fedbayes.sim.simulator.Simulator.client_phase`, which does not cross devices) is
    launched once its inputs are on the devices, and one thread per device waits for that
    device's share of the messages. The spread between devices is the time the round's server
    step waits for the slowest one. ``state`` is not changed.
    """
    import threading

    import jax
    import numpy as np

    program = _client_phase_program(sim)
    p = sim.prepare_round(state.round)
    a = p.args
    args = (state.server_state, sim.cohort_states(state, p), a.client_ids, a.offsets, a.num_examples, a.round_idx, a.x, a.y, a.order)
    jax.block_until_ready(args)
    done: dict[int, float] = {}
    t0 = time.perf_counter()
    first = program(*args)[0]

    def watch(shard):
        shard.data.block_until_ready()
        done[shard.device.id] = time.perf_counter() - t0

    threads = [threading.Thread(target=watch, args=(shard,)) for shard in first.addressable_shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return np.array([done[d.id] for d in sim.mesh.devices.flat])


def _profile_rows(profiler, top: int, total_s: float) -> list[dict[str, Any]]:
    import pstats

    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    rows = []
    for (path, line, name), (_, ncalls, tottime, cumtime, _) in stats.items():
        where = name if path == "~" else f"{os.path.basename(path)}:{line}({name})"
        rows.append({"function": where, "calls": ncalls, "own_s": tottime, "cum_s": cumtime, "own_share": tottime / total_s if total_s > 0 else 0.0})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:top]


def _central_epoch(loss, optimizer, num_examples: int, batch_size: int):
    """One jit-compiled epoch of shuffled minibatch training over ``num_examples`` examples.

    The last batch is partial and masked, exactly as a client's is (``fedbayes.models.loss_fn``).
    Compiled with the simulator round's XLA options, so that the per-step code is the clients'.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from fedbayes.sim.simulator import round_compiler_options

    steps = -(-num_examples // batch_size)
    pad = steps * batch_size - num_examples
    grad_fn = jax.grad(loss)

    def epoch(params, opt_state, key, x, y):
        perm = jax.random.permutation(key, num_examples).astype(jnp.int32)
        perm = jnp.concatenate([perm, jnp.zeros((pad,), jnp.int32)])

        def body(i, carry):
            p, s = carry
            start = i * batch_size
            idx = jax.lax.dynamic_slice(perm, (start,), (batch_size,))
            mask = ((start + jnp.arange(batch_size)) < num_examples).astype(jnp.float32)
            updates, s = optimizer.update(grad_fn(p, key, x[idx], y[idx], mask), s, p)
            return optax.apply_updates(p, updates), s

        return jax.lax.fori_loop(0, steps, body, (params, opt_state))

    return jax.jit(epoch, compiler_options=round_compiler_options(jax.devices()[0].platform))


def measure_limit(
    workload: LimitWorkload,
    settings: BenchSettings,
    *,
    share: int = 0,
    num_shares: int = 1,
    wait_for_go: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Times central training of share ``share`` of ``num_shares`` of the training set.

    One epoch compiles and warms up; then ``wait_for_go`` (if given) blocks until every process
    of the limit is ready; then ``settings.limit_reps`` epochs are timed, each with a new shuffle.

    Returns:
      ``examples`` (per epoch), ``first_s`` (the compile-and-warm-up epoch), ``rep_s`` (list),
      ``peak_rss_mb``, ``batch_size``.
    """
    import jax
    import numpy as np

    dataset = load_data(settings)
    bounds = np.linspace(0, dataset.num_train, num_shares + 1).astype(np.int64)
    lo, hi = int(bounds[share]), int(bounds[share + 1])
    batch_size = settings.large_batch if workload.large_batch else settings.batch_size
    params, trainer, _ = model_and_trainer(settings, dataset, batch_size)
    x = jax.device_put(dataset.x_train[lo:hi])
    y = jax.device_put(dataset.y_train[lo:hi])
    epoch = _central_epoch(trainer.loss_fn, trainer.optimizer, hi - lo, batch_size)
    key = jax.random.key(settings.seed + 1 + share)
    carry = (params, trainer.optimizer.init(params))
    t0 = time.perf_counter()
    carry = jax.block_until_ready(epoch(*carry, jax.random.fold_in(key, 0), x, y))
    first = time.perf_counter() - t0
    if wait_for_go is not None:
        wait_for_go()
    reps = []
    for r in range(settings.limit_reps):
        t0 = time.perf_counter()
        carry = jax.block_until_ready(epoch(*carry, jax.random.fold_in(key, r + 1), x, y))
        reps.append(time.perf_counter() - t0)
    return {"kind": "limit", "examples": hi - lo, "first_s": first, "rep_s": reps, "peak_rss_mb": peak_rss_mb(), "batch_size": batch_size}
