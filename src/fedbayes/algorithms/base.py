"""The algorithm interface: a federated method is a few pure functions over messages.

An :class:`Algorithm` is a named tuple of pure functions (typed by the Protocols below):

* ``server_init(key, params) -> server_state``
* ``broadcast(server_state) -> server_message`` (what every sampled client receives)
* ``client_init(params) -> client_state`` (persistent per-client state; ``()`` when stateless)
* ``client_update(key, server_message, client_state, data) -> (client_message, client_state, info)``
* ``server_update(key, server_state, aggregate) -> (server_state, info)``: ``aggregate`` is the
  :class:`~fedbayes.aggregators.Aggregate` of the round's accepted messages, made by the
  algorithm's ``aggregator`` (or one that wraps or replaces it: a robust rule, DP noise)
* ``server_params(server_state) -> params``: the point estimate used for evaluation
* ``message_ok(server_state, client_message) -> bool``: the server's acceptance test for one
  message (finite values, matching structure, proper precisions); a rejected client gets weight
  zero and keeps its old state.
* ``server_posterior(server_state) -> (mean, variance)`` (optional, Bayesian methods): the
  diagonal Gaussian ``q_g`` in moments, for marginalised predictions; ``None`` for point methods.
* ``server_precision(server_state) -> precision`` (optional, methods whose ``q_g`` has a
  structured precision): a dense ``[D, D]`` array over the raveled parameters
  (:func:`jax.flatten_util.ravel_pytree` order; ``covariance = "full"``), a last-layer
  :class:`~fedbayes.gaussian_block.BlockPrecision`, or a low-rank
  :class:`~fedbayes.gaussian_lowrank.LowRankGaussian` with a zero mean (``covariance =
  "low_rank"``), or a :class:`~fedbayes.gaussian_kron.KronSpread` (``covariance = "kron"``);
  exported to ``model.npz`` (:mod:`fedbayes.runs.export`), and the marginalised
  prediction draws from it.
* ``personal_posterior(server_state, client_state, weight) -> (mean, variance)`` (optional,
  methods whose clients keep a Gaussian site): client ``k``'s personalised posterior
  ``q_k ∝ q_g t_k^weight`` in moments (:func:`fedbayes.algorithms.sites.personalised`);
  ``None``: the method's client state gives none, and personalisation fine-tunes the global model
  on the client's data instead (:func:`fedbayes.evaluation.personal.fine_tune`).
* ``after_rejected_round(server_state) -> server_state`` (optional): the server state after a
  round in which no message was accepted; ``None`` keeps it as it was (nothing was learned). A
  method with an adaptive damping shrinks it there
  (:func:`fedbayes.algorithms.damping.adaptive`), since a refused step was too large.
* ``aggregator``: the method's own aggregation rule (default :func:`fedbayes.aggregators.weighted`).
* ``trainer``: the clients' local schedule (:class:`LocalSchedule`: a
  :class:`~fedbayes.inference.sgd.LocalTrainer` is one), required, so that a method cannot fall back
  to a schedule of its own. ``local_epochs`` and ``local_batch_size`` read it: how many shuffled
  passes over its data a client makes and with which minibatch size; the simulator lays out that
  many epochs per client (:mod:`fedbayes.data.batches`) and knows each client's step count
  ``E * ceil(n_k / B)``.
* ``server_on_one_device``: the server step is a long sequential computation (FedLap-Func's
  Adam steps over the cohort's memory points): the simulator runs its aggregation and update as
  a program of its own on its first device, after the round's program has validated the
  messages, instead of splitting them over the devices with a collective per step
  (:meth:`fedbayes.sim.simulator.Simulator.server_program`). Numbers are the same up to the
  order of floating-point sums; such a method's rounds are not fused.

``info`` outputs have a fixed structure per algorithm (as blackjax's kernels return ``(state,
info)``): a client's is a dict of its mean training loss and step count
(:func:`fedbayes.inference.sgd.training_info`); a server's is a typed ``NamedTuple`` of scalar
arrays, one type per method (e.g. :class:`~fedbayes.algorithms.fedep.FedEPInfo`; :class:`NoInfo`
for a method with nothing to report), whose fields become the round's server metrics. The round
protocol (:func:`fedbayes.protocol.server_step`) adds validation and aggregation;
the simulator runs ``client_update`` for a cohort inside one ``jit``, a deployment calls the same
functions one client at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, Protocol

import jax
import numpy as np

from fedbayes import aggregators, tree
from fedbayes.aggregators import Aggregate
from fedbayes.hparams import HParams
from fedbayes.typing import ApplyFn, Info, KeyedApplyFn, PyTree

if TYPE_CHECKING:  # annotations only: reading a config need not import the data layer
    import optax

    from fedbayes.data.batches import ClientData
    from fedbayes.inference.sgd import LocalTrainer

__all__ = [
    "AGGREGATOR_POLICIES",
    "Algorithm",
    "AlgorithmSpec",
    "BuildContext",
    "BuildFn",
    "ClientUpdateFn",
    "FederationInfo",
    "Info",
    "LocalSchedule",
    "NoInfo",
    "PriorPrecision",
    "ServerUpdateFn",
    "as_stored",
    "finite_message",
    "linearised_predictive",
    "no_laplace_prior",
    "point_estimate_algorithm",
    "sampled_predictive",
    "stateless_client_init",
    "stored_setting",
]


class ServerInitFn(Protocol):
    def __call__(self, key: jax.Array, params: PyTree) -> PyTree: ...


class ClientUpdateFn(Protocol):
    def __call__(self, key: jax.Array, message: PyTree, client_state: PyTree, data: ClientData) -> tuple[PyTree, PyTree, Info]: ...


class ServerUpdateFn(Protocol):
    def __call__(self, key: jax.Array, server_state: PyTree, aggregate: Aggregate) -> tuple[PyTree, NamedTuple]: ...


class MessageOkFn(Protocol):
    def __call__(self, server_state: PyTree, message: PyTree) -> jax.Array: ...


class PosteriorFn(Protocol):
    def __call__(self, server_state: PyTree) -> tuple[PyTree, PyTree]: ...


class LocalSchedule(Protocol):
    """A client's local schedule: ``num_epochs`` shuffled passes in minibatches of ``batch_size``
    (a :class:`~fedbayes.inference.sgd.LocalTrainer` is one)."""

    @property
    def num_epochs(self) -> int: ...

    @property
    def batch_size(self) -> int: ...


class NoInfo(NamedTuple):
    """The server info of a method that reports nothing beyond the round's counts."""


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring)."""

    name: str
    server_init: ServerInitFn
    broadcast: Any  # server_state -> message
    client_init: Any  # params -> client_state
    client_update: ClientUpdateFn
    server_update: ServerUpdateFn
    server_params: Any  # server_state -> params
    message_ok: MessageOkFn
    trainer: LocalSchedule  # required: the simulator lays out this schedule
    server_posterior: PosteriorFn | None = None
    aggregator: aggregators.Aggregator = aggregators.weighted
    server_on_one_device: bool = False
    after_rejected_round: Any = None  # server_state -> server_state; None: kept
    personal_posterior: Any = None  # (server_state, client_state, weight) -> (mean, variance); None: fine-tuning
    server_precision: Any = None  # server_state -> q_g's structured precision (dense, last-layer, low-rank or Kronecker); None: diagonal

    @property
    def local_epochs(self) -> int:
        """``E``: the shuffled passes over its data a client makes (``trainer.num_epochs``)."""
        return self.trainer.num_epochs

    @property
    def local_batch_size(self) -> int:
        """``B``: the client's minibatch size (``trainer.batch_size``)."""
        return self.trainer.batch_size


