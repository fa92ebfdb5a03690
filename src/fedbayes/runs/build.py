"""From a validated config to the parts of a run: data, model, algorithm, aggregator, evaluator.

The path, in the order a run takes it:

1. **data** (:func:`prepare_split`): load the dataset, check the model against it, partition the
   training set over the clients (seeded by ``config.seed``), hold out the validation split and
   scale the features (``data.standardize``, :mod:`fedbayes.data.standardize`);
2. **scenario** (:func:`build_scenario`): the attacking clients, the message attack, the labels
   (flipped for ``attack.kind = "label_flip"``);
3. **model** (:func:`build_model`): the flax model, its initial parameters and the clients' local
   trainer, from the data's shape alone (:class:`DataSpec`);
4. **algorithm and aggregator** (:func:`build_algorithm_and_aggregator`): the registry's method
   with its settings and the server's rule (robust and/or DP, :func:`make_server_aggregator`);
   **no data**: a deployed server (Flower), the bench and the tests build the same algorithm
   from the config, the federation's sizes and the data's shape;
5. **evaluator** (:func:`build_evaluator`): ``(server state, round) -> metrics`` on the test split
   (plus the validation split's ``val_*`` metrics).

:func:`build_experiment` runs all five and returns an :class:`Experiment`; its ``simulator`` is
built only when asked for (a Flower deployment runs the rounds without one).

:func:`build_context` is the one constructor of the registry's
:class:`~fedbayes.algorithms.registry.BuildContext`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedbayes import algorithms as algs
from fedbayes import gaussian_block, protocol
from fedbayes import tree as tree_lib
from fedbayes.algorithms import registry
from fedbayes.config.schema import ConfigError, RunConfig
from fedbayes.data import load_dataset
from fedbayes.data.dataset import Dataset, DatasetNotFoundError, check_dataset
from fedbayes.data.federation import AnyFederation, Federation, GeneratedFederation
from fedbayes.data.holdout import hold_out, hold_out_per_client
from fedbayes.data.standardize import standardize
from fedbayes.errors import DataError
from fedbayes.evaluation.evaluators import dense_spread, make_evaluator, make_marginal_evaluator, marginal_metrics, restrict_to_subset
from fedbayes.evaluation.prior_precision import make_prior_precision_search
from fedbayes.inference.sgd import LocalTrainer
from fedbayes.models import has_hidden_layers, init_params, loss_fn
from fedbayes.models import registry as model_registry
from fedbayes.models.variational import apply_with_key
from fedbayes.runs import limits
from fedbayes.sim import scenario as attacks
from fedbayes.sim.scenario import Scenario
from fedbayes.sim.simulator import Simulator

__all__ = [
    "VALIDATION_METRICS",
    "DataSpec",
    "Experiment",
    "ModelParts",
    "Splits",
    "Scenario",
    "build_algorithm_and_aggregator",
    "build_context",
    "build_evaluator",
    "build_experiment",
    "build_model",
    "build_predictive",
    "build_scenario",
    "build_simulator",
    "check_model",
    "client_optimizer",
    "client_splits",
    "load_data",
    "load_on_demand",
    "make_server_aggregator",
    "prepare_data",
    "prepare_split",
    "personal_split",
    "prepare_splits",
    "split_clients",
]

Evaluate = Callable[[Any, int], dict[str, float]]  # (server state, round) -> metrics


# ----- 1. data -----------------------------------------------------------------------------------


def load_data(config: RunConfig, given: Dataset | None = None) -> Dataset:
    """Loads the configured dataset (generated ones get their own parameters); ``given``: the
    dataset of ``data.dataset = "arrays"``, passed from Python (:func:`fedbayes.run_experiment`)."""
    d = config.data
    if d.spec.from_python != (given is not None):
        if given is None:
            raise ConfigError(f"config error: data.dataset: {d.dataset!r} are given from Python: run_experiment(config, out, data=...)")
        raise ConfigError(f"config error: data.dataset: data passed to run_experiment needs data.dataset = 'arrays'; got {d.dataset!r}")
    if given is not None:
        check_dataset(given, given.name)
        return given.subsample(d.fraction, protocol.subsample_rng(config.seed)) if d.fraction < 1.0 else given
    params: dict[str, Any] = dict(d.spec.loader_params(d))
    if d.fraction < 1.0:
        params["fraction"] = d.fraction
    try:
        return load_dataset(d.dataset, data_dir=d.data_dir, seed=config.seed, **params)
    except (DatasetNotFoundError, DataError):
        raise
    except ValueError as exc:
        raise ConfigError(f"config error: data: {exc}") from None


def load_on_demand(config: RunConfig) -> tuple[Dataset, GeneratedFederation]:
    """``data.on_demand``: the dataset's test split (no training rows) and its training clients
    as a federation that reads each sampled client from the files
    (:mod:`fedbayes.data.ondemand`); the same clients, examples and numbering as the in-memory
    natural partition. The config has already refused what needs the training set in memory
    (a validation split, calibration, personalisation, flipped labels, standardisation)."""
    d = config.data
    try:
        dataset, federation = d.spec.open_on_demand(d.data_dir, config.seed, d.cache_clients, d.cache_bytes, **d.spec.loader_params(d))
    except (DatasetNotFoundError, DataError):
        raise
    except ValueError as exc:
        raise ConfigError(f"config error: data: {exc}") from None
    if federation.num_clients != d.num_clients:
        raise ConfigError(
            f"config error: data.num_clients: the {dataset.name} data has {federation.num_clients} clients in its natural partition; got {d.num_clients} "
            f"(set data.num_clients = {federation.num_clients})"
        )
    return dataset, federation


def split_clients(config: RunConfig, dataset: Dataset) -> list[np.ndarray]:
    """Partitions the training set over clients with a generator seeded by ``config.seed``, by
    the partition the config names (:mod:`fedbayes.data.partitions`): ``data.num_clients``
    clients, or, where it is unset (data that brings its own clients), one per client id of the
    data."""
    d = config.data
    spec = d.partition_spec
    rng = protocol.partition_rng(config.seed)
    if spec.needs_client_ids and dataset.client_ids is None:
        raise ConfigError(
            f"config error: data.partition: {spec.name!r} needs client ids; {dataset.name} has none (pass client_ids, or choose iid or dirichlet)"
        )
    k = d.num_clients if d.num_clients is not None else _own_clients(config, dataset)
    if spec.needs_client_ids:
        try:
            parts = spec.split(dataset.y_train, k, rng, client_ids=dataset.client_ids, **spec.params(d))
        except ValueError as exc:
            raise ConfigError(f"config error: data.partition ({d.partition}, {dataset.num_train} examples): {exc}") from None
        if len(parts) != k:
            raise ConfigError(
                f"config error: data.num_clients: the {dataset.name} data has {len(parts)} clients in its natural partition; got {k} "
                f"(set data.num_clients = {len(parts)})"
            )
        return parts
    try:
        return spec.split(dataset.y_train, k, rng, **spec.params(d))
    except ValueError as exc:  # PartitionError included
        raise ConfigError(f"config error: data.partition ({d.partition}, data.num_clients = {k}, {dataset.num_train} examples): {exc}") from None


def _own_clients(config: RunConfig, dataset: Dataset) -> int:
    """The number of clients of data that brings its own (``data.num_clients`` unset): its
    distinct client ids; the cohort must fit in it."""
    if dataset.client_ids is None:
        raise ConfigError(f"config error: data.num_clients: the {dataset.name} data has no client ids to count; set data.num_clients")
    k = len(np.unique(dataset.client_ids))
    if config.server.clients_per_round > k:
        raise ConfigError(
            f"config error: server.clients_per_round: must be <= data.num_clients ({k}, the {dataset.name} data's clients); "
            f"got {config.server.clients_per_round}"
        )
    return k


def check_model(config: RunConfig, dataset: Dataset, module=None) -> None:
    """Rejects model/data pairs that cannot work, naming the field (before any training), from
    the model's traits (:class:`~fedbayes.models.registry.ModelSpec`: its tasks, image input,
    token ids); your own model (``model.module``, or ``module`` passed from Python) must have
    only parameters and give one logit per class (:func:`fedbayes.models.imported.check_module`)."""
    name = config.model.name
    spec = config.model.spec
    if dataset.task not in spec.tasks:
        allowed = ", ".join(s.name for s in model_registry.specs() if dataset.task in s.tasks)
        if dataset.task == "next_word":
            raise ConfigError(f"config error: model.name: {dataset.name!r} is next-word prediction (token sequences); allowed: {allowed}; got {name!r}")
        if dataset.task == "multilabel":
            raise ConfigError(
                f"config error: model.name: {dataset.name!r} is multi-label tag prediction on bag-of-words features; allowed: {allowed}; got {name!r}"
            )
        raise ConfigError(f"config error: model.name: {name!r} is built for {', '.join(spec.tasks)} data; {dataset.name!r} is a {dataset.task} task")
    if spec.image and len(dataset.feature_shape) not in (2, 3):
        allowed = ", ".join(s.name for s in model_registry.builtin_specs() if dataset.task in s.tasks and not (s.image or s.tokens or s.imported))
        raise ConfigError(
            f"config error: model.name: {name!r} needs image data [H, W] or [H, W, C]; {dataset.name!r} has features of shape "
            f"{dataset.feature_shape}" + (f"; allowed here: {allowed}" if allowed else "")
        )
    if spec.tokens:
        return
    if not np.issubdtype(dataset.x_train.dtype, np.floating):
        raise ConfigError(
            f"config error: data.dataset: {dataset.name!r} holds token ids (text, shape {dataset.feature_shape}); "
            "no fedbayes model takes text yet; allowed here: image or tabular data"
        )
    if spec.imported and module is None and config.model.module is None:
        raise ConfigError(
            f"config error: model.name: {name!r} is your own flax module: set model.module, or pass it from Python: run_experiment(config, out, model=...)"
        )
    if not spec.imported and module is not None:
        raise ConfigError(f"config error: model.name: a model passed to run_experiment needs model.name = 'module'; got {name!r}")
    if spec.imported:
        from fedbayes.models.imported import check_module

        try:
            check_module(_module(config, dataset.num_classes, module), dataset.feature_shape, dataset.num_classes)
        except ValueError as exc:
            raise ConfigError(f"config error: {exc}") from None


def prepare_data(config: RunConfig, given: Dataset | None = None, module=None) -> tuple[Dataset, list[np.ndarray]]:
    """Loads and partitions the data and checks the model against it: every check that needs
    the data, cheap enough to run for all variants of a comparison before any of them trains.
    The parts are the clients' training examples (without a validation split). ``given`` and
    ``module``: data and model passed from Python (:func:`load_data`, :func:`build_model`)."""
    dataset, parts, _ = prepare_split(config, given, module)
    return dataset, parts


def prepare_split(config: RunConfig, given: Dataset | None = None, module=None) -> tuple[Dataset, list[np.ndarray], np.ndarray | None]:
    """:func:`prepare_data` plus the validation split held out from each client's training
    examples (``data.validation_fraction``, :mod:`fedbayes.data.holdout`); None when it is 0."""
    split = prepare_splits(config, given, module)
    return split.dataset, split.parts, split.validation


class Splits(NamedTuple):
    """The data of a run (:func:`prepare_splits`)."""

    dataset: Dataset
    parts: list[np.ndarray]  # each client's training examples
    validation: np.ndarray | None  # the validation split (data.validation_fraction), or None
    calibration: list[np.ndarray] | None  # each client's conformal calibration examples (evaluation.conformal_alpha), or None
    personal: list[np.ndarray] | None = None  # each client's own test examples (evaluation.personal_fraction), or None
    federation: GeneratedFederation | None = None  # data.on_demand: the clients, read when sampled (parts is then empty)


def prepare_splits(config: RunConfig, given: Dataset | None = None, module=None) -> Splits:
    """:func:`prepare_split` plus each client's conformal calibration examples: with
    ``evaluation.conformal_alpha`` set, ``evaluation.calibration_fraction`` of what each client
    keeps after the validation split (so that split is the one a run without conformal sets
    gets), drawn with :func:`fedbayes.protocol.calibration_rng` and never trained on; then each
    client's own test examples for personalisation (:func:`personal_split`)."""
    if config.data.on_demand:
        dataset, federation = load_on_demand(config)
        check_model(config, dataset, module)
        return Splits(dataset, [], None, None, None, federation)
    dataset = load_data(config, given)
    check_model(config, dataset, module)
    parts, validation, calibration = client_splits(config, dataset)
    parts, personal = personal_split(config, parts)
    dataset = standardize(dataset, parts, config.data.standardize, config.data.dataset)
    return Splits(dataset, parts, validation, calibration, personal)


