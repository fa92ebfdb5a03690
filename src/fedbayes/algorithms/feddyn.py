"""FedDyn (Acar et al., ICLR 2021): dynamic regularisation with a per-client gradient correction.

docs/algorithms.md §5, paper form. Client ``k`` keeps ``grad_k`` (init 0) and solves

    theta_k = argmin L_k(theta) - <grad_k, theta> + (alpha/2)||theta - theta^{t-1}||^2
              + (lambda/2)||theta||^2

with ``L_k`` the mean loss and ``lambda`` the local weight decay that practical FedDyn needs
(Swaroop et al. 2025 (ADMM and Bayes) App. D.1), then ``grad_k <- grad_k - alpha (theta_k - theta^{t-1})``. The server keeps
``h`` (init 0):

    h <- h - (alpha / K) sum_{k in S_t} (theta_k - theta^{t-1})
    theta^t = mean_{k in S_t} theta_k - h / alpha.

Note ``1/K`` (all clients) in ``h`` and the uniform mean over the cohort: FedDyn's fixed-point
argument needs uniform weights, so client weights act here only as a participation mask. The
step is passed to the server optimizer as the pseudo-gradient ``theta^{t-1} - theta^t`` (with
``sgd`` at lr 1, exactly the paper's update).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import optax
from pydantic import Field

from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, NoInfo, point_estimate_algorithm
from fedbayes.algorithms.server_opt import apply_server_optimizer
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer, run_sgd


class ServerState(NamedTuple):
    """FedDyn server state: the model, the correction ``h``, the server optimizer state."""

    params: optax.Params
    h: optax.Params
    opt_state: optax.OptState


def feddyn(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    *,
    alpha: float,
    num_clients: int,
    weight_decay: float = 0.0,
) -> Algorithm:
    """FedDyn with regularisation ``alpha > 0`` and local weight decay ``weight_decay >= 0``."""
    if alpha <= 0:
        raise ValueError(f"feddyn: alpha must be > 0; got {alpha}")
    if weight_decay < 0:
        raise ValueError(f"feddyn: weight_decay must be >= 0; got {weight_decay}")

    def server_init(key, params):
        del key
        return ServerState(params, optax.tree.zeros_like(params), server_optimizer.init(params))

    def client_init(params):
        return optax.tree.zeros_like(params)

    def client_update(key, theta, grad_k, data):
        def penalty(w):
            diff = optax.tree.sub(w, theta)
            return -optax.tree.vdot(grad_k, w) + 0.5 * alpha * optax.tree.vdot(diff, diff) + 0.5 * weight_decay * optax.tree.vdot(w, w)

        local, info = run_sgd(key, theta, data, trainer, penalty)
        message = optax.tree.sub(theta, local)  # g_k = theta^{t-1} - theta_k
        new_grad = optax.tree.add_scale(grad_k, alpha, message)  # grad_k - alpha (theta_k - theta)
        return message, new_grad, info

    def server_update(key, state, aggregate):
        del key
        h = optax.tree.add_scale(state.h, alpha / num_clients, aggregate.total)
        # theta^{t-1} - theta^t = mean g_k + h / alpha (uniform mean over the cohort)
        pseudo_grad = optax.tree.add_scale(aggregate.uniform_mean(), 1.0 / alpha, h)
        params, opt_state = apply_server_optimizer(server_optimizer, state.params, state.opt_state, pseudo_grad)
        return ServerState(params, h, opt_state), NoInfo()

    return point_estimate_algorithm(
        "feddyn",
        trainer,
        server_init=server_init,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
    )


class FedDynConfig(HParams):
    """FedDyn (docs/algorithms.md §5)."""

    name: Literal["feddyn"]
    alpha: float = Field(0.01, gt=0, description="dynamic regularisation alpha")
    weight_decay: float = Field(1e-4, ge=0, description="local weight decay lambda")


def build(hp: FedDynConfig, ctx: BuildContext) -> Algorithm:
    return feddyn(ctx.trainer, ctx.server_optimizer, alpha=hp.alpha, num_clients=ctx.federation.num_clients, weight_decay=hp.weight_decay)


SPEC = AlgorithmSpec("feddyn", FedDynConfig, build, "dynamic regularisation with per-client gradient corrections")
SPECS = (SPEC,)

__all__ = ["SPEC", "SPECS", "FedDynConfig", "ServerState", "feddyn"]
