"""The prior precision of a Laplace-family posterior, chosen post hoc as Laplace Redux does.

Daxberger, Kristiadi, Immer, Eschenhagen, Bauer and Hennig, "Laplace Redux -- Effortless Bayesian
Deep Learning" (NeurIPS 2021), tune the prior precision ``delta`` of a Laplace posterior after
training, by the Laplace approximation of the marginal likelihood or by the NLL on a validation set,
with the mean kept at the MAP (their "post-hoc" tuning). docs/algorithms.md §13.3.

**The posterior.** A Laplace-family method's ``q_g`` is ``N(theta*, diag(1 / (G + delta)))``: the
data's curvature ``G`` (a diagonal GGN or Fisher of the sum loss) plus the precision ``delta`` of
the prior ``N(0, I / delta)``. The method says what its ``delta`` is
(:attr:`fedbayes.algorithms.base.AlgorithmSpec.posterior_prior_precision`), so the curvature is
``G = 1 / variance - delta`` (:func:`curvature`), and another prior precision ``delta'`` gives
``q' = N(theta*, diag(1 / (G + delta')))`` (:func:`with_prior_precision`). A coordinate of
variance 0 (a point coordinate: FedEP's burn-in, an improper site) has ``G = inf`` and stays a
point; it takes no part in either objective.

**A last-layer posterior** (``covariance = "last_layer"``: a dense precision ``Lambda_L`` over the
last layer, diagonal elsewhere; :mod:`fedbayes.gaussian_block`) arrives as its spread, not its
marginals: ``G = Lambda - delta I`` block by block, the last layer's block eigendecomposed once
(:class:`BlockCurvature`), and ``delta'`` gives the precision ``G + delta' I`` (drawn from by its scales). Its log-determinant
is ``sum_j log(g_j + delta')`` over ``G_L``'s eigenvalues ``g_j`` beside the diagonal's terms: the
same objective, with the last layer's correlations.

**A low-rank posterior** (``covariance = "low_rank"``: a precision ``Lambda = diag(d) + U diag(s)
U^T``, :class:`~fedbayes.gaussian_lowrank.LowRankGaussian`) also arrives as its spread: ``G = Lambda
- delta I`` keeps ``U`` and ``s`` and lowers the diagonal (:class:`LowRankCurvature`), ``delta'``
gives the precision ``G + delta' I`` (drawn from with the same normal draws for every candidate),
and ``log det(G + delta' I)`` is the low-rank family's log-determinant (``O(D r^2)``, through
:func:`fedbayes.gaussian_lowrank.entropy`).

**A Kronecker-factored posterior** (``covariance = "kron"``: a precision ``U diag(s) U^T`` in per-layer
Kronecker eigenbases, :class:`~fedbayes.gaussian_kron.KronSpread`) is the diagonal case in the
rotated coordinates: ``delta I`` is ``delta`` in every orthonormal basis, so ``G = s - delta`` keeps
the bases (:class:`KronCurvature`), ``delta'`` gives the eigenvalues ``G + delta'``, and the
objective below is the diagonal one over the eigenvalues with ``theta*`` rotated (``U^T theta*``,
the same norm).

**Marginal likelihood** (:func:`log_marginal_likelihood`). The Laplace approximation of the
evidence, ``p(D) ~= p(D | theta*) p(theta*) (2 pi)^{P/2} det(Lambda)^{-1/2}`` with ``Lambda =
G + delta'`` the posterior precision over the ``P`` Gaussian coordinates, is

    log p(D | delta') ~= log p(D | theta*) + log N(theta*; 0, I / delta') - 1/2 sum_i log((G_i + delta') / (2 pi))
                      = log p(D | theta*) - delta' ||theta*||^2 / 2 + (P / 2) log delta' - 1/2 sum_i log(G_i + delta').

``log p(D | theta*)`` does not depend on ``delta'``: the search needs nothing but ``q_g`` (no data
at the server). In ``t = log delta'`` the derivative is ``1/2 [sum_i G_i / (G_i + delta') -
delta' ||theta*||^2]``, strictly decreasing, so the objective is concave in ``t`` with one maximiser,
where ``delta' = gamma / ||theta*||^2`` and ``gamma = sum_i G_i / (G_i + delta')`` is the effective
number of parameters (MacKay, "A practical Bayesian framework for backpropagation networks", 1992).

**Validation NLL.** The NLL of the marginalised predictive on the validation split, every
candidate ``delta'`` with the same draws ``eps`` (``theta_s = theta* + eps_s / sqrt(G + delta')``:
common random numbers, so the objective is a smooth function of ``delta'`` and the comparison is
not drowned in Monte Carlo noise).

**The search** (:func:`maximise_log_scale`): a grid of ``GRID_POINTS`` values of ``log delta'``
spanning ``delta * 10^-GRID_DECADES`` to ``delta * 10^GRID_DECADES`` (Laplace Redux's library
searches a log-spaced grid too), then optax's L-BFGS from the best grid point, whose result is kept
only where it lies between the best point's grid neighbours and improves on it. With a unimodal
objective (the marginal likelihood always) this is the objective's maximiser to L-BFGS's
tolerance, not just the grid's best.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.flatten_util import ravel_pytree

from fedbayes import gaussian_block, gaussian_kron, gaussian_lowrank
from fedbayes.gaussian_block import BlockGaussian, BlockScale
from fedbayes.gaussian_kron import KronSpread
from fedbayes.gaussian_lowrank import LowRankGaussian

PyTree = Any

SEARCHES = ("fixed", "marglik", "validation")  # evaluation.prior_precision
GRID_DECADES = 6.0  # the grid spans delta * 10^-6 .. delta * 10^6
GRID_POINTS = 49  # half a decade apart
LBFGS_STEPS = 30

__all__ = [
    "GRID_DECADES",
    "GRID_POINTS",
    "SEARCHES",
    "BlockCurvature",
    "KronCurvature",
    "LowRankCurvature",
    "curvature",
    "log_marginal_likelihood",
    "make_prior_precision_search",
    "marglik_prior_precision",
    "maximise_log_scale",
    "validation_prior_precision",
    "with_prior_precision",
]


@struct.dataclass
class BlockCurvature:
    """``G`` of a last-layer posterior (:class:`~fedbayes.gaussian_block.BlockGaussian` spread):
    the other layers' diagonal ``G_R`` (``inf`` at a point coordinate) and the eigendecomposition
    ``G_L = V diag(g) V^T`` of the last layer's dense block, so that ``log det(G_L + delta' I) =
    sum_j log(g_j + delta')`` costs nothing per candidate ``delta'``.

    Attributes:
      rest: ``G_R``, a pytree like the other layers.
      eigenvalues: ``g`` (``[B]``, floored at 0).
      eigenvectors: ``V`` (``[B, B]``).
      key: the last layer's name (static).
    """

    rest: PyTree
    eigenvalues: jax.Array
    eigenvectors: jax.Array
    key: str = struct.field(pytree_node=False)


@struct.dataclass
class LowRankCurvature:
    """``G = diag(g) + U diag(s) U^T`` of a low-rank posterior (a
    :class:`~fedbayes.gaussian_lowrank.LowRankGaussian` spread of precision ``G + delta I``), kept as
    that spread with its diagonal lowered by ``delta``.

    Attributes:
      spread: the zero-mean :class:`~fedbayes.gaussian_lowrank.LowRankGaussian` whose diagonal is ``g``.
    """

    spread: LowRankGaussian
    key: str | None = struct.field(pytree_node=False, default=None)

    def with_diagonal_raised(self, c) -> LowRankGaussian:
        """The zero-mean spread of precision ``G + c I``."""
        return self.spread.replace(diag=jax.tree.map(lambda g: g + jnp.asarray(c, g.dtype), self.spread.diag))

    def posterior(self, c) -> LowRankGaussian | gaussian_lowrank.LayerMarginal:
        """The spread of precision ``G + c I``, or its marginal over the layer ``key``."""
        joint = self.with_diagonal_raised(c)
        return joint if self.key is None else gaussian_lowrank.marginal(joint, self.key)


@struct.dataclass
class KronCurvature:
    """``G = U diag(g) U^T`` of a Kronecker-factored posterior (a
    :class:`~fedbayes.gaussian_kron.KronSpread` of eigenvalues ``g + delta``).

    Attributes:
      eigenvalues: ``g``, shaped like the parameters, floored at 0.
      bases: the spread's bases.
      key: the layer the spread draws (``None``: all weights; static).
    """

    eigenvalues: PyTree
    bases: PyTree
    key: str | None = struct.field(pytree_node=False, default=None)


def _diag_curvature(variance: PyTree, prior_precision) -> PyTree:
    return jax.tree.map(lambda v: jnp.where(v > 0, jnp.maximum(1.0 / jnp.where(v > 0, v, 1.0) - prior_precision, 0.0), jnp.inf), variance)


def curvature(variance: PyTree | BlockGaussian, prior_precision: float) -> PyTree | BlockCurvature:
    """``G = 1 / variance - delta``, floored at 0 (the methods keep their precision at least
    ``delta``; the floor absorbs round-off); ``inf`` where the variance is 0 (a point coordinate).
    For a last-layer spread (a :class:`~fedbayes.gaussian_block.BlockGaussian` of precision
    ``Lambda``): ``G = Lambda - delta I`` block by block, a :class:`BlockCurvature`."""
    if isinstance(variance, gaussian_lowrank.LayerMarginal):  # the evidence is the whole posterior's; the draws stay the layer's
        return LowRankCurvature(curvature(variance.joint, prior_precision).spread, variance.key)
    if isinstance(variance, KronSpread):
        return KronCurvature(
            jax.tree.map(lambda s: jnp.maximum(s - jnp.asarray(prior_precision, s.dtype), 0.0), variance.precision), variance.bases, variance.key
        )
    if isinstance(variance, LowRankGaussian):
        return LowRankCurvature(variance.replace(diag=jax.tree.map(lambda d: d - jnp.asarray(prior_precision, d.dtype), variance.diag)))
    if isinstance(variance, BlockGaussian):
        p = variance.precision
        rest = jax.tree.map(lambda d: jnp.where(jnp.isfinite(d), jnp.maximum(d - prior_precision, 0.0), jnp.inf), p.diagonal)
        g, v = jnp.linalg.eigh(0.5 * (p.dense + p.dense.T) - prior_precision * jnp.eye(p.dense.shape[0], dtype=p.dense.dtype))
        return BlockCurvature(rest, jnp.maximum(g, 0.0), v, p.key)
    return _diag_curvature(variance, prior_precision)


def with_prior_precision(curv: PyTree | BlockCurvature, prior_precision) -> PyTree | BlockScale:
    """The variance ``1 / (G + delta')`` of the posterior with prior precision ``delta'`` (0 where
    ``G`` is infinite); for a :class:`BlockCurvature`, the spread of precision ``G + delta' I`` by its
    scales (:class:`~fedbayes.gaussian_block.BlockScale`: ``1 / sqrt(G_R + delta')`` and the root
    ``V diag(g + delta')^{-1/2}`` of the last layer's covariance), which draws without a
    factorisation, so a search differentiates through its draws."""
    if isinstance(curv, LowRankCurvature):
        return curv.posterior(prior_precision)
    if isinstance(curv, KronCurvature):
        return KronSpread(jax.tree.map(lambda g: g + jnp.asarray(prior_precision, g.dtype), curv.eigenvalues), curv.bases, curv.key)
    if isinstance(curv, BlockCurvature):
        std = jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), jax.lax.rsqrt(jnp.where(jnp.isfinite(g), g, 0.0) + prior_precision), 0.0), curv.rest)
        root = curv.eigenvectors * jax.lax.rsqrt(curv.eigenvalues + prior_precision)[None, :]
        return BlockScale(std, root.astype(curv.eigenvectors.dtype), curv.key)
    return jax.tree.map(lambda g: jnp.where(jnp.isfinite(g), 1.0 / (jnp.where(jnp.isfinite(g), g, 0.0) + prior_precision), 0.0), curv)


def log_marginal_likelihood(mean: PyTree, curv: PyTree, prior_precision, log_likelihood=0.0) -> jax.Array:
    """The Laplace approximation of ``log p(D | delta')`` (module docstring):
    ``log p(D | theta*) + log N(theta*; 0, I / delta') - 1/2 sum_i log((G_i + delta') / (2 pi))``
    over the coordinates with finite curvature ``G``.

    Args:
      mean: ``theta*``, the posterior mean (the MAP).
      curv: ``G`` (:func:`curvature`), a pytree like ``mean``.
      prior_precision: ``delta'`` > 0.
      log_likelihood: ``log p(D | theta*)``; the default 0 leaves it out (it does not depend on
        ``delta'``).
    """
    delta = jnp.asarray(prior_precision, jnp.float32)
    log_2pi = jnp.log(2.0 * jnp.pi)

    def leaf(m, g):
        gauss = jnp.isfinite(g)
        g0 = jnp.where(gauss, g, 0.0)
        log_prior = -0.5 * delta * jnp.square(m) + 0.5 * (jnp.log(delta) - log_2pi)  # log N(m; 0, 1/delta)
        log_det = jnp.log(g0 + delta) - log_2pi
        return jnp.sum(jnp.where(gauss, log_prior - 0.5 * log_det, 0.0))

    if isinstance(curv, KronCurvature):  # the diagonal objective over the eigenvalues, theta* in the bases (whole posterior's evidence)
        return log_likelihood + sum(jax.tree.leaves(jax.tree.map(leaf, gaussian_kron.rotate(mean, curv.bases), curv.eigenvalues)))
    if isinstance(curv, LowRankCurvature):  # log det(G + delta' I) = D (1 + log 2 pi) - 2 H of the spread
        m = ravel_pytree(mean)[0]
        size = m.size
        log_det = size * (1.0 + log_2pi) - 2.0 * gaussian_lowrank.entropy(curv.with_diagonal_raised(delta))
        return log_likelihood - 0.5 * delta * jnp.sum(jnp.square(m)) + 0.5 * size * jnp.log(delta) - 0.5 * log_det
    if isinstance(curv, BlockCurvature):  # the last layer's block: its log-determinant from G_L's eigenvalues
        rest, last = gaussian_block.split(mean, curv.key)
        m = ravel_pytree(last)[0]
        dense = -0.5 * delta * jnp.sum(jnp.square(m)) + 0.5 * m.size * jnp.log(delta) - 0.5 * jnp.sum(jnp.log(curv.eigenvalues + delta))
        return log_likelihood + dense + sum(jax.tree.leaves(jax.tree.map(leaf, rest, curv.rest)))
    return log_likelihood + sum(jax.tree.leaves(jax.tree.map(leaf, mean, curv)))


def maximise_log_scale(objective: Callable[[jax.Array], jax.Array], center: float, *, decades: float = GRID_DECADES, points: int = GRID_POINTS) -> jax.Array:
    """``argmax_t objective(t)`` over ``t = log delta'`` in ``[log center - decades ln 10, log
    center + decades ln 10]``: the best of a grid of ``points`` values, then optax's L-BFGS from it,
    kept where it stays between the grid neighbours and does not lower the objective. Traceable
    (``jit`` it with the objective). Returns ``delta' = exp(t)``."""
    if points < 3:
        raise ValueError(f"points must be >= 3; got {points}")
    half = decades * jnp.log(10.0)
    grid = jnp.log(jnp.asarray(center, jnp.float32)) + jnp.linspace(-half, half, points)
    values = jax.lax.map(objective, grid)
    values = jnp.where(jnp.isnan(values), -jnp.inf, values)
    best = jnp.argmax(values)
    lo, hi = grid[jnp.maximum(best - 1, 0)], grid[jnp.minimum(best + 1, points - 1)]

    loss = lambda t: -objective(t)  # noqa: E731  optax minimises
    opt = optax.lbfgs()
    value_and_grad = optax.value_and_grad_from_state(loss)

    def step(_, carry):
        t, state = carry
        value, grad = value_and_grad(t, state=state)
        updates, state = opt.update(grad, state, t, value=value, grad=grad, value_fn=loss)
        return optax.apply_updates(t, updates), state

    t0 = grid[best]
    t, _ = jax.lax.fori_loop(0, LBFGS_STEPS, step, (t0, opt.init(t0)))
    polished = jnp.clip(t, lo, hi)
    better = jnp.logical_and(jnp.isfinite(polished), objective(polished) >= values[best])
    return jnp.exp(jnp.where(better, polished, t0))


def _any_gaussian(curv: PyTree) -> jax.Array:
    if isinstance(curv, (BlockCurvature, LowRankCurvature, KronCurvature)):
        return jnp.asarray(True)
    return jnp.any(jnp.stack([jnp.any(jnp.isfinite(g)) for g in jax.tree.leaves(curv)]))


@jax.jit
def marglik_prior_precision(mean: PyTree, variance: PyTree, prior_precision: float) -> jax.Array:
    """The ``delta'`` that maximises the Laplace marginal likelihood of the posterior
    ``N(mean, variance)`` whose prior precision is ``prior_precision`` (module docstring);
    ``prior_precision`` itself when no coordinate is Gaussian."""
    curv = curvature(variance, prior_precision)
    found = maximise_log_scale(lambda t: log_marginal_likelihood(mean, curv, jnp.exp(t)), prior_precision)
    return jnp.where(_any_gaussian(curv), found, prior_precision)


def validation_prior_precision(nll: Callable[[PyTree], jax.Array], variance: PyTree, prior_precision: float) -> jax.Array:
    """The ``delta'`` that minimises ``nll(variance')``, the validation NLL of the posterior with
    variance ``1 / (G + delta')`` (traceable; ``nll`` holds its own fixed draws and mean).
    ``prior_precision`` itself when no coordinate is Gaussian."""
    curv = curvature(variance, prior_precision)
    found = maximise_log_scale(lambda t: -nll(with_prior_precision(curv, jnp.exp(t))), prior_precision)
    return jnp.where(_any_gaussian(curv), found, prior_precision)


def make_prior_precision_search(
    search: str, prior_precision: float, *, validation_nll: Callable[..., jax.Array] | None = None
) -> Callable[[jax.Array, PyTree, PyTree], tuple[PyTree, jax.Array]]:
    """Returns ``tune(key, mean, variance) -> (variance', delta')`` (compiled): the posterior's
    variance with the prior precision chosen by ``search``, and that precision.

    Args:
      search: ``"marglik"`` (the Laplace marginal likelihood) or ``"validation"`` (the validation
        NLL); ``"fixed"`` returns the variance unchanged and ``delta`` itself.
      prior_precision: ``delta``, the prior part of the posterior's precision
        (:attr:`fedbayes.algorithms.base.AlgorithmSpec.posterior_prior_precision`), > 0.
      validation_nll: ``(key, mean, variance) -> NLL`` on the validation split, traceable (e.g. the
        ``"nll"`` of :func:`fedbayes.evaluation.evaluators.marginal_metrics`); needed by
        ``"validation"``. ``key`` fixes its draws for every candidate.
    """
    if search not in SEARCHES:
        raise ValueError(f"prior_precision search must be one of {', '.join(SEARCHES)}; got {search!r}")
    if not prior_precision > 0:
        raise ValueError(f"prior_precision (the posterior's prior precision delta) must be > 0; got {prior_precision}")
    if search == "validation" and validation_nll is None:
        raise ValueError("the validation search needs validation_nll (a validation split: data.validation_fraction > 0)")
    delta = float(prior_precision)

    @jax.jit
    def tune(key, mean, variance):
        if search == "fixed":
            return variance, jnp.asarray(delta, jnp.float32)
        if search == "marglik":
            chosen = marglik_prior_precision(mean, variance, delta)
        else:
            chosen = validation_prior_precision(lambda v: validation_nll(key, mean, v), variance, delta)
        return with_prior_precision(curvature(variance, delta), chosen), chosen

    return tune
