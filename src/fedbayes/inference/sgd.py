"""Local minibatch optimisation: the point-estimate client inference of FedAvg and its relatives.

A client minimises its mean loss plus an algorithm-specific penalty (FedProx's proximal term,
FedDyn's linear correction, ADMM's dual term) for ``E`` epochs of its optax optimizer, starting
from the broadcast parameters (docs/algorithms.md §2, "Client").

The epochs' shuffles arrive laid out in ``data.order`` (:mod:`fedbayes.data.batches`): the
simulator must lay out ``trainer.num_epochs`` epochs (``Algorithm.local_epochs``).

The loop has a per-client trip count ``E * ceil(n_k / B)``. Run alone (or one client after
another on a device) it takes exactly that many steps. Under ``jax.vmap`` JAX batches the loop
into one that runs to the cohort's longest client and holds every finished client's parameters
and optimizer state with a select, i.e. the masked no-op steps ``jnp.where(active, new, old)``
of docs/design.md step 4; partial last batches are masked inside the loss. Either way each client's
result equals its own plain loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedbayes.data.batches import ClientData, get_batch, num_local_steps

LossFn = Callable[..., jax.Array]  # (params, key, x, y, mask) -> mean loss over the valid examples


class LocalTrainer(NamedTuple):
    """Static configuration of local training.

    Attributes:
      loss_fn: ``(params, key, x, y, mask) -> scalar``, the mean loss over valid examples; ``key``
        feeds stochastic losses (sampled weights of a Bayes-by-backprop model) and is ignored by
        deterministic models.
      optimizer: the client optax transformation (initialised afresh every round).
      num_epochs: local epochs ``E``.
      batch_size: minibatch size ``B``.
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    num_epochs: int
    batch_size: int


def objective_fn(trainer: LocalTrainer, penalty: Callable | None = None):
    """``(params, key, x, y, mask) -> (loss + penalty(params), loss)``: the minibatch objective
    and, as auxiliary output, the data loss alone (what the client reports)."""

    def objective(p, k, x, y, m):
        loss = trainer.loss_fn(p, k, x, y, m)
        return (loss if penalty is None else loss + penalty(p)), loss

    return objective


def run_sgd(
    key: jax.Array,
    params,
    data: ClientData,
    trainer: LocalTrainer,
    penalty: Callable | None = None,
):
    """Runs local training and returns the last iterate ``theta_k^(E)`` and the client's info.

    Minimises ``loss_fn(theta; batch) + penalty(theta)`` with ``trainer.optimizer``; step ``s``
    passes ``fold_in(key, s)`` to the loss.

    Args:
      key: the client's key for this round (the shuffles themselves are laid out in ``data``).
      params: starting parameters (the broadcast model).
      data: the client's data.
      trainer: local training configuration.
      penalty: optional ``params -> scalar`` added to every minibatch loss.

    Returns:
      ``(params, info)`` with ``info`` as :func:`training_info`: the mean
      minibatch data loss over the steps taken and their number.
    """
    total = num_local_steps(data.num_examples, trainer.batch_size, trainer.num_epochs)
    grad_fn = jax.grad(objective_fn(trainer, penalty), has_aux=True)

    def body(step, carry):
        p, opt_state, loss_sum = carry
        x, y, m = get_batch(data, step, trainer.batch_size)
        grads, loss = grad_fn(p, jax.random.fold_in(key, step), x, y, m)
        updates, opt_state = trainer.optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss_sum + loss.astype(loss_sum.dtype)

    init = (params, trainer.optimizer.init(params), jnp.zeros((), jnp.float32))
    p, _, loss_sum = jax.lax.fori_loop(0, total, body, init)
    return p, training_info(loss_sum, total)


def training_info(loss_sum: jax.Array, steps: jax.Array) -> dict[str, jax.Array]:
    """``{"loss": loss_sum / steps, "steps": steps}`` (loss 0 when no step was taken)."""
    steps = jnp.asarray(steps, jnp.int32)
    mean = loss_sum / jnp.maximum(steps, 1).astype(jnp.float32)
    return {"loss": mean.astype(jnp.float32), "steps": steps}
