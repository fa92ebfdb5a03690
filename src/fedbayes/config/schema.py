"""Experiment configuration: a validated, immutable description of one run.

Configs are TOML files (see ``examples/``) parsed into :class:`RunConfig` by pydantic. Unknown
keys, wrong types and impossible values (``clients_per_round > num_clients``, ``lr <= 0``,
``alpha <= 0``, ...) are rejected before any work starts, with one line naming the field and what
is allowed (:func:`format_validation_error`).

The ``[algorithm]`` table is validated, when a config is, against the settings of the method it
names in the live registry (:mod:`fedbayes.algorithms.registry`): a method added with
``registry.register`` runs from a config file, and validating imports only the named method's
module. What the rest of the config must be for that method (server optimizer, aggregation rule,
privacy, variational model, local epochs) is read from its spec's traits, never from its name.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

import tomli_w
from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, ValidationError, create_model, field_validator, model_validator

from fedbayes.algorithms import registry
from fedbayes.data import partitions as partition_registry
from fedbayes.data import registry as data_registry
from fedbayes.data.standardize import is_user_data
from fedbayes.errors import BadInputError
from fedbayes.hparams import HParams
from fedbayes.models import registry as model_registry

# The data and model keys are validated against the live dataset, partition and model registries
# (fedbayes.data.registry, fedbayes.data.partitions, fedbayes.models.registry): these tuples are the
# built-in names, kept for readers of the config module.
DATASETS = data_registry.names()
NATURAL_DATASETS = tuple(s.name for s in data_registry.builtin_specs() if s.federated != "never")
USER_DATA_KEYS = tuple(k for s in data_registry.builtin_specs() if s.user_data for k in s.exclusive)  # your own data's keys only (fedbayes.data.user)
PARTITIONS = partition_registry.names()
MODELS = model_registry.names()
VARIATIONAL_MODELS = tuple(s.name for s in model_registry.builtin_specs() if s.variational)
ACTIVATIONS = ("relu", "sigmoid", "tanh")
PREDICTIVES = ("sample", "linearised")  # fedbayes.evaluation.evaluators.PREDICTIVES (a test keeps them equal)
CONFORMAL_SCORES = ("lac", "aps")  # fedbayes.evaluation.conformal.SCORES (a test keeps them equal)
PRIOR_PRECISIONS = ("fixed", "marglik", "validation")  # fedbayes.evaluation.prior_precision.SEARCHES (a test keeps them equal)
SUBSETS = ("all", "last_layer")  # fedbayes.evaluation.evaluators.SUBSETS (a test keeps them equal)
EVALUATION_KEYS = ("marginal_samples", "predictive")  # under [algorithm] before the [evaluation] section
# What a stored config (a run folder's config.toml, a checkpoint) meant when it lacks a key whose
# default now depends on the method: the behaviour of the versions that wrote it (resolved()).
STORED_EVALUATION_DEFAULTS = {"predictive": "sample", "prior_precision": "fixed", "subset_of_weights": "all"}


_Strict = HParams  # finite floats, no booleans for numbers, unknown keys rejected (fedbayes.hparams)


def _own_settings(record: HParams, section: str, common: tuple[str, ...], owners: list[tuple[str, Any]]) -> None:
    """Validates the keys of ``record`` (a ``[data]`` or ``[model]`` table) that the specs it
    names (``owners``: ``(what, spec)``) read, through each spec's settings record: a key none of
    them reads, outside the section's common keys, is an unknown key; an unset key of a spec's
    own settings takes its default (so the resolved config writes it out)."""
    extra = record.__pydantic_extra__ if record.__pydantic_extra__ is not None else {}
    own = [k for _, spec in owners for k in spec.setting_keys if k not in common]
    for key in extra:
        if key not in own:
            raise ValueError(f"{section}{key}: unknown key; allowed keys here: {', '.join(dict.fromkeys([*common, *own]))}")
    for _, spec in owners:
        if spec.settings is None:
            continue
        given = {k: (extra[k] if k in extra else getattr(record, k)) for k in spec.setting_keys if k in extra or k in common}
        try:
            values = spec.settings.model_validate(given)
        except ValidationError as exc:
            raise ValueError(format_validation_error(exc, spec.settings, prefix=section).removeprefix("config error: ")) from None
        extra.update({k: getattr(values, k) for k in spec.setting_keys if k not in common})


def _exclusive_keys(record: HParams, section: str, chosen: str, what: str, specs, message) -> None:
    """A key that another spec than the chosen one declares its own (``exclusive``) must keep its
    default; ``message(key, owner)`` is the error's text after the key."""
    fields = type(record).model_fields
    for spec in specs:
        if spec.name == chosen:
            continue
        for key in spec.exclusive:
            default = fields[key].get_default(call_default_factory=True) if key in fields else None
            value = getattr(record, key, default)
            if value != default:
                raise ValueError(f"{section}{key}: {message(key, spec.name, value)}")


DEFAULT_NUM_CLIENTS = 10  # data.num_clients of data that brings no clients of its own


def brings_clients(spec: data_registry.DatasetSpec, partition: partition_registry.PartitionSpec, data: Any) -> bool:
    """Whether the data, as ``data`` configures it, brings its own clients, whose number an unset
    ``data.num_clients`` takes: a dataset that comes federated or a partition by the data's client
    ids, unless the dataset makes as many clients as it is asked for (a generated federation)."""
    return not spec.makes_clients and (spec.comes_federated(data) or partition.needs_client_ids)


# The order `fedbayes config data` has always listed the built-in datasets' and partitions' keys in,
# and config.toml writes them in; a key a built-in spec adds later follows them. Each key is
# declared once, in its spec's settings (fedbayes.data.registry, fedbayes.data.partitions).
_LISTED_DATA_KEYS = (
    "alpha", "alpha1", "alpha2", "classes_per_client", "synthetic_alpha", "synthetic_beta", "dim", "num_classes", "only_digits",
    "vocab_size", "num_tags", "max_len", "max_clients", "max_posts", "test_examples", "test_clients", "path", "test_path",
    "test_fraction", "label", "client_column",
)  # fmt: skip


