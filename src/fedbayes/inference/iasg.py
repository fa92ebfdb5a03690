"""Iterate-averaged SGD as a posterior sampler (IASG; Mandt et al. 2017; Al-Shedivat et al. 2021 (FedPA) Algorithm 4).

Constant-learning-rate SGD is a Markov chain whose stationary distribution approximates the
posterior around a mode; averaging ``K_s`` consecutive iterates gives one approximately
independent sample (Al-Shedivat et al. 2021 (FedPA) Sec. 4, Alg. 4; docs/algorithms.md §6.3):

1. ``burn_in_steps`` optimiser steps;
2. ``num_samples`` times: ``steps_per_sample`` steps, whose **average** iterate is sample ``x_s``
   (or, with ``average=False``, the last iterate: FedEP's end-of-epoch samples, Guo et al. 2023 (FedEP) fn. 4);
   then ``discard_steps`` steps that yield nothing.

The optimiser state (e.g. the momentum buffer) carries through the whole chain, as in TFF's
``fed_pa_schedule``. Step counts may be traced (per-client values under ``vmap``); the number of
samples is static (it fixes the output shape).

:func:`epoch_samples` is the practical variant of Al-Shedivat et al. 2021 (FedPA) (App. A fn. 11; TFF): one sample per
local epoch, the average of that epoch's iterates, skipping the first ``skip_epochs`` epochs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fedbayes.data.batches import ClientData, get_batch, steps_per_epoch
from fedbayes.inference.sgd import LocalTrainer, epoch_cap, epochs_until_converged, minibatch_step_fn, objective_fn, training_info

PyTree = Any


def iasg(
    params: PyTree,
    batch_fn: Callable[[jax.Array], Any],
    grad_fn: Callable[..., PyTree],
    optimizer: optax.GradientTransformation,
    *,
    burn_in_steps,
    steps_per_sample,
    num_samples: int,
    discard_steps=0,
    average: bool = True,
    has_aux: bool = False,
):
    """Runs the IASG chain from ``params``.

    Args:
      params: the starting point (the broadcast model).
      batch_fn: ``step -> batch`` (a tuple passed to ``grad_fn`` after the parameters); ``step``
        counts every optimiser step of the chain from 0.
      grad_fn: ``(params, *batch) -> gradient`` of the objective.
      optimizer: the client optax transformation (its state is initialised here).
      burn_in_steps, steps_per_sample, discard_steps: step counts (ints or int scalars).
      num_samples: ``l``, static.
      average: record the mean of each stretch's iterates (IASG) or its last iterate.
      has_aux: ``grad_fn`` returns ``(gradient, value)`` with a scalar ``value`` (the minibatch
        loss), summed over every step of the chain.

    Returns:
      ``(samples, last)``: a pytree whose leaves have a leading axis ``l`` and the chain's last
      iterate; with ``has_aux``, ``(samples, last, value_sum)``.
    """

    def update(s, carry):
        p, opt_state, total = carry
        out = grad_fn(p, *batch_fn(s))
        grads, value = out if has_aux else (out, 0.0)
        updates, opt_state = optimizer.update(grads, opt_state, p)
        return updates, (optax.apply_updates(p, updates), opt_state, total + jnp.asarray(value, total.dtype))

    def step(s, carry):
        return update(s, carry)[1]

    burn_in_steps = jnp.asarray(burn_in_steps, jnp.int32)
    steps_per_sample = jnp.asarray(steps_per_sample, jnp.int32)
    discard_steps = jnp.asarray(discard_steps, jnp.int32)
    carry = jax.lax.fori_loop(0, burn_in_steps, step, (params, optimizer.init(params), jnp.zeros((), jnp.float32)))
    stride = steps_per_sample + discard_steps
    samples = jax.tree.map(lambda p: jnp.zeros((num_samples, *jnp.shape(p)), jnp.result_type(p)), params)

    def one_sample(j, state):
        carry, samples = state
        start = burn_in_steps + j * stride
        if average:
            # The mean of the stretch's iterates p_1..p_T from p_0, with p_i = p_{i-1} + u_i, is
            # p_0 + (1/T) sum_i (T - i + 1) u_i. Summing weighted updates rather than iterates
            # fuses into the update's kernel (no second pass over the parameters: 30% -> 7% over
            # a plain SGD step, docs/results/bench.md) and adds small numbers, not T copies of p.
            def avg_step(i, c):
                carry, total = c
                updates, carry = update(start + i, carry)
                w = steps_per_sample - i
                return carry, jax.tree.map(lambda t, u: t + w.astype(t.dtype) * u.astype(t.dtype), total, updates)

            p0 = carry[0]
            total0 = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.promote_types(jnp.result_type(p), jnp.float32)), p0)
            carry, total = jax.lax.fori_loop(0, steps_per_sample, avg_step, (carry, total0))
            count = jnp.maximum(steps_per_sample, 1)
            sample = jax.tree.map(lambda p, t: (p + t / count.astype(t.dtype)).astype(jnp.result_type(p)), p0, total)
        else:
            carry = jax.lax.fori_loop(start, start + steps_per_sample, step, carry)
            sample = carry[0]
        samples = jax.tree.map(lambda buf, x: buf.at[j].set(x), samples, sample)
        carry = jax.lax.fori_loop(start + steps_per_sample, start + stride, step, carry)
        return carry, samples

    carry, samples = jax.lax.fori_loop(0, num_samples, one_sample, (carry, samples))
    return (samples, carry[0], carry[2]) if has_aux else (samples, carry[0])


def epoch_samples(
    key: jax.Array,
    params: PyTree,
    data: ClientData,
    trainer: LocalTrainer,
    *,
    skip_epochs: int = 1,
    average: bool = True,
    penalty: Callable[[PyTree], jax.Array] | None = None,
) -> tuple[PyTree, PyTree, dict[str, jax.Array]]:
    """One sample per local epoch after the first ``skip_epochs`` (Al-Shedivat et al. 2021 (FedPA)'s benchmarks; docs/algorithms.md §6.3).

    Runs exactly ``trainer.num_epochs`` epochs of ``trainer.optimizer`` on the client's mean loss
    (plus ``penalty``), the same trajectory as :func:`fedbayes.inference.run_sgd` (step ``s``
    passes ``fold_in(key, s)`` to the loss), and returns ``l = num_epochs - skip_epochs``
    samples: each epoch's mean iterate (``average=True``, FedPA) or its last iterate
    (``average=False``, FedEP's SG-MCMC step), the last iterate and the client's info
    (:func:`fedbayes.inference.sgd.training_info`).

    With ``trainer.tol > 0`` (``skip_epochs = 0`` only) the client stops as
    :func:`fedbayes.inference.run_sgd` does, once an epoch's mean minibatch gradient has fallen to
    ``tol`` times the first epoch's; the
    samples of the epochs not run are zeros, and ``info["steps"] / ceil(n_k / B)`` tells how many
    epochs ran. A small client may then run past ``num_epochs`` epochs
    (:func:`fedbayes.inference.sgd.epoch_cap`, up to ``trainer.max_steps`` steps): the samples
    are a ring, epoch ``e``'s in row ``e mod num_epochs``, so they hold the last ``num_epochs``
    epochs run (:func:`epoch_of_sample` tells which).
    """
    num_samples = trainer.num_epochs - skip_epochs
    if num_samples < 0:
        raise ValueError(f"skip_epochs ({skip_epochs}) must be <= the number of local epochs ({trainer.num_epochs})")
    spe = steps_per_epoch(data.num_examples, trainer.batch_size)
    if trainer.tol > 0:
        if skip_epochs:
            raise ValueError("a local budget with a tolerance (client.stop = 'converged') takes every epoch's sample: skip_epochs must be 0")
        return _epochs_until_converged(key, params, data, trainer, average, penalty, spe)
    grad_fn = jax.grad(objective_fn(trainer, penalty), has_aux=True)
    samples, last, loss_sum = iasg(
        params,
        lambda s: (jax.random.fold_in(key, s), *get_batch(data, s, trainer.batch_size)),
        grad_fn,
        trainer.optimizer,
        burn_in_steps=skip_epochs * spe,
        steps_per_sample=spe,
        num_samples=num_samples,
        average=average,
        has_aux=True,
    )
    return samples, last, training_info(loss_sum, trainer.num_epochs * spe)


def epoch_of_sample(num_rows: int, done: jax.Array) -> jax.Array:
    """The epoch whose sample row ``j`` of :func:`epoch_samples` holds after ``done`` epochs of a
    converging client (the ring of the last ``num_rows``): ``done - 1 - ((done - 1 - j) mod
    num_rows)``; negative for a row no epoch has filled."""
    j = jnp.arange(num_rows)
    return done - 1 - jnp.mod(done - 1 - j, num_rows)


def _epochs_until_converged(key, params, data: ClientData, trainer: LocalTrainer, average: bool, penalty, spe):
    """:func:`epoch_samples` with the stopping rule of :func:`fedbayes.inference.run_sgd`
    (:func:`fedbayes.inference.sgd.epochs_until_converged`): one sample per epoch run."""
    step_fn = minibatch_step_fn(key, data, trainer, penalty)

    def record(samples, e, p, iterate_sum):
        sample = jax.tree.map(lambda t: t / jnp.maximum(spe, 1).astype(t.dtype), iterate_sum) if average else p
        return jax.tree.map(lambda buf, x: buf.at[e % trainer.num_epochs].set(x), samples, sample)

    samples = jax.tree.map(lambda p: jnp.zeros((trainer.num_epochs, *jnp.shape(p)), jnp.result_type(p)), params)
    last, _, loss_sum, epochs, samples = epochs_until_converged(
        params, trainer.optimizer.init(params), data, trainer, step_fn, samples, record, sum_iterates=average,
        max_epochs=epoch_cap(trainer, data.num_examples),
    )  # fmt: skip
    return samples, last, training_info(loss_sum, epochs * spe)
