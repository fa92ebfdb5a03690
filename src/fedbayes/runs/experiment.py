"""One experiment from a validated config: build data, model and algorithm, run, record, resume.

``run_experiment`` writes into its output folder:

* ``config.toml``: the resolved config (every default written out; ``fedbayes run`` accepts it);
* ``metrics.jsonl``: one line per evaluation, round 0 being the initial model: ``round``, the
  test metrics (``accuracy``, ``nll``, ``ece``, and ``accuracy_marg``, ``nll_marg``, ``ece_marg``
  for Bayesian methods; ``mse``, ``rmse`` for regression; with ``data.validation_fraction > 0``
  also ``val_accuracy``, ``val_nll``, ``val_ece`` (or ``val_mse``, ``val_rmse``) on the held-out
  split, :mod:`fedbayes.data.holdout`), ``train_loss`` (after round 0: the
  round's accepted clients' mean training loss, weighted by their example counts) and four
  counters that are cumulative since round 0: ``seconds`` (training time: the wall time of the
  rounds, evaluation excluded),
  ``bytes_up``, ``bytes_down`` and ``rejected`` (messages refused);
* ``clients.jsonl``: one line per sampled client and round (:class:`fedbayes.runs.loggers.ClientLog`);
* ``model.npz``: the final server parameters (and posterior) by tree path (:mod:`fedbayes.runs.export`);
* ``checkpoints/round_NNNNNN.npz``: atomic checkpoints every ``checkpoint_every`` rounds and at
  the end;
* ``summary.json`` and ``curves.png`` at the end.

Rounds run pipelined (:meth:`fedbayes.sim.simulator.Simulator.rounds`: round ``r + 1``'s host work and
launch overlap round ``r``; round ``r``'s evaluation queues behind round ``r + 1``); records,
divergence checks, checkpoints and progress happen strictly in round order. Results are bitwise
those of one round at a time.

A run killed at any point and resumed (``resume=True``) continues from its newest intact
checkpoint, rewrites ``metrics.jsonl`` from the records the checkpoint holds, and ends with the same
metrics as a run that never stopped (same machine and seed): every random choice derives from
(seed, round, client). One process at a time writes a run folder (:mod:`fedbayes.runs.runlock`); a
resume refuses a config that differs from the checkpoint's unless each change is accepted
(``accept_changes``, the CLI's ``resume DIR --set key=value``), and records accepted ones in
``resume_changes.jsonl``. Every JSON file is strict JSON (:mod:`fedbayes.runs.strictjson`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from fedbayes import algorithms as algs
from fedbayes.evaluation import metrics
from fedbayes.runs import runlock
from fedbayes import protocol
from fedbayes.algorithms import registry
from fedbayes.runs.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from fedbayes.config.schema import ConfigError, RunConfig, resolved, to_toml
from fedbayes.data import load_dataset, natural, partition
from fedbayes.data.dataset import Dataset, DatasetNotFoundError
from fedbayes.data.holdout import hold_out
from fedbayes.errors import BadInputError, DataError, DivergedError
from fedbayes.evaluation.evaluators import make_evaluator, make_marginal_evaluator
from fedbayes.runs.export import MODEL_FILE, save_model
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.runs.loggers import ClientLog
from fedbayes.models import init_params, loss_fn, make_model
from fedbayes.models.variational import apply_with_key
from fedbayes.runs.plotting import plot_curves
from fedbayes.aggregators.dp import epsilon as privacy_epsilon
from fedbayes.sim.simulator import Federation, Simulator
from fedbayes.runs.strictjson import dumps_record, loads_strict, restore_record

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9)


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to run."""

    config: RunConfig
    dataset: Dataset
    federation: Federation
    model: Any
    params: Any
    simulator: Simulator
    evaluate: Callable[[Any, int], dict[str, float]]  # (server state, round) -> metrics
    validation: np.ndarray | None = None  # held-out training indices (data.validation_fraction)


