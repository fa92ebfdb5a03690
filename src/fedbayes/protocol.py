"""The round protocol: what one federated round means, independently of who runs it.

The simulator (both layouts), the tests' plain per-client reference loop and a deployment (the
Flower adapter) all run a round through these functions, so that they agree bit for bit:

* **Randomness.** Every random stream of a run derives from its seed here, each with its own tag.
  JAX keys: ``client_key(seed, round, client) = fold_in(fold_in(fold_in(key(seed), 0), round),
  client)``, ``server_init_key(seed)``, ``server_key(seed, round)`` (what a server rule that
  samples uses in round ``round``), ``params_key(seed)`` (model initialisation),
  ``evaluation_key(seed, round)`` (samples of marginalised predictions). NumPy streams (host work):
  ``partition_rng(seed)``, ``cohort_rng(seed, round)``, ``shuffle_rng(seed, round, client)``,
  ``validation_rng(seed, client)`` (the held-out validation split).
  NumPy drops trailing zeros of a seed list, so no tag sits at the end of one. A client's key and
  shuffles depend only on (seed, round, client): not on its cohort, the padding, the layout or the
  device split. Because the server's per-round key is derived, not stored, a resumed run draws the
  same numbers as an uninterrupted one without carrying a key in its state.
* **Cohorts.** :func:`sample_cohort`: ``M`` of ``K`` clients uniformly without replacement, in
  ``O(M)`` (Floyd's algorithm).
* **Weighting.** :func:`client_weights`: ``q_k`` proportional to ``n_k`` (``"examples"``) or equal
  (``"uniform"``); zero for empty slots.
* **The server step.** :func:`server_step`: validate every message (``algorithm.message_ok``),
  give rejected clients weight zero, reduce the messages with the aggregator (the algorithm's own
  rule unless another is given: a robust rule, DP noise) and apply ``algorithm.server_update``.
* **The end of a round.** A round in which no message is accepted (every one rejected, dropped or
  missing) teaches the server nothing, so the server state stays as it was: round counters,
  burn-in switches and optimizer state do not move, except what the algorithm's
  ``after_rejected_round`` changes (an adaptive damping shrinks). :func:`keep_unless_accepted` is that policy
  inside a compiled round (the simulator's); :func:`finish_round` applies it on the host, owns the
  ``fail_fast`` check and builds the :class:`RoundInfo`, for every runner.
* **Messages.** :func:`message_templates`: the shapes and dtypes of the broadcast, a client's
  message and its info, which a runner needs before any message exists (byte counts, decoding a
  deployment's replies).
* **Runners.** A :class:`Runner` (the simulator, :class:`fedbayes.sim.simulator.Simulator`; a
  deployment, :class:`fedbayes.flower.rounds.FlowerRounds`) runs rounds on a :class:`SimState`;
  the run loop (:mod:`fedbayes.runs`) drives any of them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.errors import DivergedError

PyTree = Any

__all__ = [
    "WEIGHTINGS",
    "RoundInfo",
    "Runner",
    "SimState",
    "finish_round",
    "keep_unless_accepted",
    "rejected_round_state",
    "MessageTemplates",
    "message_templates",
    "client_key",
    "client_round_key",
    "attackers_rng",
    "calibration_rng",
    "client_weights",
    "cohort_rng",
    "dropout_rng",
    "evaluation_key",
    "fine_tune_rng",
    "params_key",
    "partition_rng",
    "personal_rng",
    "sample_cohort",
    "sample_without_replacement",
    "server_init_key",
    "server_key",
    "server_step",
    "shuffle_rng",
    "sizes_rng",
    "subsample_rng",
    "test_split_rng",
    "validation_rng",
]

WEIGHTINGS = ("examples", "uniform")

# Tags of JAX keys folded into key(seed).
_CLIENT, _SERVER_INIT, _PARAMS, _EVALUATION, _SERVER_ROUND = 0, 2, 3, 5, 6
# Tags of NumPy streams default_rng([seed, tag, ...]).
_SUBSAMPLE, _PARTITION, _SIZES, _COHORT, _SHUFFLE = 1, 2, 7, 11, 12
_VALIDATION, _DROPOUT, _ATTACKERS, _TEST_SPLIT, _CALIBRATION = 13, 14, 15, 16, 17
_PERSONAL, _FINE_TUNE = 18, 19


def _root(seed) -> jax.Array:
    return jax.random.key(seed)


def client_round_key(seed, round_idx) -> jax.Array:
    """The key every client of round ``round_idx`` folds its id into (traceable round index)."""
    return jax.random.fold_in(jax.random.fold_in(_root(seed), _CLIENT), round_idx)


def client_key(seed, round_idx, client_id) -> jax.Array:
    """Client ``client_id``'s key in round ``round_idx`` (traceable round and client)."""
    return jax.random.fold_in(client_round_key(seed, round_idx), client_id)


