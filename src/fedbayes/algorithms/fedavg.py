"""FedAvg (McMahan et al. 2017) with the server optimizers of Reddi et al. (2021).

docs/algorithms.md §2. Client: ``E`` epochs of the client optimizer on the mean loss from the broadcast
``theta``; message ``g_k = theta - theta_k^(E)`` (pseudo-gradient). Server:
``g = sum_k n_k g_k / sum_k n_k`` (or uniform weights), then ``theta <- theta + ServerOpt(g)``.
FedAvgM / FedAdam / FedYogi / FedAdagrad are FedAvg with another server optimizer.
"""

from __future__ import annotations

from typing import Literal

import optax

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext
from fedbayes.algorithms.point import local_delta_algorithm
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer


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