def point_estimate_algorithm(name: str, trainer, *, server_init, client_init, client_update, server_update) -> Algorithm:
    """An :class:`Algorithm` whose server state has a ``params`` field that is both broadcast and
    evaluated, whose messages are accepted when finite, and whose clients train with ``trainer``
    (a :class:`fedbayes.inference.LocalTrainer`): FedAvg, FedProx, FedDyn, ADMM."""
    return Algorithm(
        name=name,
        server_init=server_init,
        broadcast=lambda state: state.params,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=finite_message,
        trainer=trainer,
    )


def finite_message(server_state, message) -> jax.Array:
    """Default acceptance test: every value of the message is finite."""
    del server_state
    return tree.all_finite(message)


def stateless_client_init(params):
    """Stateless clients keep nothing between rounds."""
    del params
    return ()


# ----- what a builder gets, and what the registry knows of a method ------------------------------


class FederationInfo(NamedTuple):
    """The few facts about a federation that a builder may use."""

    num_clients: int
    total_examples: int
    client_sizes: tuple[int, ...]

    @classmethod
    def from_sizes(cls, sizes: Sequence[int]) -> FederationInfo:
        sizes = tuple(int(n) for n in np.asarray(sizes))
        return cls(num_clients=len(sizes), total_examples=sum(sizes), client_sizes=sizes)