def _spec_fields() -> dict[str, Any]:
    """The built-in partitions' and datasets' own keys, as pydantic field definitions: the flat
    keys of ``[data]`` (:func:`fedbayes.data.registry.settings_fields`)."""
    fields = data_registry.settings_fields([*partition_registry.builtin_specs(), *data_registry.builtin_specs()])
    order = sorted(fields, key=lambda k: _LISTED_DATA_KEYS.index(k) if k in _LISTED_DATA_KEYS else len(_LISTED_DATA_KEYS))
    return {key: (fields[key].annotation, copy.copy(fields[key])) for key in order}


class _DataChoice(_Strict):
    """The keys of ``[data]`` before the specs' own: which dataset, how much, how many clients, which partition."""

    model_config = ConfigDict(extra="allow")  # a registered dataset's or partition's own keys (checked in _own_settings)
    section: ClassVar[str] = "data."

    dataset: str = Field("fashion_mnist", description="a name of the dataset registry (`fedbayes datasets` lists them): " + ", ".join(DATASETS))
    data_dir: str | None = None
    fraction: float = Field(1.0, gt=0, le=1, description="random fraction of the training set (Swaroop et al. 2025 (ADMM and Bayes) uses 0.1 for FMNIST)")
    num_clients: int | None = Field(
        None,
        ge=1,
        description=f"the number of clients; unset: the data's own number of clients where the data brings its clients (a dataset that comes "
        f"federated: leaf, emnist, fed_cifar100, stackoverflow_*, files with a client_column; or partition = natural), else {DEFAULT_NUM_CLIENTS} "
        "(the generated federations, synthetic_leaf, least_squares and cifar100's Pachinko split, make this many)",
    )
    partition: str | None = Field(
        None,
        description="a name of the partition registry: " + ", ".join(PARTITIONS) + "; unset: natural where the dataset comes federated "
        "(its own client ids: leaf, synthetic_leaf, least_squares, emnist, fed_cifar100, cifar100, stackoverflow_*, files with a client_column), else iid",
    )


# The specs' own keys, declared in their settings (DataSettings records), sit flat between them.
_DataKeys = create_model("_DataKeys", __base__=_DataChoice, __module__=__name__, **_spec_fields())


class DataConfig(_DataKeys):
    """Which data, how much of it, and how it is split over clients. The dataset and the partition
    are names in the dataset and partition registries; the keys only one of them reads sit flat in
    this table and are validated through its settings (a dataset or partition registered from
    Python brings its own keys)."""

    @model_validator(mode="before")
    @classmethod
    def _registered_names(cls, data: Any) -> Any:
        """The dataset must be registered; an unset partition is natural where the dataset comes
        federated (:meth:`~fedbayes.data.registry.DatasetSpec.comes_federated`), else iid; an unset
        ``num_clients`` stays unset where the data brings its clients (:func:`brings_clients`:
        the federation takes their number, :func:`fedbayes.runs.build.split_clients`), else it
        is :data:`DEFAULT_NUM_CLIENTS`."""
        if not isinstance(data, dict):
            return data
        name = data.get("dataset", "fashion_mnist")
        if not isinstance(name, str) or name not in data_registry.names():
            raise ValueError(f"data.dataset: unknown dataset {name!r}; allowed: {', '.join(data_registry.names())}")
        spec = data_registry.get(name)
        partition = data.get("partition")
        if partition is None:
            partition = "natural" if spec.comes_federated(data) else "iid"
            data = {**data, "partition": partition}
        elif not isinstance(partition, str) or partition not in partition_registry.names():
            raise ValueError(f"data.partition: unknown partition {partition!r}; allowed: {', '.join(partition_registry.names())}")
        if data.get("num_clients") is None and not brings_clients(spec, partition_registry.get(partition), data):
            data = {**data, "num_clients": DEFAULT_NUM_CLIENTS}
        return data

    @model_validator(mode="after")
    def _user_data(self) -> DataConfig:
        spec, part = self.spec, self.partition_spec
        _own_settings(self, "data.", tuple(type(self).model_fields), [("dataset", spec), ("partition", part)])
        _exclusive_keys(
            self,
            "data.",
            self.dataset,
            "dataset",
            data_registry.specs(),
            lambda key, owner, value: f"only dataset {owner!r} reads it; got dataset {self.dataset!r}",
        )
        if part.needs_client_ids:
            if spec.federated == "never":
                allowed = ", ".join(s.name for s in data_registry.specs() if s.federated != "never")
                raise ValueError(f"data.partition: {part.name!r} needs a dataset with client ids ({allowed}); got {self.dataset!r}")
            if spec.client_ids_setting is not None and getattr(self, spec.client_ids_setting) is None:
                raise ValueError(f"data.partition: {part.name!r} needs the client column of your data; set data.{spec.client_ids_setting}")
        return self

    @model_validator(mode="after")
    def _on_demand_possible(self) -> DataConfig:
        if not self.on_demand:
            return self
        if self.spec.open_on_demand is None:
            allowed = ", ".join(s.name for s in data_registry.specs() if s.open_on_demand is not None)
            raise ValueError(f"data.on_demand: {self.dataset!r} is read into memory; on-demand reading is for {allowed}")
        if self.partition != "natural":
            raise ValueError(f"data.partition: on_demand reads the users of the file as the clients (natural); got {self.partition!r}")
        if self.validation_fraction > 0:
            raise ValueError("data.validation_fraction: with on_demand no training example is held out (the users are read only when sampled); set 0")
        if self.fraction < 1:
            raise ValueError("data.fraction: with on_demand every user's posts are used (data.max_clients and data.max_posts cut them); set 1")
        if self.standardize is True:
            raise ValueError("data.standardize: with on_demand no pass over all the training data is made; leave it unset or false")
        return self

    @property
    def spec(self) -> data_registry.DatasetSpec:
        """The :class:`~fedbayes.data.registry.DatasetSpec` of ``dataset`` (its loader and traits)."""
        return data_registry.get(self.dataset)

    @property
    def partition_spec(self) -> partition_registry.PartitionSpec:
        """The :class:`~fedbayes.data.partitions.PartitionSpec` of ``partition``."""
        return partition_registry.get(self.partition)

    on_demand: bool = Field(
        False,
        description="stackoverflow_*: read each sampled user's posts from the HDF5 file when its round comes (the next round's cohort in the "
        "background), never the whole training set: memory does not grow with the number of users (all 342,477 run); the same results as reading it all",
    )
    cache_clients: int = Field(64, ge=1, description="with on_demand: at most this many users' examples held in memory (least recently used dropped)")
    cache_bytes: int | None = Field(
        2**30,
        ge=1,
        description="with on_demand: at most this many bytes of users' examples held (default 1 GiB; a larger user is read, not kept); none: cache_clients alone bounds it",
    )
    validation_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="fraction of each client's training examples held out as a validation split (seeded; fedbayes sweep selects on it); 0 = none",
    )
    standardize: bool | Literal["auto"] = Field(
        "auto",
        description="centre and scale each feature by its mean and standard deviation over the clients' training examples (from per-client sums, fedbayes.data.standardize); auto: on for your own data (files, arrays: a dataset with the user_data trait) whose features' magnitudes differ by more than 100 times",
    )

    @field_validator("standardize")
    @classmethod
    def _scalable(cls, value: bool | str, info) -> bool | str:
        name = info.data.get("dataset")
        if value and name in data_registry.names() and data_registry.get(name).tokens:
            raise ValueError(f"data.standardize: {name}'s inputs are word ids, not features to scale; leave it unset or false")
        return value


