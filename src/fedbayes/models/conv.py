"""Convolutions as patch extraction plus one dot, for XLA:CPU inside loops.

Why (docs/results/vbnn.md, "Convolutions inside the round", with ``benchmarks/cnn_round.py``; docs/design.md
"Using every core"): XLA:CPU runs a ``lax.conv_general_dilated`` step called from Python through
Eigen's fast convolution, but inside a ``while`` loop (``lax.fori_loop``, the simulator's
per-client loop) the weight-gradient convolutions come out of layout assignment with
non-canonical dimension labels (``f01b_i01o->01bf``) and fall back to XLA's naive loop emitter,
several times slower per step whatever the YNNPACK fusion option. Written as shifted slices of the
padded input concatenated into patches ``[batch, H, W, kh*kw*C]`` times the kernel reshaped to
``[kh*kw*C, F]``, the forward pass is one dot and the backward pass is a dot plus pads and adds,
which run at full speed inside loops (and vmap into batched dots). The patch matrix is kh*kw times the input
(conv_1 of the CNN on Fashion-MNIST: 64 x 14 x 14 x 150 floats, 7.5 MB per batch).

:class:`PatchConv` has the parameters of ``flax.linen.Conv`` (``kernel [kh, kw, C, F]`` and
``bias [F]``, the same initialisers), so a parameter tree and its initial values are the same
under either implementation; outputs agree with ``lax.conv_general_dilated`` up to float32
reassociation (tests/models/test_models.py: relative 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = ["PADDINGS", "PatchConv", "patch_conv"]

PADDINGS: tuple[str, ...] = ("SAME", "VALID")


def _pads(size: int, window: int, padding: str) -> tuple[int, int]:
    if padding == "VALID":
        return (0, 0)
    total = window - 1  # stride 1: output size = input size
    return (total // 2, total - total // 2)


def patch_conv(x: jax.Array, kernel: jax.Array, padding: str = "SAME") -> jax.Array:
    """Stride-1 2-D convolution (cross-correlation, as ``lax.conv_general_dilated`` with
    ``NHWC``/``HWIO``) by patch extraction and one dot.

    Args:
        x: images ``[batch, H, W, C]``.
        kernel: ``[kh, kw, C, F]``.
        padding: ``"SAME"`` (XLA's split: the extra row/column of an even window goes last) or
            ``"VALID"``.

    Returns:
        ``[batch, H', W', F]`` with ``H' = H`` (SAME) or ``H - kh + 1`` (VALID).

    Raises:
        ValueError: for another padding, or a VALID window larger than the image.
    """
    if padding not in PADDINGS:
        raise ValueError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
    kh, kw, cin, features = kernel.shape
    batch, height, width, channels = x.shape
    if channels != cin:
        raise ValueError(f"kernel expects {cin} input channels, images have {channels}")
    (top, bottom), (left, right) = _pads(height, kh, padding), _pads(width, kw, padding)
    xp = jnp.pad(x, ((0, 0), (top, bottom), (left, right), (0, 0)))
    out_h, out_w = xp.shape[1] - kh + 1, xp.shape[2] - kw + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(f"a {kh}x{kw} VALID convolution needs images of at least that size, got {height}x{width}")
    # Patch layout (i, j, c) matches kernel.reshape(kh * kw * C, F) of an HWIO kernel.
    cols = [xp[:, i : i + out_h, j : j + out_w, :] for i in range(kh) for j in range(kw)]
    patches = jnp.concatenate(cols, axis=-1).reshape(batch * out_h * out_w, kh * kw * cin)
    out = jnp.dot(patches, kernel.reshape(kh * kw * cin, features))
    return out.reshape(batch, out_h, out_w, features)


class PatchConv(nn.Module):
    """Drop-in for ``nn.Conv(features, kernel_size, padding=...)`` (stride 1, no dilation, one
    group) computed by :func:`patch_conv`; same parameter names, shapes and initialisers.

    Attributes:
        features: output channels F.
        kernel_size: ``(kh, kw)``.
        padding: ``"SAME"`` or ``"VALID"``.
    """

    features: int
    kernel_size: tuple[int, int] = (5, 5)
    padding: str = "SAME"
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kh, kw = self.kernel_size
        kernel = self.param("kernel", self.kernel_init, (kh, kw, x.shape[-1], self.features), jnp.float32)
        bias = self.param("bias", self.bias_init, (self.features,), jnp.float32)
        return patch_conv(x, kernel, self.padding) + bias.reshape((1, 1, 1, -1))