def server_init_key(seed) -> jax.Array:
    """The key passed to ``algorithm.server_init``."""
    return jax.random.fold_in(_root(seed), _SERVER_INIT)


def server_key(seed, round_idx) -> jax.Array:
    """The server's key in round ``round_idx`` (aggregators and server updates that sample)."""
    return jax.random.fold_in(jax.random.fold_in(_root(seed), _SERVER_ROUND), round_idx)


def params_key(seed) -> jax.Array:
    """The key of the model's initial parameters."""
    return jax.random.fold_in(_root(seed), _PARAMS)


def evaluation_key(seed, round_idx) -> jax.Array:
    """The key of round ``round_idx``'s marginalised-prediction samples."""
    return jax.random.fold_in(jax.random.fold_in(_root(seed), _EVALUATION), round_idx)


def subsample_rng(seed: int) -> np.random.Generator:
    """The generator that draws a dataset's random ``fraction``."""
    return np.random.default_rng([seed, _SUBSAMPLE])


def test_split_rng(seed: int) -> np.random.Generator:
    """The generator that holds out the test split of your own data without a test file (``data.test_fraction``)."""
    return np.random.default_rng([seed, _TEST_SPLIT])


def partition_rng(seed: int) -> np.random.Generator:
    """The generator of the partition of the training set over clients."""
    return np.random.default_rng([seed, _PARTITION])


def sizes_rng(seed: int) -> np.random.Generator:
    """The generator of a generated federation's client sizes."""
    return np.random.default_rng([seed, _SIZES])


def cohort_rng(seed: int, round_idx: int) -> np.random.Generator:
    """The generator of round ``round_idx``'s cohort."""
    return np.random.default_rng([seed, _COHORT, round_idx])


def shuffle_rng(seed: int, round_idx: int, client_id: int) -> np.random.Generator:
    """The generator of one client's epoch shuffles in one round."""
    return np.random.default_rng([seed, _SHUFFLE, round_idx, client_id])


def validation_rng(seed: int, client_id: int) -> np.random.Generator:
    """The generator that picks which of client ``client_id``'s examples are held out for validation."""
    return np.random.default_rng([seed, _VALIDATION, client_id])


def calibration_rng(seed: int, client_id: int) -> np.random.Generator:
    """The generator that picks which of client ``client_id``'s examples it keeps for conformal calibration."""
    return np.random.default_rng([seed, _CALIBRATION, client_id])


def personal_rng(seed: int, client_id: int) -> np.random.Generator:
    """The generator that picks which of client ``client_id``'s examples it keeps as its own test
    examples for personalisation (``evaluation.personal_fraction``)."""
    return np.random.default_rng([seed, _PERSONAL, client_id])


def fine_tune_rng(seed: int, client_id: int) -> np.random.Generator:
    """The generator of client ``client_id``'s shuffles when it fine-tunes the final global model
    for personalisation (:func:`fedbayes.evaluation.personal.fine_tune`)."""
    return np.random.default_rng([seed, _FINE_TUNE, client_id])


def dropout_rng(seed: int, round_idx: int) -> np.random.Generator:
    """The generator of round ``round_idx``'s client failures (``server.dropout``)."""
    return np.random.default_rng([seed, _DROPOUT, round_idx])


def attackers_rng(seed: int) -> np.random.Generator:
    """The generator of the run's fixed set of attacking clients (``attack.fraction``)."""
    return np.random.default_rng([seed, _ATTACKERS])


