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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any

__all__ = [
    "WEIGHTINGS",
    "client_key",
    "client_round_key",
    "attackers_rng",
    "client_weights",
    "cohort_rng",
    "dropout_rng",
    "evaluation_key",
    "params_key",
    "partition_rng",
    "sample_cohort",
    "sample_without_replacement",
    "server_init_key",
    "server_key",
    "server_step",
    "shuffle_rng",
    "sizes_rng",
    "subsample_rng",
    "validation_rng",
]

WEIGHTINGS = ("examples", "uniform")

# Tags of JAX keys folded into key(seed).
_CLIENT, _SERVER_INIT, _PARAMS, _EVALUATION, _SERVER_ROUND = 0, 2, 3, 5, 6
# Tags of NumPy streams default_rng([seed, tag, ...]).
_SUBSAMPLE, _PARTITION, _SIZES, _COHORT, _SHUFFLE = 1, 2, 7, 11, 12
_VALIDATION, _DROPOUT, _ATTACKERS = 13, 14, 15


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


def server_step(algorithm, server_state, messages: PyTree, weights: jax.Array, key: jax.Array, aggregator=None):
    """One server step: validation, masking, aggregation and the server update.

    Args:
      algorithm: the :class:`~fedbayes.algorithms.base.Algorithm`.
      server_state: its server state before the round.
      messages: the cohort's client messages, stacked on a leading axis ``[M, ...]``.
      weights: ``[M]`` client weights (:func:`client_weights`); 0 marks an absent client.
      key: the server's key of the round (:func:`server_key`).
      aggregator: an :data:`fedbayes.aggregators.Aggregator`; default ``algorithm.aggregator``.
        One whose ``needs_reference`` attribute is true (a DP or robust rule for Gaussian
        messages, :mod:`fedbayes.aggregators.dp`, :mod:`fedbayes.aggregators.robust`) also receives
        ``reference=algorithm.broadcast(server_state)``, the ``q_g`` the deltas are taken against.

    Returns:
      ``(server_state, accepted, info)``: the new state, a boolean ``[M]`` (messages that passed
      ``message_ok`` and had a positive weight) and the server update's info plus
      ``num_accepted``.
    """
    ok = jax.vmap(lambda m: algorithm.message_ok(server_state, m))(messages)
    ok = jnp.logical_and(ok, weights > 0)
    rule = aggregator or algorithm.aggregator
    extra = {"reference": algorithm.broadcast(server_state)} if rule.needs_reference else {}
    aggregate = rule(jax.random.fold_in(key, 0), messages, jnp.where(ok, weights, 0.0), **extra)
    new_state, info = algorithm.server_update(jax.random.fold_in(key, 1), server_state, aggregate)
    return new_state, ok, {**info, "num_accepted": jnp.sum(ok.astype(jnp.int32))}