def load_data(config: RunConfig) -> Dataset:
    """Loads the configured dataset (generated ones get their own parameters)."""
    d = config.data
    params: dict[str, Any] = {}
    if d.dataset == "synthetic_leaf":
        params = dict(num_clients=d.num_clients, alpha=d.synthetic_alpha, beta=d.synthetic_beta, dim=d.dim)
    elif d.dataset == "least_squares":
        params = dict(num_clients=d.num_clients, dim=d.dim)
    if d.fraction < 1.0:
        params["fraction"] = d.fraction
    if d.dataset == "leaf" and d.num_classes is not None:
        params["num_classes"] = d.num_classes
    try:
        return load_dataset(d.dataset, data_dir=d.data_dir, seed=config.seed, **params)
    except (DatasetNotFoundError, DataError):
        raise
    except ValueError as exc:
        raise ConfigError(f"config error: data: {exc}") from None


def split_clients(config: RunConfig, dataset: Dataset) -> list[np.ndarray]:
    """Partitions the training set over clients with a generator seeded by ``config.seed``."""
    d = config.data
    rng = protocol.partition_rng(config.seed)
    params: dict[str, Any] = {}
    if d.partition == "dirichlet":
        params = {"alpha": d.alpha}
    elif d.partition == "two_level_dirichlet":
        params = {"alpha1": d.alpha1, "alpha2": d.alpha2}
    elif d.partition == "shards":
        params = {"classes_per_client": d.classes_per_client}
    elif d.partition == "natural":
        parts = natural(dataset.client_ids)
        if len(parts) != d.num_clients:
            raise ConfigError(f"config error: data.num_clients: the {dataset.name} data has {len(parts)} clients in its natural partition; got {d.num_clients}")
        return parts
    try:
        return partition(d.partition, dataset.y_train, d.num_clients, rng, **params)
    except ValueError as exc:  # PartitionError included
        raise ConfigError(f"config error: data.partition ({d.partition}, data.num_clients = {d.num_clients}, {dataset.num_train} examples): {exc}") from None


def check_model(config: RunConfig, dataset: Dataset) -> None:
    """Rejects model/data pairs that cannot work, naming the field (before any training)."""
    if not np.issubdtype(dataset.x_train.dtype, np.floating):
        raise ConfigError(
            f"config error: data.dataset: {dataset.name!r} holds token ids (text, shape {dataset.feature_shape}); "
            "no fedbayes model takes text yet; allowed here: image or tabular data"
        )
    if config.model.name == "cnn" and len(dataset.feature_shape) not in (2, 3):
        raise ConfigError(
            f"config error: model.name: 'cnn' needs image data [H, W] or [H, W, C]; {dataset.name!r} has features of shape "
            f"{dataset.feature_shape}; allowed here: logreg, mlp"
        )


def prepare_data(config: RunConfig) -> tuple[Dataset, list[np.ndarray]]:
    """Loads and partitions the data and checks the model against it: every check that needs
    the data, cheap enough to run for all variants of a comparison before any of them trains.
    The parts are the clients' training examples (without a validation split)."""
    dataset, parts, _ = prepare_split(config)
    return dataset, parts


def prepare_split(config: RunConfig) -> tuple[Dataset, list[np.ndarray], np.ndarray | None]:
    """:func:`prepare_data` plus the validation split held out from each client's training
    examples (``data.validation_fraction``, :mod:`fedbayes.data.holdout`); None when it is 0."""
    dataset = load_data(config)
    check_model(config, dataset)
    parts = split_clients(config, dataset)
    fraction = config.data.validation_fraction
    if fraction == 0:
        return dataset, parts, None
    parts, validation = hold_out(parts, fraction, lambda k: protocol.validation_rng(config.seed, k))
    if validation.size == 0:
        raise ConfigError(
            f"config error: data.validation_fraction: {fraction} of each client's examples holds out none "
            f"({sum(map(len, parts))} training examples over {len(parts)} clients, every client keeping one); raise it, or set 0 for no validation split"
        )
    return dataset, parts, validation


def client_optimizer(config: RunConfig) -> optax.GradientTransformation:
    c = config.client
    if c.optimizer == "sgd":
        opt = optax.sgd(c.lr, momentum=c.momentum or None)
    else:
        opt = optax.adam(c.lr)
    if c.weight_decay > 0:
        opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
    return opt


