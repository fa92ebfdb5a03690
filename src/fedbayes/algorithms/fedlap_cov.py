"""FedLap-Cov: the Laplace version of partitioned variational inference with a learned
(diagonal) precision (Swaroop, Khan and Doshi-Velez, "Connecting Federated ADMM to Bayes",
ICLR 2025, Sec. 3.3, Eqs. 13-14 and the final form of App. B, Eq. 21).

docs/algorithms.md §10. The prior is ``p_0 = N(0, I / delta)``; every site is a Gaussian factor
``t_k(w) ∝ exp(v_k^T w - 1/2 w^T V_k w)`` with two duals, the vector ``v_k`` and the precision
``V_k``; the global is their product, ``S_g = delta + sum_k V_k`` and ``w_g = S_g^{-1} sum_k v_k``.
One round, client ``k`` (``l_k`` the SUM loss, ``H_k`` its diagonal GGN):

    w_k <- argmin_w  l_k(w) + v_k^T w - 1/2 w^T V_k w + 1/2 (w - w_g)^T S_g (w - w_g)
    H_k <- diag GGN of l_k at the new w_k            (fedbayes.inference.curvature; no prior)
    S_k  = H_k + S_g - V_k                            (the local Laplace precision)
    (v_k, V_k) <- (v_k, V_k) + rho (S_k w_k - S_g w_g, S_k - S_g)

so ``V_k <- (1 - rho) V_k + rho H_k``: in natural parameters the site moves a fraction ``rho`` of
the way to ``t_k q_k / q_g`` (:func:`fedbayes.gaussian.damp`), whose precision is ``H_k``. The
server multiplies the sites' changes into ``q_g``. The fixed point (``w_k = w_g``, ``V_k = H_k``)
is the MAP of ``sum_k l_k(w) + delta/2 ||w||^2`` whatever the curvature; the curvature only
preconditions the way there.

Choices (those shared with FedLap, :mod:`fedbayes.algorithms.fedlap`, are stated there: the
mean-loss trainer minimising the objective divided by ``n_k``, the start of local training at the
initial parameters in round 1 and at ``w_g`` afterwards, partial participation by summed site
changes, no server optimizer):

* **Defaults that reach the fixed point.** The config's ``rho`` is adaptive by default
  (:mod:`fedbayes.algorithms.damping`: the server chooses it each round and broadcasts it); the
  fixed default before it was :data:`DEFAULT_RHO` ``= 0.5``, not the paper's ``1 / K``: each
  client's site moves a fraction of the way to its target whatever the cohort, so partial
  participation stays convergent (docs/results/posterior_defaults.md). The local solver must be
  unbiased: plain SGD reaches the fixed point, while Adam (restarted every round, sign-like steps)
  settles where the median of the minibatch gradients vanishes, away from the MAP
  (docs/results/posterior_defaults.md).

* **Positivity.** ``V_k`` is a convex combination of ``V_k >= 0`` and the GGN ``H_k >= 0``, so it
  stays non-negative exactly, and ``S_g >= delta``. The server keeps ``S_g`` at least ``delta``
  coordinatewise, absorbing float round-off of its running sum. A client whose curvature is not
  finite or has a negative entry flags its message (rejected; it keeps its site).
* **Initialisation** ``init_precision``: ``"delta"`` (default; PVI's) sends ``S_g = delta`` in
  round 1, ``"zero"`` sends ``S_g = 0`` in round 1 (the authors' code: no prox term in round 1, and
  the round-1 site update uses that zero). After the first server update both send
  ``delta + sum_k V_k``. ``w_g = 0`` in round 1 either way.
* **Messages**: the site change ``(Delta v_k, Delta V_k)`` and the client's flag, ``2P`` floats.
* ``server_posterior`` is ``(w_g, 1 / S_g)`` (marginalised predictions, ``model.npz``).

The update functions take :class:`PrecisionOps`, how a precision acts on a parameter vector:
:data:`DIAGONAL` for the diagonal algorithm, :data:`DENSE` for ``covariance = "full"``.

**Full covariance** (``covariance = "full"``; docs/algorithms.md §10.1): the same update with
``V_k``, ``S_g`` and ``S_k`` dense ``[D, D]`` matrices over the raveled parameters
(:class:`~fedbayes.gaussian_full.FullGaussian` sites and global) and ``H_k`` the client's dense GGN
(:func:`fedbayes.inference.curvature.data_full_ggn`), the paper's full-covariance FedLap-Cov
(Swaroop et al. 2025, Sec. 3.3 states the method for any precision structure). ``V_k`` stays a
convex combination of PSD matrices, so ``S_g - delta I`` is PSD and the server's product is exact in
the dense family (no floor is needed); ``w_g = S_g^{-1} eta_g`` is a Cholesky solve. Its
fixed point is still the MAP, and ``S_g`` there is the dense GGN Laplace precision
``delta I + sum_k GGN_k(w*)``: the full Laplace posterior (for a GLM with its canonical link the
GGN is the Hessian). A client whose GGN is not finite or has a negative diagonal entry flags its
message. For models of at most :data:`~fedbayes.algorithms.sites.MAX_FULL_PARAMS` parameters; no
robust aggregation or privacy.

**Last-layer structure** (``covariance = "last_layer"``; docs/algorithms.md §10.2): the same update
with :data:`BLOCK` precisions (:mod:`fedbayes.gaussian_block`): dense over the last layer's
weights, diagonal elsewhere, and ``H_k`` the GGN in that structure
(:func:`fedbayes.inference.curvature.data_block_ggn`: the last layer's dense GGN block, the
diagonal GGN of the other weights). Every update acts on the two blocks independently, each as its
family's (the diagonal's floor on the diagonal block, nothing to floor on the dense one), so the
fixed point is still the MAP and ``S_g`` there is Laplace Redux's last-layer GGN precision with the
rest diagonal (Daxberger et al. 2021, "Laplace Redux", Sec. 3; FedLap-Cov's Sec. 3.3 leaves the
structure open). For last layers of at most ``MAX_FULL_PARAMS`` parameters (a network's output
layer: 1,010 for the (200, 100) MLP on ten classes); no robust aggregation or privacy.

**Low-rank structure in a shared basis** (``covariance = "low_rank"``; docs/algorithms.md §10.3):
every precision is ``diag(d) + B S B^T`` (:mod:`fedbayes.gaussian_subspace`) with one orthonormal
basis ``B`` (``[D, r]``, ``r = rank``) that the server broadcasts, so the server's product stays a
sum of the sites' coordinates ``(v, d, S)``. A client's curvature target is ``H_k`` in that
structure, from its diagonal GGN and ``Y_k = G_k B`` (:func:`fedbayes.inference.curvature.data_subspace_ggn`):
``S = B^T G_k B`` and ``d = diag((I - P) G_k (I - P))``, ``P = B B^T``. The basis is found by
subspace iteration spread over the first ``basis_rounds`` rounds: ``B_0`` is random (the server's
key), and after round ``t`` the server sets ``B_{t+1} = orth(sum_k Y_k)``, the cohort's sketch of the
GGN's leading eigenspace (Halko, Martinsson and Tropp 2011, "Finding structure with randomness",
Alg. 4.3, the power scheme, one power step a round). During those rounds the sites' cores stay zero
(the targets are the diagonal method's: ``d = diag(G_k)``, ``S = 0``), so no site ever has to be
re-expressed in a new basis; from round ``basis_rounds`` on ``B`` is fixed and the cores grow. The
fixed point is still the MAP, and ``S_g`` there is ``delta I + diag((I - P) G (I - P)) + P G P``
for the total GGN ``G`` at the MAP and ``P`` of the fixed basis: exact in the span of ``B``,
diagonal outside it (Laplace Redux's low-rank Laplace, Daxberger et al. 2021, Sec. 3, keeps the
top eigenpairs and the prior only). Every message also carries its ``Y_k`` (``D r`` numbers), which
the server uses only in the basis rounds. No robust aggregation or privacy.

**Kronecker-factored structure** (``covariance = "kron"``; docs/algorithms.md §10.4): every
precision is ``U diag(s) U^T`` with ``U = L kron R`` per dense or conv layer
(:mod:`fedbayes.gaussian_kron`), bases the server broadcasts, so the server's product is a sum of
the eigenvalues. A client's curvature target is ``s = diag(U^T G_k U)``, EKFAC's corrected
eigenvalues (George et al. 2018, Sec. 3.2), and its message carries its layers' Kronecker factors
(K-FAC's input and output-gradient second moments, Martens and Grosse 2015, Sec. 3;
:func:`fedbayes.inference.curvature.data_kron_ggn`). The bases are the identity (the diagonal
method) for ``basis_rounds`` rounds; then the server sets them to the eigenvectors of the cohort's
summed factors and moves ``q_g``'s eigenvalues into them by the diagonal projection
(:func:`fedbayes.gaussian_kron.project`, linear, so it commutes with the sum over sites), keeping
its mean ``w_s`` (``eta' = Lambda' w_s``). A site from the basis rounds is moved about the same
``w_s`` when its client next takes part (:func:`fedbayes.gaussian_kron.move`; :class:`KronSite` records which sites
have moved), so the server's product stays the sites' product whoever was absent. The fixed point is still the MAP, and ``S_g`` there is
``U diag(delta + diag(U^T G U)) U^T`` (Laplace Redux's KFAC Laplace, Daxberger et al. 2021,
Sec. 3, with EKFAC's eigenvalues). No robust aggregation or privacy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from pydantic import Field

from fedbayes import gaussian, gaussian_block, gaussian_full, gaussian_kron, gaussian_subspace, tree
from fedbayes.algorithms import damping as damping_policy
from fedbayes.algorithms import sites
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, stored_setting
from fedbayes.algorithms.laplace_sites import check_settings, training_start
from fedbayes.algorithms.sites import BROADCAST_LOSS_TAG, GaussianMessage, full_personal_moments, gaussian_message_ok, personal_moments
from fedbayes.data.batches import ClientData
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_block import BlockGaussian, BlockPrecision
from fedbayes.gaussian_full import FullGaussian
from fedbayes.gaussian_kron import KronFrame, KronGaussian
from fedbayes.gaussian_subspace import SubspaceGaussian, SubspacePrecision
from fedbayes.inference.base import LocalSolver
from fedbayes.inference.curvature import TASKS as CURVATURE_TASKS
from fedbayes.inference.curvature import data_block_ggn, data_curvature, data_full_ggn, data_kron_ggn, data_subspace_ggn
from fedbayes.inference.sgd import LocalTrainer, broadcast_loss, per_example, run_sgd, stiff_step_control

PyTree = Any
DEFAULT_RHO = 0.5  # the config's default site damping (docs/results/posterior_defaults.md)
# the local step control's cap on lr times the penalty's curvature (client_step)
STEP_CAP = 1.0
Curvature = Callable[[PyTree, ClientData], PyTree]  # (params, data) -> diagonal curvature of the sum loss
INIT_PRECISIONS = ("delta", "zero")
COVARIANCES = ("diagonal", "full", "last_layer", "low_rank", "kron")
DEFAULT_RANK = sites.DEFAULT_RANK
DEFAULT_BASIS_ROUNDS = sites.DEFAULT_BASIS_ROUNDS

__all__ = [
    "BLOCK",
    "COVARIANCES",
    "DENSE",
    "DIAGONAL",
    "INIT_PRECISIONS",
    "Broadcast",
    "Curvature",
    "FedLapCovConfig",
    "FedLapCovInfo",
    "KronSite",
    "PrecisionOps",
    "ServerState",
    "client_step",
    "fedlap_cov",
    "kron_ops",
    "local_fit",
    "server_step",
    "site_terms",
    "site_update",
    "subspace_ops",
]


class PrecisionOps(NamedTuple):
    """How a precision acts on parameters.

    Attributes:
      matvec: ``(precision, x) -> precision x``.
      solve: ``(precision, x) -> precision^{-1} x``.
      scaled_identity: ``(params, c) -> c I`` as a precision for ``params``.
      at_least: ``(precision, c) -> precision`` raised to at least ``c I`` where that is cheap
        (coordinatewise for a diagonal); the identity otherwise.
      make: ``(eta, precision) -> Gaussian`` of the family (:class:`~fedbayes.gaussian.DiagGaussian`
        or :class:`~fedbayes.gaussian_full.FullGaussian`).
      family: the family's algebra (:mod:`fedbayes.gaussian` or :mod:`fedbayes.gaussian_full`).
      to_diag: a Gaussian of the family as a diagonal one, for the damping's rule (the
        moment-matched diagonal of a dense one).
      row_bound: ``(precision, params) -> bound`` shaped like ``params``: per coordinate, a bound
        on the curvature of the quadratic ``x^T precision x / 2`` (the absolute value of a diagonal;
        a dense matrix's Gershgorin row sums ``sum_j |P_ij|``), for the local step's control
        (:func:`~fedbayes.inference.sgd.stiff_step_control`).
      quad: ``(precision, x) -> x^T precision x``, or ``None``. Given, the client's site and cavity
        terms are one quadratic in ``w`` whose linear and constant parts are formed once a round
        (:func:`local_fit`): each local step then applies the precision once, not twice (the
        low-rank structure's basis is ``D r`` numbers, read from memory at every application).
    """

    matvec: Callable
    solve: Callable
    scaled_identity: Callable
    at_least: Callable
    make: Callable = DiagGaussian
    family: Any = gaussian
    to_diag: Callable = lambda g: g
    row_bound: Callable = lambda p, params: jax.tree.map(jnp.abs, p)
    quad: Callable | None = None


DIAGONAL = PrecisionOps(
    matvec=lambda p, x: jax.tree.map(jnp.multiply, p, x),
    solve=lambda p, x: jax.tree.map(jnp.divide, x, p),
    scaled_identity=optax.tree.full_like,
    at_least=lambda p, c: jax.tree.map(lambda s: jnp.maximum(s, jnp.asarray(c, s.dtype)), p),
)


def _dense_solve(p: jax.Array, x: PyTree) -> PyTree:
    flat, unravel = ravel_pytree(x)
    return unravel(jax.scipy.linalg.cho_solve((gaussian_full.cholesky(p), True), flat.astype(p.dtype)))  # on the server: never batched


def _dense_identity(params: PyTree, c: float) -> jax.Array:
    flat, _ = ravel_pytree(params)
    return c * jnp.eye(flat.size, dtype=flat.dtype)


DENSE = PrecisionOps(
    matvec=gaussian_full.matvec,
    solve=_dense_solve,  # a Cholesky solve (S_g is positive definite: delta I plus PSD sites)
    scaled_identity=_dense_identity,
    at_least=lambda p, c: p,  # S_g - delta I is a sum of PSD matrices: nothing to floor
    make=FullGaussian,
    family=gaussian_full,
    to_diag=gaussian_full.project_to_diag,
    row_bound=gaussian_full.row_bound,
)


def _block_at_least(p: BlockPrecision, c: float) -> BlockPrecision:
    # the diagonal's running sum is floored as the diagonal family's; the dense block is delta I plus PSD sites
    return BlockPrecision(DIAGONAL.at_least(p.diagonal, c), p.dense, p.key)


BLOCK = PrecisionOps(
    matvec=gaussian_block.matvec,
    solve=gaussian_block.solve,
    scaled_identity=gaussian_block.scaled_identity,
    at_least=_block_at_least,
    make=BlockGaussian,
    family=gaussian_block,
    to_diag=gaussian_block.project_to_diag,
    row_bound=gaussian_block.row_bound,
)
OPS = {"diagonal": DIAGONAL, "full": DENSE, "last_layer": BLOCK}


def _family_ops(family, make: Callable) -> PrecisionOps:
    """:class:`PrecisionOps` of a family in a shared basis (its algebra object): the diagonal part's
    running sum is floored as the diagonal family's, the rest is a sum of PSD sites."""
    return PrecisionOps(
        matvec=family.matvec,
        solve=family.solve,
        scaled_identity=family.scaled_identity,
        at_least=family.at_least,
        make=make,
        family=family,
        to_diag=family.project_to_diag,
        row_bound=family.row_bound,
        quad=family.quad,
    )


def subspace_ops(basis: jax.Array) -> PrecisionOps:
    """:class:`PrecisionOps` of the low-rank structure in the basis ``basis``
    (:func:`fedbayes.gaussian_subspace.in_basis`); the diagonal's running sum is floored as the
    diagonal family's, the core is a sum of PSD sites' cores."""
    return _family_ops(gaussian_subspace.in_basis(basis), SubspaceGaussian)


def kron_ops(bases: PyTree) -> PrecisionOps:
    """:class:`PrecisionOps` of the Kronecker-factored structure in the bases ``bases``
    (:func:`fedbayes.gaussian_kron.in_bases`): the eigenvalues' running sum is floored as the
    diagonal family's (``delta I`` is ``delta`` in every orthonormal basis)."""
    return _family_ops(gaussian_kron.in_bases(bases), KronGaussian)


class KronSite(NamedTuple):
    """A client's site under ``covariance = "kron"``: the factor, and whether its eigenvalues are in
    the fixed bases (1) or still in the identity bases of the basis rounds (0: projected when the
    client next takes part, :func:`fedbayes.gaussian_kron.project`, as the server projected its
    product when it fixed the bases)."""

    factor: KronGaussian
    fixed: jax.Array


class ServerState(NamedTuple):
    """FedLap-Cov server state.

    Attributes:
      params: the global mean ``w_g = S_g^{-1} sum_k v_k``.
      q: ``q_g`` in natural parameters, ``(sum_k v_k, delta + sum_k V_k)``.
      init: the model's initial parameters, where local training starts in round 1.
      round: rounds done.
      damping: the site damping the next round's clients use
        (:class:`~fedbayes.algorithms.damping.DampingState`).
      basis: ``covariance = "low_rank"``: the shared orthonormal basis ``[D, r]`` of every
        precision; ``"kron"``: the layers' Kronecker eigenbases
        (:class:`~fedbayes.gaussian_kron.KronBasis` per leaf); ``None`` (no leaf) otherwise.
    """

    params: optax.Params
    q: DiagGaussian
    init: optax.Params
    round: jax.Array
    damping: damping_policy.DampingState | None = None
    basis: jax.Array | None = None


class Broadcast(NamedTuple):
    """What clients receive: ``w_g``, the precision ``S_g`` they use, where training starts, the
    round's site damping ``rho``, and with ``covariance = "low_rank"`` or ``"kron"`` the basis and
    whether it is fixed (the sites' structure grows from then on); ``None`` (no leaf) otherwise."""

    anchor: optax.Params
    precision: PyTree
    start: optax.Params
    damping: jax.Array | float = 1.0
    basis: jax.Array | None = None
    basis_fixed: jax.Array | None = None


class FedLapCovInfo(NamedTuple):
    """The server step's info.

    Attributes:
      damping: the site damping ``rho`` this round's clients used.
    """

    damping: jax.Array | float


def site_terms(w, message: Broadcast, site: DiagGaussian, ops: PrecisionOps = DIAGONAL) -> jax.Array:
    """``v_k^T w - 1/2 w^T V_k w + 1/2 (w - w_g)^T S_g (w - w_g)``: the site and cavity terms of the
    client objective on the sum-loss scale."""
    diff = optax.tree.sub(w, message.anchor)
    return (
        optax.tree.vdot(site.precision_mean, w)
        - 0.5 * optax.tree.vdot(w, ops.matvec(site.precision, w))
        + 0.5 * optax.tree.vdot(diff, ops.matvec(message.precision, diff))
    )


def site_update(site: DiagGaussian, w_k, message: Broadcast, curvature: PyTree, damping: float | jax.Array, ops: PrecisionOps = DIAGONAL) -> DiagGaussian:
    """The damped site update: ``t_k <- t_k^(1 - rho) (t_k q_k / q_g)^rho`` (``rho`` the damping) with
    the local Laplace ``q_k = (S_k w_k, S_k)``, ``S_k = H_k + S_g - V_k``; the target's precision is
    ``H_k``. A convex combination (:func:`fedbayes.gaussian.damp`), as the paper writes it; ``rho``
    may be traced (the adaptive damping arrives in the broadcast)."""
    s_g = message.precision
    s_k = optax.tree.sub(optax.tree.add(curvature, s_g), site.precision)
    change = optax.tree.sub(ops.matvec(s_k, w_k), ops.matvec(s_g, message.anchor))
    target = ops.make(optax.tree.add(site.precision_mean, change), curvature)
    return ops.family.damp(site, target, damping)


def client_step(
    key: jax.Array,
    message: Broadcast,
    site: DiagGaussian,
    data: ClientData,
    trainer: LocalTrainer,
    *,
    damping: float,
    curvature: Curvature,
    ops: PrecisionOps = DIAGONAL,
    solver: LocalSolver = run_sgd,
):
    """One FedLap-Cov client round. Returns ``(w_k, H_k, new_site, info)``.

    The penalty's curvature, ``(S_g - V_k) / n_k`` (the cavity's precision per example), is known
    before the first step; where the client optimizer's step would be unstable on it (a small client
    under a cavity of many sites: ``lr (S_g - V_k) / n_k > 2``, which a dense ``S_g`` of correlated
    features reaches first, through its largest eigenvalue), the step is scaled down coordinate by
    coordinate (:func:`~fedbayes.inference.sgd.stiff_step_control` with ``ops.row_bound``; the
    local optimum is unchanged, every other coordinate steps as the optimizer does)."""
    w_k, info = local_fit(key, message, site, data, trainer, ops=ops, solver=solver)
    h_k = curvature(w_k, data)
    return w_k, h_k, site_update(site, w_k, message, h_k, damping, ops), info


def local_fit(
    key: jax.Array, message: Broadcast, site, data: ClientData, trainer: LocalTrainer, *, ops: PrecisionOps = DIAGONAL, solver: LocalSolver = run_sgd
):
    """The client's local optimisation of :func:`client_step`: ``(w_k, info)``. With ``ops.quad``
    the site and cavity terms are written as the one quadratic ``1/2 w^T (S_g - V_k) w - w^T (S_g
    w_g - v_k) + 1/2 w_g^T S_g w_g`` (:func:`site_terms` expanded), its linear and constant parts
    formed once."""
    cavity_precision = jax.tree.map(jnp.subtract, message.precision, site.precision)
    if ops.quad is None:

        def penalty(w):
            return per_example(site_terms(w, message, site, ops), data.num_examples)

    else:
        anchored = ops.matvec(message.precision, message.anchor)
        linear = optax.tree.sub(anchored, site.precision_mean)
        constant = 0.5 * optax.tree.vdot(message.anchor, anchored)

        def penalty(w):
            return per_example(0.5 * ops.quad(cavity_precision, w) - optax.tree.vdot(w, linear) + constant, data.num_examples)

    controlled = stiff_step_control(trainer, ops.row_bound(cavity_precision, message.start), data.num_examples, STEP_CAP)
    return solver(key, message.start, data, controlled, penalty)


def server_init(params, delta: float, ops: PrecisionOps = DIAGONAL, damping: damping_policy.Damping | None = None) -> ServerState:
    """``q_g = p_0 = N(0, I / delta)``, ``w_g = 0``, and the damping's state (``None``: fixed at 0.5)."""
    q = ops.make(optax.tree.zeros_like(params), ops.scaled_identity(params, delta))
    damping = damping if damping is not None else damping_policy.fixed(DEFAULT_RHO)
    return ServerState(optax.tree.zeros_like(params), q, params, jnp.zeros((), jnp.int32), damping.init(params))


def broadcast(state: ServerState, init_precision: str = "delta") -> Broadcast:
    precision = state.q.precision
    if init_precision == "zero":
        precision = jax.tree.map(lambda s: jnp.where(state.round == 0, jnp.zeros_like(s), s), precision)
    return Broadcast(state.params, precision, training_start(state.init, state.params, state.round), state.damping.value)


def server_step(
    state: ServerState,
    site_change_total: DiagGaussian,
    delta: float,
    ops: PrecisionOps = DIAGONAL,
    damping: damping_policy.Damping | None = None,
    loss: jax.Array | None = None,
) -> ServerState:
    """``q_g <- q_g prod_k (t_k^new / t_k)`` over the accepted clients, ``S_g`` kept at least
    ``delta``, and ``w_g = S_g^{-1} eta_g``; the damping's rule sees the change and the cohort's
    loss at the broadcast (``damping=None``: kept)."""
    q = ops.family.product(state.q, site_change_total)
    q = ops.make(q.precision_mean, ops.at_least(q.precision, delta))
    rule = damping.update(state.damping, ops.to_diag(state.q), ops.to_diag(q), loss) if damping is not None else state.damping
    return ServerState(ops.solve(q.precision, q.precision_mean), q, state.init, state.round + 1, rule)


def _valid_curvature(h) -> jax.Array:
    return jnp.logical_and(tree.all_finite(h), jnp.all(jnp.asarray([jnp.all(x >= 0) for x in jax.tree.leaves(h)] or [True])))


def _valid_dense_curvature(h: jax.Array) -> jax.Array:
    """A dense GGN: finite with a non-negative diagonal (it is PSD by construction; off-diagonal
    entries may be negative)."""
    return jnp.logical_and(tree.all_finite(h), jnp.all(jnp.diagonal(h) >= 0))


def _valid_block_curvature(h: BlockPrecision) -> jax.Array:
    return jnp.logical_and(_valid_curvature(h.diagonal), _valid_dense_curvature(h.dense))


VALID = {"diagonal": _valid_curvature, "full": _valid_dense_curvature, "last_layer": _valid_block_curvature}


def fedlap_cov(
    trainer: LocalTrainer,
    curvature: Curvature,
    *,
    delta: float,
    damping: float | damping_policy.Damping,
    init_precision: str = "delta",
    solver: LocalSolver = run_sgd,
    covariance: str = "diagonal",
    rank: int = DEFAULT_RANK,
    basis_rounds: int = DEFAULT_BASIS_ROUNDS,
) -> Algorithm:
    """FedLap-Cov (docs/algorithms.md §10) with diagonal precisions, or a structured one (``covariance``).

    Args:
      trainer: local training (mean loss, optimizer, epochs, batch size).
      curvature: ``(params, data) -> curvature of the client's sum loss`` (PSD): diagonal, e.g.
        :func:`fedbayes.inference.curvature.data_curvature`, or with ``covariance = "full"`` the
        dense ``[D, D]`` matrix, e.g. :func:`fedbayes.inference.curvature.data_full_ggn`.
      delta: prior precision (sum-loss scale), > 0.
      damping: site damping ``rho``, a fixed value in (0, 1] or a policy
        (:func:`fedbayes.algorithms.damping.adaptive`).
      init_precision: ``"delta"`` or ``"zero"``, the ``S_g`` clients use in round 1.
      solver: the local solver, ``run_sgd`` by default (tests pass an exact one).
      covariance: ``"diagonal"``, ``"full"`` (:data:`DENSE` precisions), ``"last_layer"``
        (:data:`BLOCK` precisions: dense over the last layer, diagonal elsewhere) or ``"low_rank"``
        (:func:`subspace_ops`: diagonal plus rank ``rank`` in a shared basis; ``curvature`` is then
        ``(params, data, basis) -> (diag GGN, GGN basis)``, e.g.
        :func:`fedbayes.inference.curvature.data_subspace_ggn`; module docstring).
        With ``"kron"`` (:func:`kron_ops`: eigenvalues in per-layer Kronecker eigenbases),
        ``curvature`` is ``(params, data, bases) -> (eigenvalues, Kronecker factors)``, e.g.
        :func:`fedbayes.inference.curvature.data_kron_ggn`.
      rank: ``covariance = "low_rank"``: the basis's directions ``r``.
      basis_rounds: ``covariance = "low_rank"``: the rounds of subspace iteration before the basis
        is fixed; ``"kron"``: the rounds in the identity bases before the Kronecker bases are set;
        at least 1.
    """
    if not isinstance(damping, damping_policy.Damping):
        check_settings("fedlap_cov", delta, damping)
        damping = damping_policy.fixed(damping)
    else:
        check_settings("fedlap_cov", delta, 1.0)
    if init_precision not in INIT_PRECISIONS:
        raise ValueError(f"fedlap_cov: init_precision must be one of {', '.join(INIT_PRECISIONS)}; got {init_precision!r}")
    if covariance not in COVARIANCES:
        raise ValueError(f"fedlap_cov: covariance must be one of {', '.join(COVARIANCES)}; got {covariance!r}")
    if covariance == "low_rank":
        if rank < 1 or basis_rounds < 1:
            raise ValueError(f"fedlap_cov: rank and basis_rounds must be at least 1; got {rank} and {basis_rounds}")
        return _low_rank(trainer, curvature, delta=delta, damping=damping, init_precision=init_precision, solver=solver, rank=rank, basis_rounds=basis_rounds)
    if covariance == "kron":
        if basis_rounds < 1:
            raise ValueError(f"fedlap_cov: basis_rounds must be at least 1; got {basis_rounds}")
        return _kron(trainer, curvature, delta=delta, damping=damping, init_precision=init_precision, solver=solver, basis_rounds=basis_rounds)
    ops, valid = OPS[covariance], VALID[covariance]

    def client_update(key, message: Broadcast, site, data):
        fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), message.start, data, trainer) if damping.adaptive else None
        _, h_k, new_site, info = client_step(key, message, site, data, trainer, damping=message.damping, curvature=curvature, ops=ops, solver=solver)
        return GaussianMessage(ops.family.difference(new_site, site), valid(h_k), fit), new_site, info

    def server_update(key, state, aggregate):
        del key
        return server_step(state, aggregate.total.difference, delta, ops, damping=damping, loss=aggregate.mean.loss), FedLapCovInfo(state.damping.value)

    def message_ok(state, message):
        # No positivity check: the server floors S_g at delta (server_step), it never keeps an old value.
        return gaussian_message_ok(message)

    def server_posterior(state):
        if covariance == "diagonal":
            return state.params, jax.tree.map(jnp.reciprocal, state.q.precision)
        return state.params, ops.family.variance(state.q)

    def personal_posterior(state, site, weight):
        if covariance != "diagonal":
            return full_personal_moments(state.q, site, weight)
        return personal_moments(state.q, site, weight, state.params)  # q_g t_k^w (docs/algorithms.md §13.8); V_k >= 0 keeps it proper

    return Algorithm(
        name="fedlap_cov",
        server_init=lambda key, params: server_init(params, delta, ops, damping=damping),
        broadcast=lambda state: broadcast(state, init_precision),
        client_init=ops.family.uniform_like,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=message_ok,
        trainer=trainer,
        server_posterior=server_posterior,
        after_rejected_round=lambda state: state._replace(damping=damping.rejected(state.damping)),
        personal_posterior=personal_posterior,
        server_precision=(lambda state: state.q.precision) if covariance != "diagonal" else None,
    )


