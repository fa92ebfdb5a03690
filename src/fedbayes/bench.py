"""Round throughput against the machine's compute limit: the code behind ``fedbayes bench``.

Issue 5, item 1. Run on demand, never timed in the test suite. Every workload runs in its own
fresh Python process, so that its start-up, compile time and peak memory are its own, and so
that its XLA flags can be set before JAX starts.

Workloads (Fashion-MNIST, the MLP (200, 100), batch 32, client SGD; one local epoch unless the
workload sets ``epochs``):

* **Federated** (:class:`FederatedWorkload`): the :class:`~fedbayes.simulate.Simulator` with
  one XLA host device per core (``--xla_force_host_platform_device_count=<cores>``, as the CLI
  sets it), running FedAvg, FedPA or FedEP (scaled identity, stateful sites in the memory store).
  The first round is timed on its own; then ``rounds`` further rounds, each
  ``run_round(state, donate=True)`` (as ``run_experiment`` runs them) timed to
  ``block_until_ready`` on the new server state.

  - ``round_s``: median steady-state round time (the rounds after the first);
  - ``examples_per_s``: median over the steady rounds of the client examples the round trained,
    ``sum over the cohort of E * n_k``, divided by that round's time;
  - ``compile_s``: first round time minus ``round_s`` (tracing, compilation, first transfers);
  - ``startup_s``: wall time from just before the process was started to the end of its first
    round: interpreter, imports, data, partition, model, first compile and round (issue 5 target
    for ``fedavg``: under 5 s), broken down in ``startup_parts``.

* **Limits** (:class:`LimitWorkload`): the same examples (the whole training set, one epoch per
  repetition) trained centrally by one ``jit``-compiled ``lax.fori_loop`` over shuffled
  minibatches with the same model, loss and client optimizer; no federation, no server.

  - ``limit_b32``: at the clients' batch size, using every core the way that is known to use
    them fully at small batch: one single-threaded process per core (pinned with
    ``os.sched_setaffinity``; ``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false
    intra_op_parallelism_threads=1`` and one host device), each training an equal share of the
    examples. The processes compile and warm up, wait for a common start signal, then run their
    repetitions concurrently; ``examples_per_s`` is the sum of their rates (share / median
    repetition time). ``round_s`` is the slowest process's median epoch time.
  - ``limit_large_batch``: batch 1024 in one process that uses all cores (XLA's default
    threading, one device).

``ratio_to_limit`` is a workload's ``examples_per_s`` over ``limit_b32``'s **measured in the
same repeat**, and ``ratio_to_fedavg`` (FedPA, FedEP) over its ``baseline``'s, FedAvg on the same
federation with the same local epochs, in the same repeat; ``paired_ratio_to_fedavg`` is that
ratio again from one process that runs the workload and its baseline with their rounds
interleaved (median over the pairs of rounds), free of the noise between processes; with several repeats every number is
the median over repeats (``*_range`` gives min and max of the throughput and the ratios). ``peak_rss_mb`` is the peak resident set of the
process that ran the workload (``ru_maxrss``), for ``limit_b32`` the largest of its processes.

The workloads are a registry keyed by name (:data:`WORKLOADS`); algorithms that federated
workloads run are a registry too (:data:`ALGORITHMS`, builders from a
:class:`~fedbayes.inference.sgd.LocalTrainer` and a :class:`BuildContext`). A new method adds a
builder there and its workloads here; nothing else changes.

This module imports no JAX at top level: the parent process only starts workers and formats
their results. Workers are ``python -m fedbayes.bench <spec-json>``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from fedbayes.hostdevices import num_cores, xla_flags

RESULT_PREFIX = "FEDBAYES_BENCH_RESULT "
READY = "FEDBAYES_BENCH_READY"
GO = "go"


class BenchError(RuntimeError):
    """A benchmark could not run (missing data, unknown workload, a worker that failed)."""


# ----- settings and workloads -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BenchSettings:
    """What every workload shares, and how long each is measured.

    Attributes:
      dataset: registered dataset name (``fashion_mnist``; tests use ``digits``).
      data_dir: folder to read the dataset from (``None``: the registry's search order).
      hidden: MLP hidden widths.
      batch_size: client (and ``limit_b32``) minibatch size.
      large_batch: ``limit_large_batch``'s minibatch size.
      epochs: local epochs per round.
      lr: client SGD learning rate (does not change the cost; kept realistic so that no message
        is rejected as non-finite).
      rounds: steady-state rounds per federated workload (scaled by its ``rounds_scale``).
      limit_reps: timed epochs per limit process (after one compile-and-warm-up epoch).
      repeats: how many times the whole set of workloads runs; numbers are medians over repeats.
      seed: seeds partitions, cohorts, initial parameters and shuffles.
    """

    dataset: str = "fashion_mnist"
    data_dir: str | None = None
    hidden: tuple[int, ...] = (200, 100)
    batch_size: int = 32
    large_batch: int = 1024
    epochs: int = 1
    lr: float = 0.05
    rounds: int = 10
    limit_reps: int = 8
    repeats: int = 5
    seed: int = 0


FULL = BenchSettings()
# A smoke check under two minutes on 2 cores (94 s quiet, paired stage included; the 3-epoch
# 10-of-10 workloads then time one steady round each).
QUICK = BenchSettings(rounds=2, limit_reps=3, repeats=1)


@dataclasses.dataclass(frozen=True)
class FederatedWorkload:
    """A simulated federated run, measured round by round.

    Attributes:
      name: registry key and JSON key.
      algorithm: key of :data:`ALGORITHMS`.
      num_clients: ``K``.
      clients_per_round: cohort size ``M``.
      partition: ``"iid"`` or ``"dirichlet"`` (label Dirichlet, unequal client sizes).
      alpha: Dirichlet concentration (``partition="dirichlet"`` only).
      rounds_scale: steady rounds are ``ceil(settings.rounds * rounds_scale)`` (small rounds get
        more of them, so that each workload is timed over a similar number of examples).
      description: one line, reported as the entry's ``description``.
      epochs: local epochs per round (``None``: ``settings.epochs``). FedPA needs at least 2
        (one IASG sample per epoch after the first); FedEP's SG-MCMC step takes one sample per
        epoch.
      baseline: another federated workload (FedAvg at the same epochs and federation) whose
        ``examples_per_s`` **in the same repeat** is the denominator of this workload's
        ``ratio_to_fedavg``; it always runs with this one.
    """

    name: str
    algorithm: str
    num_clients: int
    clients_per_round: int
    partition: str = "iid"
    alpha: float = 0.5
    rounds_scale: float = 1.0
    description: str = ""
    epochs: int | None = None
    baseline: str | None = None


@dataclasses.dataclass(frozen=True)
class LimitWorkload:
    """Central ``jit``-compiled training of the same examples (see the module docstring).

    Attributes:
      name: registry key and JSON key.
      large_batch: use ``settings.large_batch`` instead of the clients' ``batch_size``.
      per_core: one pinned single-threaded process per core (True) or one process on all cores.
      description: one line, reported as the entry's ``description``.
    """

    name: str
    large_batch: bool
    per_core: bool
    description: str = ""


Workload = FederatedWorkload | LimitWorkload
REFERENCE = "limit_b32"  # the denominator of ratio_to_limit

WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        LimitWorkload(REFERENCE, large_batch=False, per_core=True, description="central jit loop, batch 32, 1 pinned 1-thread process per core"),
        LimitWorkload("limit_large_batch", large_batch=True, per_core=False, description="central jit loop, large batch, 1 process on all cores"),
        FederatedWorkload("fedavg", "fedavg", 10, 10, description="FedAvg, 10 of 10 IID clients"),
        FederatedWorkload("fedavg_100", "fedavg", 100, 10, rounds_scale=5.0, description="FedAvg, 10 of 100 IID clients"),
        FederatedWorkload("fedavg_dirichlet", "fedavg", 10, 10, partition="dirichlet", alpha=0.5, description="FedAvg, 10 of 10, Dirichlet(0.5) label split"),
        # Posterior methods against FedAvg at the same local epochs (3: FedPA's 2 IASG samples
        # after one mixing epoch; FedEP's SG-MCMC takes 3 end-of-epoch samples).
        FederatedWorkload("fedavg_e3", "fedavg", 10, 10, epochs=3, rounds_scale=0.5, description="FedAvg, 10 of 10 IID clients, 3 epochs"),
        FederatedWorkload("fedpa", "fedpa", 10, 10, epochs=3, rounds_scale=0.5, baseline="fedavg_e3", description="FedPA (rho 0.01, 2 samples), 10 of 10 IID clients, 3 epochs"),
        FederatedWorkload("fedep", "fedep", 10, 10, epochs=3, rounds_scale=0.5, baseline="fedavg_e3", description="FedEP (identity, stateful sites), 10 of 10 IID clients, 3 epochs"),
        FederatedWorkload("fedavg_e3_100", "fedavg", 100, 10, epochs=3, rounds_scale=2.0, description="FedAvg, 10 of 100 IID clients, 3 epochs"),
        FederatedWorkload("fedpa_100", "fedpa", 100, 10, epochs=3, rounds_scale=2.0, baseline="fedavg_e3_100", description="FedPA, 10 of 100 IID clients, 3 epochs"),
        FederatedWorkload("fedep_100", "fedep", 100, 10, epochs=3, rounds_scale=2.0, baseline="fedavg_e3_100", description="FedEP (identity, stateful sites), 10 of 100 IID clients, 3 epochs"),
    )
}
BASELINE_RATIO = "ratio_to_fedavg"  # a workload's examples_per_s over its baseline's, same repeat
PAIRED_RATIO = "paired_ratio_to_fedavg"  # the same, from rounds interleaved in one process


class BuildContext(NamedTuple):
    """What an algorithm builder may need besides the trainer (FedEP: ``N``, ``K``, ``M``)."""

    num_clients: int
    clients_per_round: int
    total_examples: int
    apply_fn: Callable[..., Any]
    task: str


def _fedavg(trainer, ctx: BuildContext):
    import optax

    from fedbayes.algorithms import fedavg

    del ctx
    return fedavg(trainer, optax.sgd(1.0))


def _fedpa(trainer, ctx: BuildContext):
    import optax

    from fedbayes.algorithms import fedpa

    del ctx
    return fedpa(trainer, optax.sgd(1.0), rho=0.01, skip_epochs=1)


def _fedep(trainer, ctx: BuildContext, *, stateful: bool = True):
    """FedEP (or stateless FedSEP) with the scaled-identity client method, as
    :func:`fedbayes.experiment.build_algorithm` builds it from a default config (damping ``1/M``,
    :class:`~fedbayes.inference.tilted.TiltedSettings` defaults, no burn-in)."""
    import optax

    from fedbayes.algorithms import fedep, fedsep
    from fedbayes.inference.tilted import TiltedSettings, make_tilted_inference

    settings = TiltedSettings()
    inference = make_tilted_inference("identity", trainer, settings, apply_fn=ctx.apply_fn, task=ctx.task)
    kwargs = dict(total_examples=ctx.total_examples, num_clients=ctx.num_clients, damping=1.0 / ctx.clients_per_round, alpha_cov=settings.alpha_cov)
    build = fedep if stateful else fedsep
    return build(trainer, optax.sgd(1.0), inference, **kwargs)


# Algorithm name -> builder from a LocalTrainer and a BuildContext.
ALGORITHMS: dict[str, Callable[[Any, BuildContext], Any]] = {
    "fedavg": _fedavg,
    "fedpa": _fedpa,
    "fedep": _fedep,
    "fedsep": lambda trainer, ctx: _fedep(trainer, ctx, stateful=False),
}




def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----- what a worker measures (importable and callable in-process) -----------------------------
def _load(settings: BenchSettings):
    from fedbayes.data import load_dataset

    return load_dataset(settings.dataset, data_dir=settings.data_dir, seed=settings.seed)


def _model_and_trainer(settings: BenchSettings, dataset, batch_size: int, epochs: int | None = None):
    """``(params, trainer, apply_fn)`` of the MLP; ``epochs`` overrides ``settings.epochs``."""
    import jax
    import optax

    from fedbayes.inference.sgd import LocalTrainer
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("mlp", dataset.num_classes, hidden=settings.hidden)
    params = init_params(model, jax.random.key(settings.seed), dataset.feature_shape)
    trainer = LocalTrainer(loss_fn(model, dataset.task), optax.sgd(settings.lr), epochs or settings.epochs, batch_size)
    return params, trainer, lambda p, x: model.apply({"params": p}, x)


def workload_epochs(workload: "FederatedWorkload", settings: BenchSettings) -> int:
    return workload.epochs or settings.epochs


def steady_rounds(workload: FederatedWorkload, settings: BenchSettings) -> int:
    return max(1, math.ceil(settings.rounds * workload.rounds_scale))


def workload_partition(workload: FederatedWorkload, settings: BenchSettings, dataset) -> list:
    """The workload's clients: index arrays into the training set (seeded by ``settings.seed``)."""
    import numpy as np

    from fedbayes.data import partition

    params_p = {"alpha": workload.alpha} if workload.partition == "dirichlet" else {}
    return partition(workload.partition, dataset.y_train, workload.num_clients, np.random.default_rng([settings.seed, 2]), **params_p)


def build_simulator(workload: FederatedWorkload, settings: BenchSettings, dataset, parts=None, **simulator_kwargs):
    """``(simulator, initial state)`` of a federated workload, as every benchmark builds it.

    ``parts`` defaults to :func:`workload_partition`; ``simulator_kwargs`` go to
    :class:`~fedbayes.simulate.Simulator` (e.g. ``store="disk"``).
    """
    from fedbayes.simulate import Federation, Simulator

    if workload.algorithm not in ALGORITHMS:
        raise BenchError(f"workload {workload.name!r}: unknown algorithm {workload.algorithm!r}; known: {', '.join(ALGORITHMS)}")
    parts = workload_partition(workload, settings, dataset) if parts is None else parts
    params, trainer, apply_fn = _model_and_trainer(settings, dataset, settings.batch_size, workload_epochs(workload, settings))
    federation = Federation(dataset.x_train, dataset.y_train, tuple(parts))
    ctx = BuildContext(workload.num_clients, workload.clients_per_round, int(sum(federation.sizes)), apply_fn, dataset.task)
    algorithm = ALGORITHMS[workload.algorithm](trainer, ctx)
    sim = Simulator(algorithm, federation, clients_per_round=workload.clients_per_round, seed=settings.seed, **simulator_kwargs)
    return sim, sim.init(params)


def measure_paired(names: Sequence[str], settings: BenchSettings, rounds: int | None = None) -> dict[str, Any]:
    """Times federated workloads in this one process, their rounds interleaved.

    Every workload is built and compiled (two rounds), then ``rounds`` passes each run one round
    of every workload in turn (default: the first workload's :func:`steady_rounds`). Paired
    rounds saw the same machine state, so the ratio of their times is far less noisy than a ratio
    of separate processes' medians (on the 2-core development VM a fresh process's throughput
    varies by up to +-25%).

    Returns:
      ``{"round_s": {name: [seconds per pass]}, "examples": {name: [examples per pass]}}``.
    """
    import jax

    workloads = [WORKLOADS.get(n) for n in names]
    if not all(isinstance(w, FederatedWorkload) for w in workloads):
        raise BenchError(f"paired timing takes federated workloads only; got {list(names)}")
    dataset = _load(settings)
    runs = []
    for w in workloads:
        sim, state = build_simulator(w, settings, dataset)
        for _ in range(2):
            state, _ = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        runs.append([sim, state])
    times: dict[str, list[float]] = {n: [] for n in names}
    examples: dict[str, list[int]] = {n: [] for n in names}
    for _ in range(rounds or steady_rounds(workloads[0], settings)):
        for w, run in zip(workloads, runs):
            sim, state = run
            t0 = time.perf_counter()
            state, info = sim.run_round(state, donate=True)
            jax.block_until_ready(state.server_state)
            times[w.name].append(time.perf_counter() - t0)
            examples[w.name].append(int(sim.federation.sizes[info.cohort].sum()) * workload_epochs(w, settings))
            run[1] = state
    return {"kind": "paired", "round_s": times, "examples": examples}


def paired_ratios(raw: dict[str, Any], baseline: str) -> dict[str, list[float]]:
    """Per pass, each workload's throughput over ``baseline``'s in the same pass."""
    rate = {n: [e / t for e, t in zip(raw["examples"][n], raw["round_s"][n])] for n in raw["round_s"]}
    return {n: [a / b for a, b in zip(r, rate[baseline])] for n, r in rate.items() if n != baseline}


def measure_federated(
    workload: FederatedWorkload,
    settings: BenchSettings,
    *,
    spawn_time: float | None = None,
    profile_top: int = 0,
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

    Returns:
      ``first_round_s``, ``round_s`` (list, steady rounds), ``examples``, ``padding_waste`` and
      ``step_waste`` (lists, per steady round, the last two as the simulator reports them),
      ``startup_s``, ``startup_parts``, ``peak_rss_mb`` and a description of the layout.
    """
    t_enter = time.time()
    import jax
    import numpy as np

    import fedbayes.simulate  # noqa: F401  (imports counted before the data step, as before)

    t_imported = time.time()
    dataset = _load(settings)
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

    sizes = federation.sizes
    times, examples, padding, step_waste = [], [], [], []
    profiler = None
    if profile_top > 0:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    for _ in range(steady_rounds(workload, settings)):
        t0 = time.perf_counter()
        state, info = sim.run_round(state, donate=True)
        jax.block_until_ready(state.server_state)
        times.append(time.perf_counter() - t0)
        examples.append(int(sizes[np.asarray(info.cohort)].sum()) * epochs)
        padding.append(float(info.padding_waste))
        step_waste.append(float(info.step_waste))
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
        "layout": sim.layout,
        "devices": len(jax.local_devices()),
        "num_clients": workload.num_clients,
        "clients_per_round": workload.clients_per_round,
        "epochs": epochs,
        "algorithm": workload.algorithm,
        "partition": workload.partition if workload.partition != "dirichlet" else f"dirichlet({workload.alpha:g})",
        "client_sizes": {"min": int(sizes.min()), "median": float(np.median(sizes)), "max": int(sizes.max())},
    }
    if profiler is not None:
        profiler.disable()
        out["profile"] = _profile_rows(profiler, profile_top, sum(times))
    return out


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

    from fedbayes.simulate import round_compiler_options

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

    dataset = _load(settings)
    bounds = np.linspace(0, dataset.num_train, num_shares + 1).astype(np.int64)
    lo, hi = int(bounds[share]), int(bounds[share + 1])
    batch_size = settings.large_batch if workload.large_batch else settings.batch_size
    params, trainer, _ = _model_and_trainer(settings, dataset, batch_size)
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


# ----- from raw timings to the reported entry ---------------------------------------------------
def federated_entry(raw: dict[str, Any]) -> dict[str, Any]:
    """The reported numbers of one federated run (see the module docstring)."""
    round_s = statistics.median(raw["round_s"])
    rates = [n / t for n, t in zip(raw["examples"], raw["round_s"])]
    entry = {
        "examples_per_s": statistics.median(rates),
        "round_s": round_s,
        "compile_s": raw["first_round_s"] - round_s,
        "first_round_s": raw["first_round_s"],
        "startup_s": raw["startup_s"],
        "startup_parts": dict(raw["startup_parts"]),
        "peak_rss_mb": raw["peak_rss_mb"],
        "examples_per_round": statistics.median_low(raw["examples"]),
        "rounds": len(raw["round_s"]),
        "padding_waste": statistics.median(raw["padding_waste"]),
        "step_waste": statistics.median(raw["step_waste"]),
    }
    for k in ("num_clients", "clients_per_round", "epochs", "algorithm", "partition", "layout", "devices", "client_sizes", "profile"):
        if k in raw:
            entry[k] = raw[k]
    return entry


def limit_entry(raws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The reported numbers of one limit run from its processes' raw timings (rates summed)."""
    medians = [statistics.median(r["rep_s"]) for r in raws]
    return {
        "examples_per_s": sum(r["examples"] / m for r, m in zip(raws, medians)),
        "round_s": max(medians),
        "compile_s": statistics.median([r["first_s"] - m for r, m in zip(raws, medians)]),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in raws),
        "examples_per_round": sum(r["examples"] for r in raws),
        "rounds": min(len(r["rep_s"]) for r in raws),
        "batch_size": raws[0]["batch_size"],
        "processes": len(raws),
    }


def _median_tree(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, bool) or first is None:
        return first
    if isinstance(first, int):
        return statistics.median_low(values)  # counts stay integers
    if isinstance(first, float):
        return statistics.median(values)
    if isinstance(first, dict):
        return {k: _median_tree([v[k] for v in values if k in v]) for k in first}
    return first


def summarize(repeats: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Combines per-repeat entries into one JSON-ready object keyed by workload.

    Each repeat maps workload name -> entry (from :func:`federated_entry` / :func:`limit_entry`)
    and must hold :data:`REFERENCE`. ``ratio_to_limit`` is computed within each repeat, and so is
    ``ratio_to_fedavg`` (a workload's throughput over its ``baseline``'s, when both ran); then
    every numeric field is the median over repeats; with several repeats
    ``examples_per_s_range``, ``ratio_range`` and ``ratio_to_fedavg_range`` give [min, max].
    """
    if not repeats:
        raise BenchError("no measurements to summarize")
    for i, rep in enumerate(repeats):
        if REFERENCE not in rep:
            raise BenchError(f"repeat {i} lacks {REFERENCE!r}, the denominator of ratio_to_limit")
    out: dict[str, dict[str, Any]] = {}
    for name in repeats[0]:
        entries = []
        for rep in repeats:
            e = dict(rep[name])
            e["ratio_to_limit"] = e["examples_per_s"] / rep[REFERENCE]["examples_per_s"]
            base = _baseline(name)
            if base is not None and base in rep:
                e[BASELINE_RATIO] = e["examples_per_s"] / rep[base]["examples_per_s"]
            entries.append(e)
        merged = _median_tree(entries)
        merged["repeats"] = len(entries)
        if len(entries) > 1:
            merged["examples_per_s_range"] = [min(e["examples_per_s"] for e in entries), max(e["examples_per_s"] for e in entries)]
            merged["ratio_range"] = [min(e["ratio_to_limit"] for e in entries), max(e["ratio_to_limit"] for e in entries)]
            if BASELINE_RATIO in merged:
                got = [e[BASELINE_RATIO] for e in entries if BASELINE_RATIO in e]
                merged[BASELINE_RATIO + "_range"] = [min(got), max(got)]
        w = WORKLOADS.get(name)
        if w is not None:
            merged["description"] = w.description
            if _baseline(name) is not None and BASELINE_RATIO in merged:
                merged["baseline"] = _baseline(name)
        out[name] = merged
    return out


def _baseline(name: str) -> str | None:
    w = WORKLOADS.get(name)
    return w.baseline if isinstance(w, FederatedWorkload) else None


# ----- running workers --------------------------------------------------------------------------
def _spawn(spec: dict[str, Any], env_flags: str, stderr) -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS=env_flags)
    return subprocess.Popen(
        [sys.executable, "-m", "fedbayes.bench", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=stderr,
        env=env,
        text=True,
        bufsize=1,
    )


def _read_result(proc: subprocess.Popen, errfile, label: str) -> dict[str, Any]:
    result = None
    for line in proc.stdout:
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    code = proc.wait()
    if code != 0 or result is None:
        errfile.seek(0)
        tail = "\n".join(errfile.read().strip().splitlines()[-15:])
        raise BenchError(f"benchmark worker {label} failed (exit code {code}):\n{tail}")
    return result


def _settings_dict(settings: BenchSettings) -> dict[str, Any]:
    return dataclasses.asdict(settings)


def run_federated_process(workload: FederatedWorkload, settings: BenchSettings, *, profile_top: int = 0) -> dict[str, Any]:
    """Runs one federated workload in a fresh process laid out as the CLI lays itself out (one XLA
    host device per core)."""
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    with tempfile.TemporaryFile("w+") as err:
        spec = {"workload": workload.name, "settings": _settings_dict(settings), "spawn_time": time.time(), "profile_top": profile_top}
        proc = _spawn(spec, flags, err)
        proc.stdin.close()
        return _read_result(proc, err, workload.name)


def run_limit_processes(workload: LimitWorkload, settings: BenchSettings) -> list[dict[str, Any]]:
    """Runs a limit: one pinned single-threaded process per core started together, or one process."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(num_cores()))
    base = os.environ.get("XLA_FLAGS", "")
    if workload.per_core:
        plan = [(i, core) for i, core in enumerate(cores)]
        flags = xla_flags(base, device_count=1, single_thread=True)
    else:
        plan = [(0, None)]
        flags = xla_flags(base, device_count=1)
    errs = [tempfile.TemporaryFile("w+") for _ in plan]
    procs = []
    try:
        for (share, core), err in zip(plan, errs):
            spec = {"workload": workload.name, "settings": _settings_dict(settings), "share": share, "num_shares": len(plan), "core": core, "sync": True}
            procs.append(_spawn(spec, flags, err))
        for proc, err, (share, _) in zip(procs, errs, plan):  # every process compiled and warm
            line = proc.stdout.readline()
            if line.strip() != READY:
                proc.kill()
                proc.wait()
                err.seek(0)
                tail = "\n".join(err.read().strip().splitlines()[-15:])
                raise BenchError(f"benchmark worker {workload.name}[{share}] did not start (exit code {proc.returncode}):\n{tail}")
        for proc in procs:
            proc.stdin.write(GO + "\n")
            proc.stdin.flush()
            proc.stdin.close()
        return [_read_result(p, e, f"{workload.name}[{s}]") for p, e, (s, _) in zip(procs, errs, plan)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for e in errs:
            e.close()


def run_paired_process(names: Sequence[str], settings: BenchSettings, rounds: int) -> dict[str, Any]:
    """Runs :func:`measure_paired` for ``names`` in a fresh process laid out as the CLI's."""
    flags = xla_flags(os.environ.get("XLA_FLAGS", ""), device_count=num_cores())
    with tempfile.TemporaryFile("w+") as err:
        spec = {"paired": list(names), "rounds": rounds, "settings": _settings_dict(settings)}
        proc = _spawn(spec, flags, err)
        proc.stdin.close()
        return _read_result(proc, err, "paired " + "+".join(names))


def paired_groups(names: Sequence[str]) -> dict[str, list[str]]:
    """``baseline -> [baseline, *workloads measured against it]`` among ``names``."""
    groups: dict[str, list[str]] = {}
    for n in names:
        base = _baseline(n)
        if base is not None and base in names:
            groups.setdefault(base, [base]).append(n)
    return groups


def add_paired(results: dict[str, dict[str, Any]], raw: dict[str, Any], baseline: str) -> None:
    """Adds :data:`PAIRED_RATIO` (median over passes), its ``_range`` and ``paired_rounds`` to
    each non-baseline workload's entry of ``results``."""
    for name, ratios in paired_ratios(raw, baseline).items():
        entry = results.setdefault(name, {})
        entry[PAIRED_RATIO] = statistics.median(ratios)
        entry[PAIRED_RATIO + "_range"] = [min(ratios), max(ratios)]
        entry["paired_rounds"] = len(ratios)


def check_dataset(settings: BenchSettings) -> None:
    """Raises :class:`BenchError` saying how to get the data when it is not on this machine."""
    from fedbayes.data import DATASETS

    if settings.dataset not in DATASETS:
        raise BenchError(f"unknown dataset {settings.dataset!r}; known: {', '.join(DATASETS)}")
    present, detail = DATASETS[settings.dataset].locate(settings.data_dir)
    if not present:
        raise BenchError(f"{settings.dataset} is not on this machine, and the benchmark needs it. {detail} (fedbayes bench --data-dir FOLDER reads it from FOLDER.)")


def resolve_names(names: Sequence[str] | None) -> list[str]:
    """The workloads to run, in registry order, always with :data:`REFERENCE` (the denominator)
    and with each named workload's ``baseline``."""
    if not names:
        return list(WORKLOADS)
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise BenchError(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    wanted = set(names) | {REFERENCE} | {b for b in map(_baseline, names) if b is not None}
    return [n for n in WORKLOADS if n in wanted]


def run_bench(
    settings: BenchSettings,
    names: Sequence[str] | None = None,
    *,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, dict[str, Any]]:
    """Runs the workloads ``settings.repeats`` times, each in its own process(es), interleaved
    (all workloads of repeat 1, then of repeat 2, ...) so that a change in machine load affects
    workloads and limit alike, and returns :func:`summarize`'s object; then each group of
    workloads that share a ``baseline`` runs once more in one process (:func:`measure_paired`,
    ``steady_rounds * repeats`` interleaved rounds), which adds :data:`PAIRED_RATIO`."""
    check_dataset(settings)
    names = resolve_names(names)
    repeats = []
    for r in range(settings.repeats):
        rep = {}
        for name in names:
            w = WORKLOADS[name]
            t0 = time.perf_counter()
            if isinstance(w, LimitWorkload):
                rep[name] = limit_entry(run_limit_processes(w, settings))
            else:
                rep[name] = federated_entry(run_federated_process(w, settings))
            log(f"repeat {r + 1}/{settings.repeats}  {name:<18} {rep[name]['examples_per_s']:>10,.0f} examples/s  ({time.perf_counter() - t0:.1f} s)")
        repeats.append(rep)
    results = summarize(repeats)
    # The posterior methods against FedAvg once more, rounds interleaved in one process: the same
    # ratio as ratio_to_fedavg without the process-to-process noise.
    for base, group in paired_groups(names).items():
        rounds = steady_rounds(WORKLOADS[base], settings) * settings.repeats
        t0 = time.perf_counter()
        add_paired(results, run_paired_process(group, settings, rounds), base)
        log(f"paired        {' + '.join(group):<40} {rounds} interleaved rounds each ({time.perf_counter() - t0:.1f} s)")
    return results


# ----- presentation -----------------------------------------------------------------------------
COLUMNS = ("workload", "examples/s", "ratio to limit", "vs FedAvg", "vs FedAvg, paired", "round (s)", "compile (s)", "start-up (s)", "peak RSS (MB)", "clients / processes")


def rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Table rows (strings) in :data:`COLUMNS` order."""
    out = []
    for name, e in results.items():
        ratio = f"{e['ratio_to_limit']:.2f}"
        if "ratio_range" in e and name != REFERENCE:
            ratio += f" ({e['ratio_range'][0]:.2f}-{e['ratio_range'][1]:.2f})"
        vs = ""
        if BASELINE_RATIO in e:
            vs = f"{e[BASELINE_RATIO]:.2f}"
            if BASELINE_RATIO + "_range" in e:
                lo, hi = e[BASELINE_RATIO + "_range"]
                vs += f" ({lo:.2f}-{hi:.2f})"
        paired = ""
        if PAIRED_RATIO in e:
            lo, hi = e[PAIRED_RATIO + "_range"]
            paired = f"{e[PAIRED_RATIO]:.2f} ({lo:.2f}-{hi:.2f})"
        if "clients_per_round" in e:
            clients = f"{e['clients_per_round']} of {e['num_clients']}, {e['partition']}"
            if e.get("epochs", 1) != 1:
                clients += f", {e['epochs']} epochs"
        else:
            clients = f"{e['processes']} process{'es' if e['processes'] > 1 else ''}, batch {e['batch_size']}"
        startup = f"{e['startup_s']:.1f}" if "startup_s" in e else ""
        out.append(
            [
                name,
                f"{e['examples_per_s']:,.0f}",
                ratio,
                vs,
                paired,
                f"{e['round_s']:.3f}",
                f"{e['compile_s']:.2f}",
                startup,
                f"{e['peak_rss_mb']:,.0f}",
                clients,
            ]
        )
    return out


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The table as Markdown."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows(results)]
    return "\n".join(lines) + "\n"


def rich_table(results: dict[str, dict[str, Any]], title: str | None = None):
    """The table for a terminal (``rich``)."""
    from rich.table import Table

    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("workload", COLUMNS[-1]) else "right")
    for r in rows(results):
        table.add_row(*r)
    return table


def describe_run(settings: BenchSettings, quick: bool) -> str:
    """One line: mode, cores, versions, date (jax's version read without importing it)."""
    from importlib.metadata import version

    return (
        f"fedbayes bench{' --quick' if quick else ''}: {settings.dataset}, MLP {settings.hidden}, batch {settings.batch_size}, "
        f"{settings.epochs} local epoch unless a workload says otherwise; {num_cores()} cores; jax {version('jax')}; {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{settings.repeats} repeat{'s' if settings.repeats > 1 else ''}"
    )


# ----- worker entry point -----------------------------------------------------------------------
def _worker(argv: Sequence[str]) -> None:
    spec = json.loads(argv[0])
    if spec.get("core") is not None:
        os.sched_setaffinity(0, {spec["core"]})  # before JAX starts its threads
    s = dict(spec["settings"])
    s["hidden"] = tuple(s["hidden"])
    settings = BenchSettings(**s)
    if "paired" in spec:
        print(RESULT_PREFIX + json.dumps(measure_paired(spec["paired"], settings, spec.get("rounds"))), flush=True)
        return
    workload = WORKLOADS[spec["workload"]]
    if isinstance(workload, LimitWorkload):

        def wait_for_go():
            print(READY, flush=True)
            if sys.stdin.readline().strip() != GO:
                raise BenchError("the parent process stopped before the start signal")

        raw = measure_limit(workload, settings, share=spec["share"], num_shares=spec["num_shares"], wait_for_go=wait_for_go if spec.get("sync") else None)
    else:
        raw = measure_federated(workload, settings, spawn_time=spec.get("spawn_time"), profile_top=spec.get("profile_top", 0))
    print(RESULT_PREFIX + json.dumps(raw), flush=True)


if __name__ == "__main__":
    _worker(sys.argv[1:])
