"""Diagonal curvature of a client's sum loss: exact GGN, sampled-label Fisher, empirical Fisher.

The one place for the diagonal curvature that FedEP's Laplace and NGVI methods, FedLap-Cov and
Laplace predictions need (docs/design.md "Curvature"). For the sum loss ``sum_n m_n l(f(x_n; theta), y_n)``
over a client's data (``m_n`` the 0/1 mask of real examples) it computes

* :func:`diag_ggn`: the generalised Gauss-Newton diagonal ``sum_n m_n diag(J_n^T H_n J_n)``,
  ``J_n`` the Jacobian of the outputs in the parameters and ``H_n`` the Hessian of the loss in the
  outputs (softmax cross-entropy ``diag(p) - p p^T``; squared error ``1``);
* :func:`diag_fisher`: the Fisher with labels **sampled from the model** (Kunstner, Balles &
  Hennig 2019), ``sum_n m_n mean_s (grad_theta l(f_n, y~_ns))^2`` with ``y~_ns ~ p(. | x_n)``;
  unbiased for the GGN (for these likelihoods the Fisher equals the GGN);
* :func:`diag_empirical_fisher`: ``sum_n m_n (grad_theta l(f_n, y_n))^2`` with the true labels.

Each returns a pytree shaped like ``params``.

How (no per-example, per-parameter gradient where a layer has structure)
-------------------------------------------------------------------------
All three are sums over examples of squared per-example gradients ``(J_n^T u_n)^2`` for some
output-space vectors ``u_n``: the loss gradient at the true label (empirical Fisher), at a sampled
label (Fisher), or the columns of a square root of the output Hessian (GGN). For softmax
cross-entropy ``H = A A^T`` with ``A = diag(sqrt p) - p sqrt(p)^T``, whose column ``c`` is
``sqrt(p_c) (e_c - p)``, i.e. ``sqrt(p_c)`` times the loss gradient at label ``c``: the exact GGN is
``C`` output-space vectors per example (and the Fisher its one-sample Monte Carlo estimate).

One forward pass records, for every ``flax.linen.Dense`` and ``flax.linen.Conv`` layer, its input
``a`` and adds a zero perturbation to its output (pre-activation) ``z``. One ordinary backward
pass of ``sum_n u_n . f_n`` with respect to the perturbations gives every layer's per-example
output gradient ``g_n = dz_n`` at once (examples are independent, so the batch axis is kept);
the ``K`` vectors per example (``K = 1``, ``num_samples`` or ``C``) are ``K`` backward passes that
share the forward pass (``vmap`` over the cotangents). Then

* Dense (2-D input): ``sum_n (a_n outer g_n)^2 = (a^2)^T (g^2)``, bias ``sum_n g_n^2``;
* Conv: the per-example kernel gradient is ``sum_p patch_p(a_n) outer g_np`` over output positions
  ``p`` (im2col, ``lax.conv_general_dilated_patches``); it is formed per example (the kernels are
  small: 150 x 6 and 150 x 16 in the CNN) and squared;
* any other parameter (a layer this module does not know, a shared layer, grouped or circular
  convolutions): per-example gradients of those leaves only, by ``vmap`` over examples (exact,
  slower).

The layers are found with :func:`flax.linen.intercept_methods` (:mod:`fedbayes.models.layers`), so ``apply_fn`` may be any function
``(params, x) -> outputs`` that calls flax modules on the ``params`` collection (as
``model.apply({"params": p}, x)``); the models themselves are unchanged. The intercepted forward
pass adds exact zeros, so it computes the model's outputs up to float rounding (compiled, XLA may
fuse it differently: 2e-7 relative in float32).

kfac-jax and laplax were checked first. kfac-jax (0.0.8) estimates diagonal curvature only inside
its optimizer's state, needs the loss to be registered with its tags (``kfac_jax.register_*``)
inside the model code, and its diagonal blocks use the same ``(a^2)^T (g^2)`` identity, so it adds a
dependency and a tagged model for no speed gain. laplax (0.0.2, June 2025) computes GGN
diagonals by materialising ``J`` per example or by matrix-free diagonal estimators (one
matrix-vector product per parameter or Hutchinson samples), which is exact only at ``d`` products
or approximate otherwise. Neither fits, so this is plain JAX.

Minibatches and layout: the ``batch_*`` functions act on one ``[B, ...]`` batch with its mask.
:func:`over_client_data` is the one pass over a client's laid-out data
(:class:`~fedbayes.data.batches.ClientData`) in minibatches that every method's sum goes through:
FedEP's Laplace and NGVI passes (:mod:`fedbayes.inference.tilted`) and FedLap-Cov's curvature
(:func:`data_curvature`); each passes its own body, so each keeps its own arithmetic.
:func:`diag_ggn` and friends take host arrays ``(x, y, mask)`` instead (Laplace predictions, tests),
split them into chunks of ``batch_size`` (padding the last one with masked examples) and sum with
``lax.scan``; they draw one key per chunk by ``split`` where the data pass folds the step in, so
they stay a separate loop. Sums over minibatches equal the full-batch value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_block
from fedbayes.data.batches import ClientData, get_batch, steps_per_epoch
from fedbayes.models.layers import find_layers, layer_of

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]  # (params, x [B, ...]) -> outputs [B, C] or [B]
TASKS = ("classification", "regression", "multilabel")
FLAVOURS = ("ggn", "fisher", "empirical")

__all__ = [
    "FLAVOURS",
    "batch_block_ggn",
    "batch_curvature",
    "batch_diag_empirical_fisher",
    "batch_diag_fisher",
    "batch_diag_ggn",
    "batch_full_ggn",
    "batch_ggn_matmat",
    "batch_kron_ggn",
    "data_block_ggn",
    "data_curvature",
    "data_full_ggn",
    "data_kron_ggn",
    "data_subspace_ggn",
    "diag_empirical_fisher",
    "diag_fisher",
    "diag_ggn",
    "instrumented_forward",
    "over_client_data",
]


def instrumented_forward(apply_fn, params, x, layers):
    """``pert -> (outputs, inputs)``: the model with zero perturbations added to each structured
    layer's output, and the layers' inputs."""

    def fn(pert):
        inputs = {}

        def interceptor(next_fun, args, kwargs, context):
            out = next_fun(*args, **kwargs)
            layer = layer_of(context, args)
            if layer is not None and layer.path in pert:
                inputs[layer.path] = args[0]
                out = out + pert[layer.path]
            return out

        with nn.intercept_methods(interceptor):
            out = apply_fn(params, x)
        return out, inputs

    return fn


def _dense_diag(a, g):
    """``a [B, I]``, ``g [K, B, O]`` -> (kernel ``[I, O]``, bias ``[O]``) sums of squares."""
    g2 = jnp.sum(jnp.square(g), axis=0)
    return jnp.square(a).T @ g2, jnp.sum(g2, axis=0)


def _conv_diag(a, g, attrs, kernel_shape):
    """im2col form: ``a [B, H, W, Cin]``, ``g [K, B, H', W', Cout]``."""
    ks, strides, padding, lhs_dil, rhs_dil = attrs
    patches = jax.lax.conv_general_dilated_patches(
        a, ks, strides, padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )  # [B, H', W', Cin * kh * kw], channel-major (cin slowest)
    b = a.shape[0]
    cin = a.shape[-1]
    patches = patches.reshape(b, -1, cin, ks[0] * ks[1])
    gg = g.reshape(g.shape[0], b, -1, g.shape[-1])
    per = jnp.einsum("bpcs,kbpo->kbsco", patches, gg)  # per-example kernel gradients, [K, B, kh*kw, Cin, Cout]
    kernel = jnp.sum(jnp.square(per), axis=(0, 1)).reshape(kernel_shape)
    bias = jnp.sum(jnp.square(jnp.sum(gg, axis=2)), axis=(0, 1))
    return kernel, bias


def _split_params(params, layers):
    """(mask pytree of leaves handled by the structured layers)."""
    covered = {path + (leaf,) for path in layers for leaf in ("kernel", "bias")}

    def is_covered(kp, _):
        names = tuple(getattr(k, "key", getattr(k, "name", k)) for k in kp)
        return names in covered

    return jax.tree_util.tree_map_with_path(is_covered, params)


def _output_vectors(flavour, task, out, y, mask, key, num_samples):
    """``[K, B, C]`` (or ``[K, B]`` for scalar outputs) output-space vectors ``u`` such that the
    curvature is ``sum_k sum_n (J_n^T u_kn)^2``; the mask and the ``1/K`` of sample means are folded
    in as square roots."""
    sqrt_m = jnp.sqrt(jnp.clip(mask, 0.0, None)).astype(out.dtype)
    if task == "classification":
        p = jax.nn.softmax(out, axis=-1)
        num_classes = out.shape[-1]
        if flavour == "empirical":
            labels = jnp.where(mask > 0, y, jnp.zeros_like(y)).astype(jnp.int32)
            u = (p - jax.nn.one_hot(labels, num_classes, dtype=out.dtype))[None]
        elif flavour == "fisher":
            labels = jax.random.categorical(key, jax.lax.stop_gradient(out), axis=-1, shape=(num_samples,) + out.shape[:-1])
            u = (p[None] - jax.nn.one_hot(labels, num_classes, dtype=out.dtype)) / jnp.sqrt(float(num_samples))
        else:
            eye = jnp.eye(num_classes, dtype=out.dtype)
            # column c of A = diag(sqrt p) - p sqrt(p)^T: sqrt(p_c) (e_c - p)
            u = jnp.sqrt(p).T[:, :, None] * (eye[:, None, :] - p[None])
        return u * sqrt_m[None, :, None]
    if task == "multilabel":
        # l = mean_c of the C labels' sigmoid cross-entropies, a Bernoulli likelihood tempered by
        # 1/C: Hessian in the logits diag(p (1 - p)) / C. Both Fishers take the output vectors
        # (p - y) / sqrt(C) (y true or drawn from Bernoulli(p)), whose outer product has that
        # Hessian as its mean, so all three flavours agree in expectation as for the untempered
        # likelihoods.
        p = jax.nn.sigmoid(out)
        root_c = jnp.sqrt(float(out.shape[-1]))
        if flavour == "empirical":
            u = ((p - y.astype(out.dtype)) / root_c)[None]
        elif flavour == "fisher":
            draws = jax.random.bernoulli(key, p[None], (num_samples,) + out.shape).astype(out.dtype)
            u = (p[None] - draws) / (root_c * jnp.sqrt(float(num_samples)))
        else:
            eye = jnp.eye(out.shape[-1], dtype=out.dtype)
            u = (jnp.sqrt(p * (1.0 - p)) / root_c).T[:, :, None] * eye[:, None, :]
        return u * sqrt_m[None, :, None]
    # squared error 0.5 (f - y)^2: gradient f - y, Hessian 1, model y~ = f + N(0, 1)
    if flavour == "empirical":
        u = (out - y.astype(out.dtype).reshape(out.shape))[None]
    elif flavour == "fisher":
        u = -jax.random.normal(key, (num_samples,) + out.shape, out.dtype) / jnp.sqrt(float(num_samples))
    else:
        u = jnp.ones((1,) + out.shape, out.dtype)
    return u * sqrt_m.reshape((1,) + (-1,) + (1,) * (out.ndim - 1))


def batch_curvature(
    flavour: str,
    apply_fn: ApplyFn,
    params: PyTree,
    x: jax.Array,
    y: jax.Array,
    mask: jax.Array,
    *,
    task: str = "classification",
    key: jax.Array | None = None,
    num_samples: int = 1,
) -> PyTree:
    """The ``flavour`` (``"ggn"``, ``"fisher"``, ``"empirical"``) diagonal summed over one batch.

    Args:
      flavour: which curvature (see the module docstring).
      apply_fn: ``(params, x) -> outputs``, outputs ``[B, C]`` logits (classification) or ``[B]``
        / ``[B, D]`` predictions (regression, unit-variance Gaussian likelihood).
      params: where the curvature is evaluated.
      x: ``[B, ...]`` features; y: ``[B]`` labels or targets (unused by ``ggn`` and ``fisher``).
      mask: ``[B]``, 1 for a real example and 0 for padding (a weight ``w`` counts the example ``w``
        times).
      task: ``"classification"`` or ``"regression"``.
      key: the label draws of ``fisher``.
      num_samples: labels drawn per example by ``fisher`` (their squared gradients are averaged).
    """
    if flavour not in FLAVOURS:
        raise ValueError(f"curvature flavour must be one of {', '.join(FLAVOURS)}; got {flavour!r}")
    if task not in TASKS:
        raise ValueError(f"curvature: task {task!r} has no curvature here (a likelihood over sequences); allowed: {', '.join(TASKS)}")
    if flavour == "fisher":
        if key is None:
            raise ValueError("diag_fisher needs a key for the sampled labels")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1; got {num_samples}")
    layers, inputs, grads, u = _output_gradients(flavour, apply_fn, params, x, y, mask, task, key, num_samples)
    return _assemble_diag(apply_fn, params, x, layers, inputs, grads, u)


def _output_gradients(flavour, apply_fn, params, x, y, mask, task, key, num_samples):
    """``(layers, inputs, grads, u)``: the structured layers, their inputs, the gradients of
    ``u_k . f`` in their outputs for the ``K`` output-space vectors ``u`` (``{path: [K, B, ...]}``),
    and ``u``: one forward pass and ``K`` backward passes (the module docstring)."""
    layers, _ = find_layers(apply_fn, params, x)
    pert0 = {path: jnp.zeros(shape.shape, shape.dtype) for path, (_, shape) in layers.items()}
    fwd = instrumented_forward(apply_fn, params, x, layers)
    out, vjp_fn, inputs = jax.vjp(fwd, pert0, has_aux=True)
    u = _output_vectors(flavour, task, jax.lax.stop_gradient(out), y, mask, key, num_samples)
    (grads,) = jax.vmap(vjp_fn)(u.astype(out.dtype))  # {path: [K, B, ...out shape]}
    return layers, inputs, grads, u


def _assemble_diag(apply_fn, params, x, layers, inputs, grads, u):
    """The diagonal, shaped like ``params``, from :func:`_output_gradients`'s parts (the fallback's
    per-example gradients for parameters outside the structured layers)."""
    result = jax.tree.map(jnp.zeros_like, params)
    for path, (layer, _) in layers.items():
        node = params
        for name in path:
            node = node[name]
        a = jax.lax.stop_gradient(inputs[path])
        g = grads[path]
        if layer.kind == "dense":
            k, b = _dense_diag(a, g)
        else:
            k, b = _conv_diag(a, g, layer.attrs, node["kernel"].shape)
        entry = {"kernel": k.astype(node["kernel"].dtype)}
        if "bias" in node:
            entry["bias"] = b.astype(node["bias"].dtype)
        result = _set(result, path, entry)

    covered = _split_params(params, layers)
    if not all(jax.tree.leaves(covered)):
        result = _fallback(apply_fn, params, x, u, covered, result)
    return result


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def _fallback(apply_fn, params, x, u, covered, result):
    """Per-example gradients of the uncovered leaves only (``vmap`` over examples)."""
    flat, treedef = jax.tree.flatten(params)
    cov = jax.tree.leaves(covered)
    idx = [i for i, c in enumerate(cov) if not c]

    def out_one(sub, xn):
        leaves = list(flat)
        for i, leaf in zip(idx, sub):
            leaves[i] = leaf
        return apply_fn(jax.tree.unflatten(treedef, leaves), xn[None])[0]

    sub0 = [flat[i] for i in idx]

    def per_example(xn, un):  # un [K, ...out]
        _, vjp = jax.vjp(lambda s: out_one(s, xn), sub0)
        (g,) = jax.vmap(vjp)(un)
        return [jnp.sum(jnp.square(gi), axis=0) for gi in g]

    sq = jax.vmap(per_example, in_axes=(0, 1))(x, u)
    res = jax.tree.leaves(result)
    for j, i in enumerate(idx):
        res[i] = jnp.sum(sq[j], axis=0).astype(flat[i].dtype)
    return jax.tree.unflatten(treedef, res)


def batch_diag_ggn(apply_fn, params, x, y, mask, *, task="classification"):
    """Exact GGN diagonal summed over one batch (see :func:`batch_curvature`)."""
    return batch_curvature("ggn", apply_fn, params, x, y, mask, task=task)


def batch_diag_fisher(apply_fn, params, x, y, mask, *, key, num_samples=1, task="classification"):
    """Sampled-label Fisher diagonal summed over one batch (see :func:`batch_curvature`)."""
    return batch_curvature("fisher", apply_fn, params, x, y, mask, task=task, key=key, num_samples=num_samples)


def batch_diag_empirical_fisher(apply_fn, params, x, y, mask, *, task="classification"):
    """Empirical Fisher diagonal (true labels) summed over one batch (see :func:`batch_curvature`)."""
    return batch_curvature("empirical", apply_fn, params, x, y, mask, task=task)


def _over_batches(flavour, apply_fn, params, x, y, mask, batch_size, task, key=None, num_samples=1):
    n = x.shape[0]
    if y is None:
        y = jnp.zeros((n,), jnp.int32 if task == "classification" else x.dtype)
    if mask is None:
        mask = jnp.ones((n,), x.dtype)
    if batch_size is None or batch_size >= n:
        return batch_curvature(flavour, apply_fn, params, x, y, mask, task=task, key=key, num_samples=num_samples)
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    num = -(-n // batch_size)
    pad = num * batch_size - n

    def chunk(v):
        v = jnp.concatenate([v, jnp.zeros((pad,) + v.shape[1:], v.dtype)]) if pad else v
        return v.reshape((num, batch_size) + v.shape[1:])

    xs, ys, ms = chunk(x), chunk(y), chunk(mask)
    keys = jax.random.split(key, num) if key is not None else jnp.zeros((num,), jnp.uint32)

    def body(total, batch):
        xb, yb, mb, kb = batch
        c = batch_curvature(flavour, apply_fn, params, xb, yb, mb, task=task, key=kb if key is not None else None, num_samples=num_samples)
        return jax.tree.map(jnp.add, total, c), None

    total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, params), (xs, ys, ms, keys))
    return total


def diag_ggn(apply_fn: ApplyFn, params: PyTree, x, y=None, mask=None, *, task: str = "classification", batch_size: int | None = None) -> PyTree:
    """``sum_n m_n diag(J_n^T H_n J_n)`` over a client's data, in minibatches of ``batch_size``
    (all at once when None). ``y`` is not used (the GGN needs no labels)."""
    return _over_batches("ggn", apply_fn, params, x, y, mask, batch_size, task)


def diag_fisher(
    apply_fn: ApplyFn, params: PyTree, x, y=None, mask=None, *, key: jax.Array, num_samples: int = 1, task: str = "classification",
    batch_size: int | None = None,
) -> PyTree:  # fmt: skip
    """``sum_n m_n mean_s (grad l(f_n, y~_ns))^2`` with ``num_samples`` labels per example drawn
    from the model; its expectation is :func:`diag_ggn`."""
    return _over_batches("fisher", apply_fn, params, x, y, mask, batch_size, task, key=key, num_samples=num_samples)


def diag_empirical_fisher(apply_fn: ApplyFn, params: PyTree, x, y, mask=None, *, task: str = "classification", batch_size: int | None = None) -> PyTree:
    """``sum_n m_n (grad l(f_n, y_n))^2`` with the true labels ``y``."""
    return _over_batches("empirical", apply_fn, params, x, y, mask, batch_size, task)


def over_client_data(
    data: ClientData, batch_size: int, body: Callable, init: PyTree, *, passes: int = 1, laid_out_epochs: int = 1, max_batches: int = 0
) -> PyTree:
    """Runs ``carry = body(carry, step, (x, y, mask))`` over ``passes`` epochs of a client's
    minibatches of ``batch_size`` (at most ``max_batches`` of them when > 0), in order, cycling
    through the ``laid_out_epochs`` epochs of shuffles laid out in ``data``; returns the last carry.

    The body does the sum (and draws its keys, e.g. by ``fold_in(key, step)``), so the order and
    form of every addition stay the caller's; this owns only the pass.
    """
    spe = steps_per_epoch(data.num_examples, batch_size)
    laid_out = jnp.maximum(laid_out_epochs * spe, 1)
    total = passes * spe
    if max_batches > 0:
        total = jnp.minimum(total, max_batches)

    def step(s, carry):
        return body(carry, s, get_batch(data, s % laid_out, batch_size))

    return jax.lax.fori_loop(0, total, step, init)


def data_curvature(apply_fn: ApplyFn, *, task: str = "classification", batch_size: int) -> Callable[[PyTree, ClientData], PyTree]:
    """``(params, data) -> diag GGN`` of the client's sum loss: one pass over the client's
    examples (the first laid-out epoch) in minibatches of ``batch_size`` (:func:`over_client_data`,
    :func:`batch_diag_ggn`); FedLap-Cov's curvature."""

    def curvature(params, data: ClientData):
        def body(total, step, batch):
            x, y, mask = batch
            return optax.tree.add(total, batch_diag_ggn(apply_fn, params, x, y, mask, task=task))

        return over_client_data(data, batch_size, body, optax.tree.zeros_like(params))

    return curvature


