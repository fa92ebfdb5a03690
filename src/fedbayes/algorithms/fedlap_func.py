"""FedLap-Func: FedLap with function-space information over a few memory points per client
(Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes", ICLR 2025, Sec. 3.4,
App. C, App. E; the final algorithm is the paper's Eq. 17).

The paper's equations for this method did not survive in our copy and there is no public code, so
this module is a reconstruction from the paper's prose. docs/results/fedlap_func_choices.md
explains each choice; in short, one round with ``w_g`` the broadcast global weights:

* **Client** ``k`` (``l_k`` the sum loss, ``M_k`` its memory set, ``tau_x`` per-point weights):

      w_k <- argmin_w  l_k(w) + delta v_k^T w + (delta/2)||w - w_g||^2
                       + tau sum_{x in M_k} tau_x [ l(f_w(x), y_g(x)) - l(f_w(x), y_old(x)) ]
      v_k <- v_k + rho (w_k - w_g)                          (FedLap's dual update)
      y_k(x) <- softmax f_{w_k}(x),  x in M_k

  with ``l(f, y) = -sum_c y_c log softmax(f)_c`` the cross-entropy against a soft label,
  ``y_g = softmax f_{w_g}`` the global model's prediction and ``y_old`` the client's soft labels
  from its previous round. The client sends FedLap's site change, its memory points, their
  ``tau_x`` and its new soft labels.
* **Server**: FedLap's ``s = sum_k v_k``, then Eq. 17's optimisation over the memory points of
  the round's accepted clients, by ``server_steps`` steps of optax Adam (rate ``server_lr``,
  decaying to 0 by a cosine) started at ``s``, inside the round's compiled program:

      w_g <- argmin_w (delta/2)||w - s||^2 + tau sum_k sum_{x in M_k} tau_x l(f_w(x), y_k(x)).

Choices where the paper leaves room (each one discussed in docs/results/fedlap_func_choices.md):

1. **Scale.** Everything is on the sum-loss scale, as FedLap's ``delta``; ``tau_x = N_{k,c} / M_{k,c}``
   (App. E: a point of class ``c`` stands for the client's ``N_{k,c}`` examples of that class, of
   which ``M_{k,c}`` are in memory), so ``sum_x tau_x = n_k`` and ``tau = 1`` weighs the memory like
   the whole data set. The client divides its whole objective by ``n_k`` (FedLap's choice).
2. **Memory sets** hold ``memory_per_class`` examples of each class of the client's own data (fewer
   where it has fewer; an absent class leaves empty slots of weight 0), drawn once, in the first
   round the client takes part: the first ones of each class in the first epoch's shuffle, which
   comes from :func:`fedbayes.protocol.shuffle_rng` ``(seed, round, client)``. The client keeps them
   in its state; a run with the same seed draws the same memory sets.
3. **The server's memory is the round's.** The round protocol gives the server the aggregate of
   the cohort's messages, not a per-client table (the server cannot tell which client sent a
   message), so the server term sums over the clients accepted this round. With every client in
   every round (all of the paper's experiments) this is Eq. 17 exactly. Consistently, the global
   then holds client ``k``'s function-space part only if ``k`` was accepted in the previous round,
   and the client subtracts ``l(f_w(x), y_old(x))`` (the site's function-space part, removed from
   the cavity) only then: in a client's first round, and after rounds it sat out, it does not.
4. **What travels.** Up: the site change (``P`` floats) and the memory (``S`` points, their
   ``tau_x`` and ``S x C`` soft labels, ``S = C m``), every round, since messages have a fixed
   shape; the byte counters count all of it. Down: FedLap's broadcast and the round index. The
   server sends no soft labels: ``y_g = softmax f_{w_g}(x)`` is computed by the client from the
   ``w_g`` it receives, the same numbers the server would send.
5. **The server's Adam starts at** ``s = sum_k v_k`` (the minimiser of the weight-space part), not
   at the previous ``w_g``. Then ``tau = 0`` gives FedLap bit for bit (the gradient at the start is
   exactly zero), and few steps suffice when the function-space term is a small correction.
6. **Initialisation** is FedLap's (``v_k = 0``, ``w_g = 0``, local training starts from the model's
   initial parameters in round 1). ``y_g`` in round 1 is the prediction of ``w_g = 0``.
7. **The server's Adam rate decays** from ``server_lr`` to 0 by a cosine: at a fixed rate Adam
   hovers about the minimiser, about one rate away, in directions that rounding decides.
8. Soft labels are computed in float32 and carry no gradient; the two cross-entropies share one
   ``log softmax``, weighted by ``y_g - y_old``.

The stationary points are FedLap's: at ``w_k = w_g`` every soft label is the model's own
prediction and every function-space gradient vanishes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from fedbayes import aggregators
from fedbayes.aggregators import Aggregate
from fedbayes.algorithms import laplace_sites as lap
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, finite_message
from fedbayes.algorithms.fedlap_memory import Memory, empty_memory, function_space_loss, memory_inputs, optimise_global, select_memory, soft_labels
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer, run_sgd

PyTree = Any

__all__ = ["Broadcast", "ClientState", "FedLapFuncConfig", "FedLapFuncInfo", "Message", "ServerState", "fedlap_func"]


class ServerState(NamedTuple):
    """FedLap-Func server state.

    Attributes:
      lap: FedLap's server state; its ``params`` is ``s = sum_k v_k``.
      params: the global ``w_g`` after the optimisation over memory points (what is broadcast,
        evaluated and exported).
    """

    lap: Any  # laplace_sites.ServerState
    params: optax.Params


class Broadcast(NamedTuple):
    """FedLap's broadcast (anchor ``w_g`` and where training starts) and the round index."""

    lap: Any  # laplace_sites.Broadcast
    round: jax.Array