class ModelConfig(_Strict):
    """The flax model: a name in the model registry; the keys only that model reads sit flat in this
    table and are validated through its settings (a model registered from Python brings its own keys)."""

    model_config = ConfigDict(extra="allow")  # a registered model's own keys (checked in _own_settings)
    section: ClassVar[str] = "model."

    name: str = Field("mlp", description="a name of the model registry: " + ", ".join(MODELS))
    hidden: tuple[Annotated[int, Field(ge=1)], ...] = (200, 100)
    activation: Literal[ACTIVATIONS] = Field("relu", description="mlp hidden-layer nonlinearity (the FedLap authors' code uses sigmoid)")  # type: ignore[valid-type]
    width: int | None = Field(None, ge=1, description="resnet18_gn: first-stage channels (64); lstm_nwp: LSTM units (670)")
    embed_dim: int | None = Field(None, ge=1, description="lstm_nwp: embedding size (96)")
    # Ozer et al. 2022 (VBNN aggregation)'s VBNN: the dense layers variational (fedbayes.models.variational); mlp and cnn.
    variational: bool = False
    # Your own flax module (fedbayes.models.imported); name = "module".
    module: str | None = Field(None, description="your own flax module: 'package.module:Class' or 'path/to/file.py:Class' (sets name = 'module')")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="module: its keyword arguments (num_classes is set from the data unless given)")

    def __hash__(self) -> int:  # kwargs is a dict: hash the record by its JSON (equal records, equal JSON)
        return hash(self.model_dump_json())

    @model_validator(mode="before")
    @classmethod
    def _module_names_itself(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("module") is not None and "name" not in data:
            data = {**data, "name": "module"}
        if isinstance(data, dict):
            name = data.get("name", "mlp")
            if not isinstance(name, str) or name not in model_registry.names():
                raise ValueError(f"model.name: unknown model {name!r}; allowed: {', '.join(model_registry.names())}")
        return data

    @property
    def spec(self) -> model_registry.ModelSpec:
        """The :class:`~fedbayes.models.registry.ModelSpec` of ``name`` (its builder and traits)."""
        return model_registry.get(self.name)

    @model_validator(mode="after")
    def _own_module(self) -> ModelConfig:
        if self.module is not None and not self.spec.imported:
            raise ValueError(f"model.name: model.module gives your own model; leave name unset or set it to 'module'; got {self.name!r}")
        if self.kwargs and not self.spec.imported:
            raise ValueError(f"model.kwargs: only your own model (model.module) takes keyword arguments; got model {self.name!r}")
        if self.module is not None:
            from fedbayes.models.imported import make_module

            make_module(self.module, self.kwargs, num_classes=2)  # imports it and checks the keywords (2: a stand-in; the data sets it)
        return self

    @model_validator(mode="after")
    def _variational_models(self) -> ModelConfig:
        spec = self.spec
        if self.variational and not spec.variational:
            allowed = ", ".join(s.name for s in model_registry.specs() if s.variational)
            raise ValueError(f"model.variational: only {allowed} have a variational version; got {self.name!r}")
        _exclusive_keys(
            self, "model.", self.name, "model", model_registry.specs(),
            lambda key, owner, value: f"only the {owner} has a choice of {key}; got {value!r} with model {self.name!r}",
        )  # fmt: skip
        _own_settings(self, "model.", tuple(type(self).model_fields), [("model", spec)])
        return self


class ClientConfig(_Strict):
    """Local training: epochs, batch size and the client optax optimizer."""

    section: ClassVar[str] = "client."

    epochs: int = Field(1, ge=1, description="local epochs of a fixed budget (stop = 'epochs')")
    stop: Literal["epochs", "converged"] | None = Field(
        None,
        description="when a client stops: after client.epochs epochs, or converged: once an epoch's mean minibatch gradient has fallen "
        "to client.tol times the first epoch's (at most client.max_epochs epochs); unset: epochs where client.epochs is given, else the "
        "method's default (converged for the methods whose answer is a fixed point of local optima: FedEP/FedSEP's laplace and ngvi "
        "clients, PVI, FedLap-Cov)",
    )
    max_epochs: int = Field(20, ge=1, description="stop = 'converged': the most epochs a client runs in a round")
    max_steps: int = Field(
        200,
        ge=0,
        description="stop = 'converged': a client whose max_epochs epochs are fewer steps than this (a small client, whose epoch is a step or "
        "two) may run up to this many steps (epochs past max_epochs reuse their shuffles); 0: max_epochs epochs at most; unset: the "
        "method's default (200; FedSEP 0)",
    )
    tol: float = Field(
        0.1, gt=0, lt=1, description="stop = 'converged': a client stops once an epoch's mean minibatch gradient is at most this times the first epoch's (norm)"
    )
    batch_size: int = Field(32, ge=1)
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)