def _valid_subspace_curvature(h: SubspacePrecision) -> jax.Array:
    return jnp.logical_and(_valid_curvature(h.diagonal), _valid_dense_curvature(h.core))


def _low_rank(trainer, curvature, *, delta, damping, init_precision, solver, rank, basis_rounds) -> Algorithm:
    """FedLap-Cov with ``covariance = "low_rank"`` (module docstring): the basis rides in the server
    state and the broadcast, and every precision is a :class:`~fedbayes.gaussian_subspace.SubspacePrecision`
    in it."""

    def init(key, params):
        dim = ravel_pytree(params)[0].size
        basis = gaussian_subspace.orthonormal_basis(jax.random.normal(key, (dim, rank), ravel_pytree(params)[0].dtype))
        return server_init(params, delta, subspace_ops(basis), damping=damping)._replace(basis=basis)

    def send(state):
        return broadcast(state, init_precision)._replace(basis=state.basis, basis_fixed=state.round >= basis_rounds)

    def client_update(key, message: Broadcast, site, data):
        ops = subspace_ops(message.basis)
        fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), message.start, data, trainer) if damping.adaptive else None
        w_k, info = local_fit(key, message, site, data, trainer, ops=ops, solver=solver)
        diag, sketch = curvature(w_k, data, message.basis)
        structured = gaussian_subspace.from_curvature(diag, sketch, message.basis)
        # the basis rounds' target is the diagonal method's: the sites' cores stay zero until the basis is fixed
        h_k = SubspacePrecision(
            jax.tree.map(lambda a, b: jnp.where(message.basis_fixed, a, b), structured.diagonal, diag),
            jnp.where(message.basis_fixed, structured.core, jnp.zeros_like(structured.core)),
        )
        new_site = site_update(site, w_k, message, h_k, message.damping, ops)
        return GaussianMessage(gaussian_subspace.difference(new_site, site), _valid_subspace_curvature(h_k), fit, sketch), new_site, info

    def server_update(key, state, aggregate):
        del key
        new = server_step(state, aggregate.total.difference, delta, subspace_ops(state.basis), damping=damping, loss=aggregate.mean.loss)
        # a basis round: the cohort's sketch G B gives the next basis (one step of subspace iteration);
        # the cores are zero then, and the projection keeps that exact
        moving = state.round < basis_rounds
        basis = jnp.where(moving, gaussian_subspace.orthonormal_basis(aggregate.total.sketch), state.basis)
        q = jax.tree.map(lambda a, b: jnp.where(moving, a, b), gaussian_subspace.project(new.q, state.basis, basis), new.q)
        params = jax.tree.map(lambda a, b: jnp.where(moving, a, b), subspace_ops(basis).solve(q.precision, q.precision_mean), new.params)
        return new._replace(q=q, params=params, basis=basis), FedLapCovInfo(state.damping.value)

    def server_posterior(state):
        return state.params, gaussian_subspace.in_basis(state.basis).variance(state.q)

    def personal_posterior(state, site, weight):
        family = gaussian_subspace.in_basis(state.basis)
        q_k = family.product(state.q, family.power(site, weight))
        q_k = jax.tree.map(lambda a, b: jnp.where(family.is_proper(q_k), a, b), q_k, state.q)
        return family.mean(q_k), family.variance(q_k)

    return _with_basis(
        trainer,
        damping,
        init=init,
        send=send,
        client_init=lambda params: gaussian_subspace.uniform_like(params, rank),
        client_update=client_update,
        server_update=server_update,
        server_posterior=server_posterior,
        personal_posterior=personal_posterior,
        server_precision=lambda state: gaussian_subspace.in_basis(state.basis).to_lowrank(
            SubspaceGaussian(optax.tree.zeros_like(state.params), state.q.precision)
        ),
    )


