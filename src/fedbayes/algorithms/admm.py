"""Federated ADMM in the form of Swaroop et al. 2025 (ADMM and Bayes) (Swaroop et al., ICLR 2025), Eq. 2.

docs/algorithms.md §4.1. Client ``k`` keeps a dual ``v_k`` (init 0):

    w_k <- argmin_w mean_loss_k(w) + v_k^T w + (rho/2)||w - w_g||^2
    v_k <- v_k + rho (w_k - w_g)

and the server sets ``w_g = sum_k (rho w_k + v_k) / (K rho + delta)`` over **all** ``K`` clients
(``delta`` a global regulariser; ``delta = 0`` gives ``mean_k (w_k + v_k / rho)``).

Partial participation: the server keeps ``S = sum_k z_k`` with ``z_k = w_k + v_k / rho``, using
each absent client's last ``z_k`` (the "stale values" reading of docs/algorithms.md §4.2's variant). Each client
remembers its ``z_k`` and sends ``z_k^new - z_k^old``; ``S`` starts at ``K theta_0`` since every
``z_k`` starts at ``theta_0``. With full participation this is exactly Eq. 2; with ``delta = 0`` and
full participation it coincides with FedADMM and FedDyn (``alpha = rho``, no weight decay; spec
4.2). The new ``w_g`` reaches the server optimizer as the pseudo-gradient ``w_g^old - w_g^new``.
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
    """ADMM server state: the consensus ``w_g``, ``S = sum_k z_k``, the optimizer state."""

    params: optax.Params
    consensus_sum: optax.Params
    opt_state: optax.OptState


class ClientState(NamedTuple):
    """ADMM client state: the dual ``v_k`` and the last contribution ``z_k = w_k + v_k/rho``."""

    dual: optax.Params
    contribution: optax.Params


def admm(
    trainer: LocalTrainer,
    server_optimizer: optax.GradientTransformation,
    *,
    rho: float,
    num_clients: int,
    delta: float = 0.0,
) -> Algorithm:
    """Federated ADMM with penalty ``rho > 0`` and global regulariser ``delta >= 0``."""
    if rho <= 0:
        raise ValueError(f"admm: rho must be > 0; got {rho}")
    if delta < 0:
        raise ValueError(f"admm: delta must be >= 0; got {delta}")

    def server_init(key, params):
        del key
        return ServerState(params, optax.tree.scale(float(num_clients), params), server_optimizer.init(params))

    def client_init(params):
        return ClientState(dual=optax.tree.zeros_like(params), contribution=params)

    def client_update(key, w_g, state, data):
        def penalty(w):
            diff = optax.tree.sub(w, w_g)
            return optax.tree.vdot(state.dual, w) + 0.5 * rho * optax.tree.vdot(diff, diff)

        w_k, info = run_sgd(key, w_g, data, trainer, penalty)
        dual = optax.tree.add_scale(state.dual, rho, optax.tree.sub(w_k, w_g))
        contribution = optax.tree.add_scale(w_k, 1.0 / rho, dual)
        message = optax.tree.sub(contribution, state.contribution)
        return message, ClientState(dual=dual, contribution=contribution), info

    def server_update(key, state, aggregate):
        del key
        consensus_sum = optax.tree.add(state.consensus_sum, aggregate.total)
        target = optax.tree.scale(rho / (num_clients * rho + delta), consensus_sum)
        pseudo_grad = optax.tree.sub(state.params, target)
        params, opt_state = apply_server_optimizer(server_optimizer, state.params, state.opt_state, pseudo_grad)
        return ServerState(params, consensus_sum, opt_state), NoInfo()

    return point_estimate_algorithm(
        "admm",
        trainer,
        server_init=server_init,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
    )


class ADMMConfig(HParams):
    """Federated ADMM (docs/algorithms.md §4.1)."""

    name: Literal["admm"]
    rho: float = Field(0.01, gt=0, description="ADMM penalty rho")
    delta: float = Field(0.0, ge=0, description="global regulariser delta")


def build(hp: ADMMConfig, ctx: BuildContext) -> Algorithm:
    return admm(ctx.trainer, ctx.server_optimizer, rho=hp.rho, num_clients=ctx.federation.num_clients, delta=hp.delta)


SPEC = AlgorithmSpec("admm", ADMMConfig, build, "federated ADMM with per-client duals")
SPECS = (SPEC,)