class ServerConfig(_Strict):
    """Cohort size, client weighting and the server optimizer (docs/algorithms.md §1.2)."""

    section: ClassVar[str] = "server."

    clients_per_round: int = Field(10, ge=1)
    weighting: Literal["examples", "uniform"] = "examples"
    optimizer: Literal["sgd", "momentum", "adam", "yogi", "adagrad"] = "sgd"
    lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.9, ge=0, lt=1)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.99, ge=0, lt=1)
    tau: float = Field(1e-3, gt=0)
    variant: Literal["reddi", "optax"] = "reddi"
    fail_fast: bool = False
    on_divergence: Literal["stop", "warn"] = Field(
        "stop", description="a non-finite loss or server model: stop the run (exit 3, last good checkpoint kept) or warn and go on"
    )
    max_rejected_rounds: int = Field(
        5, ge=0, description="rounds in a row in which every client's message is rejected before the run counts as diverged (as on_divergence says); 0 = never"
    )
    # Robust aggregation, dropouts and stragglers (fedbayes.aggregators.robust, fedbayes.sim.simulator; docs/results/privacy_robust.md).
    aggregator: Literal["mean", "median", "trimmed_mean", "norm_bound"] = Field(
        "mean",
        description="mean (the method's own rule), coordinate-wise median or trimmed_mean of the messages, or norm_bound (clip each message, then the mean)",
    )
    trim_fraction: float = Field(0.1, ge=0, lt=0.5, description="trimmed_mean: share of the largest and of the smallest values dropped per coordinate")
    norm_bound: float | None = Field(None, gt=0, description="norm_bound: joint L2 bound of each client's message")
    max_precision_share: float | None = Field(
        None, gt=0, description="Gaussian methods: a client's precision delta is capped at this times the global precision, per coordinate (unset: no cap)"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="probability that a sampled client fails in a round (it keeps its state)")
    deadline: int | None = Field(None, ge=1, description="clients whose local step count exceeds this miss the round (stragglers); unset: no deadline")

    @model_validator(mode="after")
    def _norm_bound_given(self):
        if self.aggregator == "norm_bound" and self.norm_bound is None:
            raise ValueError("server.norm_bound: aggregator 'norm_bound' needs a bound > 0; set server.norm_bound")
        return self


class HealthConfig(_Strict):
    """When a run that has stopped learning is warned about, and when it is stopped (exit 3;
    fedbayes.runs.health.LearningCheck). An evaluation is unhealthy when its test NLL (MSE
    for regression) is above nll_ratio times the untrained model's, or its accuracy more than
    accuracy_drop below the run's best so far; it is past the stop bounds when above
    stop_nll_ratio times the untrained NLL or more than stop_accuracy_drop below the best."""

    section: ClassVar[str] = "health."

    nll_ratio: float = Field(1.0, gt=0, description="unhealthy: test NLL (MSE) above this times the untrained model's (round 0)")
    accuracy_drop: float = Field(0.2, gt=0, le=1, description="unhealthy: accuracy more than this below the run's best evaluation so far")
    warn_after: int = Field(3, ge=0, description="unhealthy evaluations in a row before one warning (console, summary.json, the comparison table); 0 = never")
    stop_nll_ratio: float = Field(1.5, gt=0, description="past the stop bound: test NLL (MSE) above this times the untrained model's")
    stop_accuracy_drop: float = Field(0.3, gt=0, le=1, description="past the stop bound: accuracy more than this below the run's best")
    stop_after: int = Field(
        5, ge=0, description="evaluations in a row past a stop bound before the run stops (exit 3, the last good checkpoint kept); 0 = never"
    )


class PrivacyConfig(_Strict):
    """Client-level differential privacy of the messages (fedbayes.aggregators.dp): clip, Gaussian noise, accountant."""

    section: ClassVar[str] = "privacy."

    clip: float | None = Field(None, gt=0, description="joint L2 bound C of each client's message; unset: no DP")
    noise_multiplier: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="sigma: Gaussian noise of std sigma*C on the sum of the cohort's clipped messages (at most 1e6: epsilon is 0 there, and dp-accounting fails above about 1e8)",
    )
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) reported per evaluation as epsilon")
    coordinates: Literal["natural", "moments"] = Field("natural", description="Gaussian messages: clip and noise natural parameters, or (mean, log precision)")
    precision_floor: float = Field(0.5, gt=0, lt=1, description="natural coordinates: a noisy round can shrink a global precision at most to this fraction")

    @model_validator(mode="after")
    def _noise_needs_clip(self):
        if self.noise_multiplier > 0 and self.clip is None:
            raise ValueError("privacy.clip: noise_multiplier > 0 needs a clip C (the noise's scale is sigma*C)")
        return self


class AttackConfig(_Strict):
    """Attacking clients, for measuring robust rules (fedbayes.sim.scenario)."""

    section: ClassVar[str] = "attack."

    fraction: float = Field(0.0, ge=0, lt=1, description="share of the clients (a fixed set drawn from the seed) that attack")
    kind: Literal["scaled", "sign_flip", "nan", "huge_precision", "label_flip"] = Field(
        "scaled", description="scaled, sign_flip, nan or huge_precision messages, or label_flip data"
    )
    scale: float | None = Field(None, gt=0, description="scaled: factor (default 10); huge_precision: the fake precision over the global's (default 1000)")


class EvaluationConfig(_Strict):
    """How a Bayesian method's posterior is evaluated: the marginalised predictions (the ``*_marg``
    metrics of a method with a posterior ``q_g``; all metrics of a variational model).
    ``predictive``, ``prior_precision`` and ``subset_of_weights`` default to what matches the
    method's posterior; a run's config.toml records the values it used."""

    section: ClassVar[str] = "evaluation."

    marginal_samples: int = Field(10, ge=1, description="S, samples of q_g for the marginalised prediction (a variational model: stochastic forward passes)")
    predictive: Literal[PREDICTIVES] | None = Field(  # type: ignore[valid-type]
        None,
        description="marginalised prediction: sample (the network at sampled weights) or linearised (at the mean; GLM); "
        "default: the method's (linearised for Laplace/GGN posteriors, sample otherwise)",
    )
    prior_precision: Literal[PRIOR_PRECISIONS] | None = Field(  # type: ignore[valid-type]
        None,
        description="a Laplace-family posterior's prior precision at evaluation: fixed (the method's), marglik (the Laplace marginal "
        "likelihood) or validation (the validation split's NLL; needs data.validation_fraction > 0), chosen post hoc as Laplace Redux does; "
        "default: marglik where the method's posterior is curvature plus a prior, fixed otherwise",
    )
    subset_of_weights: Literal[SUBSETS] | None = Field(  # type: ignore[valid-type]
        None,
        description="the weights the marginalised prediction draws from q_g: all, or last_layer (the output layer's; the others at q_g's mean), "
        "as Laplace Redux's default last-layer Laplace; default: last_layer where the method's posterior is curvature plus a prior, all otherwise",
    )
    conformal_alpha: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="split conformal prediction sets at miscoverage alpha (coverage 1 - alpha), calibrated on calibration_fraction of each client's "
        "training examples (then not trained on) by a federated quantile of counts; the run folder gets conformal.json; unset: off",
    )
    calibration_fraction: float = Field(
        0.1, gt=0, lt=1, description="with conformal_alpha: the fraction of each client's training examples kept for conformal calibration"
    )
    conformal_score: Literal[CONFORMAL_SCORES] = Field(  # type: ignore[valid-type]
        "lac", description="with conformal_alpha: the nonconformity score: lac (1 - p_y) or aps (the mass of the classes at least as likely as y)"
    )
    personal_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="personalisation: the fraction of each client's training examples it keeps as its own test examples (never trained on); "
        "after the last round each client's personalised model and the global one are scored there (personal.json); 0: off",
    )
    personal_weight: float = Field(
        0.5,
        ge=0,
        description="with personal_by = site, a method whose clients keep a Gaussian site t_k (FedEP, PVI, FedLap-Cov): the personalised "
        "posterior is q_g t_k^weight (pFedBayes's 1 / zeta; 0 gives the global, 1 counts the client's own data twice; 0.5 measured best of "
        "0-4 on digits, docs/results/personalisation.md)",
    )
    personal_by: Literal["fine_tune", "site"] = Field(
        "fine_tune",
        description="with personal_fraction: fine_tune (every method's global point estimate fine-tuned on the client's examples) or site "
        "(a site method's posterior q_g t_k^weight, every other method fine-tuned); fine_tune is the default: on the main job's network the "
        "site posterior fell below the global model (docs/results/personalisation.md)",
    )
    personal_epochs: int = Field(
        1, ge=1, description="with personal_fraction, every other method: the epochs of local fine-tuning from the global model (the client optimizer)"
    )


