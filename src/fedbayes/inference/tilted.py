"""FedEP's approximate tilted inference: four client methods (Guo et al. 2023 (FedEP) Sec. 2.2.2, Algs. 2-5).

Client ``k`` approximates its tilted distribution ``p_k(theta) q_{-k}(theta)`` (likelihood times
cavity) by a diagonal Gaussian ``q^_{\\k}`` (docs/algorithms.md §7.5-7.6). Every method starts with the same
**SG-MCMC step**: ``E`` epochs of the client optimizer from the broadcast mean ``mu_g`` on the
per-example-scaled tilted objective

    F_k(theta) = (1/n_k) [ l_k(theta) + theta^T diag(Lambda_p) theta / 2 - eta_p^T theta ],

where the tilted prior ``(eta_p, Lambda_p) = (eta_c, Lambda_c + lambda_wd n_k)`` is the cavity plus
weight decay as an extra prior (docs/algorithms.md §7.5); the parameters at the **end** of each epoch are the
samples (no within-epoch averaging; Guo et al. 2023 (FedEP) fn. 4). ``mu^`` is their mean and ``sigma^2`` their
unbiased diagonal variance. The methods differ in the tilted precision
``Lambda^ = Lambda_c + c L_k`` (``c`` the local-precision scale, ``alpha_cov = c (lambda_0 +
lambda_wd)``):

* ``identity`` (I): ``L_k = n_k (lambda_0 + lambda_wd)``, i.e. ``Lambda^ = Lambda_c + alpha_cov n_k``.
* ``mcmc`` (M): ``Lambda_raw = clip(1 / (s + (1 - s) sigma^2))`` (shrinkage ``s`` towards 1), rescaled
  to the norm of the identity method's ``Lambda_c + alpha_cov n_k`` (the samples set the shape).
* ``laplace`` (L): ``L_k = clip(F_k) + lambda_wd n_k`` with ``F_k = n_k mean_x (grad log p(y~|x, mu^))^2``
  and ``y~`` sampled from the model (Kunstner et al. 2019), over ``T_L`` passes (Guo et al. 2023 (FedEP) Eq. 4).
* ``ngvi`` (V): Guo et al. 2023 (FedEP) Alg. 5 with the tilted prior as the prior: ``s <- beta s + (1 - beta) clip(F_bar)``
  per minibatch, ``F_bar`` the sampled-label Fisher averaged over ``N_V`` draws
  ``theta ~ N(mu^, 1 / (n_k s^ + Lambda_p))``; ``L_k = n_k s^ + lambda_wd n_k``. By default ``s^`` is the
  bias-corrected average ``(s_t - beta^t s_0) / (1 - beta^t)`` (``t`` the minibatches averaged; Adam's
  correction, Kingma and Ba 2015): the paper's uncorrected ``s_t`` (``ngvi_bias_correction = False``)
  starts at ``s_0 = 0`` and stays a fraction ``1 - beta^t`` of the Fisher on a client with few
  minibatches, so its variances are too wide (docs/algorithms.md, "NGVI's bias correction";
  docs/results/posterior_defaults.md). The mean stays ``mu^``
  (the reference runs use ``mu_learning_rate = 0``).

The Fisher of L and V comes from :mod:`fedbayes.inference.curvature` (one sampled label per
example, per-layer ``(a^2)^T (g^2)`` sums: about a training step per batch instead of ~50), so
the paper's budgets are the defaults (``fisher_max_batches = 0``).

Stability (:func:`fedbayes.inference.sgd.stiff_step_control`): the SG-MCMC step's gradient is scaled per coordinate by
``1 / max(1, lr h_i)``, ``h_i = Lambda_p,i / n_k`` the tilted prior's exactly known curvature, so the
sampler stays stable when the Laplace/NGVI precisions make the cavity stiff (plain SGD diverges
once ``lr h_i > 2``); the tilted mode is unchanged and every coordinate with ``lr h_i <= 1`` takes
SGD's step bitwise.

**Defaults** (``scale = 1``, ``clip_ratio = 0``, ``weight_decay = 0``, bias-corrected NGVI): the sites
are at the likelihood's scale, so the laplace and ngvi methods reach the diagonal Laplace
``1 / diag(H)`` at the MAP (docs/results/posterior_defaults.md). The paper's heuristics (``c = 500``,
clipping at 2 standard deviations, ``lambda_wd = 1e-4``, no bias correction) shrink the variances by
about ``c`` and are kept as options for reproducing its tables. The identity and mcmc methods'
variance is a hyperparameter (``alpha_cov``), not the data's.

Finally ``eta^ = Lambda^ mu^``. A method is a
:class:`~fedbayes.inference.base.CavityInference`, ``infer(key, start, cavity, data) -> (DiagGaussian, info)``
(``start`` the sampler's first iterate; ``info`` the SG-MCMC step's training info); the FedEP
algorithm takes any such function (tests plug in exact Gaussian inference).

The Laplace and NGVI passes over the client's data are
:func:`fedbayes.inference.curvature.over_client_data`, the one pass FedLap-Cov's curvature uses too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from pydantic import Field

from fedbayes import gaussian_block, gaussian_full, gaussian_kron, gaussian_subspace
from fedbayes.data.batches import ClientData, steps_per_epoch
from fedbayes.gaussian import DiagGaussian
from fedbayes.gaussian_block import BlockGaussian
from fedbayes.gaussian_full import FullGaussian
from fedbayes.gaussian_subspace import SubspacePrecision
from fedbayes.hparams import HParams
from fedbayes.inference.base import CavityInference
from fedbayes.inference.clipping import ApplyFn, clip_by_spread, tree_scale_to_norm
from fedbayes.inference.curvature import TASKS as CURVATURE_TASKS
from fedbayes.inference.curvature import batch_diag_fisher, data_block_ggn, data_full_ggn, data_kron_ggn, data_subspace_ggn, over_client_data
from fedbayes.inference.iasg import epoch_of_sample, epoch_samples
from fedbayes.inference.sgd import LocalTrainer, stiff_step_control
from fedbayes.inference.vi_full import NATURAL_STEPS, natural_full_vi

PyTree = Any
METHODS = ("identity", "mcmc", "laplace", "ngvi", "nuts")
# the methods of the diagonal family (nuts matches moments in the dense one: fedbayes.inference.nuts)
DIAGONAL_METHODS = ("identity", "mcmc", "laplace", "ngvi")

__all__ = [
    "DIAGONAL_METHODS",
    "METHODS",
    "SHARED_BASIS_COVARIANCES",
    "TiltedSettings",
    "make_full_laplace_inference",
    "make_full_ngvi_inference",
    "make_shared_basis_laplace_inference",
    "make_tilted_inference",
    "sgmcmc_moments",
]


class TiltedSettings(HParams):
    """Hyperparameters of the client methods (Guo et al. 2023 (FedEP) Table 7; docs/algorithms.md §7.8), validated on creation.

    ``fisher_max_batches > 0`` stops the Laplace and NGVI loops after that many minibatches (of the
    shuffled passes, so a random subset of the client's data; the Laplace estimate ``n_k * mean``
    stays unbiased); 0 follows the paper (every pass). The Fisher comes from
    :mod:`fedbayes.inference.curvature` (about a training step per batch), so the cap is rarely
    needed. ``step_cap`` bounds the SG-MCMC step per coordinate, ``lr h_i <= step_cap`` on the
    tilted prior's curvature (:func:`fedbayes.inference.sgd.stiff_step_control`, the stability fix); ``<= 0`` disables it.
    """

    scale: float = Field(
        1.0,
        gt=0,
        description="c, the local-precision scale; 1 (default) puts the sites at the likelihood's scale, so laplace/ngvi give a posterior; "
        "the paper's 500 (preset = 'paper') gives variances ~600x too small",
    )
    weight_decay: float = Field(
        0.0, ge=0, description="lambda_wd: weight decay as an extra prior of precision lambda_wd n_k per client (0 by default: the prior is prior_precision)"
    )
    initial_precision: float = Field(0.0, ge=0, description="lambda_0 (identity method; NGVI's s_0)")
    mcmc_shrinkage: float = Field(1e-4, ge=0, le=1, description="mcmc method: variance shrinkage towards 1")
    clip_ratio: float = Field(
        0.0, ge=0, description="Fisher clipping to mean +- ratio * std (0, the default: off, the Fisher is the data's; the paper's 2 biases it)"
    )
    laplace_epochs: int = Field(5, ge=1, description="T_L, passes over the data for the Laplace Fisher")
    ngvi_epochs: int = Field(5, ge=1, description="T_V, NGVI passes")
    ngvi_samples: int = Field(
        5, ge=1, description="N_V, NGVI weight samples per minibatch; with covariance = 'full', antithetic pairs of draws per natural-gradient iteration"
    )
    ngvi_beta: float = Field(0.99, ge=0, lt=1, description="NGVI's moving-average factor beta")
    natural_steps: int = Field(
        NATURAL_STEPS, ge=2, description="ngvi method with covariance = 'full': natural-gradient iterations per client and round (each a pass per draw)"
    )
    ngvi_bias_correction: bool = Field(
        True,
        description="NGVI's Fisher average divided by 1 - beta^t (t: minibatches averaged), as Adam does; without it (the paper's, preset = 'paper') "
        "a client with few minibatches keeps s at a fraction of the Fisher and its variances too wide",
    )
    fisher_max_batches: int = Field(0, ge=0, description="laplace/ngvi: stop the Fisher passes after this many minibatches (0: all)")
    step_cap: float = Field(1.0, description="SG-MCMC step bound lr * h_i <= step_cap on the tilted prior's curvature (<= 0: off)")
    nuts_warmup: int = Field(500, ge=10, description="nuts method: warm-up transitions (step size and diagonal metric adaptation) per client and round")
    nuts_draws: int = Field(1000, ge=1, description="nuts method: kept draws per client and round (their mean is the tilted mean)")
    nuts_curvature_draws: int = Field(
        20, ge=1, description="nuts method: the draws (evenly spaced) at which the likelihood's curvature is averaged for the tilted precision"
    )
    nuts_target_accept: float = Field(0.9, gt=0, lt=1, description="nuts method: the warm-up's target acceptance probability")
    nuts_max_doublings: int = Field(10, ge=1, le=15, description="nuts method: the largest tree depth (at most 2^depth gradients per draw)")

    @property
    def alpha_cov(self) -> float:
        """Per-example local precision of the identity method, ``c (lambda_0 + lambda_wd)``."""
        return self.scale * (self.initial_precision + self.weight_decay)


def tilted_prior(cavity: DiagGaussian, num_examples: jax.Array, weight_decay: float) -> DiagGaussian:
    """The cavity with weight decay as an extra zero-mean prior of precision ``lambda_wd n_k``."""
    n = num_examples.astype(jnp.float32)
    return DiagGaussian(
        precision_mean=cavity.precision_mean,
        precision=jax.tree.map(lambda lam: lam + (weight_decay * n).astype(lam.dtype), cavity.precision),
    )


def sgmcmc_moments(key, start: PyTree, prior: DiagGaussian, data: ClientData, trainer: LocalTrainer) -> tuple[PyTree, PyTree, dict]:
    """The shared SG-MCMC step: mean and unbiased diagonal variance of the end-of-epoch iterates of
    ``trainer`` on ``F_k`` (docs/algorithms.md §7.6), and the training info. With one epoch the variance is zero.
    With a local budget that runs until the objective settles (``trainer.tol > 0``), the moments
    of the second half of the epochs run (:func:`_tail_moments`)."""
    inv_n = 1.0 / jnp.maximum(data.num_examples, 1).astype(jnp.float32)

    def penalty(theta):
        quad = optax.tree.sum(jax.tree.map(lambda lam, t: jnp.sum(lam * jnp.square(t)), prior.precision, theta))
        lin = optax.tree.vdot(prior.precision_mean, theta)
        return inv_n * (0.5 * quad - lin)

    return _penalised_moments(key, start, penalty, data, trainer)


def _penalised_moments(key, start: PyTree, penalty, data: ClientData, trainer: LocalTrainer) -> tuple[PyTree, PyTree, dict]:
    """:func:`sgmcmc_moments` on the client's mean loss plus any ``penalty(theta)``."""
    samples, _, info = epoch_samples(key, start, data, trainer, skip_epochs=0, average=False, penalty=penalty)
    num = trainer.num_epochs
    if trainer.tol > 0:
        mean, var = _tail_moments(samples, info["steps"] // jnp.maximum(steps_per_epoch(data.num_examples, trainer.batch_size), 1))
        return mean, var, info
    mean = jax.tree.map(lambda s: jnp.mean(s, axis=0), samples)
    var = jax.tree.map(lambda s: jnp.var(s, axis=0, ddof=1) if num > 1 else jnp.zeros(s.shape[1:], s.dtype), samples)
    return mean, var, info


def _tail_moments(samples: PyTree, done: jax.Array) -> tuple[PyTree, PyTree]:
    """Mean and unbiased variance of the second half of the ``done`` epochs' samples (epochs
    ``floor(done / 2) .. done - 1``, of those the ring of samples still holds: the last ``E``,
    :func:`fedbayes.inference.iasg.epoch_of_sample`): a client that ran until its objective
    settled spent its first epochs on the way to the tilted mode, and their iterates would pull
    the mean back towards the start (Polyak-Ruppert averaging of the tail)."""
    num = jax.tree.leaves(samples)[0].shape[0]
    e = epoch_of_sample(num, done)
    w = ((e >= done // 2) & (e >= 0) & (e < done)).astype(jnp.float32)
    count = jnp.maximum(jnp.sum(w), 1.0)

    def moments(s):
        ws = w.reshape((num,) + (1,) * (s.ndim - 1)).astype(s.dtype)
        mean = jnp.sum(ws * s, axis=0) / count.astype(s.dtype)
        var = jnp.sum(ws * jnp.square(s - mean[None]), axis=0) / jnp.maximum(count - 1.0, 1.0).astype(s.dtype)
        return mean, var

    pairs = jax.tree.map(moments, samples)
    is_pair = lambda x: isinstance(x, tuple)
    return jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair), jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)


def make_tilted_inference(
    method: str,
    trainer: LocalTrainer,
    settings: TiltedSettings = TiltedSettings(),
    *,
    apply_fn: ApplyFn | None = None,
    task: str = "classification",
) -> CavityInference:
    """One of the four client methods as a :class:`~fedbayes.inference.base.CavityInference`.

    Args:
      method: ``"identity"``, ``"mcmc"``, ``"laplace"`` or ``"ngvi"`` (I / M / L / V of Guo et al. 2023 (FedEP)).
      trainer: the SG-MCMC step's loss, optimizer, epochs (= samples) and batch size.
      settings: :class:`TiltedSettings`.
      apply_fn: ``(params, x) -> logits``; needed by ``laplace`` and ``ngvi``.
      task: how labels are sampled for the Fisher (``laplace`` and ``ngvi`` need one of
        :data:`fedbayes.inference.curvature.TASKS`; ``identity`` and ``mcmc`` take any task).
    """
    if method not in DIAGONAL_METHODS:
        raise ValueError(f"tilted inference method must be one of {', '.join(DIAGONAL_METHODS)} (nuts takes covariance = 'full'); got {method!r}")
    if method in ("laplace", "ngvi") and apply_fn is None:
        raise ValueError(f"the {method} method needs the model's apply_fn")
    if method == "mcmc" and trainer.num_epochs < 2:
        raise ValueError(f"the mcmc method estimates a variance from one sample per epoch: it needs >= 2 local epochs; got {trainer.num_epochs}")
    s = settings
    if method in ("laplace", "ngvi") and task not in CURVATURE_TASKS:
        raise ValueError(
            f"the {method} method needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {task!r}"
        )

    def laplace_fisher(key, mu, data):
        # Sum over the T_L passes of the sampled-label Fisher (fedbayes.inference.curvature, one
        # label per example and pass), divided by the examples seen: the per-example mean.
        def body(carry, step, batch):
            total, count = carry
            x, y, mask = batch
            f = batch_diag_fisher(apply_fn, mu, x, y, mask, key=jax.random.fold_in(key, step), task=task)
            return jax.tree.map(jnp.add, total, f), count + jnp.sum(mask)

        init = (optax.tree.zeros_like(mu), jnp.zeros(()))
        total, count = over_client_data(
            data, trainer.batch_size, body, init, passes=s.laplace_epochs, laid_out_epochs=trainer.num_epochs, max_batches=s.fisher_max_batches
        )
        return optax.tree.scale(1.0 / jnp.maximum(count, 1.0), total)

    def ngvi_precision(key, mu, prior, data, n):
        def corrected(state):
            # Adam's bias correction of a moving average started at s_0: (s_t - beta^t s_0) / (1 - beta^t).
            sv, t = state
            if not s.ngvi_bias_correction:
                return sv
            decay = jnp.power(jnp.float32(s.ngvi_beta), t)
            return jax.tree.map(lambda v: jnp.where(t > 0, (v - decay * s.initial_precision) / jnp.maximum(1.0 - decay, 1e-30), v), sv)

        def body(state, step, batch):
            x, y, mask = batch
            k = jax.random.fold_in(key, step)
            std = jax.tree.map(lambda sv, lam: jax.lax.rsqrt(n * sv + lam), corrected(state), prior.precision)
            keys = jax.random.split(k, s.ngvi_samples)
            inv_count = 1.0 / jnp.maximum(jnp.sum(mask), 1.0)

            def one(kj):
                kd, kf = jax.random.split(kj)
                leaves_keys = optax.tree.split_key_like(kd, mu)
                theta = jax.tree.map(lambda kk, m, sd: m + sd * jax.random.normal(kk, m.shape, m.dtype), leaves_keys, mu, std)
                return optax.tree.scale(inv_count, batch_diag_fisher(apply_fn, theta, x, y, mask, key=kf, task=task))

            f_bar = jax.tree.map(lambda f: jnp.mean(f, axis=0), jax.vmap(one)(keys))
            f_bar = clip_by_spread(f_bar, s.clip_ratio)
            # An all-padding batch carries no information: keep s.
            has_data = jnp.sum(mask) > 0
            sv, t = state
            new = jax.tree.map(lambda v, f: s.ngvi_beta * v + (1 - s.ngvi_beta) * f, sv, f_bar)
            return jax.tree.map(lambda a, b: jnp.where(has_data, a, b), new, sv), t + has_data.astype(jnp.float32)

        init = (optax.tree.full_like(mu, s.initial_precision), jnp.zeros((), jnp.float32))
        final = over_client_data(
            data, trainer.batch_size, body, init, passes=s.ngvi_epochs, laid_out_epochs=trainer.num_epochs, max_batches=s.fisher_max_batches
        )
        return corrected(final)

    def infer(key, start, cavity: DiagGaussian, data: ClientData) -> tuple[DiagGaussian, dict]:
        n = jnp.maximum(data.num_examples, 1).astype(jnp.float32)
        prior = tilted_prior(cavity, data.num_examples, s.weight_decay)
        key_mc, key_f = jax.random.split(key)
        mu, var, info = sgmcmc_moments(key_mc, start, prior, data, stiff_step_control(trainer, prior.precision, data.num_examples, s.step_cap))
        identity = jax.tree.map(lambda lam: lam + s.alpha_cov * n, cavity.precision)
        if method == "identity":
            lam = identity
        elif method == "mcmc":
            raw = jax.tree.map(lambda v: 1.0 / (s.mcmc_shrinkage + (1 - s.mcmc_shrinkage) * v), var)
            lam = tree_scale_to_norm(clip_by_spread(raw, s.clip_ratio), identity)
        elif method == "laplace":
            fisher = clip_by_spread(optax.tree.scale(n, laplace_fisher(key_f, mu, data)), s.clip_ratio)
            lam = jax.tree.map(lambda lc, f: lc + s.scale * (f + s.weight_decay * n), cavity.precision, fisher)
        else:
            sv = ngvi_precision(key_f, mu, prior, data, n)
            lam = jax.tree.map(lambda lc, v: lc + s.scale * (n * v + s.weight_decay * n), cavity.precision, sv)
        return DiagGaussian(precision_mean=jax.tree.map(jnp.multiply, lam, mu), precision=lam), info

    return infer


def _tilted_mode(key, start: PyTree, eta_c: PyTree, quad, bound: PyTree, data: ClientData, trainer: LocalTrainer, step_cap: float):
    """The mode of the tilted objective ``F_k(theta) = (1/n_k) [l_k(theta) + quad(theta) / 2 - eta_c^T
    theta]`` (``quad(theta) = theta^T Lambda_p theta`` in the cavity's structure) by the diagonal
    method's local optimisation (:func:`sgmcmc_moments`'s mean of the end-of-epoch iterates, from
    ``start``), each coordinate's step scaled by ``bound``, a Gershgorin bound on ``Lambda_p``'s
    rows (:func:`fedbayes.inference.sgd.stiff_step_control`). Returns ``(mode, info)``."""
    inv_n = 1.0 / jnp.maximum(data.num_examples, 1).astype(jnp.float32)

    def penalty(theta):
        return inv_n * (0.5 * quad(theta) - optax.tree.vdot(eta_c, theta))

    key_mc, _ = jax.random.split(key)
    mu, _, info = _penalised_moments(key_mc, start, penalty, data, stiff_step_control(trainer, bound, data.num_examples, step_cap))
    return mu, info


def make_full_laplace_inference(trainer: LocalTrainer, settings: TiltedSettings = TiltedSettings(), *, apply_fn: ApplyFn, task: str = "classification"):
    """The laplace method with a dense precision: ``infer(key, start, cavity, data) -> (FullGaussian, info)``
    for a :class:`~fedbayes.gaussian_full.FullGaussian` cavity ``(eta_c, Lambda_c)`` (Guo et al.
    2023 (FedEP) Sec. 2.2.2 with the full-covariance family of Vehtari et al. 2020, "Expectation
    propagation as a way of life", Sec. 3-4; docs/algorithms.md §7.12).

    The tilted prior is the cavity plus weight decay, ``Lambda_p = Lambda_c + lambda_wd n_k I``. The
    mode is found by the same local optimisation as the diagonal method's (:func:`sgmcmc_moments`'s
    mean of the end-of-epoch iterates, from ``start``) on

        F_k(theta) = (1/n_k) [ l_k(theta) + theta^T Lambda_p theta / 2 - eta_c^T theta ]

    (``theta`` raveled), its step scaled per coordinate by the Gershgorin bound ``sum_j
    |Lambda_p,ij|`` of the quadratic's curvature (:func:`fedbayes.inference.sgd.stiff_step_control`:
    a diagonal preconditioner, the mode unchanged). At the mode ``mu^`` the tilted precision is

        Lambda^ = Lambda_c + c (GGN_k(mu^) + lambda_wd n_k I),   eta^ = Lambda^ mu^,

    with ``GGN_k = sum_n J_n^T H_n J_n`` the dense generalised Gauss-Newton of the client's sum loss
    over one pass of its data (:func:`fedbayes.inference.curvature.data_full_ggn`) and ``c`` the
    local-precision scale (1 by default: the likelihood's).

    A last-layer cavity (:class:`~fedbayes.gaussian_block.BlockGaussian`: dense over the last layer,
    diagonal elsewhere) gives a last-layer tilted approximation by the same steps in that structure:
    ``GGN_k`` the last layer's dense block and the other weights' diagonal
    (:func:`fedbayes.inference.curvature.data_block_ggn`), the penalty's products and bounds the
    block family's (:mod:`fedbayes.gaussian_block`).
    """
    s = settings
    if task not in CURVATURE_TASKS:
        raise ValueError(
            f"the laplace method needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {task!r}"
        )

    def infer(key, start, cavity: FullGaussian | BlockGaussian, data: ClientData) -> tuple[FullGaussian | BlockGaussian, dict]:
        block = isinstance(cavity, BlockGaussian)
        family = gaussian_block if block else gaussian_full
        n = jnp.maximum(data.num_examples, 1).astype(jnp.float32)
        lam_p = family.shifted(cavity.precision, s.weight_decay * n)
        quad = lambda theta: optax.tree.vdot(theta, family.matvec(lam_p, theta))  # noqa: E731
        mu, info = _tilted_mode(key, start, cavity.precision_mean, quad, family.row_bound(lam_p, start), data, trainer, s.step_cap)
        curvature = data_block_ggn if block else data_full_ggn
        ggn = family.shifted(curvature(apply_fn, mu, data, batch_size=trainer.batch_size, task=task), s.weight_decay * n)
        lam = jax.tree.map(lambda c, g: c + s.scale * g.astype(c.dtype), cavity.precision, ggn)
        if block:
            lam = lam.replace(dense=0.5 * (lam.dense + lam.dense.T))
            return BlockGaussian(precision_mean=family.matvec(lam, mu), precision=lam), info
        lam = 0.5 * (lam + lam.T)
        return FullGaussian(precision_mean=family.matvec(lam, mu), precision=lam), info

    return infer


SHARED_BASIS_COVARIANCES = ("kron", "low_rank")


def make_shared_basis_laplace_inference(
    trainer: LocalTrainer, settings: TiltedSettings = TiltedSettings(), *, apply_fn: ApplyFn, task: str = "classification", covariance: str = "kron"
):
    """The laplace method in a structure whose basis the server shares: ``infer(key, start, cavity,
    data, basis, basis_fixed) -> (tilted, sketch, info)`` for a cavity in that structure
    (docs/algorithms.md §7.12, "Structures in a shared basis").

    The steps of :func:`make_full_laplace_inference` with the structure's algebra: the mode of
    ``F_k`` with the penalty's products and Gershgorin bounds in the basis, then at the mode the
    cavity's precision plus ``c (GGN_k(mu^) + lambda_wd n_k I)`` in the structure and
    ``eta^ = Lambda^ mu^``:

    * ``covariance = "kron"`` (:mod:`fedbayes.gaussian_kron`; ``basis`` the per-leaf Kronecker
      eigenbases): the GGN's diagonal in the bases, ``diag(U^T GGN_k U)``, EKFAC's eigenvalues
      (George et al. 2018, Sec. 3.2), and as ``sketch`` the client's Kronecker factors (K-FAC's
      second moments, Martens and Grosse 2015, Sec. 3), from
      :func:`fedbayes.inference.curvature.data_kron_ggn`;
    * ``covariance = "low_rank"`` (:mod:`fedbayes.gaussian_subspace`; ``basis`` ``B``, ``[D, r]``):
      the GGN exact in the span of ``B`` and diagonal outside it
      (:func:`fedbayes.gaussian_subspace.from_curvature`), or while the basis is not yet fixed
      (``basis_fixed`` false) its diagonal alone, and as ``sketch`` ``GGN_k B``, from
      :func:`fedbayes.inference.curvature.data_subspace_ggn`.

    ``lambda_wd n_k I`` is the same in every orthonormal basis (the structure's ``scaled_identity``).
    """
    s = settings
    if task not in CURVATURE_TASKS:
        raise ValueError(
            f"the laplace method needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {task!r}"
        )
    if covariance not in SHARED_BASIS_COVARIANCES:
        raise ValueError(f"covariance must be one of {', '.join(SHARED_BASIS_COVARIANCES)}; got {covariance!r}")

    def curvature(mu, data, basis, basis_fixed):
        if covariance == "kron":
            return data_kron_ggn(apply_fn, mu, data, basis, batch_size=trainer.batch_size, task=task)
        diag, sketch = data_subspace_ggn(apply_fn, mu, data, basis, batch_size=trainer.batch_size, task=task)
        structured = gaussian_subspace.from_curvature(diag, sketch, basis)
        # until the basis is fixed the target is the diagonal method's: the cores stay zero
        h = SubspacePrecision(
            jax.tree.map(lambda a, b: jnp.where(basis_fixed, a, b), structured.diagonal, diag),
            jnp.where(basis_fixed, structured.core, jnp.zeros_like(structured.core)),
        )
        return h, sketch

    def infer(key, start, cavity, data: ClientData, basis: PyTree, basis_fixed: jax.Array):
        family = gaussian_kron.in_bases(basis) if covariance == "kron" else gaussian_subspace.in_basis(basis)
        n = jnp.maximum(data.num_examples, 1).astype(jnp.float32)
        decay = family.scaled_identity(start, s.weight_decay * n)
        lam_p = jax.tree.map(jnp.add, cavity.precision, decay)
        quad = lambda theta: family.quad(lam_p, theta)  # noqa: E731
        mu, info = _tilted_mode(key, start, cavity.precision_mean, quad, family.row_bound(lam_p, start), data, trainer, s.step_cap)
        ggn, sketch = curvature(mu, data, basis, basis_fixed)
        lam = jax.tree.map(lambda c, g, w: c + s.scale * (g.astype(c.dtype) + w), cavity.precision, ggn, decay)
        return type(cavity)(precision_mean=family.matvec(lam, mu), precision=lam), sketch, info

    return infer


def make_full_ngvi_inference(trainer: LocalTrainer, settings: TiltedSettings = TiltedSettings(), *, apply_fn: ApplyFn, task: str = "classification"):
    """The ngvi method with a dense precision: ``infer(key, start, cavity, data) -> (FullGaussian, info)``,
    the tilted distribution's full-covariance Gaussian VI approximation by natural-gradient steps
    (Guo et al. 2023 (FedEP) Sec. 2.2.2's NGVI in the full-covariance family:
    :func:`fedbayes.inference.vi_full.natural_full_vi` with ``natural_steps`` iterations and
    ``2 ngvi_samples`` draws, in antithetic pairs).

    The tilted prior is the cavity plus weight decay, ``Lambda_p = Lambda_c + lambda_wd n_k I``, as
    for the laplace method; the iteration starts at the mean ``start`` with the tilted prior's
    precision, and at its fixed point

        Lambda^ = Lambda_p + E_q^[GGN_k],   Lambda_p mu^ = eta_c - E_q^[grad l_k],

    (the stationarity of ``E_q[l_k] + KL(q || N(Lambda_p^{-1} eta_c, Lambda_p^{-1}))``; Opper &
    Archambeau 2009, Eqs. 11-12, with the expected GGN for the expected Hessian). The local
    precision scale is the likelihood's (``scale = 1``; the config refuses another).
    """
    s = settings
    if task not in CURVATURE_TASKS:
        raise ValueError(
            f"the ngvi method needs the curvature of the task's likelihood, which fedbayes has for {', '.join(CURVATURE_TASKS)}; got task {task!r}"
        )
    fit = natural_full_vi(trainer, apply_fn=apply_fn, task=task, samples=2 * s.ngvi_samples, steps=s.natural_steps)

    def infer(key, start, cavity: FullGaussian, data: ClientData) -> tuple[FullGaussian, dict]:
        n = jnp.maximum(data.num_examples, 1).astype(cavity.precision.dtype)
        eye = jnp.eye(cavity.precision.shape[0], dtype=cavity.precision.dtype)
        prior = FullGaussian(precision_mean=cavity.precision_mean, precision=cavity.precision + s.weight_decay * n * eye)
        flat, unravel = ravel_pytree(start)
        begin = FullGaussian(precision_mean=unravel(prior.precision @ flat.astype(eye.dtype)), precision=prior.precision)
        return fit(key, begin, prior, data)

    return infer
