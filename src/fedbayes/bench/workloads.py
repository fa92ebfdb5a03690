"""The benchmark's workloads and settings, and how a workload's simulator is built.

:data:`WORKLOADS` is the registry of what ``fedbayes bench`` measures (see :mod:`fedbayes.bench`
for what each number means); :func:`build_simulator` builds a federated workload exactly as every
benchmark (``fedbayes bench``, ``benchmarks/*.py``) runs it. The algorithms a workload names are
built by :func:`build_algorithm`, a small stand-in for ``fedbayes.algorithms.registry``.

No JAX at top level: the parent process of ``fedbayes bench`` imports this module too.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any


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
      image_shape: input shape of the relative workloads' CNN (the MLP's is its flattening).
      curvature_models: the models of the ``curvature`` workload (``mlp``, ``cnn``).
      relative_reps: paired repetitions of each relative workload (:mod:`fedbayes.bench.relative`).
      cnn_clients, cnn_per_client, cnn_batch: the ``cnn`` and ``vbnn`` workloads' federation
        (all clients in every round, one local epoch) and client batch size.
      own_limit_blocks, own_limit_rounds: pairs of blocks, and rounds per block (at most the
        workload's steady rounds), in which a federated workload's rounds are timed against the
        same rounds as a plain jitted loop (:mod:`fedbayes.bench.own_limit`).
      paired: run the paired process of each group of workloads that share a baseline
        (``paired_ratio_to_fedavg``).
      idle_probes: rounds whose client phase is probed for each device's busy time
        (:func:`fedbayes.bench.measure.device_busy_times`) after a federated workload's
        timed rounds.
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
    image_shape: tuple[int, ...] = (28, 28, 1)
    curvature_models: tuple[str, ...] = ("mlp", "cnn")
    relative_reps: int = 15
    cnn_clients: int = 10
    cnn_per_client: int = 640
    cnn_batch: int = 64
    idle_probes: int = 5
    own_limit_blocks: int = 3
    own_limit_rounds: int = 5
    paired: bool = True


FULL = BenchSettings()
# A smoke check: every workload compiles and runs a few rounds, one repeat; compiles are most of
# its time (docs/results/bench.md, 2026-11-24, "pipelined rounds, the device store, device idle").
QUICK = BenchSettings(rounds=2, limit_reps=3, repeats=1, relative_reps=3, cnn_per_client=128, idle_probes=2, own_limit_blocks=1)
# The GPU record (``fedbayes bench gpu``, :data:`GPU_WORKLOADS`): one repeat, no paired processes
# (each workload's own limit and its ratio to FedAvg come from its own process), kept short.
GPU = BenchSettings(rounds=4, repeats=1, relative_reps=5, idle_probes=0, own_limit_blocks=2, own_limit_rounds=2, paired=False)


@dataclasses.dataclass(frozen=True)
class FederatedWorkload:
    """A simulated federated run, measured round by round.

    Attributes:
      name: registry key and JSON key.
      algorithm: a registered algorithm (built by :func:`build_algorithm`).
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
      store: where a stateful method's client states live (the simulator's ``store``:
        ``"memory"`` on the host, ``"device"`` in device memory).
      hparams: ``(name, value)`` pairs that override the method's registered defaults.
      fuse: rounds per compiled program (the simulator's ``fuse``; 1: one program per round).
      layout: the simulator's layout (``"auto"``: sequential on CPU, vmap elsewhere).
      gpu: part of the GPU record (:data:`GPU_WORKLOADS`), not of the default set.
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
    store: str = "memory"
    hparams: tuple[tuple[str, Any], ...] = ()
    fuse: int = 1
    layout: str = "auto"
    gpu: bool = False


@dataclasses.dataclass(frozen=True)
class LimitWorkload:
    """Central ``jit``-compiled training of the same examples (see :mod:`fedbayes.bench`).

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
    gpu: bool = False  # never: a limit is a CPU reference


@dataclasses.dataclass(frozen=True)
class RelativeWorkload:
    """A computation timed against a reference computation in one process (see
    :mod:`fedbayes.bench.relative`); measured once per bench, not once per repeat (its
    ``settings.relative_reps`` repetitions are paired inside the process).

    Attributes:
      name: registry key, JSON key and the key of its measure in
        :data:`fedbayes.bench.relative.MEASURES`.
      description: one line, reported as the entry's ``description``.
      gpu: part of the GPU record (:data:`GPU_WORKLOADS`), not of the default set.
    """

    name: str
    description: str = ""
    gpu: bool = False


Workload = FederatedWorkload | LimitWorkload | RelativeWorkload
REFERENCE = "limit_b32"  # the denominator of ratio_to_limit


def _against_fedavg_e3_100(name: str, algorithm: str, label: str, **fields) -> FederatedWorkload:
    """A method at 10 of 100 IID clients and 3 local epochs, measured against ``fedavg_e3_100``."""
    return FederatedWorkload(
        name, algorithm, 100, 10, epochs=3, rounds_scale=2.0, baseline="fedavg_e3_100", description=f"{label}, 10 of 100 IID clients, 3 epochs", **fields
    )


def _gpu_record() -> list[FederatedWorkload]:
    """The GPU record's federated workloads: FedAvg, FedEP, PVI and FedLap-Cov with M of 100 IID
    clients (M = 10, 100), 3 local epochs, vmap layout, states in device memory."""
    methods = (
        ("fedavg", "FedAvg", ()),
        ("fedep", "FedEP (identity)", (("preset", "paper"),)),
        ("pvi", "PVI (1 weight sample per step)", (("init_std", 0.1), ("init_mean", "model"), ("estimator", "weights"))),
        ("fedlap_cov", "FedLap-Cov (GGN pass included)", ()),
    )
    out = []
    for m in (10, 100):
        for algorithm, label, hparams in methods:
            base = None if algorithm == "fedavg" else f"gpu_fedavg_{m}"
            out.append(
                FederatedWorkload(
                    f"gpu_{algorithm}_{m}",
                    algorithm,
                    100,
                    m,
                    epochs=3,
                    baseline=base,
                    store="device",
                    layout="vmap",
                    hparams=hparams,
                    gpu=True,
                    description=f"{label}, {m} of 100 IID clients, 3 epochs, vmap layout, states in device memory",
                )
            )
    return out


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
        FederatedWorkload(
            "fedpa",
            "fedpa",
            10,
            10,
            epochs=3,
            rounds_scale=0.5,
            baseline="fedavg_e3",
            description="FedPA (rho 0.01, 2 samples), 10 of 10 IID clients, 3 epochs",
        ),
        FederatedWorkload(
            "fedep",
            "fedep",
            10,
            10,
            epochs=3,
            rounds_scale=0.5,
            baseline="fedavg_e3",
            store="device",
            hparams=(("preset", "paper"),),
            description="FedEP (identity, sites in device memory), 10 of 10 IID clients, 3 epochs",
        ),
        FederatedWorkload("fedavg_e3_100", "fedavg", 100, 10, epochs=3, rounds_scale=2.0, description="FedAvg, 10 of 100 IID clients, 3 epochs"),
        _against_fedavg_e3_100("fedpa_100", "fedpa", "FedPA"),
        _against_fedavg_e3_100("fedep_100", "fedep", "FedEP (identity, sites in device memory)", store="device", hparams=(("preset", "paper"),)),
        _against_fedavg_e3_100("fedep_100_host", "fedep", "FedEP (identity, sites in the host memory store)", hparams=(("preset", "paper"),)),
        # The methods of the PVI / FedLap family (FedLap-Cov counts its curvature pass; the stateful
        # ones keep their sites in device memory). PVI starts as examples/digits_pvi.toml does
        # (local std 0.1, mean at the model's init): from the prior's std 1 its weight noise makes
        # the client SGD diverge.
        _against_fedavg_e3_100(
            "pvi_100", "pvi", "PVI (1 weight sample per step)", store="device", hparams=(("init_std", 0.1), ("init_mean", "model"), ("estimator", "weights"))
        ),
        _against_fedavg_e3_100(
            "pvi_local_100",
            "pvi",
            "PVI, local reparameterisation (dense outputs drawn per example)",
            store="device",
            hparams=(("init_std", 0.1), ("init_mean", "model"), ("estimator", "local")),
        ),
        _against_fedavg_e3_100("fedlap_100", "fedlap", "FedLap", store="device"),
        _against_fedavg_e3_100("fedlap_cov_100", "fedlap_cov", "FedLap-Cov (GGN pass included)", store="device"),
        _against_fedavg_e3_100("fedlap_func_100", "fedlap_func", "FedLap-Func (500 server steps)", store="device"),
        FederatedWorkload(
            "fedavg_100_fused",
            "fedavg",
            100,
            10,
            rounds_scale=5.0,
            fuse=10,
            description="FedAvg, 10 of 100 IID clients, 10 rounds a compiled program",
        ),
        *_gpu_record(),
        RelativeWorkload("curvature", description="diagonal Fisher, empirical Fisher and GGN against a training step (MLP, CNN)"),
        RelativeWorkload("cnn", description="CNN FedAvg round against a plain jitted step loop over the same examples"),
        RelativeWorkload("vbnn", description="VBNN (GAA) round against the CNN FedAvg round"),
        RelativeWorkload("cnn_100", description="CNN FedAvg round of 100 clients against a plain jitted step loop over the same examples", gpu=True),
        RelativeWorkload("vbnn_100", description="VBNN (GAA) round of 100 clients against the CNN FedAvg round", gpu=True),
    )
}
# The GPU record: the vmap layout with the device-resident store, 10 and 100 clients a round of
# 100, each against its own plain jitted loop on the device and against FedAvg at the same cohort;
# the CNN and VBNN rounds of 10 and 100 clients. No limit_b32 (a per-core CPU reference).
GPU_WORKLOADS = tuple(n for n, w in WORKLOADS.items() if w.gpu) + ("cnn", "vbnn")


def baseline_of(name: str) -> str | None:
    """The ``baseline`` of workload ``name`` (``None`` for limits, unknown names and workloads without one)."""
    w = WORKLOADS.get(name)
    return w.baseline if isinstance(w, FederatedWorkload) else None


def is_relative(name: str) -> bool:
    """Whether workload ``name`` is a :class:`RelativeWorkload`."""
    return isinstance(WORKLOADS.get(name), RelativeWorkload)


def resolve_names(names: Sequence[str] | None) -> list[str]:
    """The workloads to run, in registry order, with each named workload's ``baseline`` and,
    unless only relative or GPU workloads are named (they carry their own references), with
    :data:`REFERENCE` (the denominator of ``ratio_to_limit``). No names: every workload but the
    GPU record's.

    Raises:
      BenchError: a name is not in :data:`WORKLOADS`. Checks names only: no data is touched, so
        a wrong name is reported as such on a machine without the dataset too.
    """
    if not names:
        return [n for n, w in WORKLOADS.items() if not w.gpu]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise BenchError(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    wanted = set(names) | {b for b in map(baseline_of, names) if b is not None}
    if not all(is_relative(n) or WORKLOADS[n].gpu for n in names):
        wanted.add(REFERENCE)
    return [n for n in WORKLOADS if n in wanted]


def check_dataset(settings: BenchSettings) -> None:
    """Raises :class:`BenchError` saying how to get the data when it is not on this machine."""
    from fedbayes.data import DATASETS

    if settings.dataset not in DATASETS:
        raise BenchError(f"unknown dataset {settings.dataset!r}; known: {', '.join(DATASETS)}")
    present, detail = DATASETS[settings.dataset].locate(settings.data_dir)
    if not present:
        raise BenchError(
            f"{settings.dataset} is not on this machine, and the benchmark needs it. {detail} (fedbayes bench --data-dir FOLDER reads it from FOLDER.)"
        )


# ----- the algorithms workloads run: a stand-in for fedbayes.algorithms.registry ----------------
def algorithm_names() -> tuple[str, ...]:
    """The methods a workload may run: every registered one."""
    from fedbayes.algorithms import registry

    return registry.names()


def build_algorithm(name: str, trainer, federation, clients_per_round: int, apply_fn, task: str, feature_spec=None, hparams=(), hidden_layers=False):
    """The :class:`~fedbayes.algorithms.Algorithm` called ``name``, as the bench runs it: built by
    :mod:`fedbayes.algorithms.registry` from its default settings (FedPA ``rho = 0.01``, one
    mixing epoch; the FedEP workloads ask for ``preset = "paper"``: the scaled-identity method, damping ``1/M``), with the server
    optimizer ``optax.sgd(1.0)`` (the plain sum of the clients' deltas).

    Args:
      name: a registered algorithm.
      trainer: the clients' :class:`~fedbayes.inference.sgd.LocalTrainer`.
      federation: the client sizes (a sequence) or a :class:`~fedbayes.algorithms.registry.FederationInfo`.
      clients_per_round: ``M``.
      apply_fn, task: the model's apply function and task.
      feature_spec: one example's features (``jax.ShapeDtypeStruct``), for FedLap-Func's memory.
      hparams: ``(name, value)`` pairs overriding the method's defaults.
      hidden_layers: the model is a network (:func:`fedbayes.models.has_hidden_layers`).

    Raises:
      BenchError: ``name`` is not registered.
    """
    import optax

    from fedbayes.algorithms import registry

    if name not in registry.names():
        raise BenchError(f"unknown algorithm {name!r}; known: {', '.join(registry.names())}")
    info = federation if isinstance(federation, registry.FederationInfo) else registry.FederationInfo.from_sizes(federation)
    spec = registry.get(name)
    ctx = registry.BuildContext(trainer, optax.sgd(1.0), info, clients_per_round, apply_fn, task, feature_spec=feature_spec, hidden_layers=hidden_layers)
    return spec.build(spec.hparams(name=name, **dict(hparams)), ctx)


# ----- building a workload ----------------------------------------------------------------------
def load_data(settings: BenchSettings):
    """The :class:`~fedbayes.data.Dataset` of ``settings`` (name, folder, seed), as every workload loads it."""
    from fedbayes.data import load_dataset

    return load_dataset(settings.dataset, data_dir=settings.data_dir, seed=settings.seed)


def model_and_trainer(settings: BenchSettings, dataset, batch_size: int, epochs: int | None = None):
    """The MLP of ``settings`` on ``dataset`` and the client SGD that trains it.

    Returns:
      ``(params, trainer, apply_fn)``: initial parameters (seeded by ``settings.seed``), a
      :class:`~fedbayes.inference.sgd.LocalTrainer` at ``batch_size`` for ``epochs`` local epochs
      (``None``: ``settings.epochs``), and ``apply_fn(params, x) -> logits``.
    """
    import jax
    import optax

    from fedbayes.inference.sgd import LocalTrainer
    from fedbayes.models import init_params, loss_fn, make_model

    model = make_model("mlp", dataset.num_classes, hidden=settings.hidden)
    params = init_params(model, jax.random.key(settings.seed), dataset.feature_shape)
    trainer = LocalTrainer(loss_fn(model, dataset.task), optax.sgd(settings.lr), epochs or settings.epochs, batch_size)
    return params, trainer, lambda p, x: model.apply({"params": p}, x)


def workload_epochs(workload: FederatedWorkload, settings: BenchSettings) -> int:
    """Local epochs per round of ``workload`` (its own, else ``settings.epochs``)."""
    return workload.epochs or settings.epochs


def steady_rounds(workload: FederatedWorkload, settings: BenchSettings) -> int:
    """Timed rounds after the first: ``ceil(settings.rounds * workload.rounds_scale)``, at least 1."""
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
    :class:`~fedbayes.sim.simulator.Simulator` (e.g. ``store="disk"``).
    """
    from fedbayes.data.federation import Federation
    from fedbayes.sim.simulator import Simulator

    if workload.algorithm not in algorithm_names():
        raise BenchError(f"workload {workload.name!r}: unknown algorithm {workload.algorithm!r}; known: {', '.join(algorithm_names())}")
    parts = workload_partition(workload, settings, dataset) if parts is None else parts
    params, trainer, apply_fn = model_and_trainer(settings, dataset, settings.batch_size, workload_epochs(workload, settings))
    federation = Federation(dataset.x_train, dataset.y_train, tuple(parts))
    import jax

    from fedbayes.models import has_hidden_layers

    feature_spec = jax.ShapeDtypeStruct(dataset.x_train.shape[1:], dataset.x_train.dtype)
    algorithm = build_algorithm(
        workload.algorithm, trainer, federation.sizes, workload.clients_per_round, apply_fn, dataset.task, feature_spec, workload.hparams,
        hidden_layers=has_hidden_layers(params),
    )  # fmt: skip
    simulator_kwargs.setdefault("store", workload.store)
    simulator_kwargs.setdefault("fuse", workload.fuse)
    simulator_kwargs.setdefault("layout", workload.layout)
    sim = Simulator(algorithm, federation, clients_per_round=workload.clients_per_round, seed=settings.seed, **simulator_kwargs)
    return sim, sim.init(params)