def _output_hessian(task: str, out: jax.Array) -> jax.Array:
    """``H_n``, ``[B, C, C]``: the Hessian of the loss in the outputs (softmax cross-entropy
    ``diag(p) - p p^T``; the multilabel mean of sigmoid cross-entropies ``diag(p (1 - p)) / C``;
    squared error ``I``)."""
    if task == "classification":
        p = jax.nn.softmax(out, axis=-1)
        return jax.vmap(jnp.diag)(p) - p[:, :, None] * p[:, None, :]
    if task == "multilabel":
        p = jax.nn.sigmoid(out)
        return jax.vmap(jnp.diag)(p * (1.0 - p) / out.shape[-1])
    return jnp.broadcast_to(jnp.eye(out.shape[-1], dtype=out.dtype), out.shape + out.shape[-1:])


def batch_full_ggn(apply_fn: ApplyFn, params: PyTree, x: jax.Array, mask: jax.Array, *, task: str = "classification") -> jax.Array:
    """The dense GGN ``sum_n m_n J_n^T H_n J_n`` of one batch, ``[D, D]`` over the raveled parameters.

    ``J_n`` (``[C, D]``) is the Jacobian of example ``n``'s outputs in the parameters in
    :func:`jax.flatten_util.ravel_pytree` order (``jax.jacrev``, ``vmap`` over the batch) and
    ``H_n`` the output Hessian (softmax cross-entropy ``diag(p) - p p^T``, Martens 2020, "New
    insights and perspectives on the natural gradient method", Sec. 8; squared error ``I``). Memory
    ``B C D`` for the Jacobians and ``D^2`` for the sum: for models of a few thousand parameters
    (the full-covariance FedEP client; its diagonal is :func:`batch_diag_ggn`).

    Args:
      apply_fn: ``(params, x) -> outputs`` (``[B, C]``, or ``[B]`` for a scalar regression).
      params: where the GGN is evaluated.
      x: ``[B, ...]`` features.
      mask: ``[B]``, 1 for a real example, 0 for padding (a weight ``w`` counts the example ``w`` times).
      task: ``"classification"``, ``"regression"`` or ``"multilabel"``.
    """
    if task not in TASKS:
        raise ValueError(f"curvature: task {task!r} has no curvature here (a likelihood over sequences); allowed: {', '.join(TASKS)}")
    flat, unravel = ravel_pytree(params)

    def outputs(theta, xn):
        out = apply_fn(unravel(theta), xn[None])[0]
        return jnp.reshape(out, (-1,))

    jac = jax.vmap(jax.jacrev(outputs), in_axes=(None, 0))(flat, x)  # [B, C, D]
    out = jax.lax.stop_gradient(jax.vmap(outputs, in_axes=(None, 0))(flat, x))  # [B, C]
    hess = _output_hessian(task, out) * jnp.clip(mask, 0.0, None).astype(out.dtype)[:, None, None]
    return jnp.einsum("bcd,bce,bef->df", jac, hess, jac)


