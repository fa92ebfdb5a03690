"""FedAvg (McMahan et al. 2017) with the server optimizers of Reddi et al. (2021).

docs/algorithms.md §2. Client: ``E`` epochs of the client optimizer on the mean loss from the broadcast
``theta``; message ``g_k = theta - theta_k^(E)`` (pseudo-gradient). Server:
``g = sum_k n_k g_k / sum_k n_k`` (or uniform weights), then ``theta <- theta + ServerOpt(g)``.
FedAvgM / FedAdam / FedYogi / FedAdagrad are FedAvg with another server optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import optax

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, point_estimate_algorithm, stateless_client_init
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer, run_sgd


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
        return ServerState(params=params, opt_state=opt_state), {}

    return point_estimate_algorithm(
        name,
        trainer,
        server_init=server_init,
        client_init=stateless_client_init,
        client_update=client_update,
        server_update=server_update,
    )


def fedavg(trainer: LocalTrainer, server_optimizer: optax.GradientTransformation) -> Algorithm:
    """FedAvg: local training on the mean loss, weighted averaging of deltas (docs/algorithms.md §2)."""
    return local_delta_algorithm("fedavg", trainer, server_optimizer)


class FedAvgConfig(HParams):
    """FedAvg (docs/algorithms.md §2); FedAvgM/FedAdam/FedYogi/FedAdagrad via ``server.optimizer``."""

    name: Literal["fedavg"] = "fedavg"


def build(hp: FedAvgConfig, ctx: BuildContext) -> Algorithm:
    return fedavg(ctx.trainer, ctx.server_optimizer)


SPEC = AlgorithmSpec("fedavg", FedAvgConfig, build, "weighted averaging of local deltas; FedAvgM/FedAdam/FedYogi via the server optimizer")
SPECS = (SPEC,)
