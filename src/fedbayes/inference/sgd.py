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

from typing import Callable, NamedTuple

import jax
import optax

from fedbayes.data.batches import ClientData, get_batch, num_local_steps

LossFn = Callable[..., jax.Array]  # (params, x, y, mask) -> mean loss over the valid examples


class LocalTrainer(NamedTuple):
    """Static configuration of local training.

    Attributes:
      loss_fn: ``(params, x, y, mask) -> scalar``, the mean loss over valid examples.
      optimizer: the client optax transformation (initialised afresh every round).
      num_epochs: local epochs ``E``.
      batch_size: minibatch size ``B``.
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    num_epochs: int
    batch_size: int


def run_sgd(
    key: jax.Array,
    params,
    data: ClientData,
    trainer: LocalTrainer,
    penalty: Callable | None = None,
):
    """Runs local training and returns the last iterate ``theta_k^(E)``.

    Minimises ``loss_fn(theta; batch) + penalty(theta)`` with ``trainer.optimizer``.

    Args:
      key: the client's key for this round (unused by plain SGD; the shuffles are in ``data``).
      params: starting parameters (the broadcast model).
      data: the client's data.
      trainer: local training configuration.
      penalty: optional ``params -> scalar`` added to every minibatch loss.
    """
    del key  # shuffles come laid out in data.order (drawn on the host per client and round)
    total = num_local_steps(data.num_examples, trainer.batch_size, trainer.num_epochs)

    def objective(p, x, y, m):
        loss = trainer.loss_fn(p, x, y, m)
        return loss if penalty is None else loss + penalty(p)

    grad_fn = jax.grad(objective)

    def body(step, carry):
        p, opt_state = carry
        x, y, m = get_batch(data, step, trainer.batch_size)
        grads = grad_fn(p, x, y, m)
        updates, opt_state = trainer.optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    p, _ = jax.lax.fori_loop(0, total, body, (params, trainer.optimizer.init(params)))
    return p