def build_context(
    config: RunConfig, trainer: LocalTrainer, federation: registry.FederationInfo, *, apply_fn=None, task: str = "classification"
) -> registry.BuildContext:
    """What the registry's builders need besides the algorithm's own settings: no data."""
    s = config.server
    server_opt = algs.make_server_optimizer(s.optimizer, s.lr, momentum=s.momentum, b1=s.beta1, b2=s.beta2, tau=s.tau, variant=s.variant)
    return registry.BuildContext(trainer, server_opt, federation, s.clients_per_round, apply_fn, task)


def build_algorithm(
    config: RunConfig, trainer: LocalTrainer, federation: registry.FederationInfo, *, apply_fn=None, task: str = "classification"
) -> algs.Algorithm:
    """The configured algorithm, through the registry (no data needed: a deployment can call it)."""
    return registry.build(config.algorithm, build_context(config, trainer, federation, apply_fn=apply_fn, task=task))


def build_model_algorithm(config: RunConfig, num_classes: int, feature_shape, x_dtype, task: str, sizes):
    """``(model, params, algorithm, apply_fn, keyed_apply_fn)`` from the config and the data's
    shape alone (no data: a Flower node builds its algorithm with it from a cached partition)."""
    kwargs = {"hidden": tuple(config.model.hidden), "activation": config.model.activation} if config.model.name == "mlp" else {}
    variational = config.model.variational
    model = make_model(config.model.name, num_classes, variational=variational, **kwargs)
    params = init_params(model, protocol.params_key(config.seed), feature_shape)
    trainer = LocalTrainer(loss_fn(model, task), client_optimizer(config), config.client.epochs, config.client.batch_size)
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    keyed_apply_fn = apply_with_key(model) if variational else None
    ctx = build_context(config, trainer, registry.FederationInfo.from_sizes(sizes), apply_fn=apply_fn, task=task)
    feature_spec = jax.ShapeDtypeStruct(tuple(feature_shape), x_dtype)
    algorithm = registry.build(config.algorithm, ctx._replace(keyed_apply_fn=keyed_apply_fn, feature_spec=feature_spec))
    return model, params, algorithm, apply_fn, keyed_apply_fn


def build_experiment(config: RunConfig, store_dir: str | Path | None = None) -> Experiment:
    """Builds everything; ``store_dir`` is the disk client store's folder when ``config.store_dir`` is unset."""
    dataset, parts, validation = prepare_split(config)
    aggregator, attack, attackers, y_train = _protection(config, dataset, parts)
    federation = Federation(dataset.x_train, y_train, tuple(parts))
    model, params, algorithm, apply_fn, keyed_apply_fn = build_model_algorithm(
        config, dataset.num_classes, dataset.feature_shape, dataset.x_train.dtype, dataset.task, federation.sizes
    )
    simulator = Simulator(
        algorithm,
        federation,
        clients_per_round=config.server.clients_per_round,
        seed=config.seed,
        weighting=config.server.weighting,
        layout=config.layout,
        fail_fast=config.server.fail_fast,
        store=config.store,
        store_dir=config.store_dir or store_dir,
        aggregator=aggregator(algorithm),
        dropout=config.server.dropout,
        deadline=config.server.deadline,
        attack=attack,
        attackers=attackers,
    )
    evaluate = _evaluation(algorithm, config, dataset, apply_fn, keyed_apply_fn)
    if validation is not None:
        held_out = dataclasses.replace(dataset, x_test=dataset.x_train[validation], y_test=dataset.y_train[validation], test_client_ids=None)
        evaluate = _with_validation(evaluate, _evaluation(algorithm, config, held_out, apply_fn, keyed_apply_fn, marginal=False))
    return Experiment(config, dataset, federation, model, params, simulator, evaluate, validation)


def _evaluation(algorithm: algs.Algorithm, config: RunConfig, dataset: Dataset, apply_fn, keyed_apply_fn, marginal: bool = True):
    """``(server state, round) -> metrics`` on ``dataset``'s test split (see :func:`build_experiment`)."""
    if config.model.variational:
        return _variational(algorithm, config, keyed_apply_fn, dataset)
    evaluate = make_evaluator(apply_fn, dataset.x_test, dataset.y_test, task=dataset.task, batch_size=config.eval_batch_size, num_bins=config.ece_bins)
    if marginal and algorithm.server_posterior is not None and dataset.task == "classification":
        return _with_marginal(evaluate, algorithm, config, apply_fn, dataset)
    return _on_state(evaluate, algorithm)