def _with_basis(
    trainer, damping, *, init, send, client_init, client_update, server_update, server_posterior, personal_posterior, server_precision
) -> Algorithm:
    """The :class:`~fedbayes.algorithms.base.Algorithm` of a structure in a shared basis: the
    basis rides in the server state and the broadcast, a message carries a sketch or factors (which
    must be finite too)."""
    return Algorithm(
        name="fedlap_cov",
        server_init=init,
        broadcast=send,
        client_init=client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=lambda state, message: gaussian_message_ok(message) & tree.all_finite(message.sketch),
        trainer=trainer,
        server_posterior=server_posterior,
        after_rejected_round=lambda state: state._replace(damping=damping.rejected(state.damping)),
        personal_posterior=personal_posterior,
        server_precision=server_precision,
    )


def _where(flag, a, b):
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def _kron(trainer, curvature, *, delta, damping, init_precision, solver, basis_rounds) -> Algorithm:
    """FedLap-Cov with ``covariance = "kron"`` (module docstring): the bases ride in the server
    state and the broadcast (:class:`~fedbayes.gaussian_kron.KronFrame`), every precision is a pytree of eigenvalues in them
    (:mod:`fedbayes.gaussian_kron`), and each site remembers whether it is in the fixed bases."""

    def init(key, params):
        del key
        frame = KronFrame(gaussian_kron.identity_bases(params), optax.tree.zeros_like(params))
        return server_init(params, delta, kron_ops(frame.bases), damping=damping)._replace(basis=frame)

    def send(state):
        return broadcast(state, init_precision)._replace(basis=state.basis, basis_fixed=state.round >= basis_rounds)

    def current(site: KronSite, fixed, frame: KronFrame) -> KronGaussian:
        # a site from the basis rounds, in the identity bases, as the server's product holds it since the bases were fixed
        # (a cond: a client run on its own moves its site only once; under vmap it is a select)
        return jax.lax.cond(fixed & (site.fixed == 0), lambda: gaussian_kron.move(site.factor, frame.bases, frame.anchor), lambda: site.factor)

    def client_update(key, message: Broadcast, site: KronSite, data):
        ops = kron_ops(message.basis.bases)
        fit = broadcast_loss(jax.random.fold_in(key, BROADCAST_LOSS_TAG), message.start, data, trainer) if damping.adaptive else None
        old = current(site, message.basis_fixed, message.basis)
        w_k, info = local_fit(key, message, old, data, trainer, ops=ops, solver=solver)
        h_k, factors = curvature(w_k, data, message.basis.bases)
        new = site_update(old, w_k, message, h_k, message.damping, ops)
        fixed = jnp.asarray(message.basis_fixed, site.fixed.dtype)
        return GaussianMessage(gaussian_kron.difference(new, old), _valid_curvature(h_k), fit, factors), KronSite(new, fixed), info

    def server_update(key, state, aggregate):
        del key
        new = server_step(state, aggregate.total.difference, delta, kron_ops(state.basis.bases), damping=damping, loss=aggregate.mean.loss)
        # the last basis round: the cohort's Kronecker factors give the bases; q_g's eigenvalues move
        # into them about its mean, which stays where it is (the prior delta I is delta in every basis)
        # (a cond: the factors' eigendecompositions run in that round only)

        def fix_bases():
            bases = gaussian_kron.bases_from_factors(aggregate.total.sketch)
            precision = gaussian_kron.project(new.q.precision, None, bases)
            return KronGaussian(kron_ops(bases).matvec(precision, new.params), precision), KronFrame(bases, new.params)

        q, frame = jax.lax.cond(state.round == basis_rounds - 1, fix_bases, lambda: (new.q, state.basis))
        return new._replace(q=q, basis=frame), FedLapCovInfo(state.damping.value)

    def server_posterior(state):
        return state.params, gaussian_kron.in_bases(state.basis.bases).variance(state.q)

    def personal_posterior(state, site: KronSite, weight):
        family = gaussian_kron.in_bases(state.basis.bases)
        q_k = family.product(state.q, family.power(current(site, state.round >= basis_rounds, state.basis), weight))
        q_k = _where(family.is_proper(q_k), q_k, state.q)
        return family.mean(q_k), family.variance(q_k)

    return _with_basis(
        trainer,
        damping,
        init=init,
        send=send,
        client_init=lambda params: KronSite(gaussian_kron.uniform_like(params), jnp.zeros((), jnp.int32)),
        client_update=client_update,
        server_update=server_update,
        server_posterior=server_posterior,
        personal_posterior=personal_posterior,
        server_precision=lambda state: gaussian_kron.KronSpread(state.q.precision, state.basis.bases),
    )