def data_full_ggn(apply_fn: ApplyFn, params: PyTree, data: ClientData, *, batch_size: int, task: str = "classification") -> jax.Array:
    """The dense GGN ``[D, D]`` of a client's sum loss at ``params``: one pass over its examples
    (the first laid-out epoch) in minibatches of ``batch_size``, the batches of
    :func:`data_curvature` (:func:`over_client_data`, :func:`batch_full_ggn`)."""
    d = ravel_pytree(params)[0].size

    def body(total, step, batch):
        x, _, mask = batch
        return total + batch_full_ggn(apply_fn, params, x, mask, task=task).astype(total.dtype)

    return over_client_data(data, batch_size, body, jnp.zeros((d, d), ravel_pytree(params)[0].dtype))


def _dense_block(a: jax.Array, g: jax.Array, has_bias: bool) -> jax.Array:
    """The dense GGN block of one Dense layer over a batch, ``[P, P]`` in the ravel order of its
    ``{"bias", "kernel"}`` (bias first, then the kernel row-major), from its inputs ``a [B, I]`` and
    output gradients ``g [K, B, O]``: example ``n``'s gradient of ``u_k . f`` in the kernel is
    ``a_n g_kn^T``, so the block is ``sum_n (a~_n a~_n^T) kron (sum_k g_kn g_kn^T)`` with ``a~_n =
    (1, a_n)`` (the bias's input 1 first) -- ``B I^2 O^2`` work, where the same sum through
    per-example Jacobians of the ``C`` outputs costs ``C`` times more."""
    q = jnp.einsum("kbo,kbp->bop", g, g)
    if has_bias:
        a = jnp.concatenate([jnp.ones((a.shape[0], 1), a.dtype), a], axis=1)
    size = a.shape[1] * g.shape[-1]
    return jnp.einsum("bi,bj,bop->iojp", a, a, q).reshape(size, size)