VALIDATION_METRICS = ("accuracy", "nll", "ece", "mse", "rmse")  # recorded as val_<metric>


def _with_validation(evaluate_test, evaluate_validation):
    """Adds the validation split's metrics as ``val_accuracy``, ``val_nll``, ... to the test metrics."""

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = evaluate_test(server_state, round_idx)
        held_out = evaluate_validation(server_state, round_idx)
        out.update({f"val_{k}": v for k, v in held_out.items() if k in VALIDATION_METRICS})
        return out

    return evaluate


def make_server_aggregator(config: RunConfig, algorithm: algs.Algorithm):
    """The server's aggregation rule from ``server.aggregator`` and ``[privacy]``: a robust rule
    (:mod:`fedbayes.aggregators.robust`) and/or the DP mechanism around it (:mod:`fedbayes.aggregators.dp`), or
    ``None`` for the method's own. Needs no data: a deployment (the Flower adapter) passes it to
    :func:`fedbayes.protocol.server_step` as the simulator does."""
    from fedbayes.aggregators.dp import DPAggregator
    from fedbayes.aggregators.robust import make_aggregator

    s, p = config.server, config.privacy
    robust = make_aggregator(
        s.aggregator, trim_fraction=s.trim_fraction, norm_bound=s.norm_bound, max_precision_share=s.max_precision_share, base=algorithm.aggregator
    )
    if p.clip is None:
        return robust
    return DPAggregator(p.clip, p.noise_multiplier, coordinates=p.coordinates, precision_floor=p.precision_floor, base=robust or algorithm.aggregator)


def _protection(config: RunConfig, dataset: Dataset, parts):
    """The server's rule (a function of the algorithm, :func:`make_server_aggregator`), the
    message attack, the attacking clients and the training labels (flipped for
    ``attack.kind = "label_flip"``) from the ``privacy``, ``server`` and ``attack`` sections."""
    from fedbayes.sim import scenario as attacks

    a = config.attack
    attackers = attacks.attacker_ids(config.seed, len(parts), a.fraction)
    y_train = dataset.y_train
    attack = None
    if len(attackers) and a.kind == "label_flip":
        y_train = attacks.flip_labels(dataset.y_train, np.concatenate([parts[c] for c in attackers]), dataset.num_classes)
    elif len(attackers):
        attack = attacks.message_attack(a.kind, a.scale)
    return (lambda algorithm: make_server_aggregator(config, algorithm)), attack, attackers, y_train


def _variational(algorithm: algs.Algorithm, config: RunConfig, keyed_apply_fn, dataset: Dataset):
    """A variational model's metrics: accuracy, NLL and ECE of its marginalised predictive over
    ``S = evaluation.marginal_samples`` stochastic forward passes (a variational network has no
    deterministic forward pass; Ozer et al. 2022 report these), and ``std_norm``, the L2 norm of
    its learned standard deviations. The passes' key depends on the seed and the round only."""
    from fedbayes.algorithms.vbnn import predictive_metrics

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = predictive_metrics(
            keyed_apply_fn, algorithm.server_params(server_state), protocol.evaluation_key(config.seed, round_idx),
            dataset.x_test, dataset.y_test, num_samples=config.evaluation.marginal_samples, num_bins=config.ece_bins,
            batch_size=config.eval_batch_size,
        )  # fmt: skip
        out.pop("std_norm_clamped", None)
        return out

    return evaluate


def _with_marginal(evaluate_point, algorithm: algs.Algorithm, config: RunConfig, apply_fn, dataset: Dataset):
    """Adds the marginalised prediction over ``S`` samples of ``q_g`` (``accuracy_marg``,
    ``nll_marg``, ``ece_marg``; Guo et al. 2023 (FedEP) Table 5) to the point metrics. The samples' key depends on
    the seed and the round only, so a resumed run draws the same ones."""
    marginal = make_marginal_evaluator(
        apply_fn, dataset.x_test, dataset.y_test, num_samples=config.evaluation.marginal_samples,
        batch_size=config.eval_batch_size, num_bins=config.ece_bins, predictive=config.evaluation.predictive,
    )  # fmt: skip

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = evaluate_point(algorithm.server_params(server_state))
        mean, variance = algorithm.server_posterior(server_state)
        key = protocol.evaluation_key(config.seed, round_idx)
        out.update({f"{k}_marg": v for k, v in marginal(key, mean, variance).items() if k in ("accuracy", "nll", "ece")})
        return out

    return evaluate