class ClientState(NamedTuple):
    """FedLap's site ``v_k``, the client's memory with its latest soft labels, and the last round
    in which its message was accepted (-1: never; its memory is then still to be drawn)."""

    site: optax.Params
    memory: Memory
    last_round: jax.Array


class Message(NamedTuple):
    """FedLap's site change and the memory (points, ``tau_x``, new soft labels)."""

    site_change: optax.Params
    memory: Memory


class FedLapFuncInfo(NamedTuple):
    """The server step's info.

    Attributes:
      server_prox: the prox term ``delta/2 ||w_g - s||^2`` at the optimised global.
      server_fn_loss: the function-space loss over the cohort's memory points there.
      memory_points: the cohort's memory points with positive weight.
    """

    server_prox: jax.Array
    server_fn_loss: jax.Array
    memory_points: jax.Array


def fedlap_func(
    trainer: LocalTrainer,
    apply_fn: Callable,
    feature_spec: jax.ShapeDtypeStruct,
    *,
    delta: float,
    damping: float,
    tau: float,
    memory_per_class: int = 1,
    server_steps: int = 500,
    server_lr: float = 1e-3,
    solver=run_sgd,
) -> Algorithm:
    """FedLap-Func (module docstring) for a classifier ``apply_fn(params, x) -> logits``.

    Args:
      trainer: local training (mean loss, optimizer, epochs, batch size).
      apply_fn: the model's forward pass, ``[B, *feature_shape] -> [B, C]`` logits.
      feature_spec: shape and dtype of one example's features (the memory points' slots).
      delta: prior precision (sum-loss scale), as FedLap's.
      damping: site damping ``rho``, as FedLap's.
      tau: weight of the function-space terms (``0``: FedLap).
      memory_per_class: memory points per class and client.
      server_steps: Adam steps of the server problem (``0``: FedLap's server).
      server_lr: the peak of Adam's learning rate there (it decays to 0 by a cosine).
      solver: the local solver (as :func:`fedbayes.algorithms.fedlap.fedlap`).
    """
    lap.check_settings("fedlap_func", delta, damping)
    if not tau >= 0:
        raise ValueError(f"fedlap_func: tau must be >= 0; got {tau}")
    if memory_per_class < 1:
        raise ValueError(f"fedlap_func: memory_per_class must be >= 1; got {memory_per_class}")
    if server_steps < 0:
        raise ValueError(f"fedlap_func: server_steps must be >= 0; got {server_steps}")
    if not server_lr > 0:
        raise ValueError(f"fedlap_func: server_lr must be > 0; got {server_lr}")
    feature_spec = jax.ShapeDtypeStruct(tuple(feature_spec.shape), feature_spec.dtype)

    def num_classes(params) -> int:
        out = jax.eval_shape(apply_fn, params, jax.ShapeDtypeStruct((1, *feature_spec.shape), feature_spec.dtype))
        return int(out.shape[-1])

    def server_init(key, params):
        del key
        state = lap.server_init(params)
        return ServerState(state, state.params)

    def broadcast(state: ServerState) -> Broadcast:
        return Broadcast(lap.broadcast(state.lap._replace(params=state.params)), state.lap.round)

    def client_init(params):
        memory = empty_memory(feature_spec, num_classes(params), memory_per_class)
        return ClientState(optax.tree.zeros_like(params), memory, jnp.asarray(-1, jnp.int32))

    def client_update(key, message: Broadcast, state: ClientState, data):
        c = state.memory.soft_labels.shape[-1]
        fresh = state.last_round < 0

        def draw(_):
            positions, weights = select_memory(data, c, memory_per_class)
            return memory_inputs(data, positions, weights), weights

        inputs, weights = jax.lax.cond(fresh, draw, lambda _: (state.memory.inputs, state.memory.weights), None)
        global_labels = soft_labels(apply_fn, message.lap.anchor, inputs)
        # The site's function-space part is in the global only if the server saw it last round.
        in_global = jnp.logical_and(jnp.logical_not(fresh), state.last_round == message.round - 1)
        targets = global_labels - jnp.where(in_global, state.memory.soft_labels, 0.0)

        def extra(w):
            return tau * function_space_loss(apply_fn, w, inputs, weights, targets)

        w_k, site, change, info = lap.client_step(key, message.lap, state.site, data, trainer, delta=delta, damping=damping, extra=extra, solver=solver)
        memory = Memory(inputs, weights, soft_labels(apply_fn, w_k, inputs))
        return Message(change, memory), ClientState(site, memory, message.round.astype(jnp.int32)), info

    def aggregate(key, messages: Message, weights) -> Aggregate:
        sites = aggregators.weighted(key, messages.site_change, weights)  # FedLap's own reduction

        def masked(a):
            keep = (weights > 0).reshape((-1,) + (1,) * (a.ndim - 1))
            return jnp.where(keep, a, jnp.zeros((), a.dtype))

        memory = jax.tree.map(masked, messages.memory)  # the cohort's, stacked; rejected clients zero
        return Aggregate(mean=Message(sites.mean, memory), total=Message(sites.total, memory), count=sites.count)

    def server_update(key, state: ServerState, agg: Aggregate):
        del key
        memory = agg.total.memory
        if jnp.ndim(memory.weights) != 2:
            raise ValueError(
                "fedlap_func: its server needs the cohort's memory points stacked by client, as its own "
                "aggregator gives them; it cannot run with another aggregation rule"
            )
        new_lap = lap.server_step(state.lap, agg.total.site_change)
        flat = Memory(
            inputs=memory.inputs.reshape((-1, *memory.inputs.shape[2:])),
            weights=memory.weights.reshape(-1),
            soft_labels=memory.soft_labels.reshape((-1, memory.soft_labels.shape[-1])),
        )
        w_g, info = optimise_global(apply_fn, new_lap.params, flat, delta=delta, tau=tau, steps=server_steps, lr=server_lr)
        return ServerState(new_lap, w_g), FedLapFuncInfo(**info, memory_points=jnp.sum((flat.weights > 0).astype(jnp.int32)))

    return Algorithm(
        name="fedlap_func",
        server_init=server_init,
        broadcast=broadcast,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=finite_message,
        trainer=trainer,
        aggregator=aggregators.Rule(aggregate),
        # server_steps Adam steps: on one device, no reduction per step; with tau = 0 (or no steps)
        # the server problem is FedLap's and stays in the round's program, FedLap's bit for bit
        server_on_one_device=tau > 0 and server_steps > 0,
    )