def sample_without_replacement(rng: np.random.Generator, num_items: int, num_samples: int) -> np.ndarray:
    """Uniform sample of ``num_samples`` distinct items of ``range(num_items)`` in ``O(num_samples)``.

    Floyd's algorithm (Bentley & Floyd 1987): every subset is equally likely, and the cost does not
    depend on ``num_items`` (a permutation of 342,477 clients per round would).
    """
    chosen: set[int] = set()
    for j in range(num_items - num_samples, num_items):
        t = int(rng.integers(0, j + 1))
        chosen.add(j if t in chosen else t)
    return np.sort(np.fromiter(chosen, dtype=np.int64, count=num_samples))


def sample_cohort(seed: int, round_idx: int, num_clients: int, clients_per_round: int) -> np.ndarray:
    """Round ``round_idx``'s cohort: ``clients_per_round`` sorted client ids (all when ``M = K``)."""
    if clients_per_round == num_clients:
        return np.arange(num_clients)
    return sample_without_replacement(cohort_rng(seed, round_idx), num_clients, clients_per_round)


def client_weights(num_examples, weighting: str):
    """``q_k`` before normalisation: ``n_k`` (``"examples"``) or 1 (``"uniform"``) for every slot
    with data, 0 for empty (padding) slots; float32, NumPy in, NumPy out (JAX in, JAX out)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {', '.join(WEIGHTINGS)}; got {weighting!r}")
    xp = jnp if isinstance(num_examples, jax.Array) else np
    n = xp.asarray(num_examples)
    if weighting == "examples":
        return n.astype(xp.float32)
    return (n > 0).astype(xp.float32)


def accepted(algorithm, server_state, messages: PyTree, weights: jax.Array) -> jax.Array:
    """``[M]`` booleans: the stacked ``messages`` that pass ``algorithm.message_ok`` and have a
    positive weight (the first part of :func:`server_step`)."""
    ok = jax.vmap(lambda m: algorithm.message_ok(server_state, m))(messages)
    return jnp.logical_and(ok, weights > 0)


def server_step(key: jax.Array, algorithm, server_state, messages: PyTree, weights: jax.Array, aggregator=None):
    """One server step: validation, masking, aggregation and the server update.

    Args:
      key: the server's key of the round (:func:`server_key`); the rule draws from
        ``fold_in(key, 0)``, the server update from ``fold_in(key, 1)``.
      algorithm: the :class:`~fedbayes.algorithms.base.Algorithm`.
      server_state: its server state before the round.
      messages: the cohort's client messages, stacked on a leading axis ``[M, ...]``.
      weights: ``[M]`` client weights (:func:`client_weights`); 0 marks an absent client.
      aggregator: an :data:`fedbayes.aggregators.Aggregator`; default ``algorithm.aggregator``.
        One whose ``needs_reference`` attribute is true (a DP or robust rule for Gaussian
        messages, :mod:`fedbayes.aggregators.dp`, :mod:`fedbayes.aggregators.robust`) also receives
        ``reference=algorithm.broadcast(server_state)``, the ``q_g`` the deltas are taken against.

    Returns:
      ``(server_state, accepted, info)``: the new state, a boolean ``[M]`` (messages that passed
      ``message_ok`` and had a positive weight) and the server update's info plus
      ``num_accepted``.
    """
    ok = accepted(algorithm, server_state, messages, weights)
    rule = aggregator or algorithm.aggregator
    extra = {"reference": algorithm.broadcast(server_state)} if rule.needs_reference else {}
    aggregate = rule(jax.random.fold_in(key, 0), messages, jnp.where(ok, weights, 0.0), **extra)
    new_state, info = algorithm.server_update(jax.random.fold_in(key, 1), server_state, aggregate)
    info = info._asdict() if hasattr(info, "_asdict") else info  # a method's typed info (a NamedTuple) as the round's dict
    return new_state, ok, {**info, "num_accepted": jnp.sum(ok.astype(jnp.int32))}


# ----- runners and the end of a round ------------------------------------------------------------
class SimState(NamedTuple):
    """Everything a run needs to continue: the next round, server state, client store.

    ``client_states`` is the runner's: the simulator's client store (a pytree of host arrays
    ``[num_clients, ...]``, a :class:`~fedbayes.sim.store.DiskStore`, device arrays, or ``()`` when
    stateless), a deployment's per-client bookkeeping (:class:`~fedbayes.flower.rounds.FlowerRounds`).
    """

    round: int
    server_state: Any
    client_states: Any


class RoundInfo(NamedTuple):
    """What one round did.

    ``padding_waste`` is the share of padded entries in the cohort's order buffer (and, for a
    generated federation, its feature buffer); ``step_waste`` the share of masked no-op client
    steps (0 in the sequential layout, where each client runs exactly its own steps).
    """

    round: int
    cohort: np.ndarray
    rejected: np.ndarray  # client ids whose messages were rejected
    bytes_up: int
    bytes_down: int
    padding_waste: float = 0.0
    step_waste: float = 0.0
    clients: dict[str, np.ndarray] | None = None  # per cohort client (in cohort order): num_examples and its info
    server: dict[str, float] | None = None  # the server update's info
    dropped: np.ndarray | None = None  # client ids that failed this round (server.dropout) or never replied
    late: np.ndarray | None = None  # client ids cut by the deadline (server.deadline)


@runtime_checkable
class Runner(Protocol):
    """What runs the rounds of a run: the simulator or a deployment.

    Attributes:
      algorithm: the :class:`~fedbayes.algorithms.base.Algorithm` it runs.
      counts_dropped: whether its rounds can lose clients that the config does not ask to drop
        (a deployment's missing replies), so that the run loop counts ``dropped`` clients even
        without ``server.dropout`` or ``server.deadline``.
    """

    algorithm: Any
    counts_dropped: bool

    def init(self, params: PyTree, *, resume: bool = False) -> SimState:
        """The state before round 0: ``server_init`` and every client's initial state.
        ``resume=True``: a checkpoint will replace it (open the existing client store)."""
        ...

    def place(self, server_state: PyTree) -> PyTree:
        """A server state (e.g. restored from a checkpoint) laid out as :meth:`run_round` returns it."""
        ...

    def run_round(self, state: SimState, *, donate: bool = False) -> tuple[SimState, RoundInfo]:
        """Runs round ``state.round``; ``donate=True``: the caller drops ``state`` (update in place)."""
        ...

    def rounds(self, state: SimState, stop: int, *, donate: bool = True, keep: Callable[[int], bool] | None = None) -> Iterator[tuple[SimState, RoundInfo]]:
        """Runs rounds ``state.round .. stop - 1``, yielding ``(state, info)`` after each: bitwise
        what :meth:`run_round` in a loop gives. ``keep(r)``: the caller needs round ``r``'s
        yielded state intact until it resumes the iteration (to checkpoint it)."""
        ...

    def server_params(self, state: SimState) -> PyTree:
        """The model parameters the server state stands for (what is evaluated and exported)."""
        ...

    def message_bytes(self, state: SimState) -> tuple[int, int]:
        """``(down, up)``: the bytes of one broadcast and of one client's message
        (:func:`fedbayes.tree.tree_bytes` of their templates); a round's ``bytes_up`` is ``up``
        times the messages it received."""
        ...


def rejected_round_state(algorithm, server_state: PyTree) -> PyTree:
    """The server state after a round with no accepted message: ``server_state`` itself, or what
    the algorithm's ``after_rejected_round`` makes of it."""
    after = getattr(algorithm, "after_rejected_round", None)
    return server_state if after is None else after(server_state)


def keep_unless_accepted(accepted: jax.Array, new_server_state: PyTree, server_state: PyTree, algorithm=None) -> PyTree:
    """The policy for a round with no accepted message, inside a compiled round.

    ``new_server_state`` when any entry of ``accepted`` (the ``[M]`` flags of
    :func:`server_step`) is true, else ``server_state`` (:func:`rejected_round_state` of
    ``algorithm``, when given): a per-leaf select, so a round with an accepted message returns
    ``new_server_state`` bit for bit.
    """
    any_accepted = jnp.any(accepted)
    kept = server_state if algorithm is None else rejected_round_state(algorithm, server_state)
    return jax.tree.map(lambda new, old: jnp.where(any_accepted, new, old), new_server_state, kept)


def finish_round(
    server_state: PyTree,
    new_server_state: PyTree,
    accepted: np.ndarray,
    *,
    round_idx: int,
    cohort: np.ndarray,
    rejected: np.ndarray,
    fail_fast: bool,
    bytes_up: int,
    bytes_down: int,
    padding_waste: float = 0.0,
    step_waste: float = 0.0,
    clients: dict[str, np.ndarray] | None = None,
    server: dict[str, float] | None = None,
    dropped: np.ndarray | None = None,
    late: np.ndarray | None = None,
    algorithm=None,
) -> tuple[PyTree, RoundInfo]:
    """The end of a round on the host, the same for every runner.

    ``round_idx``, ``cohort``, ``bytes_up``, ``bytes_down``, ``padding_waste``, ``step_waste``,
    ``clients``, ``server``, ``dropped`` and ``late`` are the :class:`RoundInfo` fields.

    Args:
      server_state: the server state the round started from.
      new_server_state: the server step's result (:func:`server_step`).
      accepted: ``[M]`` booleans, the messages the server step accepted.
      rejected: the client ids whose messages were rejected.
      fail_fast: raise on a rejected message (``server.fail_fast``).
      algorithm: the round's algorithm, whose ``after_rejected_round`` applies when no message
        was accepted (:func:`rejected_round_state`); ``None``: the state is kept.

    Returns:
      ``(server_state, info)``: the state to continue from (``server_state`` itself, or what the
      algorithm's ``after_rejected_round`` makes of it, when no message was accepted: nothing was
      learned, see :func:`keep_unless_accepted`) and what the round did.

    Raises:
      DivergedError: ``fail_fast`` and a message was rejected (exit code 3 in the CLI).
    """
    if fail_fast and len(rejected):
        raise DivergedError(
            f"round {round_idx}: client messages rejected (non-finite or invalid) from clients {np.asarray(rejected).tolist()} (server.fail_fast)"
        )
    info = RoundInfo(
        round=round_idx,
        cohort=cohort,
        rejected=rejected,
        bytes_up=bytes_up,
        bytes_down=bytes_down,
        padding_waste=padding_waste,
        step_waste=step_waste,
        clients=clients,
        server=server,
        dropped=dropped,
        late=late,
    )
    return (new_server_state if np.any(accepted) else rejected_round_state(algorithm, server_state)), info


# ----- message shapes ----------------------------------------------------------------------------
class MessageTemplates(NamedTuple):
    """Shapes and dtypes (``jax.ShapeDtypeStruct`` pytrees) of one round's messages."""

    broadcast: PyTree  # the server's message, algorithm.broadcast(server_state)
    message: PyTree  # one client's message, client_update's first output
    info: PyTree  # one client's info, client_update's third output


def message_templates(algorithm, params: PyTree, data=None, *, server_state: PyTree = None, client_state: PyTree = None) -> MessageTemplates:
    """The shapes of a round's messages, traced (``jax.eval_shape``) without computing anything.

    Args:
      algorithm: the :class:`~fedbayes.algorithms.base.Algorithm`.
      params: the model's parameters (arrays or ``jax.ShapeDtypeStruct``); unused when both
        ``server_state`` and ``client_state`` are given.
      data: a client's data or its shapes (:func:`fedbayes.sim.simulator.client_data_template`); ``None``: the broadcast
        only (``message`` and ``info`` are ``None``; a client that decodes the broadcast does not
        trace its update twice).
      server_state: a server state (or its shapes) to broadcast; default ``server_init(params)``'s.
      client_state: one client's state (or its shapes); default ``client_init(params)``'s.
    """
    if server_state is None:
        server_state = jax.eval_shape(algorithm.server_init, server_init_key(0), params)
    if data is None:
        return MessageTemplates(broadcast=jax.eval_shape(algorithm.broadcast, server_state), message=None, info=None)
    if client_state is None:
        client_state = jax.eval_shape(algorithm.client_init, params)
    broadcast = jax.eval_shape(algorithm.broadcast, server_state)
    message, _, info = jax.eval_shape(algorithm.client_update, jax.random.key(0), broadcast, client_state, data)
    return MessageTemplates(broadcast=broadcast, message=message, info=info)