class BuildContext(NamedTuple):
    """What a builder gets besides its own settings: no data, so that a deployed server or client
    builds the same algorithm without loading anyone's.

    Attributes:
      trainer: the clients' local training (loss, optimizer, epochs, batch size).
      server_optimizer: the optax transformation of the server step.
      federation: :class:`FederationInfo`.
      clients_per_round: the cohort size ``M`` (e.g. FedEP's default damping ``1 / M``).
      apply_fn: the model's forward pass, for methods that need the model's outputs (curvature);
        ``None`` when not needed (:attr:`AlgorithmSpec.needs_apply_fn`).
      task: ``"classification"`` or ``"regression"``.
      keyed_apply_fn: one stochastic forward pass of a variational model (VBNN); ``None`` for
        deterministic models (:attr:`AlgorithmSpec.needs_variational_model`).
      feature_spec: shape and dtype of one example's features (no batch axis), for methods whose
        states hold inputs (FedLap-Func's memory points); ``None`` when not needed
        (:attr:`AlgorithmSpec.needs_feature_spec`).
      hidden_layers: the model is a network, not a generalised linear model
        (:func:`fedbayes.models.has_hidden_layers`), for methods whose default start differs
        between the two (PVI's local step).
      num_params: the model's scalar parameters, for methods whose messages grow with it faster
        than linearly (FedEP's dense precisions); ``None``: not known.
      last_layer_params: the scalar parameters of the model's last layer
        (:func:`fedbayes.gaussian_block.dense_size`), the side of a last-layer structure's dense
        block; ``None``: not known, or the parameters are no dict of layers.
      param_shapes: the model's parameters as shape structs (``jax.ShapeDtypeStruct`` leaves), for
        methods whose messages depend on the layers' shapes (the Kronecker structure's factors);
        ``None``: not known.
    """

    trainer: LocalTrainer
    server_optimizer: optax.GradientTransformation
    federation: FederationInfo
    clients_per_round: int
    apply_fn: ApplyFn | None = None
    task: str = "classification"
    keyed_apply_fn: KeyedApplyFn | None = None
    feature_spec: jax.ShapeDtypeStruct | None = None
    hidden_layers: bool = False
    num_params: int | None = None
    last_layer_params: int | None = None
    param_shapes: Any = None


class BuildFn(Protocol):
    """``build(hparams, ctx) -> Algorithm``: a method from its settings and the :class:`BuildContext`."""

    def __call__(self, hparams: Any, ctx: BuildContext) -> Algorithm: ...


AGGREGATOR_POLICIES = ("wrappable", "own", "refuses")
AggregatorPolicy = Literal["wrappable", "own", "refuses"]


def no_minimum_epochs(hparams: HParams) -> tuple[int, str]:
    """The default :attr:`AlgorithmSpec.min_local_epochs`: any number of local epochs (at least one)."""
    del hparams
    return 1, ""


def no_burn_in(hparams: HParams) -> int:
    """The default :attr:`AlgorithmSpec.burn_in_rounds`: the method is itself from the first round."""
    del hparams
    return 0


