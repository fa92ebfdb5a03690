"""Function-space memory for FedLap-Func: memory sets, soft labels and the terms built on them (public, tested on their own).

The pieces of FedLap-Func (Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes",
ICLR 2025, Sec. 3.4, App. C and App. E; :mod:`fedbayes.algorithms.fedlap_func`) that do not depend
on FedLap itself, each a pure function:

* :func:`select_memory`: a client's memory set, ``memory_per_class`` of its own examples per class,
  drawn from the first epoch's shuffle laid out in its order buffer (so from the NumPy stream
  :func:`fedbayes.protocol.shuffle_rng` of that round and client), with the per-point weights
  ``tau_x = N_{k,c} / M_{k,c}`` of the paper's App. E;
* :func:`soft_labels`: ``softmax f_w(x)`` on the memory inputs;
* :func:`function_space_loss`: ``-sum_x tau_x sum_c t_c(x) log softmax f_w(x)_c``, the weighted
  cross-entropy against soft targets ``t`` (the client term uses ``t = y_g - y_old``, the server
  term ``t = y_k``);
* :func:`optimise_global`: the server problem of Eq. 17,
  ``argmin_w (delta/2)||w - anchor||^2 + tau * function_space_loss(w)``, by optax Adam (cosine-decayed
  rate) inside one ``lax.fori_loop`` (it runs inside the round's compiled program).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fedbayes.data.batches import ClientData

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]

__all__ = ["Memory", "empty_memory", "function_space_loss", "memory_inputs", "optimise_global", "select_memory", "soft_labels"]


class Memory(NamedTuple):
    """A client's memory set and its soft labels (``S = num_classes * memory_per_class`` slots).

    Attributes:
      inputs: ``[S, *feature_shape]`` the memory points (zeros in empty slots).
      weights: ``[S]`` float32 ``tau_x = N_{k,c} / M_{k,c}`` for a point of class ``c``; 0 marks an
        empty slot (the client has fewer than ``memory_per_class`` examples of that class).
      soft_labels: ``[S, C]`` float32 ``softmax f_{w_k}(x)`` of the client's latest weights.
    """

    inputs: jax.Array
    weights: jax.Array
    soft_labels: jax.Array


def empty_memory(feature_spec: jax.ShapeDtypeStruct, num_classes: int, memory_per_class: int) -> Memory:
    """A memory with every slot empty (a client that has not yet taken part)."""
    slots = num_classes * memory_per_class
    return Memory(
        inputs=jnp.zeros((slots, *feature_spec.shape), feature_spec.dtype),
        weights=jnp.zeros((slots,), jnp.float32),
        soft_labels=jnp.zeros((slots, num_classes), jnp.float32),
    )


def select_memory(data: ClientData, num_classes: int, memory_per_class: int) -> tuple[jax.Array, jax.Array]:
    """A client's memory set from the first epoch of its order buffer.

    The first epoch ``data.order[offset : offset + n_k]`` is a uniform random permutation of the
    client's examples (:mod:`fedbayes.data.batches`), so the first ``m = memory_per_class``
    examples of class ``c`` in it are ``m`` examples of that class drawn uniformly without
    replacement. Slot ``c * m + j`` holds the ``j``-th; a class with fewer than ``m`` examples
    leaves slots empty.

    Args:
      data: the client's data.
      num_classes: ``C``; labels are ``0 .. C-1``.
      memory_per_class: ``m >= 1``.

    Returns:
      ``(positions, weights)``: ``[C m]`` int32 positions into ``data.x`` (0 in empty slots) and
      float32 ``tau_x = N_{k,c} / min(m, N_{k,c})`` (0 in empty slots).
    """
    m, slots = memory_per_class, num_classes * memory_per_class
    idx = jnp.arange(data.order.shape[0])
    first_epoch = jnp.logical_and(idx >= data.offset, idx < data.offset + data.num_examples)
    labels = jnp.where(first_epoch, data.y[data.order].astype(jnp.int32), -1)
    onehot = (labels[:, None] == jnp.arange(num_classes, dtype=jnp.int32)[None, :]).astype(jnp.int32)
    counts = jnp.sum(onehot, axis=0)  # N_{k,c}
    rank = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)  # occurrence number of each entry's class
    take = jnp.logical_and(first_epoch, rank < m)
    slot = jnp.where(take, labels * m + rank, slots)  # slots is out of range: dropped
    positions = jnp.zeros((slots,), jnp.int32).at[slot].set(data.order.astype(jnp.int32), mode="drop")
    filled = jnp.zeros((slots,), jnp.bool_).at[slot].set(True, mode="drop")
    kept = jnp.minimum(counts, m)  # M_{k,c}
    per_class = counts.astype(jnp.float32) / jnp.maximum(kept, 1).astype(jnp.float32)
    weights = jnp.where(filled, jnp.repeat(per_class, m), 0.0)
    return positions, weights


def memory_inputs(data: ClientData, positions: jax.Array, weights: jax.Array) -> jax.Array:
    """The memory points ``data.x[positions]``, zeros in empty slots."""
    x = data.x[positions]
    filled = (weights > 0).reshape((-1,) + (1,) * (x.ndim - 1))
    return jnp.where(filled, x, jnp.zeros((), x.dtype))


def soft_labels(apply_fn: ApplyFn, params: PyTree, inputs: jax.Array) -> jax.Array:
    """``softmax f_w(x)`` ``[S, C]`` float32 on the memory points (no gradient flows through)."""
    return jax.lax.stop_gradient(jax.nn.softmax(apply_fn(params, inputs).astype(jnp.float32), axis=-1))


def function_space_loss(apply_fn: ApplyFn, params: PyTree, inputs: jax.Array, weights: jax.Array, targets: jax.Array) -> jax.Array:
    """``-sum_x tau_x sum_c t_c(x) log softmax f_w(x)_c`` over memory points ``[S, ...]``.

    With ``t`` a soft label this is the weighted cross-entropy ``sum_x tau_x l(f_w(x), t(x))``;
    with ``t = y_g - y_old`` it is the difference of two cross-entropies of Eq. 17. Empty slots
    have ``tau_x = 0`` and contribute exactly nothing.
    """
    log_p = jax.nn.log_softmax(apply_fn(params, inputs).astype(jnp.float32), axis=-1)
    return -jnp.sum(weights[:, None] * targets * log_p)


def optimise_global(
    apply_fn: ApplyFn,
    anchor: PyTree,
    memory: Memory,
    *,
    delta: float,
    tau: float,
    steps: int,
    lr: float,
) -> tuple[PyTree, dict[str, jax.Array]]:
    """The server problem of Eq. 17 by ``steps`` of optax Adam, its learning rate decaying from
    ``lr`` to 0 by a cosine:

        w_g = argmin_w (delta/2) ||w - anchor||^2 + tau sum_x tau_x l(f_w(x), y(x)),

    with ``anchor = sum_k v_k`` (FedLap's global) and the memory points, weights and soft labels
    ``memory`` flattened over clients (``[P, ...]``; rejected clients and empty slots have weight
    0). Adam starts at ``anchor``: with ``tau = 0`` the gradient there is exactly zero and so is
    every Adam step, and the result is ``anchor`` bit for bit.

    Returns:
      ``(w_g, info)`` with ``server_fn_loss`` and ``server_prox`` the two terms at ``w_g``.
    """
    # The rate decays to 0 (cosine): at a fixed rate Adam hovers about the minimiser at a distance
    # of about the rate, in directions that rounding decides (a 1e-7 difference between two
    # layouts' client messages became up to 8e-5 in w_g after 500 steps at 1e-3; decayed, 1e-7).
    optimizer = optax.adam(optax.cosine_decay_schedule(lr, max(steps, 1)))

    def terms(w):
        diff = optax.tree.sub(w, anchor)
        return 0.5 * delta * optax.tree.vdot(diff, diff), function_space_loss(apply_fn, w, memory.inputs, memory.weights, memory.soft_labels)

    def objective(w):
        prox, fn = terms(w)
        return prox + tau * fn

    grad_fn = jax.grad(objective)

    def body(_, carry):
        w, opt_state = carry
        updates, opt_state = optimizer.update(grad_fn(w), opt_state, w)
        return optax.apply_updates(w, updates), opt_state

    w, _ = jax.lax.fori_loop(0, steps, body, (anchor, optimizer.init(anchor)))
    prox, fn = terms(w)
    return w, {"server_prox": prox.astype(jnp.float32), "server_fn_loss": fn.astype(jnp.float32)}
