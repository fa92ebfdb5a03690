"""The algorithm interface: a federated method is a few pure functions over messages.

An :class:`Algorithm` is a named tuple of pure functions (typed by the Protocols below):

* ``server_init(key, params) -> server_state``
* ``broadcast(server_state) -> server_message`` (what every sampled client receives)
* ``client_init(params) -> client_state`` (persistent per-client state; ``()`` when stateless)
* ``client_update(key, server_message, client_state, data) -> (client_message, client_state, info)``
* ``server_update(server_state, aggregate, key) -> (server_state, info)``: ``aggregate`` is the
  :class:`~fedbayes.aggregators.Aggregate` of the round's accepted messages, made by the
  algorithm's ``aggregator`` (or one that wraps or replaces it: a robust rule, DP noise)
* ``server_params(server_state) -> params``: the point estimate used for evaluation
* ``message_ok(server_state, client_message) -> bool``: the server's acceptance test for one
  message (finite values, matching structure, proper precisions); a rejected client gets weight
  zero and keeps its old state.
* ``server_posterior(server_state) -> (mean, variance)`` (optional, Bayesian methods): the
  diagonal Gaussian ``q_g`` in moments, for marginalised predictions; ``None`` for point methods.
* ``aggregator``: the method's own aggregation rule (default :func:`fedbayes.aggregators.weighted`).
* ``local_epochs``, ``local_batch_size``: how many shuffled passes over its data a client makes
  and with which minibatch size; the simulator lays out that many epochs per client
  (:mod:`fedbayes.data.batches`) and knows each client's step count ``E * ceil(n_k / B)``.

``info`` outputs are dicts of scalar arrays with a fixed structure per algorithm (as blackjax's
kernels return ``(state, info)``): the client's mean training loss and step count
(:func:`fedbayes.inference.sgd.training_info`), the server's counts. The round protocol (:func:`fedbayes.protocol.server_step`) adds validation and aggregation;
the simulator runs ``client_update`` for a cohort inside one ``jit``, a deployment calls the same
functions one client at a time.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax

from fedbayes import aggregators, tree
from fedbayes.aggregators import Aggregate
from fedbayes.data.batches import ClientData

PyTree = Any
Info = dict[str, jax.Array]

__all__ = [
    "Algorithm",
    "ClientUpdateFn",
    "Info",
    "ServerUpdateFn",
    "finite_message",
    "point_estimate_algorithm",
    "stateless_client_init",
]


class ServerInitFn(Protocol):
    def __call__(self, key: jax.Array, params: PyTree) -> PyTree: ...


class ClientUpdateFn(Protocol):
    def __call__(self, key: jax.Array, message: PyTree, client_state: PyTree, data: ClientData) -> tuple[PyTree, PyTree, Info]: ...


class ServerUpdateFn(Protocol):
    def __call__(self, key: jax.Array, server_state: PyTree, aggregate: Aggregate) -> tuple[PyTree, Info]: ...


class MessageOkFn(Protocol):
    def __call__(self, server_state: PyTree, message: PyTree) -> jax.Array: ...


class PosteriorFn(Protocol):
    def __call__(self, server_state: PyTree) -> tuple[PyTree, PyTree]: ...


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
    local_epochs: int = 1
    local_batch_size: int = 1
    server_posterior: PosteriorFn | None = None
    aggregator: aggregators.Aggregator = aggregators.weighted


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
        local_epochs=trainer.num_epochs,
        local_batch_size=trainer.batch_size,
    )


def finite_message(server_state, message) -> jax.Array:
    """Default acceptance test: every value of the message is finite."""
    del server_state
    return tree.all_finite(message)


def stateless_client_init(params):
    """Stateless clients keep nothing between rounds."""
    del params
    return ()