def _on_state(evaluate_point, algorithm: algs.Algorithm):
    """The point evaluation of the server state's model."""
    return lambda server_state, round_idx: evaluate_point(algorithm.server_params(server_state))


def train_loss(info) -> float | None:
    """The round's training loss: the mean over its accepted clients of their mean minibatch loss,
    weighted by their example counts (``None`` when no client was accepted)."""
    c = info.clients
    w = np.where(c["accepted"], c["num_examples"], 0).astype(np.float64)
    if not w.sum():
        return None
    return float(np.sum(w * np.where(c["accepted"], c["loss"], 0.0)) / w.sum())


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(restore_record(loads_strict(line)))
            except ValueError:
                break  # a line torn by a kill: everything after it is dropped too
    return out


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def summarize(config: RunConfig, records: list[dict], task: str) -> dict:
    """Final metrics and curve summaries (docs/algorithms.md §13.2) of one run."""
    last = records[-1] if records else {}
    summary: dict[str, Any] = {
        "name": config.name,
        "algorithm": config.algorithm.name,
        "server_optimizer": config.server.optimizer,
        "rounds": config.rounds,
        "final": {k: v for k, v in last.items() if k != "round"},
    }
    if task == "classification" and records:
        rounds = [r["round"] for r in records]
        acc = [r["accuracy"] for r in records]
        summary["best_accuracy"] = float(max(acc))
        # Swaroop et al. 2025 (ADMM and Bayes) Table 3: the first round whose accuracy reaches the threshold (no smoothing);
        # Guo et al. 2023 (FedEP) and Al-Shedivat et al. 2021 (FedPA): the first round whose 10-evaluation running mean reaches it.
        summary["rounds_to"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=1) for t in THRESHOLDS}
        summary["rounds_to_rm10"] = {f"{t:.2f}": metrics.rounds_to_threshold(rounds, acc, t, window=10) for t in THRESHOLDS}
        summary["final_mean_3"] = metrics.final_mean(acc, 3)
        for w in (10, 100):
            m = metrics.running_mean(acc, w)
            summary[f"running_mean_{w}"] = None if np.isnan(m[-1]) else float(m[-1])
    return summary


class PlainReporter:
    """Progress as plain lines (when output is not a terminal)."""

    def __init__(self, echo: Callable[[str], None] = print):
        self.echo = echo

    def start(self, name: str, total: int, done: int) -> None:
        self.echo(f"[{name}] rounds {done}/{total}")

    def update(self, round_idx: int, total: int, record: dict | None) -> None:
        if record is not None:
            self.echo(format_record(record, total))

    def stop(self) -> None:
        pass


def format_record(r: dict, total: int) -> str:
    if "accuracy" in r:
        body = f"acc {r['accuracy']:.4f}  nll {r['nll']:.4f}  ece {100 * r['ece']:.2f}%"
    else:
        body = f"mse {r['mse']:.5f}"
    rej = f"  rejected {r['rejected']}" if r.get("rejected") else ""
    return f"round {r['round']:>4}/{total}  {body}  {r['seconds']:.1f}s{rej}"


class Diverged(DivergedError):
    """A run stopped because a loss or the server model turned non-finite (``server.on_divergence``;
    exit code 3).

    Attributes: ``round``, ``metric`` (what turned non-finite), ``checkpoint`` (the round of the
    last good checkpoint, or None).
    """

    def __init__(self, message: str, round_idx: int, metric: str, checkpoint: int | None):
        super().__init__(message)
        self.round, self.metric, self.checkpoint = round_idx, metric, checkpoint


DIVERGENCE_METRICS = ("loss", "nll", "mse", "nll_marg")  # evaluated losses a guard checks


