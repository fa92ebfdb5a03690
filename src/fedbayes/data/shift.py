"""Shifted test sets: images rotated, noised, blurred or faded, at increasing levels, generated here.

Ovadia et al. 2019, "Can You Trust Your Model's Uncertainty? Evaluating Predictive Uncertainty Under
Dataset Shift" (Sec. 4.1), evaluate a classifier's accuracy, NLL and ECE on test sets moved away
from the training distribution step by step: MNIST rotated by 0..180 degrees, and images under the
corruptions of Hendrycks and Dietterich 2019, "Benchmarking Neural Network Robustness to Common
Corruptions and Perturbations", each at five intensities. This module makes four such shifts of an
image test set, deterministically, with nothing downloaded (:data:`SHIFTS`):

* ``rotation``: the image turned counter-clockwise about its centre by 30, 60, ..., 180 degrees,
  bilinear interpolation, zero (the background of MNIST-like data) outside the image;
* ``noise``: i.i.d. Gaussian noise of standard deviation 0.08, 0.12, 0.18, 0.26, 0.38 added to each
  pixel (Hendrycks and Dietterich's ``gaussian_noise`` severities), clipped back to [0, 1];
* ``blur``: a Gaussian blur of standard deviation 0.5, 1, 1.5, 2, 3 pixels of a 28-pixel image
  (scaled with the image's height: 8x8 digits get 8/28 of that), edges reflected;
* ``contrast``: each image's pixels pulled toward that image's mean, ``m + c (x - m)`` with
  ``c`` = 0.4, 0.3, 0.2, 0.1, 0.05 (Hendrycks and Dietterich's ``contrast`` severities).

Level 0 of every shift is the clean test set. Images are ``[N, H, W]`` or ``[N, H, W, C]`` floats in
[0, 1], as :mod:`fedbayes.data.idx` and :mod:`fedbayes.data.sklearn_data` store them; every shift
is applied per channel. The primitives (:func:`rotate`, :func:`add_noise`, :func:`blur`,
:func:`fade`) take an intensity; :func:`shift_images` maps a level to it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes.errors import DataError

__all__ = ["INTENSITIES", "SHIFTS", "UNITS", "add_noise", "blur", "check_images", "fade", "intensity", "levels", "rotate", "shift_images"]

SHIFTS = ("rotation", "noise", "blur", "contrast")
# The intensity of levels 1, 2, ...; level 0 is the clean set (0 degrees, no noise, no blur, c = 1).
INTENSITIES: dict[str, tuple[float, ...]] = {
    "rotation": (30.0, 60.0, 90.0, 120.0, 150.0, 180.0),
    "noise": (0.08, 0.12, 0.18, 0.26, 0.38),
    "blur": (0.5, 1.0, 1.5, 2.0, 3.0),
    "contrast": (0.4, 0.3, 0.2, 0.1, 0.05),
}
CLEAN = {"rotation": 0.0, "noise": 0.0, "blur": 0.0, "contrast": 1.0}
UNITS = {"rotation": "degrees", "noise": "noise std", "blur": "blur std (px of 28)", "contrast": "contrast factor"}
REFERENCE_HEIGHT = 28  # blur's standard deviations are in pixels of a 28-pixel image
_NOISE_STREAM = 0x5F1F7  # the noise generator's stream tag, beside the seed and the level


def _unknown(kind: str) -> DataError:
    return DataError(f"shift: unknown kind {kind!r}; allowed: {', '.join(SHIFTS)}")


def levels(kind: str) -> range:
    """The levels of shift ``kind``: 0 (clean) .. number of intensities."""
    if kind not in INTENSITIES:
        raise _unknown(kind)
    return range(len(INTENSITIES[kind]) + 1)


def intensity(kind: str, level: int) -> float:
    """The intensity of ``kind`` at ``level`` (degrees, noise std, blur std, contrast factor)."""
    if level not in levels(kind):
        raise DataError(f"shift: level {level!r} of {kind!r}; allowed: 0..{len(INTENSITIES[kind])}")
    return CLEAN[kind] if level == 0 else INTENSITIES[kind][level - 1]


def check_images(x: np.ndarray, name: str) -> None:
    """Raises a one-line :class:`DataError` unless ``x`` is a float image batch ``[N, H, W(, C)]``."""
    if x.ndim not in (3, 4) or not np.issubdtype(x.dtype, np.floating):
        raise DataError(
            f"shift: dataset {name!r} holds no images (features of shape {tuple(x.shape[1:])}, {x.dtype}); "
            "the shifts need image data [H, W] or [H, W, C]: fashion_mnist, mnist or digits"
        )


def _as_nhwc(x: np.ndarray) -> np.ndarray:
    return x[..., None] if x.ndim == 3 else x


@jax.jit
def _rotate(x: jax.Array, degrees: jax.Array) -> jax.Array:
    n, h, w, c = x.shape
    theta = jnp.deg2rad(degrees)
    rows, cols = jnp.meshgrid(jnp.arange(h, dtype=jnp.float32), jnp.arange(w, dtype=jnp.float32), indexing="ij")
    # Output pixel (r, c) reads the input at the point that the rotation carries onto it: with
    # y = centre - r upward and x = c - centre rightward, the inverse (clockwise) rotation.
    cy, cx = (h - 1) / 2.0, (w - 1) / 2.0
    y, xx = cy - rows, cols - cx
    src_x = jnp.cos(theta) * xx + jnp.sin(theta) * y
    src_y = -jnp.sin(theta) * xx + jnp.cos(theta) * y
    coords = [cy - src_y, src_x + cx]

    def one(image):  # [H, W]
        return jax.scipy.ndimage.map_coordinates(image, coords, order=1, mode="constant", cval=0.0)

    # over examples and channels: [N, H, W, C] -> [N, C, H, W] -> back
    out = jax.vmap(jax.vmap(one))(jnp.moveaxis(x, -1, 1))
    return jnp.moveaxis(out, 1, -1)


def rotate(x: np.ndarray, degrees: float) -> np.ndarray:
    """``x`` rotated counter-clockwise (as displayed, row 0 at the top) by ``degrees`` about the
    image centre, by bilinear interpolation; points that come from outside the image are 0."""
    if degrees == 0:
        return np.array(x)
    out = _rotate(jnp.asarray(_as_nhwc(x)), jnp.float32(degrees))
    return np.asarray(out, dtype=x.dtype).reshape(x.shape)


def add_noise(x: np.ndarray, std: float, rng: np.random.Generator, clip: bool = True) -> np.ndarray:
    """``x + std * eps`` with ``eps`` i.i.d. standard normal from ``rng``, clipped to [0, 1] when ``clip``."""
    out = x + np.float32(std) * rng.standard_normal(x.shape, dtype=np.float32)
    return np.clip(out, 0.0, 1.0, out=out) if clip else out


def _kernel(sigma: float) -> np.ndarray:
    radius = max(1, math.ceil(3.0 * sigma))
    t = np.arange(-radius, radius + 1, dtype=np.float64)
    k = np.exp(-0.5 * (t / sigma) ** 2)
    return (k / k.sum()).astype(np.float32)


def blur(x: np.ndarray, sigma: float) -> np.ndarray:
    """A separable Gaussian blur of standard deviation ``sigma`` pixels (kernel radius ``ceil(3 sigma)``,
    normalised), edges reflected about the border (numpy's ``symmetric`` padding). A symmetric kernel
    no wider than the image and that reflection keep each image's sum, hence its mean, exactly."""
    if sigma == 0:
        return np.array(x)
    nhwc = _as_nhwc(x)
    k = _kernel(sigma)
    r = len(k) // 2
    h, w = nhwc.shape[1:3]
    if r >= min(h, w):
        raise DataError(f"shift: blur std {sigma} px needs a kernel of radius {r}, wider than the {h}x{w} image")
    padded = jnp.pad(jnp.asarray(nhwc), ((0, 0), (r, r), (r, r), (0, 0)), mode="symmetric")
    kj = jnp.asarray(k)
    rows = sum(kj[i] * padded[:, i : i + h, :, :] for i in range(len(k)))
    out = sum(kj[i] * rows[:, :, i : i + w, :] for i in range(len(k)))
    return np.asarray(out, dtype=x.dtype).reshape(x.shape)


def fade(x: np.ndarray, factor: float) -> np.ndarray:
    """Each image's pixels pulled toward its own mean (over pixels and channels): ``m + factor (x - m)``."""
    m = x.reshape(len(x), -1).mean(axis=1).reshape((len(x),) + (1,) * (x.ndim - 1))
    return (m + np.float32(factor) * (x - m)).astype(x.dtype)


def shift_images(x: np.ndarray, kind: str, level: int, seed: int = 0, name: str = "images") -> np.ndarray:
    """The test images ``x`` under shift ``kind`` at ``level`` (0: ``x`` itself, copied).

    Deterministic: the noise comes from ``numpy.random.default_rng([tag, seed, level])``; the other
    shifts draw nothing. ``name`` names the dataset in the error for non-image features.

    Raises:
      DataError: one line, for features that are not images, an unknown kind or a level out of range.
    """
    check_images(x, name)
    value = intensity(kind, level)
    if level == 0:
        return np.array(x)
    if kind == "rotation":
        return rotate(x, value)
    if kind == "noise":
        return add_noise(x, value, np.random.default_rng([_NOISE_STREAM, seed, level]))
    if kind == "blur":
        return blur(x, value * x.shape[1] / REFERENCE_HEIGHT)
    return fade(x, value)