def batch_block_ggn(apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, mask: jax.Array, *, task: str = "classification"):
    """The GGN of one batch in the last-layer block structure (:func:`data_block_ggn`), as a
    :class:`~fedbayes.gaussian_block.BlockPrecision`. One forward and ``C`` backward passes give the
    other layers' diagonal (as :func:`batch_diag_ggn`) and, when the last layer is a ``Dense``
    layer found by :func:`fedbayes.models.layers.find_layers` (a network's output layer), its dense
    block in Kronecker form (:func:`_dense_block`); any other last layer takes the per-example
    Jacobians of :func:`batch_full_ggn`."""
    if task not in TASKS:
        raise ValueError(f"curvature: task {task!r} has no curvature here (a likelihood over sequences); allowed: {', '.join(TASKS)}")
    key = gaussian_block.last_layer_key(params)
    layers, inputs, grads, u = _output_gradients("ggn", apply_fn, params, x, y, mask, task, None, 1)
    rest = gaussian_block.split(_assemble_diag(apply_fn, params, x, layers, inputs, grads, u), key)[0]
    layer = layers.get((key,))
    last = params[key]
    if layer is not None and layer[0].kind == "dense" and inputs[(key,)].ndim == 2 and grads[(key,)].ndim == 3:
        dense = _dense_block(jax.lax.stop_gradient(inputs[(key,)]), grads[(key,)], "bias" in last)
    else:
        others = gaussian_block.split(params, key)[0]
        dense = batch_full_ggn(lambda t, xs: apply_fn(gaussian_block.join(others, t, key), xs), last, x, mask, task=task)
    return gaussian_block.BlockPrecision(rest, dense.astype(ravel_pytree(last)[0].dtype), key)


