"""FedProx (Li et al. 2020): FedAvg with a proximal term on the client.

docs/algorithms.md §3. The client approximately minimises
``h_k(w) = mean_loss_k(w) + (mu / 2) ||w - theta||_2^2`` (the squared norm, as in the paper; the
``bayes-admm`` code's unsquared norm is a known deviation, docs/algorithms.md §3 pitfall). With ``mu = 0`` this is
FedAvg.
"""

from __future__ import annotations

from typing import Literal

import optax
from pydantic import Field

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext
from fedbayes.algorithms.point import local_delta_algorithm
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer


def proximal_penalty(mu: float):
    """``(theta, w) -> (mu/2) ||w - theta||^2`` (docs/algorithms.md §3)."""

    def penalty(theta, w):
        diff = optax.tree.sub(w, theta)
        return 0.5 * mu * optax.tree.vdot(diff, diff)

    return penalty


def fedprox(trainer: LocalTrainer, server_optimizer: optax.GradientTransformation, mu: float) -> Algorithm:
    """FedProx with proximal strength ``mu >= 0``."""
    if mu < 0:
        raise ValueError(f"fedprox: mu must be >= 0; got {mu}")
    return local_delta_algorithm("fedprox", trainer, server_optimizer, proximal_penalty(mu))


class FedProxConfig(HParams):
    """FedProx (docs/algorithms.md §3)."""

    name: Literal["fedprox"]
    mu: float = Field(0.01, ge=0, description="proximal strength mu (0: FedAvg)")


def build(hp: FedProxConfig, ctx: BuildContext) -> Algorithm:
    return fedprox(ctx.trainer, ctx.server_optimizer, hp.mu)


SPEC = AlgorithmSpec("fedprox", FedProxConfig, build, "FedAvg with a proximal term on the clients")
SPECS = (SPEC,)