class FedLapCovConfig(sites.SharedBasisSettings):
    """FedLap-Cov (docs/algorithms.md §10)."""

    name: Literal["fedlap_cov"]
    delta: float = Field(1.0, gt=0, description="prior precision delta, on the sum-loss scale")
    rho: Annotated[float, Field(gt=0, le=1)] | Literal["adaptive"] = Field(
        damping_policy.ADAPTIVE,
        description="site damping rho: adaptive (the default: starts at 0.5, grown while the global posterior contracts, shrunk when it "
        "swings back or grows) or a fixed value in (0, 1] (the paper's 1 / num_clients); use a plain SGD client: Adam's local optimum is biased",
    )
    init_precision: Literal[INIT_PRECISIONS] = Field(  # type: ignore[valid-type]
        "delta", description="S_g the clients use in round 1: delta (PVI's) or zero (the authors' code)"
    )
    covariance: Literal[COVARIANCES] = Field(  # type: ignore[valid-type]
        "diagonal",
        description="the precision of the sites and q_g: diagonal (default, the diagonal GGN), full, a dense [D, D] GGN over all D "
        f"parameters (the full Laplace at the fixed point; for models up to {sites.MAX_FULL_PARAMS} parameters, e.g. model.name = 'logreg'), "
        "last_layer, a dense GGN over the last layer's weights and the diagonal GGN elsewhere (Laplace Redux's last-layer structure; "
        f"for last layers up to {sites.MAX_FULL_PARAMS} parameters), or low_rank, the GGN exact in a shared basis of rank directions "
        "that the first basis_rounds rounds find (its leading eigenvectors) and diagonal outside it, for networks, or kron, per dense "
        "or conv layer the GGN's diagonal in the eigenbases of its two Kronecker factors (EKFAC), the bases fixed after basis_rounds rounds; "
        "full, last_layer, low_rank and kron take no robust aggregation or privacy",
    )