def data_block_ggn(apply_fn: ApplyFn, params: PyTree, data: ClientData, *, batch_size: int, task: str = "classification") -> gaussian_block.BlockPrecision:
    """The GGN of a client's sum loss at ``params`` in the last-layer block structure
    (:class:`~fedbayes.gaussian_block.BlockPrecision`): the dense ``[B, B]`` GGN of the last layer's
    ``B`` parameters (the outputs as a function of the last layer, the other weights held at
    ``params``) and the diagonal GGN of every other weight, by :func:`batch_block_ggn` over one
    pass of the client's examples in minibatches of ``batch_size``, the batches of
    :func:`data_curvature`. The blocks are those of the full GGN: the cross terms
    between the last layer and the rest are dropped (Laplace Redux's last-layer and diagonal
    structures, Daxberger et al. 2021)."""
    key = gaussian_block.last_layer_key(params)
    rest, last = gaussian_block.split(params, key)
    last_flat = ravel_pytree(last)[0]

    def body(total, step, batch):
        x, y, mask = batch
        return jax.tree.map(jnp.add, total, batch_block_ggn(apply_fn, params, x, y, mask, task=task))

    start = gaussian_block.BlockPrecision(optax.tree.zeros_like(rest), jnp.zeros((last_flat.size, last_flat.size), last_flat.dtype), key)
    return over_client_data(data, batch_size, body, start)


