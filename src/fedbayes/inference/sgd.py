"""Local minibatch optimisation: the point-estimate client inference of FedAvg and its relatives.

A client minimises its mean loss plus an algorithm-specific penalty (FedProx's proximal term,
FedDyn's linear correction, ADMM's dual term) for ``E`` epochs of its optax optimizer, starting
from the broadcast parameters (docs/algorithms.md §2, "Client").

The epochs' shuffles arrive laid out in ``data.order`` (:mod:`fedbayes.data.batches`): the
simulator must lay out ``trainer.num_epochs`` epochs (``Algorithm.local_epochs``).

**Local budget.** With ``trainer.tol == 0`` a client takes exactly ``E`` epochs. With
``trainer.tol > 0`` it trains *until its local objective has converged*: it stops after the first
epoch ``e >= 2`` whose mean minibatch gradient (the sum of the epoch's minibatch gradients over its
steps: the full gradient for an epoch of one batch, and for many small steps nearly so, its
noise averaged over the epoch) has a norm at most ``tol`` times the first epoch's,
``||g_bar_e|| <= tol ||g_bar_1||``, and after ``E`` epochs at most (the cap, laid out by the
simulator), or after ``trainer.max_steps`` steps where ``E`` epochs are fewer (:func:`epoch_cap`:
a small client's epoch is a step or two). A criterion on the gradient and relative to the round's start is free of the
objective's scale: a tilted objective whose cavity term is large at the optimum (a small client
under a precise cavity) changes by a small fraction of its value per step long before it
settles, and a relative-objective rule stopped such clients after two steps. A client starts each
round from the global's mean, so a run that is near its fixed point asks for a further ``1 / tol``
reduction of an already small gradient. The steps taken are the client's ``steps`` info
(``clients.jsonl``).

The loop has a per-client trip count ``E * ceil(n_k / B)`` (a fixed budget; with a tolerance, at most that). Run alone (or one client after
another on a device) it takes exactly that many steps. Under ``jax.vmap`` JAX batches the loop
into one that runs to the cohort's longest client and holds every finished client's parameters
and optimizer state with a select, i.e. the masked no-op steps ``jnp.where(active, new, old)``
of docs/design.md step 4; partial last batches are masked inside the loss. Either way each client's
result equals its own plain loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedbayes.data.batches import ClientData, get_batch, num_local_steps, steps_per_epoch

PyTree = Any
LossFn = Callable[..., jax.Array]  # (params, key, x, y, mask) -> mean loss over the valid examples


class LocalTrainer(NamedTuple):
    """Static configuration of local training.

    Attributes:
      loss_fn: ``(params, key, x, y, mask) -> scalar``, the mean loss over valid examples; ``key``
        feeds stochastic losses (sampled weights of a Bayes-by-backprop model) and is ignored by
        deterministic models.
      optimizer: the client optax transformation (initialised afresh every round).
      num_epochs: local epochs ``E`` (with ``tol > 0``: the most a client runs).
      batch_size: minibatch size ``B``.
      tol: 0 runs exactly ``E`` epochs; ``> 0`` stops a client once an epoch's mean minibatch
        gradient is at most ``tol`` times the first epoch's in norm (the module docstring).
      max_steps: with ``tol > 0``, a client whose ``E`` epochs are fewer steps than this may run
        more epochs, up to this many steps (:func:`epoch_cap`); 0: ``E`` epochs at most.
    """

    loss_fn: LossFn
    optimizer: optax.GradientTransformation
    num_epochs: int
    batch_size: int
    tol: float = 0.0
    max_steps: int = 0


def epoch_cap(trainer: LocalTrainer, num_examples) -> jax.Array:
    """The most epochs a client that runs until converged (``trainer.tol > 0``) may take:
    ``max(E, ceil(max_steps / ceil(n_k / B)))``. A small client's epoch is one or two steps (its
    whole data in one batch), and ``E`` of them stop it far from its local optimum; it gets up to
    ``max_steps`` steps instead. Epochs past the ``E`` laid out reuse their shuffles in turn
    (:func:`minibatch_step_fn`); for a client whose epoch is one batch the order does not matter."""
    spe = jnp.maximum(steps_per_epoch(num_examples, trainer.batch_size), 1)
    return jnp.maximum(jnp.asarray(trainer.num_epochs, jnp.int32), ((trainer.max_steps + spe - 1) // spe).astype(jnp.int32))


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
    if trainer.tol > 0:
        return _run_until_converged(key, params, data, trainer, penalty)
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


def stiff_step_control(trainer: LocalTrainer, precision: PyTree, num_examples: jax.Array, cap: float = 1.0) -> LocalTrainer:
    """The local optimizer with its step capped where a known quadratic penalty is stiff.

    A local objective with the penalty ``theta^T diag(precision) theta / (2 n_k)`` (FedEP's tilted
    prior, PVI's KL to the cavity in the mean) has curvature ``h_i = precision_i / n_k`` in
    coordinate ``i``, exactly known before the first step. Gradient descent with step ``lr`` on it
    is stable only while ``lr h_i < 2`` (heavy ball ``< 2 (1 + beta)``); a cavity that grows round
    by round passes that in some coordinates and the client iterates blow up
    (docs/algorithms.md §7.5, §8.2).

    The fix scales the gradient per coordinate by ``P_i = 1 / max(1, lr_i h_i / cap)``: a diagonal
    preconditioner, so the fixed point (the local optimum) is unchanged; in stiff coordinates it is
    the proximal (implicit) step on the quadratic, the same scaling by ``precision / n_k`` that Guo
    et al. 2023 (FedEP)'s NGVI mean step uses (docs/algorithms.md §7.6 V); in every coordinate with
    ``lr_i h_i <= cap`` the step is bitwise SGD's (the multiplier is exactly 1). ``lr_i`` is the
    optimizer's first step on a unit gradient (plain and heavy-ball SGD: ``lr``; Nesterov: ``lr (1 +
    beta)``). Adaptive optimizers (Adam) are invariant to this scaling and gain nothing. A zero
    precision (a coordinate without the penalty) leaves the step alone; ``cap <= 0`` disables it.

    Args:
      trainer: the local training whose optimizer is wrapped.
      precision: the penalty's ``precision``, a pytree shaped like the optimized parameters.
      num_examples: ``n_k``, the client's examples (the objective is per example).
      cap: the largest ``lr_i h_i`` left unscaled.
    """
    if cap <= 0:
        return trainer
    opt = trainer.optimizer
    inv_n = 1.0 / jnp.maximum(num_examples, 1).astype(jnp.float32)
    zeros = jax.tree.map(jnp.zeros_like, precision)
    probe, _ = opt.update(jax.tree.map(jnp.ones_like, zeros), opt.init(zeros), zeros)
    scale = jax.tree.map(lambda u, lam: 1.0 / jnp.maximum(1.0, jnp.abs(u) * lam * inv_n / cap), probe, precision)

    def update(grads, state, params=None):
        del params
        return jax.tree.map(lambda g, p: g * p.astype(g.dtype), grads, scale), state

    precondition = optax.GradientTransformation(lambda params: optax.EmptyState(), update)
    return trainer._replace(optimizer=optax.chain(precondition, opt))


def broadcast_loss(key: jax.Array, params, data: ClientData, trainer: LocalTrainer) -> jax.Array:
    """The client's mean data loss at ``params`` (the broadcast, before any local step) over the
    minibatches of its first laid-out epoch: every example once, the per-example mean weighted by
    each batch's examples; 0 for a client without data. A forward pass per batch, no gradient.

    The site methods send it with their message: its mean over the cohort is the federated
    training loss of the global mean, which the adaptive damping watches
    (:mod:`fedbayes.algorithms.damping`)."""
    spe = steps_per_epoch(data.num_examples, trainer.batch_size)

    def body(step, carry):
        total, count = carry
        x, y, m = get_batch(data, step, trainer.batch_size)
        loss = trainer.loss_fn(params, jax.random.fold_in(key, step), x, y, m)
        k = jnp.sum(m)
        return total + k * loss.astype(jnp.float32), count + k

    total, count = jax.lax.fori_loop(0, spe, body, (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)))
    return jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0)


class EpochTracker(NamedTuple):
    """The stopping rule's state between epochs: the first epoch's mean-gradient norm, epochs
    completed, and whether the rule has fired. A client's loop sums its minibatch gradients over an
    epoch and hands the sum to :meth:`end_epoch` (one norm per epoch, none per step)."""

    first: jax.Array
    epochs: jax.Array
    done: jax.Array

    @classmethod
    def start(cls) -> EpochTracker:
        return cls(jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.bool_))

    def end_epoch(self, gradient_sum: PyTree, steps_per_epoch, tol: float) -> EpochTracker:
        """The state after an epoch whose minibatch gradients sum to ``gradient_sum``: the rule fires
        once the epoch's mean gradient is at most ``tol`` times the first epoch's in norm."""
        norm = optax.tree.norm(gradient_sum).astype(jnp.float32) / jnp.maximum(steps_per_epoch, 1).astype(jnp.float32)
        first_epoch = self.epochs == 0
        first = jnp.where(first_epoch, norm, self.first)
        fired = jnp.logical_not(first_epoch) & (norm <= tol * first)
        return EpochTracker(first, self.epochs + 1, self.done | fired)


def epochs_until_converged(
    params,
    opt_state,
    data: ClientData,
    trainer: LocalTrainer,
    step_fn: Callable,
    extra,
    extra_epoch: Callable,
    sum_iterates: bool = False,
    max_epochs: jax.Array | int | None = None,
):
    """The loop of a client that stops once its objective settles (``trainer.tol > 0``): a
    ``while_loop`` over epochs (the client's own trip count; under ``vmap`` finished clients hold
    their values), each a ``fori_loop`` of ``ceil(n_k / B)`` steps.

    ``step_fn(s, p, opt_state) -> (p, opt_state, grads, loss)`` takes step ``s``; ``extra`` is a
    per-epoch carry updated by ``extra_epoch(extra, e, p, epoch_carry)`` at each epoch's end
    (``epoch_carry`` the sum of the epoch's iterates with ``sum_iterates``, for averaging; else
    zeros). ``max_epochs``: the cap (default ``trainer.num_epochs``; :func:`epoch_cap`). Returns
    ``(p, opt_state, loss_sum, epochs, extra)``.
    """
    spe = steps_per_epoch(data.num_examples, trainer.batch_size)
    cap = trainer.num_epochs if max_epochs is None else max_epochs

    def epoch(carry):
        e, p, opt_state, loss_sum, track, extra = carry

        def step(i, c):
            p, opt_state, loss_sum, grad_sum, iterate_sum = c
            p, opt_state, grads, loss = step_fn(e * spe + i, p, opt_state)
            iterate_sum = optax.tree.add(iterate_sum, p) if sum_iterates else iterate_sum
            return p, opt_state, loss_sum + loss.astype(loss_sum.dtype), optax.tree.add(grad_sum, grads), iterate_sum

        zeros = optax.tree.zeros_like(p)
        p, opt_state, loss_sum, grad_sum, iterate_sum = jax.lax.fori_loop(0, spe, step, (p, opt_state, loss_sum, zeros, zeros))
        return e + 1, p, opt_state, loss_sum, track.end_epoch(grad_sum, spe, trainer.tol), extra_epoch(extra, e, p, iterate_sum)

    def cond(carry):
        e, _, _, _, track, _ = carry
        return (e < cap) & jnp.logical_not(track.done) & (spe > 0)

    init = (jnp.zeros((), jnp.int32), params, opt_state, jnp.zeros((), jnp.float32), EpochTracker.start(), extra)
    e, p, opt_state, loss_sum, _, extra = jax.lax.while_loop(cond, epoch, init)
    return p, opt_state, loss_sum, e, extra


def minibatch_step_fn(key, data: ClientData, trainer: LocalTrainer, penalty: Callable | None = None) -> Callable:
    """``step_fn(s, p, opt_state) -> (p, opt_state, grads, loss)``: local step ``s`` of the
    optimizer with key ``fold_in(key, s)`` on minibatch ``s`` of the ``E`` epochs laid out (step
    ``s`` modulo their steps: the epochs past them that :func:`epoch_cap` allows reuse their
    shuffles), as :func:`epochs_until_converged` takes it (the loops of :func:`run_sgd` and
    :func:`fedbayes.inference.epoch_samples`)."""
    grad_fn = jax.grad(objective_fn(trainer, penalty), has_aux=True)
    laid_out = jnp.maximum(trainer.num_epochs * steps_per_epoch(data.num_examples, trainer.batch_size), 1)

    def step_fn(s, p, opt_state):
        x, y, m = get_batch(data, s % laid_out, trainer.batch_size)
        grads, loss = grad_fn(p, jax.random.fold_in(key, s), x, y, m)
        updates, opt_state = trainer.optimizer.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, grads, loss

    return step_fn


def _run_until_converged(key, params, data: ClientData, trainer: LocalTrainer, penalty):
    """:func:`run_sgd` with the stopping rule (``trainer.tol > 0``)."""
    step_fn = minibatch_step_fn(key, data, trainer, penalty)
    p, _, loss_sum, epochs, _ = epochs_until_converged(
        params, trainer.optimizer.init(params), data, trainer, step_fn, (), lambda extra, *_: extra, max_epochs=epoch_cap(trainer, data.num_examples)
    )
    return p, training_info(loss_sum, epochs * steps_per_epoch(data.num_examples, trainer.batch_size))


def training_info(loss_sum: jax.Array, steps: jax.Array) -> dict[str, jax.Array]:
    """``{"loss": loss_sum / steps, "steps": steps}`` (loss 0 when no step was taken)."""
    steps = jnp.asarray(steps, jnp.int32)
    mean = loss_sum / jnp.maximum(steps, 1).astype(jnp.float32)
    return {"loss": mean.astype(jnp.float32), "steps": steps}


def per_example(total: jax.Array, num_examples) -> jax.Array:
    """``total / n_k`` (``n_k`` at least 1): a sum-loss-scale term on the trainer's mean-loss scale."""
    n = jnp.maximum(jnp.asarray(num_examples), 1)
    return total / n.astype(total.dtype)
