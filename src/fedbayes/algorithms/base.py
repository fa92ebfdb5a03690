"""The algorithm interface: a federated method is a few pure functions over messages.

An :class:`Algorithm` is a named tuple of pure functions (docs/style.md, "Shapes worth keeping"):

* ``server_init(key, params) -> server_state``
* ``broadcast(server_state) -> server_message`` (what every sampled client receives)
* ``client_init(params) -> client_state`` (persistent per-client state; ``()`` when stateless)
* ``client_update(key, server_message, client_state, data) -> (client_message, client_state)``
* ``server_update(server_state, client_messages, weights) -> server_state``: messages stacked on
  axis 0, ``weights[m] >= 0`` (zero for padded or rejected clients)
* ``server_params(server_state) -> params``: the point estimate used for evaluation
* ``message_ok(server_state, client_message) -> bool``: the server's acceptance test for one
  message (docs/design.md, "Messages and their validation"); a rejected client gets weight zero and
  keeps its old state.
* ``server_posterior(server_state) -> (mean, variance)`` (optional, Bayesian methods): the
  diagonal Gaussian ``q_g`` in moments, for marginalised predictions (docs/algorithms.md §13.1); ``None`` for
  point-estimate methods.
* ``local_epochs``, ``local_batch_size``: how many shuffled passes over its data a client makes
  and with which minibatch size; the simulator lays out that many epochs per client
  (:mod:`fedbayes.data.batches`) and knows each client's step count ``E * ceil(n_k / B)``.

The simulator vmaps (or maps) ``client_update`` over a cohort; the Flower adapter calls the same
functions one client at a time. Point-estimate and posterior methods share this interface.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from fedbayes import tree


class Algorithm(NamedTuple):
    """A federated algorithm as pure functions (see the module docstring)."""

    name: str
    server_init: Callable[..., Any]
    broadcast: Callable[[Any], Any]
    client_init: Callable[[Any], Any]
    client_update: Callable[..., tuple[Any, Any]]
    server_update: Callable[[Any, Any, jax.Array], Any]
    server_params: Callable[[Any], Any]
    message_ok: Callable[[Any, Any], jax.Array]
    local_epochs: int = 1
    local_batch_size: int = 1
    server_posterior: Callable[[Any], tuple[Any, Any]] | None = None


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


def participation_mask(weights: jax.Array) -> jax.Array:
    """1.0 for clients that take part in aggregation this round, else 0.0."""
    return (weights > 0).astype(jnp.float32)