def personal_split(config: RunConfig, parts: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each client's training examples and its own test examples (``evaluation.personal_fraction``
    of what it keeps after the validation and calibration splits, so those splits are the ones a
    run without personalisation gets), drawn with :func:`fedbayes.protocol.personal_rng` and never
    trained on; ``(parts, None)`` when the fraction is 0."""
    fraction = config.evaluation.personal_fraction
    if fraction == 0:
        return parts, None
    parts, personal = hold_out_per_client(parts, fraction, lambda k: protocol.personal_rng(config.seed, k))
    if sum(map(len, personal)) == 0:
        raise ConfigError(
            f"config error: evaluation.personal_fraction: {fraction} of each client's examples holds out none "
            f"({sum(map(len, parts))} training examples over {len(parts)} clients, every client keeping one); raise it, or set 0 for no personalisation"
        )
    return parts, personal


def client_splits(config: RunConfig, dataset: Dataset) -> tuple[list[np.ndarray], np.ndarray | None, list[np.ndarray] | None]:
    """The partition and the held-out splits of :func:`prepare_splits`: ``(parts, validation,
    calibration)``, indices into ``dataset``'s training set (the same for the same seed)."""
    parts = split_clients(config, dataset)
    fraction = config.data.validation_fraction
    validation = None
    if fraction > 0:
        parts, validation = hold_out(parts, fraction, lambda k: protocol.validation_rng(config.seed, k))
        if validation.size == 0:
            raise ConfigError(
                f"config error: data.validation_fraction: {fraction} of each client's examples holds out none "
                f"({sum(map(len, parts))} training examples over {len(parts)} clients, every client keeping one); raise it, or set 0 for no validation split"
            )
    calibration = None
    if config.evaluation.conformal_alpha is not None:
        parts, calibration = _calibration_split(config, dataset, parts)
    return parts, validation, calibration