def build(hp: FedLapCovConfig, ctx: BuildContext) -> Algorithm:
    if ctx.apply_fn is None:
        raise ValueError("fedlap_cov: needs the model's apply_fn for the curvature")
    if ctx.task not in CURVATURE_TASKS:
        raise ValueError(
            f"fedlap_cov: needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {ctx.task!r}"
        )
    apply_fn, task, batch_size = ctx.apply_fn, ctx.task, ctx.trainer.batch_size
    if hp.covariance == "full":
        sites.check_full_size(ctx.num_params)

        def curvature(params, data):
            return data_full_ggn(apply_fn, params, data, batch_size=batch_size, task=task)

    elif hp.covariance == "last_layer":
        sites.check_last_layer_size(ctx.last_layer_params, ctx.num_params)

        def curvature(params, data):
            return data_block_ggn(apply_fn, params, data, batch_size=batch_size, task=task)

    elif hp.covariance == "low_rank":
        sites.check_low_rank_size(hp.rank, ctx.num_params)

        def curvature(params, data, basis):
            return data_subspace_ggn(apply_fn, params, data, basis, batch_size=batch_size, task=task)

    elif hp.covariance == "kron":
        if ctx.param_shapes is not None:
            sites.check_kron_size(ctx.param_shapes)

        def curvature(params, data, bases):
            return data_kron_ggn(apply_fn, params, data, bases, batch_size=batch_size, task=task)

    else:
        curvature = data_curvature(ctx.apply_fn, task=ctx.task, batch_size=ctx.trainer.batch_size)
    algorithm = fedlap_cov(
        ctx.trainer,
        curvature,
        delta=hp.delta,
        damping=damping_policy.from_setting(hp.rho),
        init_precision=hp.init_precision,
        covariance=hp.covariance,
        rank=hp.rank,
        basis_rounds=hp.basis_rounds,
    )
    return algorithm


