"""The point methods' local-delta client, shared by FedAvg (:mod:`fedbayes.algorithms.fedavg`) and
FedProx (:mod:`fedbayes.algorithms.fedprox`).

docs/algorithms.md §2-3. The client trains from the broadcast ``theta`` on its mean loss plus an
optional penalty and sends ``g_k = theta - theta_k^(E)``; the server applies its optimizer to the
weighted mean ``g``: ``theta <- theta + ServerOpt(g)`` (Reddi et al. 2021).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import optax

from fedbayes.algorithms.base import Algorithm, NoInfo, point_estimate_algorithm, stateless_client_init
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.inference.sgd import LocalTrainer, run_sgd

__all__ = ["ServerState", "local_delta_algorithm"]


class ServerState(NamedTuple):
    """Server state of FedAvg-style methods: the model and the server optimizer state."""

    params: optax.Params
    opt_state: optax.OptState


def local_delta_algorithm(
    name: str,
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    penalty: Callable | None = None,
) -> Algorithm:
    """A stateless method whose client minimises ``mean loss + penalty(theta_server, w)``.

    Args:
      name: the algorithm's name.
      trainer: local training configuration.
      server_optimizer: optax transformation applied to the aggregated pseudo-gradient.
      penalty: optional ``(server_params, w) -> scalar``; ``None`` is FedAvg.
    """

    def server_init(key, params):
        del key
        return ServerState(params=params, opt_state=server_optimizer.init(params))

    def client_update(key, server_params, client_state, data):
        pen = None if penalty is None else (lambda w: penalty(server_params, w))
        local, info = run_sgd(key, server_params, data, trainer, pen)
        return optax.tree.sub(server_params, local), client_state, info

    def server_update(key, state, aggregate):
        del key
        params, opt_state = apply_server_optimizer(server_optimizer, state.params, state.opt_state, aggregate.mean)
        return ServerState(params=params, opt_state=opt_state), NoInfo()

    return point_estimate_algorithm(
        name,
        trainer,
        server_init=server_init,
        client_init=stateless_client_init,
        client_update=client_update,
        server_update=server_update,
    )