class FedLapFuncConfig(HParams):
    """FedLap-Func (docs/results/fedlap_func_choices.md; Swaroop et al. 2025, Eq. 17)."""

    name: Literal["fedlap_func"]
    delta: float = Field(1.0, gt=0, description="prior precision delta, on the sum-loss scale (as fedlap)")
    rho: float | None = Field(None, gt=0, le=1, description="site damping rho; default 1 / num_clients (as fedlap)")
    tau: float = Field(1e-3, ge=0, description="weight of the function-space terms, sum-loss scale (0: fedlap)")
    memory_per_class: int = Field(1, ge=1, description="memory points per class and client, drawn once")
    server_steps: int = Field(500, ge=0, description="Adam steps of the server's optimisation over the memory points")
    server_lr: float = Field(1e-3, gt=0, description="peak Adam learning rate of the server's optimisation (cosine decay to 0)")


def build(hp: FedLapFuncConfig, ctx: BuildContext) -> Algorithm:
    if ctx.task != "classification":
        raise ValueError(f"fedlap_func: needs a classification task (soft labels); got task {ctx.task!r}")
    if ctx.apply_fn is None or ctx.feature_spec is None:
        raise ValueError("fedlap_func: needs the model's forward pass and feature shape (BuildContext.apply_fn, BuildContext.feature_spec)")
    rho = hp.rho if hp.rho is not None else 1.0 / ctx.federation.num_clients
    return fedlap_func(
        ctx.trainer, ctx.apply_fn, ctx.feature_spec, delta=hp.delta, damping=rho, tau=hp.tau,
        memory_per_class=hp.memory_per_class, server_steps=hp.server_steps, server_lr=hp.server_lr,
    )  # fmt: skip


SPEC = AlgorithmSpec(
    "fedlap_func", FedLapFuncConfig, build, "FedLap plus soft labels on memory points, fitted at the server",
    exact_server="solves its own problem (the sum of the sites, then Adam over the memory points; algorithm.server_lr sets that rate)",
    bayesian=True, aggregator_policy="refuses",
    aggregator_note="aggregates its sites and stacks the cohort's memory points with its own rule, which its server needs and a robust rule or DP cannot wrap",
    needs_apply_fn=True, needs_feature_spec=True,
)  # fmt: skip
SPECS = (SPEC,)