def batch_ggn_matmat(apply_fn: ApplyFn, params: PyTree, x: jax.Array, mask: jax.Array, vectors: jax.Array, *, task: str = "classification") -> jax.Array:
    """``G V``: the GGN ``sum_n m_n J_n^T H_n J_n`` of one batch times ``vectors`` (``[D, r]`` over
    the raveled parameters), without forming ``G`` or a Jacobian: per column, one forward-mode
    product ``J v`` (``jax.jvp``) and one reverse-mode product ``J^T (H J v)`` (``jax.vjp``), the
    Gauss-Newton-vector product of Schraudolph 2002 ("Fast curvature matrix-vector products for
    second-order gradient descent", Sec. 3). ``r`` columns cost about ``r`` forward and backward
    passes over the batch. Arguments as :func:`batch_full_ggn`."""
    if task not in TASKS:
        raise ValueError(f"curvature: task {task!r} has no curvature here (a likelihood over sequences); allowed: {', '.join(TASKS)}")
    flat, unravel = ravel_pytree(params)

    def outputs(theta):
        return apply_fn(unravel(theta), x)

    out, pullback = jax.vjp(outputs, flat)
    size = out.shape[0]
    hess = _output_hessian(task, jax.lax.stop_gradient(out).reshape(size, -1))
    hess = hess * jnp.clip(mask, 0.0, None).astype(out.dtype)[:, None, None]

    def column(v):
        _, jv = jax.jvp(outputs, (flat,), (v.astype(flat.dtype),))
        u = jnp.einsum("bce,be->bc", hess, jv.reshape(size, -1))
        return pullback(u.reshape(out.shape).astype(out.dtype))[0]

    return jax.vmap(column, in_axes=1, out_axes=1)(vectors)


