"""The structured layers of a flax model, found by interception: what per-layer identities need.

Some computations are exact and cheap only per layer: the diagonal curvature's ``(a^2)^T (g^2)``
sums (:mod:`fedbayes.inference.curvature`) and PVI's local reparameterisation
(:mod:`fedbayes.algorithms.pvi`). Both need, for a model called as ``apply_fn(params, x)``, the
``flax.linen.Dense`` and ``flax.linen.Conv`` (and :class:`~fedbayes.models.conv.PatchConv`) layers
it calls, where their parameters sit in ``params``, and each layer's input and output inside the
forward pass. :func:`find_layers` traces the model once (shapes only) with
:func:`flax.linen.intercept_methods` and lists them; :func:`layer_of` recognises one inside an
interceptor. The models themselves are unchanged.

Only layers called once, whose parameters are exactly ``kernel`` (and ``bias``) of ``params`` at
their path, are listed; a dense layer counts only on a 2-D input ``[batch, features]``, a conv only
ungrouped, unmasked, 2-D, with a padding ``lax`` understands. Everything else is left to the
caller's general path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedbayes.models.conv import PatchConv

PyTree = Any
ApplyFn = Callable[[PyTree, jax.Array], jax.Array]

__all__ = ["Layer", "find_layers", "layer_of"]


class Layer(NamedTuple):
    """A structured layer of a model: its kind, its path in ``params`` and (conv) its geometry."""

    kind: str  # "dense" or "conv"
    path: tuple[str, ...]
    attrs: tuple  # conv: (kernel_size, strides, padding, input_dilation, kernel_dilation)


def _conv_attrs(module: nn.Conv, ndim: int):
    """The conv's geometry in ``lax`` terms, or None where the im2col path does not apply."""
    if module.feature_group_count != 1 or ndim != 4 or getattr(module, "mask", None) is not None:
        return None
    ks = tuple(module.kernel_size)
    if len(ks) != 2:
        return None

    def pair(v):
        if v is None:
            return (1, 1)
        if isinstance(v, int):
            return (v, v)
        return tuple(v)

    padding = module.padding
    if isinstance(padding, str):
        if padding not in ("SAME", "VALID"):
            return None
    elif isinstance(padding, int):
        padding = ((padding, padding), (padding, padding))
    else:
        padding = tuple((p, p) if isinstance(p, int) else tuple(p) for p in padding)
        if len(padding) != 2:
            return None
    return (ks, pair(module.strides), padding, pair(module.input_dilation), pair(module.kernel_dilation))


def layer_of(context, args) -> Layer | None:
    """The structured layer behind an intercepted call, or None."""
    module = context.module
    if context.method_name != "__call__" or not args:
        return None
    path = tuple(module.scope.path)
    if type(module) is nn.Dense and jnp.ndim(args[0]) == 2:
        return Layer("dense", path, ())
    if type(module) is nn.Conv:
        attrs = _conv_attrs(module, jnp.ndim(args[0]))
        if attrs is not None:
            return Layer("conv", path, attrs)
    if type(module) is PatchConv and jnp.ndim(args[0]) == 4:
        # The same stride-1, undilated convolution as nn.Conv, computed as patches plus a dot
        # (fedbayes.models.conv): the same im2col identity applies.
        return Layer("conv", path, (tuple(module.kernel_size), (1, 1), module.padding, (1, 1), (1, 1)))
    return None


def find_layers(apply_fn: ApplyFn, params: PyTree, x: jax.Array) -> tuple[dict[tuple[str, ...], tuple[Layer, jax.ShapeDtypeStruct]], Any]:
    """Traces ``apply_fn`` once (shapes only) and lists its structured layers with their output
    shapes; a layer called twice, or one whose parameters are not ``kernel`` (and ``bias``) of
    ``params`` at its path, is left to the fallback."""
    found: dict[tuple, tuple[Layer, Any]] = {}
    calls: dict[tuple, int] = {}

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        layer = layer_of(context, args)
        if layer is not None:
            calls[layer.path] = calls.get(layer.path, 0) + 1
            found[layer.path] = (layer, jax.ShapeDtypeStruct(out.shape, out.dtype))
        return out

    def run(p, xx):
        with nn.intercept_methods(interceptor):
            return apply_fn(p, xx)

    out_shape = jax.eval_shape(run, params, x)
    layers = {}
    for path, (layer, shape) in found.items():
        node = params
        try:
            for name in path:
                node = node[name]
        except (KeyError, TypeError):
            continue
        if calls[path] != 1 or not isinstance(node, dict) or "kernel" not in node or set(node) - {"kernel", "bias"}:
            continue
        layers[path] = (layer, shape)
    return layers, out_shape