def _calibration_split(config: RunConfig, dataset: Dataset, parts: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each client's training and calibration examples; refuses, in one line, a task without
    classes or too few calibration examples for a finite threshold (``k <= N``)."""
    from fedbayes.evaluation.conformal import conformal_rank, min_calibration

    e = config.evaluation
    if dataset.task != "classification":
        raise ConfigError(
            f"config error: evaluation.conformal_alpha: conformal sets here are for classification; {dataset.name!r} is a {dataset.task} task; unset it"
        )
    parts, calibration = hold_out_per_client(parts, e.calibration_fraction, lambda k: protocol.calibration_rng(config.seed, k))
    total = sum(map(len, calibration))
    if conformal_rank(total, e.conformal_alpha) > total:
        raise ConfigError(
            f"config error: evaluation.calibration_fraction: {e.calibration_fraction} of the clients' examples gives {total} calibration examples; "
            f"coverage {1 - e.conformal_alpha:g} needs at least {min_calibration(e.conformal_alpha)} (raise it, or raise evaluation.conformal_alpha)"
        )
    return parts, calibration


class DataSpec(NamedTuple):
    """The data's shape, all that building the model and the algorithm needs of it."""

    num_classes: int
    feature_shape: tuple[int, ...]  # one example's features, no batch axis
    x_dtype: Any
    task: str  # one of fedbayes.data.dataset.TASKS

    @classmethod
    def of(cls, dataset: Dataset) -> DataSpec:
        return cls(dataset.num_classes, tuple(dataset.feature_shape), dataset.x_train.dtype, dataset.task)


# ----- 2. scenario (attacks) ---------------------------------------------------------------------


def build_scenario(config: RunConfig, dataset: Dataset, parts) -> tuple[Scenario, np.ndarray]:
    """The simulated failures and attacks (``server.dropout``, ``server.deadline``, ``[attack]``)
    over the partition ``parts``, and the training labels (flipped on the attackers' examples for
    ``attack.kind = "label_flip"``; otherwise the dataset's own)."""
    a = config.attack
    attackers = attacks.attacker_ids(config.seed, len(parts), a.fraction)
    y_train = dataset.y_train
    attack = None
    if len(attackers) and a.kind == "label_flip":
        y_train = attacks.flip_labels(dataset.y_train, np.concatenate([parts[c] for c in attackers]), dataset.num_classes)
    elif len(attackers):
        attack = attacks.message_attack(a.kind, a.scale)
    return Scenario(dropout=config.server.dropout, deadline=config.server.deadline, attack=attack, attackers=attackers), y_train


# ----- 3. model ----------------------------------------------------------------------------------


class ModelParts(NamedTuple):
    """The model and what the algorithm needs of it."""

    model: Any  # the flax module
    params: Any  # its initial parameters (key: protocol.params_key(seed))
    trainer: LocalTrainer  # the clients' local training
    apply_fn: Callable[[Any, Any], Any]  # (params, x) -> outputs
    keyed_apply_fn: Callable[[Any, Any, Any], Any] | None  # (params, key, x): a variational model's stochastic pass


def client_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """The clients' optax optimizer from the ``[client]`` section."""
    c = config.client
    if c.optimizer == "sgd":
        opt = optax.sgd(c.lr, momentum=c.momentum or None)
    else:
        opt = optax.adam(c.lr)
    if c.weight_decay > 0:
        opt = optax.chain(optax.add_decayed_weights(c.weight_decay), opt)
    return opt


def local_trainer(config: RunConfig, loss) -> LocalTrainer:
    """The clients' :class:`~fedbayes.inference.LocalTrainer` from the ``[client]`` section: a fixed
    budget of ``client.epochs`` epochs (``client.stop = "epochs"``), or at most ``client.max_epochs``
    epochs (``client.max_steps`` steps where those are fewer) until the objective settles
    (``"converged"``, tolerance ``client.tol``)."""
    c = config.client
    if c.stop == "converged":
        return LocalTrainer(loss, client_optimizer(config), c.max_epochs, c.batch_size, tol=c.tol, max_steps=c.max_steps)
    return LocalTrainer(loss, client_optimizer(config), c.epochs, c.batch_size)


def _module(config: RunConfig, num_classes: int, module=None):
    """The flax module: ``module`` (passed from Python), or the one the model registry builds
    from the ``[model]`` config (:attr:`~fedbayes.models.registry.ModelSpec.build`)."""
    if module is not None:
        return module
    m = config.model
    return m.spec.build(m, num_classes, m.variational)


def build_model(config: RunConfig, spec: DataSpec, module=None) -> ModelParts:
    """The model, its initial parameters and the local trainer from the config and the data's
    shape; ``module``: a flax module passed from Python (``model.name = "module"``)."""
    variational = config.model.variational
    model = _module(config, spec.num_classes, module)
    limits.check_model(config, lambda: tree_lib.num_params(jax.eval_shape(lambda: init_params(model, protocol.params_key(config.seed), spec.feature_shape))))
    params = init_params(model, protocol.params_key(config.seed), spec.feature_shape)
    trainer = local_trainer(config, loss_fn(model, spec.task))
    apply_fn = lambda p, x: model.apply({"params": p}, x)  # noqa: E731
    keyed_apply_fn = apply_with_key(model) if variational else None
    return ModelParts(model, params, trainer, apply_fn, keyed_apply_fn)


# ----- 4. algorithm and aggregator ---------------------------------------------------------------


def build_context(config: RunConfig, spec: DataSpec, federation: registry.FederationInfo, model: ModelParts) -> registry.BuildContext:
    """The one constructor of what the registry's builders get besides their own settings: the
    trainer, the server optimizer, the federation's sizes, the cohort size, the model's apply
    functions, the task, one example's feature shape and whether the model is a network. No data."""
    s = config.server
    server_opt = algs.make_server_optimizer(s.optimizer, s.lr, momentum=s.momentum, b1=s.beta1, b2=s.beta2, tau=s.tau, variant=s.variant)
    return registry.BuildContext(
        trainer=model.trainer,
        server_optimizer=server_opt,
        federation=federation,
        clients_per_round=s.clients_per_round,
        apply_fn=model.apply_fn,
        task=spec.task,
        keyed_apply_fn=model.keyed_apply_fn,
        feature_spec=jax.ShapeDtypeStruct(tuple(spec.feature_shape), spec.x_dtype),
        hidden_layers=has_hidden_layers(model.params),
        num_params=tree_lib.num_params(model.params),
        last_layer_params=gaussian_block.dense_size(model.params) if isinstance(model.params, dict) and model.params else None,
        param_shapes=jax.tree.map(lambda p: jax.ShapeDtypeStruct(jnp.shape(p), jnp.result_type(p)), model.params),
    )


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


def build_algorithm_and_aggregator(
    config: RunConfig, federation: registry.FederationInfo, spec: DataSpec, model: ModelParts | None = None
) -> tuple[algs.Algorithm, Any]:
    """The configured algorithm (through the registry) and the server's aggregation rule
    (:func:`make_server_aggregator`; ``None``: the method's own), without any data: ``federation``
    gives the clients' example counts and ``spec`` the data's shape. ``model``: the parts already
    built by :func:`build_model` (built here when None)."""
    model = build_model(config, spec) if model is None else model
    try:
        algorithm = registry.build(config.algorithm, build_context(config, spec, federation, model))
    except ValueError as exc:  # what the method cannot do with this model or task (a curvature the task lacks, ...)
        raise ConfigError(f"config error: algorithm ({config.algorithm.name}, {spec.task} data, model {config.model.name}): {exc}") from None
    return algorithm, make_server_aggregator(config, algorithm)


# ----- 5. evaluator ------------------------------------------------------------------------------

VALIDATION_METRICS = ("accuracy", "nll", "ece", "mse", "rmse")  # recorded as val_<metric>


def build_evaluator(
    config: RunConfig,
    algorithm: algs.Algorithm,
    dataset: Dataset,
    model: ModelParts,
    validation: np.ndarray | None = None,
    federation: registry.FederationInfo | None = None,
) -> Evaluate:
    """``(server state, round) -> metrics`` on ``dataset``'s test split, plus ``val_*`` on the
    validation split (training indices ``validation``) when there is one. ``federation``: the
    clients' example counts (a prior precision that grows with the data needs their total);
    default: every training example outside the validation split."""
    held_out = None
    if validation is not None:
        held_out = dataclasses.replace(dataset, x_test=dataset.x_train[validation], y_test=dataset.y_train[validation], test_client_ids=None)
    total = federation.total_examples if federation is not None else dataset.num_train - (0 if validation is None else len(validation))
    evaluate = _evaluation(algorithm, config, dataset, model.apply_fn, model.keyed_apply_fn, held_out=held_out, total_examples=total)
    if held_out is not None:
        evaluate = _with_validation(evaluate, _evaluation(algorithm, config, held_out, model.apply_fn, model.keyed_apply_fn, marginal=False))
    return evaluate


def _evaluation(
    algorithm: algs.Algorithm,
    config: RunConfig,
    dataset: Dataset,
    apply_fn,
    keyed_apply_fn,
    marginal: bool = True,
    held_out: Dataset | None = None,
    total_examples: int = 0,
) -> Evaluate:
    """``(server state, round) -> metrics`` on ``dataset``'s test split."""
    if config.model.variational:
        return _variational(algorithm, config, keyed_apply_fn, dataset)
    evaluate = make_evaluator(apply_fn, dataset.x_test, dataset.y_test, task=dataset.task, batch_size=config.eval_batch_size, num_bins=config.ece_bins)
    if marginal and algorithm.server_posterior is not None and dataset.task == "classification":
        return _with_marginal(evaluate, algorithm, config, apply_fn, dataset, held_out, total_examples)
    return _on_state(evaluate, algorithm)


def _with_validation(evaluate_test: Evaluate, evaluate_validation: Evaluate) -> Evaluate:
    """Adds the validation split's metrics as ``val_accuracy``, ``val_nll``, ... to the test metrics."""

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = evaluate_test(server_state, round_idx)
        held_out = evaluate_validation(server_state, round_idx)
        out.update({f"val_{k}": v for k, v in held_out.items() if k in VALIDATION_METRICS})
        return out

    return evaluate


def _variational(algorithm: algs.Algorithm, config: RunConfig, keyed_apply_fn, dataset: Dataset) -> Evaluate:
    """A variational model's metrics: accuracy, NLL and ECE of its marginalised predictive over
    ``S = evaluation.marginal_samples`` stochastic forward passes (a variational network has no
    deterministic forward pass; Ozer et al. 2022 report these), and ``std_norm``, the L2 norm of
    its learned standard deviations. The passes' key depends on the seed and the round only."""
    from fedbayes.evaluation.variational import make_predictive_metrics

    # built once: its program compiled for the run, not at every round's evaluation
    metrics = make_predictive_metrics(
        keyed_apply_fn, num_samples=config.evaluation.marginal_samples, num_bins=config.ece_bins, batch_size=config.eval_batch_size
    )

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = metrics(algorithm.server_params(server_state), protocol.evaluation_key(config.seed, round_idx), dataset.x_test, dataset.y_test)
        out.pop("std_norm_clamped", None)
        return out

    return evaluate


def _with_marginal(
    evaluate_point, algorithm: algs.Algorithm, config: RunConfig, apply_fn, dataset: Dataset, held_out: Dataset | None, total_examples: int
) -> Evaluate:
    """Adds the marginalised prediction over ``S`` samples of ``q_g`` (``accuracy_marg``,
    ``nll_marg``, ``ece_marg``; Guo et al. 2023 (FedEP) Table 5) to the point metrics, with
    ``evaluation.predictive``, drawing the weights of ``evaluation.subset_of_weights``. Under ``evaluation.prior_precision = "marglik"`` or ``"validation"``
    the posterior's prior precision is first chosen post hoc (:mod:`fedbayes.evaluation.prior_precision`;
    the validation search on ``held_out``) and reported as ``prior_precision_marg``. The samples'
    key depends on the seed and the round only, so a resumed run draws the same ones."""
    e = config.evaluation
    settings = dict(num_samples=e.marginal_samples, batch_size=config.eval_batch_size, num_bins=config.ece_bins, predictive=e.predictive)
    marginal = make_marginal_evaluator(apply_fn, dataset.x_test, dataset.y_test, **settings)
    posterior = _evaluated_posterior(config, algorithm, _prior_precision_search(config, apply_fn, held_out, total_examples, settings))

    def evaluate(server_state, round_idx: int) -> dict[str, float]:
        out = evaluate_point(algorithm.server_params(server_state))
        key, mean, variance, chosen = posterior(server_state, round_idx)
        if chosen is not None:
            out["prior_precision_marg"] = chosen
        out.update({f"{k}_marg": v for k, v in marginal(key, mean, variance).items() if k in ("accuracy", "nll", "ece")})
        return out

    return evaluate


def _evaluated_posterior(config: RunConfig, algorithm: algs.Algorithm, tune):
    """``(server state, round) -> (key, mean, variance, chosen prior precision or None)``: the
    posterior the marginalised prediction draws from, as :func:`_with_marginal` describes."""
    e = config.evaluation

    def posterior(server_state, round_idx: int):
        mean, variance = algorithm.server_posterior(server_state)
        dense = getattr(algorithm, "server_precision", None)
        if dense is not None:  # a dense posterior: draws from the full Gaussian, not its marginals
            variance = dense_spread(mean, dense(server_state))
        variance = restrict_to_subset(variance, e.subset_of_weights)
        key = protocol.evaluation_key(config.seed, round_idx)
        chosen = None
        if tune is not None:  # the validation draws: another stream than the test's
            variance, chosen = tune(jax.random.fold_in(key, 1), mean, variance)
            chosen = float(chosen)
        return key, mean, variance, chosen

    return posterior


def _prior_precision_search(config: RunConfig, apply_fn, held_out: Dataset | None, total_examples: int, settings: dict):
    """``evaluation.prior_precision``'s search (``None`` for ``"fixed"``) around the method's prior
    precision for a federation of ``total_examples`` examples."""
    search = config.evaluation.prior_precision
    prior = config.spec.prior_precision_for(config.algorithm)
    if search == "fixed" or prior is None:  # the config allows a search only with a prior
        return None
    nll = None
    if search == "validation":
        if held_out is None:
            raise ConfigError("config error: evaluation.prior_precision: 'validation' needs a validation split; set data.validation_fraction > 0")
        metrics_of = marginal_metrics(apply_fn, held_out.x_test, held_out.y_test, **settings)
        nll = lambda key, mean, variance: metrics_of(key, mean, variance)["nll"]  # noqa: E731
    return make_prior_precision_search(search, prior.at(total_examples), validation_nll=nll)


def _on_state(evaluate_point, algorithm: algs.Algorithm) -> Evaluate:
    """The point evaluation of the server state's model."""
    return lambda server_state, round_idx: evaluate_point(algorithm.server_params(server_state))


Predict = Callable[[np.ndarray, int], np.ndarray]  # (x, stream) -> class probabilities [n, C]


def build_predictive(
    config: RunConfig,
    algorithm: algs.Algorithm,
    model: ModelParts,
    validation_set: Dataset | None = None,
    total_examples: int = 0,
) -> Callable[[Any, int], dict[str, Predict]]:
    """``(server state, round) -> {suffix: predict}``: the predictives whose metrics the run's
    evaluation reports at that round, as functions ``predict(x, stream) -> probabilities``.

    ``""``: the point predictive ``softmax(f(x; params))``, or a variational model's marginalised
    one (its only one); ``"_marg"``: a method with a posterior, the marginalised predictive with
    the evaluation's key, weights and prior precision (:func:`_with_marginal`), so its draws
    ``theta_s`` are those of ``*_marg`` and the same for every ``x``. A variational model draws
    each example's forward-pass noise afresh: ``stream`` keeps the noise of two sets apart.
    ``validation_set`` and ``total_examples``: as :func:`build_evaluator` passes them on.
    """
    from fedbayes.evaluation.evaluators import make_marginal_probabilities, make_probabilities
    from fedbayes.evaluation.variational import predictive_log_probs

    e = config.evaluation
    if config.model.variational:
        passes = jax.jit(lambda params, key, xs: jnp.exp(predictive_log_probs(model.keyed_apply_fn, params, key, xs, e.marginal_samples)))

        def variational(server_state, round_idx: int) -> dict[str, Predict]:
            params, key = algorithm.server_params(server_state), protocol.evaluation_key(config.seed, round_idx)

            def predict(x, stream):
                size = config.eval_batch_size
                stream_key = jax.random.fold_in(key, 2 + stream)  # not the evaluation's key: other draws
                return np.concatenate(
                    [np.asarray(passes(params, jax.random.fold_in(stream_key, b), jnp.asarray(x[i : i + size]))) for b, i in enumerate(range(0, len(x), size))]
                )

            return {"": predict}

        return variational
    point = make_probabilities(model.apply_fn, batch_size=config.eval_batch_size)
    posterior = None
    if algorithm.server_posterior is not None:
        settings = dict(num_samples=e.marginal_samples, batch_size=config.eval_batch_size, num_bins=config.ece_bins, predictive=e.predictive)
        tune = _prior_precision_search(config, model.apply_fn, validation_set, total_examples, settings)
        posterior = _evaluated_posterior(config, algorithm, tune)
        marginal = make_marginal_probabilities(model.apply_fn, num_samples=e.marginal_samples, batch_size=config.eval_batch_size, predictive=e.predictive)

    def predictives(server_state, round_idx: int) -> dict[str, Predict]:
        params = algorithm.server_params(server_state)
        out = {"": lambda x, stream: point(params, x)}
        if posterior is not None:
            key, mean, variance, _ = posterior(server_state, round_idx)
            out["_marg"] = lambda x, stream: marginal(key, mean, variance, x)
        return out

    return predictives


# ----- all of it ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Experiment:
    """Everything built from a config, ready to run (:func:`build_experiment`)."""

    config: RunConfig
    dataset: Dataset
    federation: AnyFederation  # the clients' training examples (labels flipped for label_flip attackers); read on demand with data.on_demand
    model: Any  # the flax module
    params: Any  # its initial parameters
    algorithm: algs.Algorithm
    aggregator: Any  # the server's rule (None: the algorithm's own)
    scenario: Scenario  # simulated failures and attacks
    evaluate: Evaluate  # (server state, round) -> metrics
    validation: np.ndarray | None = None  # held-out training indices (data.validation_fraction)
    store_dir: str | Path | None = None  # the disk client store's folder when config.store_dir is unset
    calibration: list[np.ndarray] | None = None  # each client's conformal calibration examples (evaluation.conformal_alpha)
    predictive: Callable[[Any, int], dict] | None = None  # build_predictive's, with calibration
    personal: list[np.ndarray] | None = None  # each client's own test examples (evaluation.personal_fraction)
    personalise: Callable[[Any, Any, int], dict] | None = None  # (server state, client states, round) -> personal.json's body

    @functools.cached_property
    def simulator(self) -> Simulator:
        """The simulator of this experiment (:func:`build_simulator`), built on first use."""
        return build_simulator(self)


def build_simulator(exp: Experiment) -> Simulator:
    """The simulator that runs ``exp``'s rounds: its algorithm, aggregator, scenario and store."""
    config = exp.config
    return Simulator(
        exp.algorithm,
        exp.federation,
        clients_per_round=config.server.clients_per_round,
        seed=config.seed,
        weighting=config.server.weighting,
        layout=config.layout,
        fail_fast=config.server.fail_fast,
        store=config.store,
        store_dir=config.store_dir or exp.store_dir,
        aggregator=exp.aggregator,
        scenario=exp.scenario,
        fuse=config.fuse_rounds,
    )


def build_experiment(config: RunConfig, store_dir: str | Path | None = None, data: Dataset | None = None, module=None) -> Experiment:
    """Builds everything; ``store_dir`` is the disk client store's folder when ``config.store_dir`` is unset;
    ``data`` and ``module``: your dataset (``data.dataset = "arrays"``) and flax module
    (``model.name = "module"``) passed from Python."""
    dataset, parts, validation, calibration, personal, on_demand = prepare_splits(config, data, module)
    if on_demand is not None:  # label_flip is refused with on_demand: only the clients' number matters
        scenario, _ = build_scenario(config, dataset, range(on_demand.num_clients))
        federation = on_demand
    else:
        scenario, y_train = build_scenario(config, dataset, parts)
        federation = Federation(dataset.x_train, y_train, tuple(parts))
    spec = DataSpec.of(dataset)
    model = build_model(config, spec, module)
    info = registry.FederationInfo.from_sizes(federation.sizes)
    algorithm, aggregator = build_algorithm_and_aggregator(config, info, spec, model)
    evaluate = build_evaluator(config, algorithm, dataset, model, validation, info)
    predictive = None
    if calibration is not None:
        held_out = (
            None
            if validation is None
            else dataclasses.replace(dataset, x_test=dataset.x_train[validation], y_test=dataset.y_train[validation], test_client_ids=None)
        )
        predictive = build_predictive(config, algorithm, model, held_out, info.total_examples)
    exp = Experiment(config, dataset, federation, model.model, model.params, algorithm, aggregator, scenario, evaluate, validation, store_dir)
    exp.calibration, exp.predictive, exp.personal = calibration, predictive, personal
    if personal is not None:
        from fedbayes.runs.personal import build_personalisation

        exp.personalise = build_personalisation(config, algorithm, model, dataset, federation, personal)
    return exp