def _default_algorithm() -> HParams:
    return registry.get("fedavg").hparams()


class StoredAlgorithm(HParams):
    """A stored config's ``[algorithm]`` table kept as stored, so that reading a run folder imports
    no method (:func:`read_stored` with ``method=False``): ``name`` and every stored key as an
    attribute, not checked against the method's settings (the run checked them when it wrote the
    file). A config holding one skips the checks that need the method's traits too."""

    model_config = ConfigDict(extra="allow")

    name: str


def validate_algorithm(value: Any) -> HParams:
    """The ``[algorithm]`` table validated against the settings of the method its ``name`` names
    in the live registry; raises ``ValueError`` with one line naming the field."""
    if isinstance(value, StoredAlgorithm):
        return value  # kept as stored: read_stored(..., method=False)
    if isinstance(value, HParams):
        registry.get(value.name)  # a registered method
        return value
    if not isinstance(value, dict):
        raise ValueError(f"algorithm: must be a table with a name (one of {', '.join(registry.names())}); got {value!r}")
    name = value.get("name")
    if name not in registry.names():
        what = "missing" if name is None else f"unknown algorithm {name!r}"
        raise ValueError(f"algorithm.name: {what}; allowed: {', '.join(registry.names())}")
    hparams = registry.get(name).hparams
    try:
        return hparams.model_validate(value)
    except ValidationError as exc:
        raise ValueError(format_validation_error(exc, hparams, prefix="algorithm.").removeprefix("config error: ")) from None


def _moved_evaluation_keys(data: Any) -> Any:
    """Configs written before the ``[evaluation]`` section (run folders, checkpoints, old
    examples) hold ``marginal_samples`` and ``predictive`` under ``[algorithm]``: read them as
    the ``[evaluation]`` keys they are now, so that such a run resumes as the same config."""
    if not isinstance(data, dict) or not isinstance(data.get("algorithm"), dict) or not isinstance(data.get("evaluation", {}), dict):
        return data
    moved = {k: v for k, v in data["algorithm"].items() if k in EVALUATION_KEYS}
    if not moved:
        return data
    evaluation = dict(data.get("evaluation", {}))
    for key, value in moved.items():
        if key in evaluation and evaluation[key] != value:
            raise ValueError(
                f"evaluation.{key}: given as {evaluation[key]!r} and, in the old place algorithm.{key}, as {value!r}; keep the one under [evaluation]"
            )
        evaluation[key] = value
    algorithm = {k: v for k, v in data["algorithm"].items() if k not in EVALUATION_KEYS}
    return {**data, "algorithm": algorithm, "evaluation": evaluation}


def _method_evaluation_defaults(data: Any) -> Any:
    """Fills the unset ``evaluation.predictive``, ``evaluation.prior_precision`` and
    ``evaluation.subset_of_weights`` with what matches the method's posterior: its spec's
    ``default_predictive``; where its ``posterior_prior_precision`` says the posterior is curvature
    plus a known prior, Laplace Redux's recipe, the prior precision by the marginal likelihood over
    the last layer (``"marglik"``, ``"last_layer"``; else ``"fixed"``, ``"all"``). An invalid
    ``[algorithm]`` is left to its own validator."""
    if not isinstance(data, dict) or isinstance(data.get("algorithm"), StoredAlgorithm):
        return data
    evaluation = data.get("evaluation", {})
    if isinstance(evaluation, EvaluationConfig):
        evaluation = evaluation.model_dump(exclude_none=True)
    if not isinstance(evaluation, dict) or all(evaluation.get(k) is not None for k in STORED_EVALUATION_DEFAULTS):
        return data
    try:
        hparams = validate_algorithm(data.get("algorithm", _default_algorithm()))
    except ValueError:
        return data
    spec = registry.get(hparams.name)
    filled = dict(evaluation)
    if filled.get("predictive") is None:
        filled["predictive"] = spec.predictive_for(hparams)
    laplace = spec.prior_precision_for(hparams) is not None
    if filled.get("prior_precision") is None:
        filled["prior_precision"] = "marglik" if laplace else "fixed"
    if filled.get("subset_of_weights") is None:
        filled["subset_of_weights"] = "last_layer" if laplace else "all"
    return {**data, "evaluation": filled}