def _non_finite(record: dict | None, params, training_loss: float | None = None) -> str | None:
    """The first non-finite quantity: the server model's parameters, the round's training loss
    (of its accepted clients), then the evaluated losses; None when all are finite.

    The parameters are checked on the host: a check on the devices would queue behind the next
    round, which the pipelined loop has already started."""
    if training_loss is not None and not np.isfinite(training_loss):
        return "training loss"
    if params is not None and not all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(params)):
        return "server parameters"
    for key in DIVERGENCE_METRICS:
        if record is not None and key in record and not np.isfinite(record[key]):
            return f"evaluated {key}"
    return None


class _Pending(NamedTuple):
    """A finished round and its evaluation's metrics (``None``: not an evaluation round)."""

    round: int
    info: Any
    evaluation: dict | None
    counters: dict
    bad: str | None  # non-finite parameters or training loss, found when the round finished


def _round_stream(sim, state, stop: int, keep: Callable[[int], bool]):
    """The rounds of ``sim`` from ``state`` to ``stop``: the simulator's pipelined
    :meth:`~fedbayes.sim.simulator.Simulator.rounds`, or one round at a time for a runner without
    them (the Flower deployment)."""
    if hasattr(sim, "rounds"):
        yield from sim.rounds(state, stop, donate=True, keep=keep)
        return
    while state.round < stop:
        state, info = sim.run_round(state, donate=True)  # the old state is dropped: no store copy
        jax.block_until_ready(state.server_state)
        yield state, info


def _divergence_message(config: RunConfig, round_idx: int, metric: str, out: Path, checkpoint: int | None) -> str:
    cause = (
        "likely cause: a step too large for the loss's curvature (client.lr, server.lr"
        + (f", or {config.spec.divergence_hint}" if config.spec.divergence_hint else "")
        + ")"
    )
    ckpt = f"last good checkpoint: round {checkpoint}" if checkpoint is not None else "no checkpoint was saved yet (checkpoint_every)"
    return f"diverged at round {round_idx}: {metric} non-finite; {cause}; {ckpt}; continue with: fedbayes resume {out} --set client.lr=... (or server.lr=...)"


CALIBRATION_GAP = 0.05  # marginalised accuracy this far below the point estimate gets a warning


class CalibrationCheck:
    """Warns once per run, in the log, when the marginalised accuracy falls more than
    :data:`CALIBRATION_GAP` below the point estimate's: the posterior is too wide for the data
    (FedEP/FedSEP: ``scale`` too small for the data size; see docs/algorithms.md, "Choosing scale").
    The initial model and burn-in rounds are not checked."""

    def __init__(self, name: str, after_round: int = 0, advice: str = "raise algorithm.scale (see docs/algorithms.md, 'Choosing scale')"):
        self.name = name
        self.after_round = after_round  # the initial model and burn-in rounds are not checked
        self.advice = advice  # what to change (the default is FedEP's and FedSEP's knob)
        self.message: str | None = None

    def check(self, record: dict) -> None:
        if self.message is not None or "accuracy_marg" not in record or record["round"] <= self.after_round:
            return
        gap = record["accuracy"] - record["accuracy_marg"]
        if gap > CALIBRATION_GAP:
            self.message = (
                f"{self.name}: round {record['round']}: the marginalised accuracy {record['accuracy_marg']:.4f} is "
                f"{100 * gap:.1f} points below the point estimate's {record['accuracy']:.4f}; the posterior is too wide "
                f"for this data: {self.advice}"
            )
            logging.getLogger("fedbayes").warning("warning: %s", self.message)


def _calibration_advice(config: RunConfig) -> dict:
    return {"advice": config.spec.calibration_advice} if config.spec.calibration_advice else {}