def _stored_meaning(table: dict, stored: dict) -> dict:
    """A config written before ``rho`` had a value of its own meant ``1 / num_clients``."""
    if "rho" not in table:
        table["rho"] = 1.0 / stored_setting(stored, "data", "num_clients", 10)
    return table


SPEC = AlgorithmSpec(
    "fedlap_cov", FedLapCovConfig, build, "FedLap with diagonal-GGN site precisions: two duals, a preconditioned server",
    bayesian=True, exact_server="multiplies the clients' sites exactly", needs_apply_fn=True,
    # its posterior's width is set by the prior precision
    calibration_advice=(
        "to predict with a narrower posterior, choose its prior precision on held-out data (evaluation.prior_precision = \"validation\", "
        "data.validation_fraction > 0), or train with a larger algorithm.delta, the prior precision (docs/algorithms.md §10)"
    ),
    # S_g = delta + sum_k V_k: a GGN Laplace; the last-layer structure's search reads its dense block (evaluation.prior_precision);
    # a dense posterior's marginals are not 1 / (G_ii + delta): no post-hoc prior search there
    # the low-rank and Kronecker structures' prior precision is re-chosen on their own structure, the last layer's marginal drawn
    default_predictive="linearised", posterior_prior_precision=lambda hp: hp.delta if hp.covariance != "full" else None, local_budget="converged",
    stored_meaning=_stored_meaning,
    # a dense precision is no vector of coordinates: a robust rule's per-coordinate statistics, a precision cap and DP's clip and noise have no meaning for it
    settings_aggregator_policy=lambda hp: {
        "full": ("own", sites.FULL_AGGREGATOR_NOTE), "last_layer": ("own", sites.LAST_LAYER_AGGREGATOR_NOTE), "low_rank": ("own", sites.LOW_RANK_AGGREGATOR_NOTE),
        "kron": ("own", sites.KRON_AGGREGATOR_NOTE),
    }.get(hp.covariance),
)  # fmt: skip
SPECS = (SPEC,)