def _method_local_budget(data: Any) -> Any:
    """Fills an unset ``client.stop``: ``"epochs"`` where ``client.epochs`` is given (the user chose
    a budget), else the method's :attr:`~fedbayes.algorithms.base.AlgorithmSpec.local_budget`; and
    an unset ``client.max_steps`` with the method's
    :attr:`~fedbayes.algorithms.base.AlgorithmSpec.local_max_steps`."""
    if not isinstance(data, dict) or isinstance(data.get("algorithm"), StoredAlgorithm):
        return data
    client = data.get("client", {})
    if isinstance(client, ClientConfig):
        client = {k: getattr(client, k) for k in client.model_fields_set}
    if not isinstance(client, dict):
        return data
    filled = dict(client)
    if filled.get("stop") is None and "epochs" in filled:
        filled["stop"] = "epochs"
    if filled.get("stop") is None or "max_steps" not in filled:
        try:
            hparams = validate_algorithm(data.get("algorithm", _default_algorithm()))
        except ValueError:
            return data if filled == client else {**data, "client": filled}
        spec = registry.get(hparams.name)
        if filled.get("stop") is None:
            filled["stop"] = spec.local_budget_for(hparams)
        filled.setdefault("max_steps", spec.local_max_steps)
    return data if filled == client else {**data, "client": filled}


def stored_meaning(raw: Any, method: bool = True) -> Any:
    """``raw``, a config as a run folder or a checkpoint stored it, with each key of
    :data:`STORED_EVALUATION_DEFAULTS` that it lacks set to what it meant when it was written (the
    behaviour of the versions before the key's default came to depend on the method), so that a
    resumed old run evaluates as it did; likewise ``data.standardize`` (off for your own data,
    which was not scaled then), and, with ``method``, the method's own keys (its
    :attr:`~fedbayes.algorithms.base.AlgorithmSpec.stored_meaning`, which imports its module).
    New runs record every key, and are returned as they are."""
    if not isinstance(raw, dict) or not isinstance(raw.get("evaluation", {}), dict):
        return raw
    algorithm = raw["algorithm"] if isinstance(raw.get("algorithm"), dict) else {}
    evaluation = dict(raw.get("evaluation", {}))
    for key, value in STORED_EVALUATION_DEFAULTS.items():
        if key not in evaluation and not (key in EVALUATION_KEYS and key in algorithm):  # FedEP's own prior_precision is another key
            evaluation[key] = value
    out = {**raw, "evaluation": evaluation}
    if isinstance(raw.get("client"), dict) and "stop" not in raw["client"]:  # written before client.stop: a fixed budget
        out["client"] = {**raw["client"], "stop": "epochs"}
    if isinstance(raw.get("client"), dict) and "max_steps" not in raw["client"]:  # written before client.max_steps: max_epochs alone
        out["client"] = {**out.get("client", raw["client"]), "max_steps": 0}
    data = raw.get("data", {})
    if isinstance(data, dict) and "standardize" not in data:  # written before data.standardize: own data was not scaled
        out["data"] = {**data, "standardize": False if is_user_data(data.get("dataset")) else "auto"}
    if method and algorithm.get("name") in registry.names():  # the method's own keys (AlgorithmSpec.stored_meaning)
        out["algorithm"] = registry.get(algorithm["name"]).stored_meaning(dict(algorithm), raw)
    return out