def config_hash(config: RunConfig) -> str:
    """SHA-256 of the resolved config (every default included), as a checkpoint records it."""
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def check_resume_config(config: RunConfig, meta: dict, out: Path, accept_changes=()) -> dict[str, list]:
    """Compares the config to resume with against the checkpoint's; returns the accepted changes.

    Raises:
      ConfigError: a key differs and is not in ``accept_changes``; the message names every such
        key with both values and the command that accepts them.
    """
    if meta.get("config_hash") == config_hash(config):
        return {}
    old, new = _flat(resolved(meta.get("config") or {})), _flat(config.model_dump(mode="json"))
    changed = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    accepted = set(accept_changes)
    log = out / "resume_changes.jsonl"
    for line in log.read_text().splitlines() if log.is_file() else []:  # accepted before, from this checkpoint
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("round") == meta["round"]:
            accepted |= {k for k, (_, v) in rec.get("changed", {}).items() if k in changed and changed[k][1] == v}
    refused = [k for k in changed if k not in accepted]
    if refused:
        what = ", ".join(f"{k} ({json.dumps(changed[k][0])} -> {json.dumps(changed[k][1])})" for k in refused)
        sets = " ".join(f"--set {k}={json.dumps(changed[k][1])}" for k in refused)
        raise ConfigError(
            f"config error: {out / 'config.toml'} differs from the run's checkpoint (round {meta['round']}) in {what}; "
            f"put it back, or make the change on purpose with `fedbayes resume {out} {sets}`"
        )
    return changed


def _check_store_dir(config: RunConfig, out: Path) -> None:
    if config.store != "disk":
        return
    folder = Path(config.store_dir) if config.store_dir else out / "client_store"
    if folder.exists() and not folder.is_dir():
        raise BadInputError(f"config error: store_dir: {folder} is a file, not a folder")