def data_subspace_ggn(
    apply_fn: ApplyFn, params: PyTree, data: ClientData, basis: jax.Array, *, batch_size: int, task: str = "classification"
) -> tuple[PyTree, jax.Array]:
    """``(diag(G), G B)`` for the GGN ``G`` of a client's sum loss at ``params`` and a basis ``B``
    (``[D, r]``): one pass over its examples (the first laid-out epoch) in the minibatches of
    :func:`data_curvature`, :func:`batch_diag_ggn` and :func:`batch_ggn_matmat` per batch. What
    the diagonal-plus-low-rank structure in a shared basis needs
    (:func:`fedbayes.gaussian_subspace.from_curvature`)."""

    def body(total, step, batch):
        x, y, mask = batch
        diag, prod = total
        diag = optax.tree.add(diag, batch_diag_ggn(apply_fn, params, x, y, mask, task=task))
        return diag, prod + batch_ggn_matmat(apply_fn, params, x, mask, basis, task=task).astype(prod.dtype)

    return over_client_data(data, batch_size, body, (optax.tree.zeros_like(params), jnp.zeros(basis.shape, ravel_pytree(params)[0].dtype)))


def _at(tree, path):
    for name in path:
        tree = tree[name]
    return tree


def _kron_dense(a, g, mask, kernel_basis, bias_basis):
    """A Dense layer's EKFAC eigenvalues and Kronecker factors over one batch, from its inputs
    ``a [B, I]`` and output gradients ``g [K, B, O]``: example ``n``'s kernel gradient ``a_n
    g_kn^T`` is ``(L^T a_n) (R^T g_kn)^T`` in the basis, so ``diag(U^T G U) = ((a L)^2)^T sum_k (g_k
    R)^2`` (the identity of :func:`_dense_diag` in rotated coordinates); the factors are ``sum_n m_n
    a_n a_n^T`` and ``sum_kn g_kn g_kn^T``."""
    rotated_g = jnp.sum(jnp.square(g @ kernel_basis.right), axis=0)  # [B, O]
    kernel = jnp.square(a @ kernel_basis.left).T @ rotated_g
    weights = jnp.clip(mask, 0.0, None).astype(a.dtype)
    a_factor = (a * weights[:, None]).T @ a
    g_factor = jnp.einsum("kbo,kbp->op", g, g)
    bias = None if bias_basis is None else jnp.sum(jnp.square(g @ bias_basis.right), axis=(0, 1))
    return kernel, bias, a_factor, g_factor