class RunConfig(_Strict):
    """One experiment."""

    section: ClassVar[str] = ""

    name: str = Field("run", description="the run's name: a plain file name (runs/<name>/ is its folder)")
    seed: int = Field(0, ge=0)
    rounds: int = Field(10, ge=1)
    eval_every: int = Field(1, ge=1)
    checkpoint_every: int = Field(5, ge=0, description="rounds between checkpoints; 0 = only at the end")
    layout: Literal["auto", "sequential", "vmap"] = "auto"
    store: Literal["memory", "disk", "device"] = Field(
        "memory",
        description="where client states live between rounds: memory (host), disk (large federations) or device (in device memory, no per-round transfers)",
    )
    store_dir: str | None = Field(None, description="folder of the disk client store; default <out>/client_store")
    fuse_rounds: int = Field(
        1,
        ge=1,
        description="at most this many rounds between evaluations and checkpoints run as one compiled program (stateless methods or store = device; bitwise the same results on the CPU, the same to float32 rounding on a GPU); 1 = one program per round",
    )
    eval_batch_size: int = Field(2000, ge=1)
    ece_bins: int = Field(15, ge=1)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    algorithm: SerializeAsAny[HParams] = Field(default_factory=_default_algorithm)
    evaluation: EvaluationConfig = EvaluationConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    attack: AttackConfig = AttackConfig()
    health: HealthConfig = HealthConfig()

    @model_validator(mode="before")
    @classmethod
    def _evaluation_section(cls, data: Any) -> Any:
        """The ``[evaluation]`` keys moved from their old place (:func:`_moved_evaluation_keys`),
        then the unset ones that depend on the method resolved (:func:`_method_evaluation_defaults`),
        and the client's stopping rule (:func:`_method_local_budget`)."""
        return _method_local_budget(_method_evaluation_defaults(_moved_evaluation_keys(data)))

    @field_validator("algorithm", mode="before")
    @classmethod
    def _registered_algorithm(cls, value: Any) -> HParams:
        return validate_algorithm(value)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or v in (".", "..") or any(c in v for c in "/\\") or any(ord(c) < 32 for c in v) or len(v.encode()) > 200:
            raise ValueError(f"must be a plain file name (no '/', not empty, not '.' or '..', at most 200 bytes); got {v!r}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.data.num_clients is not None and self.server.clients_per_round > self.data.num_clients:
            raise ValueError(f"server.clients_per_round: must be <= data.num_clients ({self.data.num_clients}); got {self.server.clients_per_round}")
        data, model = self.data.spec, self.model.spec
        if (data.task == "regression" and "regression" not in model.tasks) or (model.tasks == ("regression",) and data.task != "regression"):
            datasets = " or ".join(s.name for s in data_registry.specs() if s.task == "regression")
            models = " or ".join(repr(s.name) for s in model_registry.specs() if s.tasks == ("regression",))
            raise ValueError(
                f"model.name: the {datasets} dataset needs model {models}, and {models} needs {datasets}; "
                f"got model {self.model.name!r} with dataset {self.data.dataset!r}"
            )
        spec = None if isinstance(self.algorithm, StoredAlgorithm) else self.spec  # kept as stored: the run passed the method's checks
        if spec is not None:
            minimum, why = spec.min_local_epochs(self.algorithm)
            field = "max_epochs" if self.client.stop == "converged" else "epochs"
            if getattr(self.client, field) < minimum:
                raise ValueError(f"client.{field}: {why}, so it needs {field} >= {minimum}; got {getattr(self.client, field)}")
        if spec is not None and spec.exact_server and (self.server.optimizer != "sgd" or self.server.lr != 1.0):
            raise ValueError(
                f"server.optimizer: {spec.name}'s server {spec.exact_server} and uses no server optimizer; "
                f"leave server.optimizer = 'sgd' and server.lr = 1; got {self.server.optimizer!r} with lr {self.server.lr}"
            )
        return self

    @model_validator(mode="after")
    def _privacy_and_robustness(self) -> RunConfig:
        spec = None if isinstance(self.algorithm, StoredAlgorithm) else self.spec
        policy, note = spec.aggregator_policy_for(self.algorithm) if spec is not None else ("wrappable", "")
        if policy != "wrappable":  # the method's own rule stays: no robust rule, cap or DP around it
            why = f"{spec.name} {note}"
            if self.server.aggregator != "mean":
                raise ValueError(f"server.aggregator: {why}; allowed: mean; got {self.server.aggregator!r}")
            if self.server.max_precision_share is not None:
                raise ValueError(f"server.max_precision_share: {why}; unset it")
            if self.privacy.clip is not None:
                raise ValueError(f"privacy.clip: {why}; unset privacy.clip")
        if self.privacy.clip is not None:
            if self.server.weighting != "uniform":
                raise ValueError("server.weighting: client-level DP needs uniform weights (n_k is private and changes the sensitivity); allowed: uniform")
            if self.server.aggregator in ("median", "trimmed_mean"):
                raise ValueError(
                    f"server.aggregator: the DP noise is calibrated to a sum of clipped messages; allowed with privacy: mean, norm_bound; got {self.server.aggregator!r}"
                )
        if self.data.on_demand:
            if self.attack.fraction > 0 and self.attack.kind == "label_flip":
                raise ValueError(
                    "attack.kind: label_flip changes the training labels, which data.on_demand never holds; allowed: scaled, sign_flip, nan, huge_precision"
                )
            if self.evaluation.conformal_alpha is not None:
                raise ValueError("evaluation.conformal_alpha: conformal calibration holds out training examples, which data.on_demand never holds; unset it")
            if self.evaluation.personal_fraction > 0:
                raise ValueError("evaluation.personal_fraction: personalisation holds out training examples, which data.on_demand never holds; set 0")
        if self.attack.fraction > 0 and self.attack.kind == "label_flip" and self.data.spec.task == "regression":
            raise ValueError("attack.kind: label_flip needs a classification dataset; allowed here: scaled, sign_flip, nan")
        return self

    @model_validator(mode="after")
    def _prior_precision_search_possible(self) -> RunConfig:
        search = self.evaluation.prior_precision
        if search == "fixed" or isinstance(self.algorithm, StoredAlgorithm):
            return self
        if self.spec.prior_precision_for(self.algorithm) is None:
            raise ValueError(
                f"evaluation.prior_precision: {self.algorithm.name} (as configured) has no Laplace-family posterior (data curvature plus a known "
                f"prior precision) whose prior could be re-chosen; allowed: fixed; got {search!r}"
            )
        if search == "validation" and self.data.validation_fraction == 0:
            raise ValueError("evaluation.prior_precision: 'validation' chooses on the validation split; set data.validation_fraction > 0, or use 'marglik'")
        return self

    @model_validator(mode="after")
    def _conformal_possible(self) -> RunConfig:
        if self.evaluation.conformal_alpha is None:
            return self
        if self.data.spec.task == "regression":
            raise ValueError(
                f"evaluation.conformal_alpha: conformal prediction sets here are for classification; {self.data.dataset} is a regression; unset it"
            )
        if self.data.validation_fraction + self.evaluation.calibration_fraction >= 1:
            raise ValueError(
                f"evaluation.calibration_fraction: with data.validation_fraction = {self.data.validation_fraction} nothing is left to train on; "
                f"their sum must be below 1; got {self.evaluation.calibration_fraction}"
            )
        return self

    @model_validator(mode="after")
    def _personalisation_possible(self) -> RunConfig:
        e = self.evaluation
        if e.personal_fraction == 0:
            return self
        if self.data.spec.task == "regression":
            raise ValueError(f"evaluation.personal_fraction: personalisation here scores classifiers; {self.data.dataset} is a regression; set it to 0")
        if self.model.variational:
            raise ValueError("evaluation.personal_fraction: personalisation here needs a deterministic model; model.variational = true; set it to 0")
        held = self.data.validation_fraction + (e.calibration_fraction if e.conformal_alpha is not None else 0.0)
        if held + e.personal_fraction >= 1:
            raise ValueError(
                f"evaluation.personal_fraction: with {held:g} of each client's examples held out already (data.validation_fraction, "
                f"evaluation.calibration_fraction) nothing is left to train on; their sum must be below 1; got {e.personal_fraction}"
            )
        return self

    @model_validator(mode="after")
    def _variational_model_as_the_method_needs(self) -> RunConfig:
        if isinstance(self.algorithm, StoredAlgorithm):
            return self
        needed = self.spec.needs_variational_model
        if self.model.variational != needed:
            kind = "variational models (model.variational = true; mlp or cnn)" if needed else "deterministic models (model.variational = false)"
            raise ValueError(f"model.variational: algorithm {self.algorithm.name!r} trains {kind}; got variational={self.model.variational}")
        return self

    @property
    def spec(self):
        """The :class:`~fedbayes.algorithms.base.AlgorithmSpec` of ``algorithm.name`` (its traits)."""
        return registry.get(self.algorithm.name)


class ReferenceTable(_Strict):
    """A comparison file's ``[reference]`` table: a paper's numbers, printed beside ours.

    ``values`` maps a variant to the paper's number in percent (``76.0``) or to the text the paper
    prints (``"76.0(0.7)"``, mean and standard deviation); ``summary`` says which of our curve
    summaries it is set beside: the mean (``mean_last``) or max (``max_last``) test accuracy over
    rounds R-2..R, as "Federated learning with ADMM and Bayes" (Swaroop et al. 2025) reports them.
    """

    section: ClassVar[str] = "reference"

    source: str = Field(min_length=1, description="where the numbers come from (paper, table, setting)")
    dataset: str | None = Field(None, description="the data set the paper's numbers are for: a comparison on other data prints no paper table")
    rounds: int | None = Field(None, ge=1, description="the rounds R the paper's numbers are after: a comparison of other length prints no paper table")
    summary: Literal["mean_last", "max_last"] = Field("mean_last", description="the curve summary the numbers are set beside")
    values: dict[str, Union[float, str]] = Field(min_length=1, description="variant -> the paper's number (percent) or its printed text")


def read_reference(raw: Any, path: str | Path, variants) -> ReferenceTable:
    """Validates a ``[reference]`` table; every name in ``values`` must be a variant."""
    try:
        ref = ReferenceTable.model_validate(raw)
    except ValidationError as exc:
        detail = format_validation_error(exc, ReferenceTable).removeprefix("config error: ")
        raise ConfigError(f"config error: {path}: reference.{detail}") from None
    unknown = [k for k in ref.values if k not in variants]
    if unknown:
        raise ConfigError(f"config error: {path}: reference.values: unknown variant(s) {unknown}; allowed: {', '.join(variants)}")
    return ref


class ConfigError(BadInputError):
    """A configuration problem, already formatted as one line for the user (exit code 2)."""


def _allowed(err: dict) -> str:
    ctx = err.get("ctx") or {}
    if "expected" in ctx:
        return "" if str(ctx["expected"]) in err["msg"] else f"allowed: {ctx['expected']}"
    for key, word in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
        if key in ctx:
            return f"allowed: {word} {ctx[key]}"
    return ""


def format_validation_error(exc: ValidationError, model: type[BaseModel] = RunConfig, prefix: str = "") -> str:
    """One line naming the first offending field, what is allowed and what was given; ``prefix``
    names the section ``model`` is (``"algorithm."`` for a method's settings)."""
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    loc = prefix + loc if loc else prefix.rstrip(".")
    if err["type"] == "extra_forbidden":
        parent = _section_model(model, err["loc"][:-1])
        allowed = ", ".join(parent.model_fields) if parent is not None else ""
        return f"config error: {loc}: unknown key; allowed keys here: {allowed}"
    if err["type"] == "value_error":
        msg = str(err["msg"]).removeprefix("Value error, ")
        return f"config error: {msg}" if ":" in msg.split(" ")[0] else f"config error: {loc}: {msg}"
    allowed = _allowed(err)
    given = err.get("input")
    given_s = "" if isinstance(given, dict) else f"; got {given!r}"
    return f"config error: {loc}: {err['msg']}" + (f" ({allowed})" if allowed else "") + given_s


def _section_model(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    current: Any = model
    for part in loc:
        field = current.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            current = ann
        else:
            return None
    return current


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"server.lr=0.5"`` -> ``(["server", "lr"], 0.5)``; values are read as TOML (strings may be bare)."""
    if "=" not in item:
        raise ConfigError(f"config error: --set {item!r}: expected key=value (e.g. server.lr=0.5)")
    key, raw = item.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Returns a copy of ``raw`` with dotted ``key=value`` overrides applied."""
    out = copy.deepcopy(raw)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config error: --set {item!r}: {part} is not a section")
        node[path[-1]] = value
    return out


def deep_merge(base: dict, update: dict) -> dict:
    """Recursively merges ``update`` into a copy of ``base`` (update wins)."""
    out = copy.deepcopy(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    if "algorithm" in update and "name" in update["algorithm"]:
        # Switching algorithm drops the old algorithm's keys (e.g. fedprox.mu when moving to feddyn).
        out["algorithm"] = copy.deepcopy(update["algorithm"])
    return out


def validate(raw: dict) -> RunConfig:
    """Validates a raw dict; raises :class:`ConfigError` with one line on failure."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc)) from None


def read_toml(path: str | Path) -> dict:
    """Reads a TOML file; a missing file or a syntax error raises :class:`ConfigError`."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config error: {path}: is a folder, not a config file (a TOML file; `fedbayes resume {path}` continues a run folder)")
    if not path.is_file():
        raise ConfigError(f"config error: {path}: no such file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config error: {path}: invalid TOML: {' '.join(str(exc).split())}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config error: {path}: not a text file (not UTF-8); a config is a TOML file") from None
    except OSError as exc:
        raise ConfigError(f"config error: {path}: cannot read it ({exc.strerror or exc})") from None
    if not raw:
        raise ConfigError(f"config error: {path}: the config is empty; start from `fedbayes config` or one of the commented examples in examples/")
    return raw


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Reads, overrides and validates a run config."""
    return validate(apply_overrides(read_toml(path), list(overrides)))


def read_stored(path: str | Path, method: bool = True) -> RunConfig:
    """A run folder's ``config.toml`` read as it meant when written (:func:`stored_meaning`).
    ``method=False``: without importing the method's module: ``[algorithm]`` is kept as stored
    (:class:`StoredAlgorithm`) and the checks that need the method are left out (the run passed
    them when it wrote the file); every other section is validated as usual.

    Raises:
      ConfigError: the file is missing, not TOML, or does not validate.
    """
    raw = stored_meaning(read_toml(path), method=method)
    if not method:
        try:
            raw = _moved_evaluation_keys(raw)
            raw = {**raw, "algorithm": StoredAlgorithm.model_validate(raw.get("algorithm", {"name": "fedavg"}))}
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, StoredAlgorithm, prefix="algorithm.")) from None
        except ValueError as exc:
            raise ConfigError(f"config error: {exc}") from None
    return validate(raw)


def to_toml(config: RunConfig) -> str:
    """The resolved config as TOML (every default written out)."""
    data = config.model_dump(mode="json", exclude_none=True)
    return tomli_w.dumps(data)


def resolved(raw: dict) -> dict:
    """``raw`` (a config as a run folder or a checkpoint stored it) read by this version's schema:
    keys this version added get their defaults, which by our rule reproduce the behaviour of the
    versions before them, and keys whose default came to depend on the method get what they meant
    then (:func:`stored_meaning`). ``raw`` itself where it no longer validates (then it differs
    from any valid config)."""
    try:
        return RunConfig.model_validate(stored_meaning(raw)).model_dump(mode="json")
    except (ValidationError, TypeError, ValueError):
        return raw


def same_config(stored: str | Path, config: RunConfig) -> bool:
    """Whether the ``config.toml`` at ``stored`` holds ``config``: equal once read by this
    version's schema (:func:`resolved`), so that a run written before a defaulted key was added
    still counts as the same run. ``False`` for a missing or unreadable file."""
    try:
        raw = tomllib.loads(Path(stored).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return resolved(raw) == config.model_dump(mode="json")
