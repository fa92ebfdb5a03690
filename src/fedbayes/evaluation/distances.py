"""Distances between diagonal Gaussian posteriors, on the host in float64.

Used to compare a federated posterior with a reference (``fedbayes bench posterior``). Every
function takes pytrees (or arrays) of the same structure and compares them leaf by leaf on the
flattened vector:

* :func:`relative_l2`: ``||a - b|| / ||b||``;
* :func:`variance_ratio`: the median, minimum and maximum of ``v / v_ref`` over the coordinates;
* :func:`kl_diag`: ``KL(N(m_p, diag v_p) || N(m_q, diag v_q))``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedbayes import gaussian

__all__ = ["flat64", "kl_diag", "relative_l2", "variance_ratio"]


def flat64(tree: Any) -> np.ndarray:
    """The leaves of ``tree`` concatenated in ``jax.tree`` order, as one float64 vector."""
    leaves = [np.asarray(leaf, np.float64).ravel() for leaf in jax.tree.leaves(tree)]
    return np.concatenate(leaves) if leaves else np.zeros(0)


def _pair(a: Any, b: Any, what: str) -> tuple[np.ndarray, np.ndarray]:
    if jax.tree.structure(a) != jax.tree.structure(b):
        raise ValueError(f"{what}: the two pytrees differ in structure: {jax.tree.structure(a)} and {jax.tree.structure(b)}")
    fa, fb = flat64(a), flat64(b)
    if fa.shape != fb.shape:
        raise ValueError(f"{what}: the two pytrees differ in size: {fa.size} and {fb.size}")
    return fa, fb


def relative_l2(a: Any, b: Any) -> float:
    """``||a - b||_2 / ||b||_2`` over all coordinates (``b`` is the reference).

    Raises:
        ValueError: for pytrees of different structure or a zero reference.
    """
    fa, fb = _pair(a, b, "relative_l2")
    norm = float(np.linalg.norm(fb))
    if norm == 0.0:
        raise ValueError("relative_l2: the reference is zero")
    return float(np.linalg.norm(fa - fb)) / norm


def variance_ratio(v: Any, v_ref: Any) -> tuple[float, float, float]:
    """``(median, min, max)`` over the coordinates of ``v / v_ref``.

    Raises:
        ValueError: for pytrees of different structure or a non-positive reference variance.
    """
    fv, fr = _pair(v, v_ref, "variance_ratio")
    if not np.all(fr > 0):
        raise ValueError("variance_ratio: the reference variances must be > 0")
    ratio = fv / fr
    return float(np.median(ratio)), float(np.min(ratio)), float(np.max(ratio))


def kl_diag(p_mean: Any, p_var: Any, q_mean: Any, q_var: Any) -> float:
    """``KL(p || q)`` between diagonal Gaussians, summed over coordinates:

    ``0.5 sum_j [log(v_q / v_p) + (v_p + (m_p - m_q)^2) / v_q - 1]``.

    Raises:
        ValueError: for pytrees of different structure or a non-positive variance.
    """
    mp, mq = _pair(p_mean, q_mean, "kl_diag")
    vp, vq = _pair(p_var, q_var, "kl_diag")
    if not (np.all(vp > 0) and np.all(vq > 0)):
        raise ValueError("kl_diag: variances must be > 0")
    with jax.enable_x64(True):  # fedbayes.gaussian.kl, on the float64 vectors
        return float(gaussian.kl(gaussian.from_moments(jnp.asarray(mp), jnp.asarray(vp)), gaussian.from_moments(jnp.asarray(mq), jnp.asarray(vq))))
