"""Round throughput against the machine's compute limit: the code behind ``fedbayes bench``.

Run on demand, never timed in the test suite. Every workload runs in its own
fresh Python process, so that its start-up, compile time and peak memory are its own, and so
that its XLA flags can be set before JAX starts.

Workloads (Fashion-MNIST, the MLP (200, 100), batch 32, client SGD; one local epoch unless the
workload sets ``epochs``):

* **Federated** (:class:`FederatedWorkload`): the :class:`~fedbayes.sim.simulator.Simulator` with
  one XLA host device per core (``--xla_force_host_platform_device_count=<cores>``, as the CLI
  sets it), running FedAvg, FedPA, FedEP (scaled identity; sites in device memory, or in the
  host memory store for ``fedep_100_host``) or a method of the PVI / FedLap family. The first
  round is timed on its own; then ``rounds`` further rounds run pipelined, as ``run_experiment``
  runs them (:meth:`~fedbayes.sim.simulator.Simulator.rounds`, ``donate=True``), each timed from the
  previous round's results to its own.

  - ``round_s``: median steady-state round time (the rounds after the first);
  - ``examples_per_s``: median over the steady rounds of the client examples the round trained,
    ``sum over the cohort of E * n_k``, divided by that round's time;
  - ``compile_s``: first round time minus ``round_s`` (tracing, compilation, first transfers);
  - ``startup_s``: wall time from just before the process was started to the end of its first
    round: interpreter, imports, data, partition, model, first compile and round (target for
    ``fedavg``: under 5 s), broken down in ``startup_parts``;
  - ``rejected``: client messages rejected in the timed rounds (0 for a healthy workload);
  - ``ratio_to_own_limit``: the workload's round against its own limit, the same rounds' client
    updates and server step as a plain jitted loop without the simulator
    (:mod:`fedbayes.bench.own_limit`), in ``settings.own_limit_blocks`` pairs of interleaved
    blocks of rounds after the timed ones: the plain loop's round time over the simulator's,
    median over the pairs (of every repeat), ``_range`` their min and max; above 1 the simulator
    is faster than its plain loop (it spreads the cohort over the devices and pipelines rounds);
    ``own_limit_round_s`` the plain loop's median round time;
  - ``device_busy_s`` (per device, median over ``settings.idle_probes`` probe rounds after the
    timed ones) and ``device_idle`` (median; ``device_idle_max`` the largest): each device's time
    on its share of the client phase alone, and the share of the devices' time spent waiting for
    the slowest, ``1 - mean(busy) / max(busy)``
    (:func:`fedbayes.bench.measure.device_busy_times`).

* **Relative** (:class:`RelativeWorkload`, :mod:`fedbayes.bench.relative`): a computation timed
  against a reference computation in one process, paired per repetition: ``curvature`` (the
  diagonal Fisher, empirical Fisher and GGN against a training step), ``cnn`` (the CNN FedAvg
  round against a plain jitted step loop) and ``vbnn`` (the VBNN round against the CNN FedAvg
  round). Each runs once per bench, after the repeats; its entry has ``"kind": "relative"`` and
  ``ratios`` (median, range, target, whether the median meets it), shown in a second table.

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
ratio again from one process that runs the workload and its baseline interleaved in blocks of 5
pipelined rounds (median over the pairs of blocks), free of the noise between processes; with several repeats every number is
the median over repeats (``*_range`` gives min and max of the throughput and the ratios;
``ratio_worst`` is the slowest repeat's ratio to the limit). ``peak_rss_mb`` is the peak resident set of the
process that ran the workload (``ru_maxrss``), for ``limit_b32`` the largest of its processes.

**The GPU record** (``fedbayes bench gpu``, settings :data:`GPU`, workloads :data:`GPU_WORKLOADS`):
FedAvg, FedEP, PVI and FedLap-Cov with 10 and 100 of 100 clients a round in the vmap layout with
the client states in device memory, each with ``ratio_to_own_limit`` (the same cohort as a plain
jitted loop on the device) and ``ratio_to_fedavg``; the CNN FedAvg round against a plain jitted
step loop and the VBNN round against it, at 10 and 100 clients. It needs no XLA host-device flags
(on a GPU backend they only shape the unused CPU platform) and no ``limit_b32``.

``fedavg_100_fused`` is ``fedavg_100`` with 10 rounds a compiled program (the simulator's
``fuse``); its round time is the mean over each block of 10 rounds.

The workloads are a registry keyed by name (:data:`WORKLOADS`); the algorithms that federated
workloads run are built by :func:`build_algorithm` through :mod:`fedbayes.algorithms.registry`
(every registered method, with its default settings). A new method adds its workloads to
:data:`WORKLOADS`; nothing else changes.

The package, one concept per module (everything public is exported here):

* :mod:`~fedbayes.bench.workloads`: settings, the workload registry, names and data checks, the
  algorithm builders, and :func:`build_simulator` (how every benchmark builds a workload);
* :mod:`~fedbayes.bench.measure`: in-process measurement (federated rounds, the compute limit,
  paired interleaved rounds, profiling);
* :mod:`~fedbayes.bench.protocol`: the subprocess protocol (spawning workers, reading their
  results, the worker's entry point);
* :mod:`~fedbayes.bench.report`: entries, summaries over repeats, the Markdown and rich tables;
* :mod:`~fedbayes.bench.run`: :func:`run_bench`, the driver behind ``fedbayes bench``, with each
  measurement's progress (:class:`Step`: a bar per measurement on a terminal, a line as each ends).

No module imports JAX at top level: the parent process only starts workers and formats their
results. Workers are ``python -m fedbayes.bench <spec-json>`` (:mod:`fedbayes.bench.__main__`).
"""