def sampled_predictive(hparams: HParams) -> str:
    """The default :attr:`AlgorithmSpec.default_predictive`: the network at weights drawn from
    ``q_g`` (a variational or sample-based posterior over the weights themselves)."""
    del hparams
    return "sample"


def linearised_predictive(hparams: HParams) -> str:
    """:attr:`AlgorithmSpec.default_predictive` of Laplace/GGN posteriors (a Gaussian about a mode
    whose precision is curvature plus prior): the network linearised at the mean, the GLM
    predictive that matches them (docs/algorithms.md §13.1)."""
    del hparams
    return "linearised"


class PriorPrecision(NamedTuple):
    """The prior part ``delta`` of a Laplace-family posterior's precision ``G + delta`` (sum-loss
    scale, the same for every weight): ``constant + per_example * N`` with ``N`` the federation's
    examples (a weight decay ``lambda`` that each client counts as a prior of precision
    ``lambda n_k`` adds ``lambda`` per example)."""

    constant: float
    per_example: float = 0.0

    def at(self, total_examples: int) -> float:
        """``delta`` for a federation of ``total_examples`` examples."""
        return self.constant + self.per_example * total_examples


def stored_setting(stored: dict, section: str, key: str, default: Any) -> Any:
    """``stored[section][key]`` of a stored config (for a method's :attr:`AlgorithmSpec.stored_meaning`),
    ``default`` where the config lacks it (a stored config holds every default, so only a config
    written by hand does)."""
    table = stored.get(section)
    return table.get(key, default) if isinstance(table, dict) else default


def as_stored(table: dict, stored: dict) -> dict:
    """The default :attr:`AlgorithmSpec.stored_meaning`: no key of the method changed its meaning."""
    del stored
    return table


def no_laplace_prior(hparams: HParams) -> PriorPrecision | None:
    """The default :attr:`AlgorithmSpec.posterior_prior_precision`: the posterior is not data
    curvature plus a known prior precision, so its prior precision cannot be re-chosen post hoc."""
    del hparams
    return None