def _kron_conv(a, g, mask, attrs, kernel_shape, kernel_basis, bias_basis):
    """A Conv layer's EKFAC eigenvalues and Kronecker factors (KFC, Grosse and Martens 2016, Sec.
    3: the patches' and the output gradients' second moments over examples and positions), the
    per-example kernel gradients ``sum_p patch_p g_p^T`` rotated and squared."""
    ks, strides, padding, lhs_dil, rhs_dil = attrs
    patches = jax.lax.conv_general_dilated_patches(
        a, ks, strides, padding, lhs_dilation=lhs_dil, rhs_dilation=rhs_dil, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )
    b, cin, cout = a.shape[0], a.shape[-1], g.shape[-1]
    # the kernel's row-major matrix [kh * kw * cin, cout]: the window position slowest, then the channel
    patches = patches.reshape(b, -1, cin, ks[0] * ks[1]).transpose(0, 1, 3, 2).reshape(b, -1, ks[0] * ks[1] * cin)
    gg = g.reshape(g.shape[0], b, -1, cout)
    per = jnp.einsum("bpm,kbpo->kbmo", patches, gg)
    rotated = jnp.einsum("kbmo,mi,oj->kbij", per, kernel_basis.left, kernel_basis.right)
    kernel = jnp.sum(jnp.square(rotated), axis=(0, 1)).reshape(kernel_shape)
    weights = jnp.clip(mask, 0.0, None).astype(a.dtype)
    a_factor = jnp.einsum("bpm,bpn,b->mn", patches, patches, weights)
    g_factor = jnp.einsum("kbpo,kbpq->oq", gg, gg)
    bias = None
    if bias_basis is not None:
        summed = jnp.sum(gg, axis=2)  # [K, B, O]: the bias's per-example gradients
        bias = jnp.sum(jnp.square(summed @ bias_basis.right), axis=(0, 1))
    return kernel, bias, a_factor, g_factor


def batch_kron_ggn(apply_fn: ApplyFn, params: PyTree, x: jax.Array, y: jax.Array, mask: jax.Array, bases: PyTree, *, task: str = "classification"):
    """``(s, factors)`` over one batch: the GGN's diagonal in the Kronecker eigenbases ``bases``
    (:mod:`fedbayes.gaussian_kron`; ``s = diag(U^T G U)``, EKFAC's corrected eigenvalues, George et
    al. 2018, Eq. 11, with the exact GGN's output vectors in place of sampled ones) and each leaf's
    Kronecker factors (:class:`~fedbayes.gaussian_kron.KronBasis` of the inputs' and the output
    gradients' second moments; zero where the leaf has none). One forward and ``C`` backward passes
    (:func:`batch_diag_ggn`'s); the Dense and Conv layers of
    :func:`fedbayes.models.layers.find_layers` are rotated, every other leaf (identity bases) keeps
    the plain diagonal."""
    if task not in TASKS:
        raise ValueError(f"curvature: task {task!r} has no curvature here (a likelihood over sequences); allowed: {', '.join(TASKS)}")
    layers, inputs, grads, u = _output_gradients("ggn", apply_fn, params, x, y, mask, task, None, 1)
    diag = _assemble_diag(apply_fn, params, x, layers, inputs, grads, u)
    factors = jax.tree.map(jnp.zeros_like, bases)
    for path, (layer, _) in layers.items():
        node, basis = _at(params, path), _at(bases, path)
        kernel_basis, bias_basis = basis["kernel"], basis.get("bias")
        a = jax.lax.stop_gradient(inputs[path])
        if layer.kind == "dense":
            k, bb, af, gf = _kron_dense(a, grads[path], mask, kernel_basis, bias_basis)
        else:
            k, bb, af, gf = _kron_conv(a, grads[path], mask, layer.attrs, node["kernel"].shape, kernel_basis, bias_basis)
        entry = {"kernel": k.astype(node["kernel"].dtype)}
        found = {"kernel": type(kernel_basis)(af.astype(node["kernel"].dtype), gf.astype(node["kernel"].dtype))}
        if "bias" in node:
            entry["bias"] = bb.astype(node["bias"].dtype)
            found["bias"] = type(kernel_basis)(
                None, gf.astype(node["bias"].dtype) if layer.kind == "dense" else _bias_factor(grads[path]).astype(node["bias"].dtype)
            )
        diag = _set(diag, path, {**_at(diag, path), **entry})
        factors = _set(factors, path, {**_at(factors, path), **found})
    return diag, factors


def _bias_factor(g: jax.Array) -> jax.Array:
    """A conv bias's factor: the second moment of its per-example gradients ``sum_p g_p``."""
    summed = jnp.sum(g.reshape(g.shape[0], g.shape[1], -1, g.shape[-1]), axis=2)
    return jnp.einsum("kbo,kbp->op", summed, summed)


def data_kron_ggn(
    apply_fn: ApplyFn, params: PyTree, data: ClientData, bases: PyTree, *, batch_size: int, task: str = "classification"
) -> tuple[PyTree, PyTree]:
    """``(s, factors)`` of a client's sum loss at ``params``: :func:`batch_kron_ggn` summed over one
    pass of its examples (the first laid-out epoch) in the minibatches of :func:`data_curvature`.
    What the Kronecker-factored structure needs (:mod:`fedbayes.gaussian_kron`)."""

    def body(total, step, batch):
        x, y, mask = batch
        return jax.tree.map(jnp.add, total, batch_kron_ggn(apply_fn, params, x, y, mask, bases, task=task))

    return over_client_data(data, batch_size, body, (optax.tree.zeros_like(params), jax.tree.map(jnp.zeros_like, bases)))