from fedbayes.bench.measure import measure_federated, measure_limit, measure_own_limit, measure_paired, peak_rss_mb
from fedbayes.bench.own_limit import plain_round, prepare_plain_round
from fedbayes.bench.protocol import (
    GO,
    PROGRESS_PREFIX,
    READY,
    RESULT_PREFIX,
    progress_lines,
    progress_of,
    run_federated_process,
    run_limit_processes,
    run_paired_process,
    run_relative_process,
    settings_from_dict,
    settings_to_dict,
)
from fedbayes.bench.relative import MEASURES as RELATIVE_MEASURES
from fedbayes.bench.report import (
    BASELINE_RATIO,
    COLUMNS,
    OWN_LIMIT_RATIO,
    PAIRED_RATIO,
    RELATIVE_COLUMNS,
    add_paired,
    describe_run,
    federated_entry,
    limit_entry,
    markdown,
    paired_ratios,
    relative_entry,
    relative_rows,
    rows,
    summarize,
    text_tables,
)
from fedbayes.bench.run import LoggedStep, Step, Steps, paired_groups, run_bench
from fedbayes.bench.workloads import (
    FULL,
    GPU,
    GPU_WORKLOADS,
    QUICK,
    REFERENCE,
    WORKLOADS,
    BenchError,
    BenchSettings,
    FederatedWorkload,
    LimitWorkload,
    RelativeWorkload,
    Workload,
    algorithm_names,
    baseline_of,
    build_algorithm,
    build_simulator,
    check_dataset,
    is_relative,
    load_data,
    model_and_trainer,
    resolve_names,
    steady_rounds,
    workload_epochs,
    workload_partition,
)

__all__ = [
    "algorithm_names",
    "BASELINE_RATIO",
    "COLUMNS",
    "FULL",
    "GPU",
    "GPU_WORKLOADS",
    "GO",
    "OWN_LIMIT_RATIO",
    "PAIRED_RATIO",
    "PROGRESS_PREFIX",
    "QUICK",
    "READY",
    "REFERENCE",
    "RELATIVE_COLUMNS",
    "RELATIVE_MEASURES",
    "RESULT_PREFIX",
    "WORKLOADS",
    "BenchError",
    "BenchSettings",
    "FederatedWorkload",
    "LimitWorkload",
    "LoggedStep",
    "RelativeWorkload",
    "Step",
    "Steps",
    "Workload",
    "add_paired",
    "baseline_of",
    "build_algorithm",
    "build_simulator",
    "check_dataset",
    "describe_run",
    "is_relative",
    "federated_entry",
    "limit_entry",
    "load_data",
    "markdown",
    "measure_federated",
    "measure_limit",
    "measure_own_limit",
    "measure_paired",
    "model_and_trainer",
    "paired_groups",
    "paired_ratios",
    "peak_rss_mb",
    "plain_round",
    "prepare_plain_round",
    "progress_lines",
    "progress_of",
    "relative_entry",
    "relative_rows",
    "resolve_names",
    "text_tables",
    "rows",
    "run_bench",
    "run_federated_process",
    "run_limit_processes",
    "run_paired_process",
    "run_relative_process",
    "settings_from_dict",
    "settings_to_dict",
    "steady_rounds",
    "summarize",
    "workload_epochs",
    "workload_partition",
]