@dataclasses.dataclass(frozen=True)
class AlgorithmSpec:
    """One method as the registry, the config and the run read it: its name, settings and builder,
    and the traits that the rest of the package needs to know of it (so that nothing outside the
    method's module tests its name).

    A method's module declares its spec (``SPEC = AlgorithmSpec(...)``; a module of two methods
    declares one per method) and lists it in ``SPECS``; :mod:`fedbayes.algorithms.registry` has one
    line per built-in method, and :func:`fedbayes.algorithms.registry.register` adds others.

    Attributes:
      name: the name used in configs (``[algorithm] name = ...``); ``hparams`` must have a ``name``
        field whose literal or default is this name.
      hparams: the :class:`~fedbayes.hparams.HParams` subclass the config's ``[algorithm]`` table
        is validated into.
      build: ``build(hparams, ctx) -> Algorithm`` (:class:`BuildFn`).
      summary: one line for listings.
      bayesian: the method is approximate Bayesian inference (its clients infer local posteriors, or
        sites of one, and its server combines them), whether or not it keeps a posterior beyond its
        mean; ``False``: it optimises a point estimate (FedAvg, FedProx, FedDyn, ADMM). Comparisons
        draw the two families apart.
      exact_server: non-empty when the server's update is exact and takes no server optimizer: what
        it does instead, as a phrase after "<name>'s server" (the config then requires
        ``server.optimizer = 'sgd'`` and ``server.lr = 1``, naming this phrase).
      aggregator_policy: ``"wrappable"``: the method's aggregator may be replaced by a robust rule
        or wrapped by DP (``server.aggregator``, ``server.max_precision_share``, ``[privacy]``);
        ``"own"``: the method combines messages with a rule of its own settings; ``"refuses"``:
        its server needs its own aggregator's output and cannot run under another rule. For
        ``"own"`` and ``"refuses"`` the config allows only ``server.aggregator = 'mean'``, no
        ``max_precision_share`` and no ``privacy.clip``.
      aggregator_note: why, as a phrase after the method's name (for those config errors).
      needs_variational_model: the method trains variational models (``BuildContext.keyed_apply_fn``);
        the config requires ``model.variational`` to equal this.
      needs_apply_fn: the builder reads ``BuildContext.apply_fn``.
      needs_feature_spec: the builder reads ``BuildContext.feature_spec``.
      min_local_epochs: ``hparams -> (minimum, why)``: the fewest ``client.epochs`` the settings
        allow and why, as a phrase (the config error says "client.epochs: <why>, so it needs
        epochs >= <minimum>").
      burn_in_rounds: ``hparams -> rounds`` run before the method is itself (FedAvg rounds of FedPA
        and FedEP); the calibration check skips them.
      calibration_advice: what to change when the marginalised accuracy falls below the point
        estimate's (the posterior too wide); empty: the run's default advice.
      default_predictive: ``"sample"`` or ``"linearised"``, or ``hparams ->`` one of them: the
        marginalised predictive that matches the method's posterior ``q_g``, used when
        ``evaluation.predictive`` is not set (read it with :meth:`predictive_for`):
        ``"linearised"`` (the GLM predictive) for Laplace/GGN posteriors, Gaussians about a mode
        whose precision is curvature plus prior; ``"sample"`` for posteriors fitted to the weights
        themselves (variational, sample moments). docs/algorithms.md §13.1.
      posterior_prior_precision: ``hparams ->`` the prior part ``delta`` of the posterior precision
        when ``q_g``'s precision is data curvature plus a prior, ``Lambda = G + delta``: a
        :class:`PriorPrecision`, a ``(constant, per_example)`` pair or a number (the constant), so
        that the evaluation can swap ``delta`` for another (``evaluation.prior_precision``,
        :mod:`fedbayes.evaluation.prior_precision`); ``None`` where it is not (variational
        posteriors, sample moments, a fixed variance), and then ``evaluation.prior_precision``
        allows only ``"fixed"``. Read it with :meth:`prior_precision_for`.
      divergence_hint: a further likely cause of a non-finite loss, named in the divergence error.
      local_budget: ``"epochs"`` or ``"converged"``, or ``hparams ->`` one of them: when a client
        stops by default (``client.stop`` unset and ``client.epochs`` not given): after
        ``client.epochs`` epochs, or once its local objective has settled (``client.tol``, at most
        ``client.max_epochs`` epochs). A method whose answer is the fixed point of exact local
        steps (a site method's tilted posterior, a dual method's local optimum) needs the latter:
        a fixed epoch of a few minibatches leaves it far from that point for hundreds of rounds
        (docs/results/posterior_defaults.md). Read it with :meth:`local_budget_for`.
      local_max_steps: ``client.max_steps`` when not given: the steps a converging small client
        may run past ``client.max_epochs`` epochs (:func:`fedbayes.inference.sgd.epoch_cap`); 0
        for a method measured worse with them (FedSEP, whose fixed point moves away from the
        family optimum with longer local runs).
      stored_meaning: ``(algorithm_table, stored_config) -> algorithm_table``: a run folder's or a
        checkpoint's ``[algorithm]`` table with each key it lacks set to what it meant when it was
        written (a key whose default has changed since, or a key added since), so that an old run
        resumes and evaluates as it ran. A stored config holds every default that was not ``None``,
        so a key the method records is absent only in a config written before the key existed.
        The default keeps the table as it is.
      settings_aggregator_policy: ``hparams -> (policy, note)`` where the settings narrow
        :attr:`aggregator_policy` (FedEP's dense messages), ``None`` where they do not; read with
        :meth:`aggregator_policy_for`.
    """

    name: str
    hparams: type[HParams]
    build: BuildFn
    summary: str = ""
    _: dataclasses.KW_ONLY
    bayesian: bool = False
    exact_server: str = ""
    aggregator_policy: AggregatorPolicy = "wrappable"
    aggregator_note: str = ""
    needs_variational_model: bool = False
    needs_apply_fn: bool = False
    needs_feature_spec: bool = False
    min_local_epochs: Callable[[Any], tuple[int, str]] = no_minimum_epochs
    burn_in_rounds: Callable[[Any], int] = no_burn_in
    calibration_advice: str = ""
    divergence_hint: str = ""
    default_predictive: str | Callable[[Any], str] = sampled_predictive
    posterior_prior_precision: Callable[[Any], PriorPrecision | tuple[float, float] | float | None] = no_laplace_prior
    local_budget: str | Callable[[Any], str] = "epochs"
    local_max_steps: int = 200
    stored_meaning: Callable[[dict, dict], dict] = as_stored
    settings_aggregator_policy: Callable[[Any], tuple[AggregatorPolicy, str] | None] | None = None

    def __post_init__(self):
        if not (isinstance(self.hparams, type) and issubclass(self.hparams, HParams)):
            raise ValueError(f"algorithm {self.name!r}: hparams must be an HParams subclass; got {self.hparams!r}")
        if "name" not in self.hparams.model_fields:
            raise ValueError(f"algorithm {self.name!r}: its settings {self.hparams.__name__} need a name field (Literal[{self.name!r}])")
        if self.aggregator_policy not in AGGREGATOR_POLICIES:
            raise ValueError(f"algorithm {self.name!r}: aggregator_policy must be one of {', '.join(AGGREGATOR_POLICIES)}; got {self.aggregator_policy!r}")
        if self.aggregator_policy != "wrappable" and not self.aggregator_note:
            raise ValueError(f"algorithm {self.name!r}: aggregator_policy {self.aggregator_policy!r} needs an aggregator_note (why; named in config errors)")

    def predictive_for(self, hparams: Any) -> str:
        """:attr:`default_predictive` for these settings."""
        return self.default_predictive if isinstance(self.default_predictive, str) else self.default_predictive(hparams)

    def aggregator_policy_for(self, hparams: Any) -> tuple[AggregatorPolicy, str]:
        """``(policy, note)`` for these settings: :attr:`settings_aggregator_policy`'s where it gives
        one, else :attr:`aggregator_policy` and :attr:`aggregator_note`."""
        narrowed = None if self.settings_aggregator_policy is None else self.settings_aggregator_policy(hparams)
        return narrowed if narrowed is not None else (self.aggregator_policy, self.aggregator_note)

    def local_budget_for(self, hparams: Any) -> str:
        """:attr:`local_budget` for these settings."""
        return self.local_budget if isinstance(self.local_budget, str) else self.local_budget(hparams)

    def prior_precision_for(self, hparams: Any) -> PriorPrecision | None:
        """:attr:`posterior_prior_precision` for these settings, as a :class:`PriorPrecision`;
        ``None`` also for a flat prior (``delta = 0``: no prior precision to re-choose)."""
        prior = self.posterior_prior_precision(hparams)
        if prior is None:
            return None
        prior = PriorPrecision(*prior) if isinstance(prior, tuple) else PriorPrecision(float(prior))
        return prior if prior.constant > 0 or prior.per_example > 0 else None  # a flat prior: nothing to re-choose

    def check_context(self, ctx: BuildContext) -> None:
        """Raises ``ValueError`` (one line) when ``ctx`` lacks what the traits say the builder needs."""
        missing = [
            what
            for what, needed, given in (
                ("apply_fn (the model's forward pass)", self.needs_apply_fn, ctx.apply_fn),
                ("keyed_apply_fn (a variational model: model.variational = true)", self.needs_variational_model, ctx.keyed_apply_fn),
                ("feature_spec (one example's feature shape)", self.needs_feature_spec, ctx.feature_spec),
            )
            if needed and given is None
        ]
        if missing:
            raise ValueError(f"{self.name}: the build context lacks {'; '.join(missing)}")


def burn_in_setting(hparams: Any) -> int:
    """:attr:`AlgorithmSpec.burn_in_rounds` of methods whose settings have ``burn_in_rounds``."""
    return hparams.burn_in_rounds