def run_experiment(config: RunConfig, out_dir: str | Path, *, resume: bool = False, reporter=None, accept_changes=(), warn=None, rounds=None) -> dict:
    """Runs (or resumes) one experiment and returns its summary (see the module docstring).

    ``accept_changes``: dotted config keys that may differ from the checkpoint's on resume.
    ``warn``: where one-line warnings go (a damaged checkpoint skipped); default stderr.
    ``rounds``: ``Experiment -> runner`` with the simulator's ``init``, ``place``, ``run_round``,
    ``server_params`` and ``algorithm`` that runs the rounds instead of ``exp.simulator`` (the
    Flower deployment, :class:`fedbayes.flower.rounds.FlowerRounds`); ``None``: the simulator.
    """
    with runlock.hold(out_dir):
        return _run_experiment(config, Path(out_dir), resume, reporter, tuple(accept_changes), warn or _stderr, rounds)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_experiment(config: RunConfig, out: Path, resume: bool, reporter, accept_changes: tuple, warn, rounds=None) -> dict:
    ckpt_dir = out / "checkpoints"
    metrics_path = out / "metrics.jsonl"
    reporter = reporter or PlainReporter()
    found = find_resume_checkpoint(ckpt_dir, warn) if resume else None
    changes = check_resume_config(config, found[1], out, accept_changes) if found is not None else {}
    _check_store_dir(config, out)
    exp = build_experiment(config, store_dir=out / "client_store")
    sim = exp.simulator if rounds is None else rounds(exp)
    ckpt = found[0] if found is not None else None
    if ckpt is None:
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # before a new disk client store replaces the old one
    state = sim.init(exp.params, resume=ckpt is not None)  # resume: open the disk store, not rewrite it
    counters = {"seconds": 0.0, "bytes_up": 0, "bytes_down": 0, "rejected": 0}
    if config.server.dropout > 0 or config.server.deadline is not None or getattr(sim, "counts_dropped", False):
        counters.update(dropped=0, late=0)
    records: list[dict] = []
    if ckpt is not None:
        state, meta = load_checkpoint(ckpt, state)
        state = state._replace(server_state=sim.place(state.server_state))
        counters = meta["counters"]
        records = [restore_record(dict(r)) for r in meta["metrics"]]  # metrics.jsonl is rewritten from these
        if changes:
            with open(out / "resume_changes.jsonl", "a") as f:
                f.write(json.dumps({"round": state.round, "changed": changes}, allow_nan=False) + "\n")
    else:
        for stale in ("summary.json", "curves.png"):  # a killed fresh run must not look finished
            (out / stale).unlink(missing_ok=True)
    _write_atomic(out / "config.toml", to_toml(config))
    _write_atomic(metrics_path, "".join(dumps_record(r) + "\n" for r in records))
    client_log = ClientLog(out / "clients.jsonl", exp.federation.sizes)
    client_log.restart(state.round)
    calibration = CalibrationCheck(config.name, after_round=config.spec.burn_in_rounds(config.algorithm), **_calibration_advice(config))

    def record(round_idx: int, evaluated: dict, snapshot: dict, info=None) -> dict:
        r = {"round": round_idx, **evaluated, **snapshot}
        if config.privacy.clip is not None:
            p = config.privacy
            r["epsilon"] = privacy_epsilon(p.noise_multiplier, len(exp.federation.sizes), config.server.clients_per_round, round_idx, p.delta)
        if info is not None:
            r["train_loss"] = train_loss(info)
        r["seconds"] = round(r["seconds"], 3)
        calibration.check(r)
        records.append(r)
        with open(metrics_path, "a") as f:
            f.write(dumps_record(r) + "\n")
        return r

    fixed_meta = {"name": config.name, "config": config.model_dump(mode="json"), "config_hash": config_hash(config)}
    last_ckpt = int(state.round) if ckpt is not None else None
    warned = False

    def checkpointed(r: int) -> bool:  # after round r (1-based: the state's round)
        return r == config.rounds or bool(config.checkpoint_every and r % config.checkpoint_every == 0)

    # Round r's evaluation is dispatched after round r + 1 was launched, so it queues behind it on
    # the devices. It runs on this thread: two threads dispatching multi-device programs can queue
    # them in different orders on different devices, and their all-reduces then deadlock (seen:
    # XLA:CPU aborted in a rendezvous). Rounds are recorded, checked for divergence, checkpointed
    # and reported strictly in order.
    def settle(e: _Pending) -> None:
        """Records round ``e``, checks it for divergence, checkpoints and reports it."""
        nonlocal warned, last_ckpt
        rec = record(e.round, e.evaluation, e.counters, e.info) if e.evaluation is not None else None
        bad = e.bad or _non_finite(rec, None)
        if bad is not None and not warned:
            message = _divergence_message(config, e.round, bad, out, last_ckpt)
            if config.server.on_divergence == "stop":
                summary = {**summarize(config, records, exp.dataset.task), "diverged": {"round": e.round, "metric": bad, "checkpoint": last_ckpt}}
                _write_atomic(out / "summary.json", dumps_record(summary, indent=2) + "\n")
                raise Diverged(message, e.round, bad, last_ckpt)
            warn(f"warning: {message}")
            warned = True
        if not warned and checkpointed(e.round):
            assert e.round == state.round, "a checkpoint round is settled before the next round starts"
            strict = [json.loads(dumps_record(x)) for x in records]
            save_checkpoint(ckpt_dir, state, {**fixed_meta, "counters": e.counters, "metrics": strict})
            last_ckpt = e.round
        reporter.update(e.round, config.rounds, rec)

    reporter.start(config.name, config.rounds, state.round)
    if state.round == 0 and not records:
        reporter.update(0, config.rounds, record(0, exp.evaluate(state.server_state, 0), dict(counters)))
    try:
        t0 = time.perf_counter()
        for state, info in _round_stream(sim, state, config.rounds, keep=lambda r: checkpointed(r + 1)):
            counters["seconds"] += time.perf_counter() - t0
            counters["bytes_up"] += info.bytes_up
            counters["bytes_down"] += info.bytes_down
            counters["rejected"] += len(info.rejected)
            if "dropped" in counters:
                counters["dropped"] += len(info.dropped)
                counters["late"] += len(info.late)
            client_log.write(info, state.round)
            r = state.round
            evaluation = exp.evaluate(state.server_state, r) if (r % config.eval_every == 0 or r == config.rounds) else None
            settle(_Pending(r, info, evaluation, dict(counters), _non_finite(None, sim.server_params(state), train_loss(info))))
            t0 = time.perf_counter()
    finally:
        reporter.stop()
    task = exp.dataset.task
    summary = summarize(config, records, task)
    save_model(out / MODEL_FILE, sim.algorithm, state.server_state)
    if calibration.message:
        summary["warnings"] = [calibration.message]
    _write_atomic(out / "summary.json", dumps_record(summary, indent=2) + "\n")
    plot_curves(out / "curves.png", {config.name: records}, title=config.name, task=task)
    return summary
