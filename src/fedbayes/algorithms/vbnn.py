"""Federated variational Bayesian neural networks (Ozer et al. 2022, "How to Combine Variational
Bayesian Networks in Federated Learning"; docs/algorithms.md §12): Bayes-by-backprop clients and
the server's aggregation rules for variational weights.

Clients start from the broadcast variational parameters (means, log-variances and deterministic
weights, :mod:`fedbayes.models.variational`), minimise their objective over minibatches with one
stochastic forward pass each, and send their parameters. The server combines them with one rule
(:mod:`fedbayes.aggregators.variational`) applied elementwise to every variational weight;
deterministic leaves (biases, convolutions) always by the weighted mean, exactly as FedAvg's
:func:`fedbayes.tree.weighted_mean`. The weights ``beta_k`` are the round's client weights
normalised to sum 1: uniform gives Ozer et al. 2022's FVBA, ``n_k``-proportional its FVBWA (the
simulator's ``weighting``; FVBWA is the one under which the ``bayes`` rules are exact).

**The prior once (``variant = "bayes"``, the default).** The federation's negative ELBO over all
``N = sum_k n_k`` examples (Ozer et al. 2022, Eq. 2) splits into the clients' shares,

    F(q) = KL(q || p) - sum_k E_q log p(D_k | theta) = sum_k F_k(q),
    F_k(q) = -E_q log p(D_k | theta) + (n_k / N) KL(q || p),

so each client carries the fraction ``n_k / N`` of the prior's KL and the prior enters ``F`` once.
Per example (the client's mean cross-entropy), client ``k`` minimises
``F_k / n_k = mean CE + KL(q || p) / N``. The paper's Eq. 3 gives every client the whole prior,
``mean CE + KL / n_k``: summed over clients the prior is counted ``K`` times, and a rule that
multiplies the clients' posteriors (CF, GAA) multiplies ``K`` priors. Why a share of the KL and not
the prior to the power ``n_k / N`` (a share of ``E_q log p`` only): with the KL share each client's
optimum is the posterior of its data replicated ``N / n_k`` times under the whole prior, a
posterior of the whole federation's size, so the clients start every round near their own optimum
(the broadcast posterior) and the ``beta``-weighted geometric mean of their posteriors is the
posterior of the union (:mod:`fedbayes.aggregators.variational`); with the tempered prior each
client's optimum is about ``K`` times wider than the broadcast one, its variances would have to
grow by ``log K`` every round, and a product of clients that have not got there shrinks the
variance round after round.

**Variances that learn.** The log-variances get their gradient everywhere (the models' guard
[-30, 20] is never reached). Their gradient is small: the KL's is ``(sigma^2 / s^2 - 1) / (2N)``
per weight and example (``8e-5`` for 6,000 examples), and the data term's scales with
``sigma^2``, so a client's SGD at the means' rate moves ``log sigma^2`` by ``1e-6`` per step. The
``bayes`` variant therefore gives the log-variance leaves their own step (``logvar_optimizer``;
:func:`optax.multi_transform`), the means and deterministic leaves the client's optimizer:

* ``"natural"``: the natural-gradient step (:func:`natural_logvar_step`), which relaxes every
  variance towards its own optimum ``1 / (1 / s^2 + (N / lambda) E_q[d^2 CE])`` at one rate, so
  the variances follow the data's curvature weight by weight;
* ``"adam"``: Adam at ``logvar_lr`` (1e-3), whose normalised steps move every log-variance of a
  layer by about the same amount whatever its gradient (the variances move in lockstep);
* ``"auto"`` (the default): natural on a generalised linear model, Adam on a network
  (:func:`fedbayes.models.has_hidden_layers`). On a network the mean-field posterior that the
  natural step reaches is over-pruned (Trippe and Turner 2018, "Overpruning in Variational
  Bayesian Neural Networks"): most variances go to the prior's and the network underfits, so
  the network's default keeps Adam's small steps near the layers' small initial variances
  (docs/results/vbnn_natural.md has both measurements).

Either step's state starts afresh every round like the client optimizer's.

**The client (``method``).** ``"bbb"`` is Bayes-by-backprop as above; ``"ivon"`` trains the means
and variances together by IVON's natural-gradient steps (:func:`run_ivon`); ``"auto"`` (the
default) is IVON on a generalised linear model and Bayes-by-backprop on a network. IVON's batch
(``ivon_batch``): ``"client"`` takes the ``[client]`` minibatches; ``"whole"`` takes one step per
epoch on the client's whole data (the trainer's batch is then the largest client's size);
``"auto"`` is whole on a generalised linear model. One whole-data step a round is the central
IVON step exactly: with the ``bayes`` CF rule under FVBWA (``beta_k = n_k / N``), client ``k``
sends ``m_k = m - alpha (g_k + delta m) / (h_k + delta)`` with precision ``lambda (h_k + delta)``,
and the rule's precision-weighted mean is ``m - alpha (sum_k beta_k g_k + delta m) / (sum_k beta_k
h_k + delta)``, the step of IVON on the pooled data with the clients' draws; its precision is
``lambda`` times the pooled ``h + delta``. So the federation has no client drift, and its fixed
point is the mean-field optimum of its objective (the bias a point without a prior). More local
steps would move each client towards its own data's optimum, which the rule does not combine into
the federation's (docs/results/vbnn_natural.md measured that drift for Bayes-by-backprop). On a
network the whole-data step is not the default: measured with minibatches, IVON's steps diverge
there at its defaults (docs/results/vbnn_ivon.md), so a network keeps Bayes-by-backprop.

**The published code (``variant = "paper"``)**, for reproducing the paper's tables: log-variances
drawn from ``N(-9, 0.001^2)`` at :meth:`server_init`, clamped to [-8, 8] in the forward pass and
the KL (:func:`fedbayes.models.variational.paper_clamp`; the gradient of every log-variance is then
exactly 0), the whole prior at every client (``KL / n_k``), the client's optimizer for every leaf,
and the rules of Eqs. 4-8 with the clamp (``accumulation`` as the code's sum). The parameters it
evaluates (``server_params``) are the clamped ones, so the test metrics are those of the code's
forward pass; the state keeps the stored values, which AALV averages and Table 4's norms are of.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field, model_validator

from fedbayes.aggregators.variational import ACCUMULATIONS, RULES, VARIANTS, variational_rule
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, NoInfo, finite_message, stateless_client_init
from fedbayes.data.batches import get_batch, num_local_steps
from fedbayes.hparams import HParams
from fedbayes.inference.ivon import hessian_from_variance, ivon
from fedbayes.inference.sgd import LocalTrainer, run_sgd, training_info
from fedbayes.models import has_hidden_layers
from fedbayes.models.variational import (
    LOGVAR_MIN,
    kl_to_prior,
    merge_variational,
    paper_clamp,
    paper_init,
    prior_variances,
    split_variational,
    variance,
)

__all__ = [
    "CLIENT_METHODS",
    "IVON_BATCHES",
    "IVON_MINIBATCH",
    "IVON_WHOLE_DATA",
    "ivon_settings_for",
    "resolve_client",
    "DEFAULT_LOGVAR_LR",
    "DEFAULT_NATURAL_LOGVAR_LR",
    "LOGVAR_OPTIMIZERS",
    "natural_logvar_step",
    "IVONClient",
    "ivon_init",
    "VBNNState",
    "logvar_labels",
    "run_ivon",
    "variational_data_loss",
    "variational_objective",
    "vbnn",
]

DEFAULT_LOGVAR_LR = 1e-3  # Adam's rate on the log-variances
DEFAULT_NATURAL_LOGVAR_LR = 0.1  # the natural-gradient step's rate (docs/results/vbnn_natural.md)
NATURAL_LOGVAR_MAX_STEP = 1.0  # the most a log-variance moves in one natural step (a factor e)
CLIENT_METHODS = ("auto", "bbb", "ivon")  # IVON on a GLM, else Bayes-by-backprop; Bayes-by-backprop; IVON
IVON_BATCHES = ("auto", "client", "whole")  # whole on a GLM, else client; the [client] minibatches; one whole-data step an epoch
LOGVAR_OPTIMIZERS = ("auto", "natural", "adam")

# ----- the client -------------------------------------------------------------------------------


def variational_data_loss(apply_fn: Callable) -> Callable:
    """``(params, key, x, y, mask) -> masked mean cross-entropy`` of one stochastic forward pass
    (``key`` draws the weights' noise): the keyed loss of a Bayes-by-backprop client."""

    def loss(params, key, x, y, mask):
        logits = apply_fn(params, key, x)
        valid = mask > 0
        labels = jnp.where(valid, y, jnp.zeros_like(y))
        per = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        per = jnp.where(valid, per, jnp.zeros((), per.dtype))
        return jnp.sum(per * mask) / jnp.maximum(jnp.sum(mask), 1.0)

    return loss


def variational_objective(
    apply_fn: Callable, prior_variance: float | str = 1.0, variant: str = "bayes", total_examples: int | None = None, kl_weight: float = 1.0
) -> Callable:
    """The client objective for one minibatch (module docstring).

    Args:
        apply_fn: ``(params, key, x) -> logits``, one stochastic forward pass
            (:func:`fedbayes.models.variational.apply_with_key`).
        prior_variance: the prior ``N(0, prior_variance)`` per variational weight, or
            ``"fan_in"``: ``N(0, 1 / fan_in)`` (:func:`fedbayes.models.variational.prior_variances`).
        variant: ``"bayes"``: ``mean CE + KL(q || prior) / N`` (the client's share ``n_k / N`` of
            the KL, per example); ``"paper"``: ``mean CE + KL(q || prior) / n_k`` with the
            log-variances clamped to [-8, 8] in both terms (Eq. 3 and the published code).
        total_examples: ``N``, the federation's example count (``bayes`` only).
        kl_weight: the KL's weight ``lambda`` (``bayes`` only; :func:`vbnn`).

    Returns:
        ``f(params, key, x, y, mask, num_examples)`` with ``num_examples`` the client's ``n_k``
        (at least 1).

    Raises:
        ValueError: for an unknown variant or ``bayes`` without ``total_examples >= 1``.
    """
    _check_variant(variant, total_examples)
    data_loss = variational_data_loss(apply_fn)

    def objective(params, key, x, y, mask, num_examples):
        n = jnp.maximum(jnp.asarray(num_examples, jnp.float32), 1.0)
        if variant == "paper":
            clamped = paper_clamp(params)
            return data_loss(clamped, key, x, y, mask) + kl_to_prior(clamped, prior_variance) / n
        return data_loss(params, key, x, y, mask) + kl_weight * kl_to_prior(params, prior_variance) / float(total_examples)

    return objective


def _check_variant(variant: str, total_examples: int | None) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "bayes" and (total_examples is None or int(total_examples) < 1):
        raise ValueError(f"total_examples: the bayes variant needs the federation's example count N >= 1, got {total_examples}")


def logvar_labels(params: Any) -> Any:
    """``"logvar"`` at every log-variance leaf, ``"rest"`` elsewhere: the labels of
    :func:`optax.multi_transform`."""
    means, log_vars, det = split_variational(params)
    return merge_variational({k: "rest" for k in means}, {k: "logvar" for k in log_vars}, jax.tree.map(lambda _: "rest", det))


class IVONClient(NamedTuple):
    """Settings of the IVON client (:func:`run_ivon`; :mod:`fedbayes.inference.ivon`).

    Attributes:
        lr: IVON's step size ``alpha``.
        beta1: the momentum's decay.
        beta2: the Hessian estimate's decay (per local step; ``h`` carries over rounds through the
            broadcast variances).
        hess_init: ``h_0``: the server's initial ``h`` of every weight (:func:`ivon_init`) and
            the deterministic leaves' (biases') ``h`` at the start of every round.
        samples: weight draws per step.
        antithetic: draw them in pairs ``eps, -eps``.
        clip: clip every preconditioned step of the means elementwise to ``[-clip, clip]``
            (``None``: no clip, as Algorithm 1).
    """

    lr: float = 0.03
    beta1: float = 0.9
    beta2: float = 0.99
    hess_init: float = 0.1
    samples: int = 2
    antithetic: bool = True
    clip: float | None = None


# The IVON client's defaults with minibatches (``ivon_batch = "client"``) and with one whole-data
# step an epoch (``"whole"``). The whole-data client takes one step a round, so it needs a larger
# step and a faster Hessian average than the minibatch one (which takes 1-9 steps a round on the
# benchmark's clients), and more draws, which are its only noise; a smaller h_0 makes its first
# steps larger. Chosen on the posterior benchmark's two logistic regressions
# (docs/results/vbnn_ivon.md, "One whole-data step a round").
IVON_MINIBATCH = IVONClient()
IVON_WHOLE_DATA = IVONClient(lr=0.1, beta2=0.97, hess_init=0.03, samples=64)


def resolve_client(method: str, ivon_batch: str, hidden_layers: bool, variant: str = "bayes") -> tuple[str, str]:
    """``(method, batch)`` with the ``"auto"`` choices made: IVON with whole-data steps on a
    generalised linear model (``hidden_layers`` False) in the ``bayes`` variant, Bayes-by-backprop
    elsewhere (module docstring); ``batch`` is ``"client"`` for Bayes-by-backprop."""
    if method == "auto":
        method = "ivon" if variant == "bayes" and not hidden_layers else "bbb"
    if method != "ivon":
        return method, "client"
    return method, ("client" if hidden_layers else "whole") if ivon_batch == "auto" else ivon_batch


def ivon_init(params: Any, hess_init: float, ess: float, prior_variance: float | str = 1.0) -> Any:
    """The tree with every log-variance at IVON's start ``h = hess_init`` (Shen et al. 2024,
    Algorithm 1's ``h_0``): ``log(1 / (lambda (h_0 + delta_j)))`` with ``lambda = ess`` and
    ``delta_j = 1 / (lambda s_j^2)`` (:func:`run_ivon`). The server starts the IVON client's
    posterior there instead of the layers' ``log(0.01 / fan_in)``, whose ``h = 1 / (lambda
    sigma^2)`` would be hundreds of times the data's curvature and take ``beta2``'s time constant
    many times over to forget."""
    means, log_vars, det = split_variational(params)
    prior = prior_variances(means, prior_variance)
    new = {k: (-jnp.log(ess * (hess_init + 1.0 / (ess * prior[k])))).astype(v.dtype) for k, v in log_vars.items()}
    return merge_variational(means, new, det)


def run_ivon(
    key: jax.Array,
    params: Any,
    data: Any,
    apply_fn: Callable,
    settings: IVONClient,
    *,
    num_epochs: int,
    batch_size: int,
    total_examples: int,
    prior_variance: float | str = 1.0,
    kl_weight: float = 1.0,
) -> tuple[Any, dict]:
    """A VBNN client by IVON (Shen et al. 2024, Algorithm 1; :mod:`fedbayes.inference.ivon`).

    The client's share of the federation's negative ELBO, ``n_k (mean CE_k + kl_weight KL(q || p) /
    N)`` (module docstring), is IVON's objective ``lambda E_q[mean CE_k] + KL(q || N(0, 1 / (lambda
    delta)))`` up to the factor ``n_k / lambda`` with

        lambda = N / kl_weight,   delta_j = 1 / (lambda s_j^2)

    (``s_j^2`` the prior's variance of weight ``j``); deterministic leaves (biases) get
    ``delta = 0``, no prior, as in the Bayes-by-backprop client. IVON's posterior
    ``N(m, 1 / (lambda (h + delta)))`` is the client's variational posterior: ``m`` starts at the
    broadcast means and ``h`` at ``1 / (lambda sigma^2) - delta`` of the broadcast variances
    (:func:`~fedbayes.inference.ivon.hessian_from_variance`), so the Hessian estimate carries over
    rounds through the server's rule; at the end the client returns ``m`` and
    ``log(1 / (lambda (h + delta)))``. The deterministic leaves (biases) are IVON's points: the
    model's own parameters, not drawn (the VBNN's objective has them as points without a prior),
    their ``h`` fixed at ``settings.hess_init``, so their step is IVON's momentum times
    ``lr / hess_init``. The model is evaluated at each draw ``theta`` with every log-variance at the models'
    floor :data:`~fedbayes.models.variational.LOGVAR_MIN` (``sigma^2 = e^-30``): the layer's forward
    pass at ``theta``, up to its numerical noise floor (an output standard deviation of about 1e-4).

    Returns:
        ``(params, info)`` with ``info`` as :func:`fedbayes.inference.sgd.training_info`.
    """
    means, log_vars, det = split_variational(params)
    ess = float(total_examples) / kl_weight
    prior = prior_variances(means, prior_variance)
    delta = ({k: 1.0 / (ess * v) for k, v in prior.items()}, jax.tree.map(jnp.zeros_like, det))
    opt = ivon(
        settings.lr, ess, delta, beta1=settings.beta1, beta2=settings.beta2, hess_init=settings.hess_init,
        num_samples=settings.samples, antithetic=settings.antithetic, clip_radius=settings.clip,
        points=(jax.tree.map(lambda _: False, means), jax.tree.map(lambda _: True, det)),
    )  # fmt: skip
    start = (means, det)
    hessian = (
        hessian_from_variance({k: variance(v) for k, v in log_vars.items()}, ess, delta[0]),
        jax.tree.map(lambda d: jnp.full_like(d, settings.hess_init), det),
    )
    data_loss = variational_data_loss(apply_fn)
    floor = {k: jnp.full_like(v, LOGVAR_MIN) for k, v in log_vars.items()}

    def loss(theta, k, x, y, m):
        return data_loss(merge_variational(theta[0], floor, theta[1]), k, x, y, m)

    grad_fn = jax.value_and_grad(loss)
    if settings.samples > 1:
        grad_fn = jax.vmap(grad_fn, in_axes=(0, 0, None, None, None))
    total = num_local_steps(data.num_examples, batch_size, num_epochs)

    def body(step, carry):
        m, state, loss_sum = carry
        draw_key, pass_key = jax.random.split(jax.random.fold_in(key, step))
        x, y, mask = get_batch(data, step, batch_size)
        theta, eps = opt.sample(draw_key, state, m)
        pass_keys = jax.random.split(pass_key, settings.samples) if settings.samples > 1 else pass_key
        value, grads = grad_fn(theta, pass_keys, x, y, mask)
        updates, state = opt.update(grads, state, m, eps)
        return optax.apply_updates(m, updates), state, loss_sum + jnp.mean(value).astype(loss_sum.dtype)

    m, state, loss_sum = jax.lax.fori_loop(0, total, body, (start, opt.init(start, hessian), jnp.zeros((), jnp.float32)))
    mean, var = opt.posterior(state, m)
    new = merge_variational(mean[0], {k: jnp.log(v).astype(log_vars[k].dtype) for k, v in var[0].items()}, mean[1])
    return new, training_info(loss_sum, total)


def natural_logvar_step(lr: float, ess: float, max_step: float = NATURAL_LOGVAR_MAX_STEP) -> optax.GradientTransformation:
    """The natural-gradient step on the log-variances of a mean-field Gaussian, as an optax
    transformation of the per-example objective's gradient.

    For ``q = N(m, diag(exp(u)))`` the Fisher information of ``q`` in the coordinates ``(m, u)``
    is block diagonal, ``diag(1 / sigma^2)`` for the means and ``1/2`` for every log-variance
    ``u_j`` (Amari 1998, "Natural Gradient Works Efficiently in Learning"; the Gaussian's
    Fisher in these coordinates, e.g. Khan and Rue 2023, "The Bayesian Learning Rule", §3). The
    client minimises ``f = mean CE + lambda KL(q || p) / N`` per example, ``ess / n`` times less
    than the (tempered) negative ELBO ``F = ess E_q[mean CE] + KL(q || p)`` with ``ess = N /
    lambda``, so the natural step on ``u`` is

        u <- u - lr * 2 * ess * df/du = u - lr (sigma_j^2 P_j - 1),
        P_j = 1 / s_j^2 + ess E_q[d^2 CE / d theta_j^2],

    (the reparameterisation gradient ``dE_q[CE]/du_j = sigma_j^2 E_q[d^2 CE/d theta_j^2] / 2``,
    Opper and Archambeau 2009), a relaxation of ``sigma_j^2`` towards its optimum ``1 / P_j`` at
    rate ``lr`` that is the same for every weight. It is IVON's precision update (Shen et al.
    2024, Algorithm 1, ``h <- beta2 h + (1 - beta2) h_hat`` with ``1 - beta2 = lr``) taken in the
    log-variance coordinate, where it stays positive without IVON's correction term. Adam's
    normalised step (``"adam"``) instead moves every log-variance by about its rate whatever the
    gradient, so a layer's variances move in lockstep. Each step is clipped to ``[-max_step,
    max_step]`` (a variance changes by at most a factor ``e^max_step``), a trust region for the
    first steps from a start far from ``1 / P_j``, where ``sigma_j^2 P_j`` is large.

    Args:
        lr: the relaxation rate (in (0, 2) for a stable step on an exact gradient).
        ess: ``N / lambda``, the federation's examples over the KL's weight.
        max_step: the clip radius.
    """
    return optax.chain(optax.scale(-2.0 * lr * ess), optax.clip(max_step))


# ----- the algorithm ----------------------------------------------------------------------------


class VBNNState(NamedTuple):
    """Server state: the global variational parameters and the round counter."""

    params: Any
    round: jax.Array


def vbnn(
    trainer: LocalTrainer,
    apply_fn: Callable,
    *,
    aggregation: str = "cf",
    population: int = 1000,
    prior_variance: float | str = 1.0,
    accumulation: str = "exact",
    variant: str = "bayes",
    total_examples: int | None = None,
    logvar_lr: float | None = None,
    kl_weight: float = 1.0,
    method: str = "bbb",
    ivon_settings: IVONClient | None = None,
    logvar_optimizer: str = "auto",
) -> Algorithm:
    """Federated VBNN with one of the rules of :data:`RULES` (FVBA / FVBWA by the round's weights).

    Clients train their variational parameters by Bayes-by-backprop from the broadcast ones
    (:func:`fedbayes.inference.sgd.run_sgd` with the keyed loss of :func:`variational_data_loss`,
    fresh noise at every step, and the KL term of :func:`variational_objective` as the penalty)
    and send them; the server combines them with the rule (the algorithm's aggregator,
    :mod:`fedbayes.aggregators.variational`, in the same variant).

    The client is not :func:`fedbayes.inference.vi.reparameterised_vi` (PVI's local VI), for three
    reasons. It has no cavity: its KL is to a fixed prior ``N(0, prior_variance)``
    (:func:`fedbayes.models.variational.kl_to_prior`), not to ``q_g / t_k``, so it is not a
    :class:`~fedbayes.inference.base.CavityInference`. Its variational parameters are the
    model's own ``*_mean``/``*_logvar`` leaves (the server's rules combine them as such), where
    PVI's are ``(mean, raw_std)`` beside a deterministic model. And the model draws its own noise
    inside the forward pass from the step's key (``apply_fn(params, key, x)``), where PVI draws
    weights outside it (:func:`fedbayes.inference.vi.draw_weights`). The ``bayes`` variant shares
    PVI's point, the prior once in the federation, through the clients' shares of the KL instead
    of cavities, so its clients stay stateless.

    Args:
        trainer: the client optimizer, epochs and batch size (``trainer.loss_fn`` is replaced by
            the variational loss of ``apply_fn``).
        apply_fn: ``(params, key, x) -> logits`` of a variational model.
        aggregation: the server's rule.
        population: PPA's ``N``.
        prior_variance: the prior's variance per weight (Ozer et al. 2022: 1), or ``"fan_in"``
            for ``1 / fan_in`` (:func:`fedbayes.models.variational.prior_variances`).
        accumulation: ``"exact"`` or ``"reference_code"`` (``paper`` only; module docstring).
        variant: ``"bayes"`` (default) or ``"paper"`` (the published code; module docstring).
        total_examples: ``N = sum_k n_k`` of the federation (``bayes``: the clients' KL share).
        logvar_lr: the log-variance step's rate; ``None``: :data:`DEFAULT_NATURAL_LOGVAR_LR` for
            the natural step, :data:`DEFAULT_LOGVAR_LR` for Adam (``bayes``), the client's
            optimizer in the ``paper`` variant (a number there: Adam at that rate).
        kl_weight: ``lambda``, the KL term's weight (``bayes`` only): the client minimises
            ``-E_q log p(D_k | theta) + lambda (n_k / N) KL(q || p)``. 1 (default) is the
            variational posterior; below 1 a tempered ("cold") one, Wenzel et al. 2020, "How Good is
            the Bayes Posterior in Deep Neural Networks Really?", equivalently the likelihood
            counted ``1 / lambda`` times.
        method: the client: ``"bbb"`` (default; Bayes-by-backprop with ``trainer.optimizer`` on
            the means and Adam at ``logvar_lr`` on the log-variances) or ``"ivon"`` (:func:`run_ivon`,
            ``bayes`` only: IVON's natural-gradient steps move every variance by its own curvature
            estimate; ``trainer.optimizer`` and ``logvar_lr`` are not used, the epochs and batch
            size are: a batch of the largest client's size is one whole-data step an epoch). The
            config's ``"auto"`` is resolved before this (:func:`resolve_client`).
        ivon_settings: the IVON client's settings (``None``: :class:`IVONClient`'s defaults).
        logvar_optimizer: the Bayes-by-backprop client's step on the log-variances (``bayes``):
            ``"natural"``, ``"adam"`` or ``"auto"`` (natural on a generalised linear model, Adam
            on a network; module docstring).

    Raises:
        ValueError: for an unknown aggregation or variant, a population below 1, a prior variance
            <= 0, ``bayes`` without ``total_examples``, ``logvar_lr <= 0``, ``kl_weight <= 0`` (or
            not 1 in ``paper``), ``reference_code`` outside ``paper``, or an unknown
            ``logvar_optimizer`` (``natural`` outside ``bayes``).
    """
    if prior_variance != "fan_in" and (isinstance(prior_variance, str) or not prior_variance > 0):
        raise ValueError(f"prior_variance must be > 0 or 'fan_in', got {prior_variance!r}")
    _check_variant(variant, total_examples)
    if logvar_lr is not None and logvar_lr <= 0:
        raise ValueError(f"logvar_lr must be > 0, got {logvar_lr}")
    if not kl_weight > 0 or (variant == "paper" and kl_weight != 1.0):
        raise ValueError(f"kl_weight must be > 0 (and 1 in the paper variant), got {kl_weight}")
    if method not in ("bbb", "ivon") or (method == "ivon" and variant != "bayes"):
        raise ValueError(f"method must be bbb or ivon (ivon in the bayes variant only; resolve auto with resolve_client), got {method!r} in {variant!r}")
    aggregator = variational_rule(aggregation, population, accumulation, variant)
    paper = variant == "paper"
    ivon_settings = IVONClient() if ivon_settings is None else ivon_settings
    model_fn = (lambda p, k, x: apply_fn(paper_clamp(p), k, x)) if paper else apply_fn
    if logvar_optimizer not in LOGVAR_OPTIMIZERS:
        raise ValueError(f"logvar_optimizer must be one of {', '.join(LOGVAR_OPTIMIZERS)}, got {logvar_optimizer!r}")
    if logvar_optimizer == "natural" and paper:
        raise ValueError("logvar_optimizer: the natural step runs in the bayes variant (the paper variant's log-variances get no gradient)")

    def local_trainer(params) -> LocalTrainer:
        """The client's trainer for a model with these parameters (``"auto"`` reads its shape)."""
        optimizer = trainer.optimizer
        if not paper:
            natural = logvar_optimizer == "natural" or (logvar_optimizer == "auto" and not has_hidden_layers(params))
            if natural:
                step = natural_logvar_step(DEFAULT_NATURAL_LOGVAR_LR if logvar_lr is None else logvar_lr, float(total_examples) / kl_weight)
            else:
                step = optax.adam(DEFAULT_LOGVAR_LR if logvar_lr is None else logvar_lr)
            optimizer = optax.multi_transform({"rest": trainer.optimizer, "logvar": step}, logvar_labels)
        elif logvar_lr is not None:
            optimizer = optax.multi_transform({"rest": trainer.optimizer, "logvar": optax.adam(logvar_lr)}, logvar_labels)
        return trainer._replace(loss_fn=variational_data_loss(model_fn), optimizer=optimizer)

    def penalty_fn(n_k):
        if paper:
            return lambda p: kl_to_prior(paper_clamp(p), prior_variance) / n_k
        return lambda p: kl_weight * kl_to_prior(p, prior_variance) / float(total_examples)

    def server_init(key, params):
        if not split_variational(params)[0]:
            raise ValueError("vbnn needs a variational model (leaves <name>_mean and <name>_logvar); got none")
        if paper:
            params = paper_init(key, params)
        if method == "ivon":
            params = ivon_init(params, ivon_settings.hess_init, int(total_examples) / kl_weight, prior_variance)
        return VBNNState(params=params, round=jnp.zeros((), jnp.int32))

    def client_update(key, params, client_state, data):
        if method == "ivon":
            new, info = run_ivon(
                key, params, data, apply_fn, ivon_settings, num_epochs=trainer.num_epochs, batch_size=trainer.batch_size,
                total_examples=int(total_examples), prior_variance=prior_variance, kl_weight=kl_weight,
            )  # fmt: skip
            return new, client_state, info
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        new, info = run_sgd(key, params, data, local_trainer(params), penalty_fn(n))
        return new, client_state, info

    def server_update(key, state, aggregate):
        del key  # PPA's draws use the aggregator's key
        any_accepted = aggregate.count > 0  # none accepted: keep the old parameters
        params = jax.tree.map(lambda n, o: jnp.where(any_accepted, n, o), aggregate.mean, state.params)
        return VBNNState(params=params, round=state.round + 1), NoInfo()

    return Algorithm(
        name="vbnn",
        server_init=server_init,
        broadcast=lambda state: state.params,
        client_init=stateless_client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=(lambda state: paper_clamp(state.params)) if paper else (lambda state: state.params),
        message_ok=finite_message,
        trainer=trainer,
        aggregator=aggregator,
    )


class VBNNConfig(HParams):
    """Federated variational BNNs (docs/algorithms.md §12): the server's aggregation rule and the
    variant; the model must be variational (``model.variational = true``)."""

    name: Literal["vbnn"]
    variant: Literal[VARIANTS] = Field(  # type: ignore[valid-type]
        "bayes",
        description="bayes (the prior once, variances that learn, rules with agreement as their fixed point) or paper (Ozer et al. 2022's published code)",
    )
    aggregation: Literal[RULES] = Field("cf", description="eaa, gaa, aalv, ppa, cf or merging")  # type: ignore[valid-type]
    accumulation: Literal[ACCUMULATIONS] = Field(  # type: ignore[valid-type]
        "exact", description="exact (the paper's equations) or reference_code (the published code's running clamp in eaa, gaa, merging; variant paper only)"
    )
    population: int = Field(1000, ge=1, description="PPA: samples drawn from the clients' posteriors")
    prior_variance: float | Literal["fan_in"] = Field(
        1.0, description="the prior N(0, prior_variance) per variational weight (> 0), or fan_in: N(0, 1 / fan_in)"
    )
    logvar_lr: float | None = Field(
        None,
        gt=0,
        description="the log-variances' step rate; unset: 0.1 for the natural step, 0.001 for adam (variant bayes), the client's optimizer in variant paper",
    )
    kl_weight: float = Field(1.0, gt=0, description="the KL's weight lambda (variant bayes): 1 the variational posterior, < 1 a tempered one")
    method: Literal[CLIENT_METHODS] = Field(  # type: ignore[valid-type]
        "auto",
        description="the client: bbb (Bayes-by-backprop), ivon (IVON's natural-gradient steps, Shen et al. 2024; variant bayes), "
        "or auto: ivon on a generalised linear model (variant bayes), bbb on a network",
    )
    ivon_batch: Literal[IVON_BATCHES] = Field(  # type: ignore[valid-type]
        "auto",
        description="ivon: client (the [client] minibatches and epochs) or whole (one step an epoch on the client's whole data; "
        "one a round is the central IVON step), or auto: whole on a generalised linear model, client on a network",
    )
    logvar_optimizer: Literal[LOGVAR_OPTIMIZERS] = Field(  # type: ignore[valid-type]
        "auto",
        description="the bbb client's step on the log-variances (variant bayes): natural (every variance relaxes to its own optimum), "
        "adam (the variances of a layer move in lockstep), or auto: natural on a generalised linear model, adam on a network",
    )
    ivon_lr: float | None = Field(
        None,
        gt=0,
        description=f"ivon: the step size alpha; unset: {IVON_WHOLE_DATA.lr} times the cohort's share of the clients with whole-data steps, "
        f"{IVON_MINIBATCH.lr} with minibatches",
    )
    ivon_beta1: float = Field(IVONClient().beta1, ge=0, lt=1, description="ivon: the momentum's decay")
    ivon_beta2: float | None = Field(
        None,
        ge=0,
        lt=1,
        description=f"ivon: the Hessian estimate's decay per local step; unset: {IVON_WHOLE_DATA.beta2} with whole-data steps, {IVON_MINIBATCH.beta2} with minibatches",
    )
    ivon_hess_init: float | None = Field(
        None,
        gt=0,
        description="ivon: h_0, the initial Hessian estimate (the weights' at the server's start, the biases' throughout); "
        f"unset: {IVON_WHOLE_DATA.hess_init} with whole-data steps, {IVON_MINIBATCH.hess_init} with minibatches",
    )
    ivon_samples: int | None = Field(
        None,
        ge=1,
        description=f"ivon: weight draws per step (even with ivon_antithetic); unset: {IVON_WHOLE_DATA.samples} with whole-data steps, {IVON_MINIBATCH.samples} with minibatches",
    )
    ivon_antithetic: bool = Field(IVONClient().antithetic, description="ivon: draw the weights in pairs eps, -eps")
    ivon_clip: float | None = Field(IVONClient().clip, gt=0, description="ivon: clip each preconditioned step of the means to this radius (unset: no clip)")

    @model_validator(mode="after")
    def _reference_code_is_paper(self) -> VBNNConfig:
        if self.kl_weight != 1.0 and self.variant == "paper":
            raise ValueError(f"algorithm.kl_weight: the paper variant weighs the KL 1, got {self.kl_weight}")
        if self.prior_variance != "fan_in" and not self.prior_variance > 0:
            raise ValueError(f"algorithm.prior_variance must be > 0 or 'fan_in', got {self.prior_variance!r}")
        if self.method == "ivon" and self.variant != "bayes":
            raise ValueError(f"algorithm.method: ivon runs in the bayes variant, got variant {self.variant!r}")
        if self.logvar_optimizer == "natural" and self.variant != "bayes":
            raise ValueError(f"algorithm.logvar_optimizer: natural runs in the bayes variant, got variant {self.variant!r}")
        if self.method != "bbb" and self.ivon_antithetic and self.ivon_samples is not None and self.ivon_samples % 2:
            raise ValueError(f"algorithm.ivon_samples must be even with ivon_antithetic, got {self.ivon_samples}")
        if self.accumulation != "exact" and self.variant != "paper":
            raise ValueError(
                f"algorithm.accumulation: {self.accumulation!r} is the published code's sum; set algorithm.variant = 'paper' (got {self.variant!r})"
            )
        return self


def ivon_settings_for(hp: VBNNConfig, batch: str, participation: float = 1.0) -> IVONClient:
    """The IVON client's settings: ``hp``'s where set, else the batch's defaults
    (:data:`IVON_WHOLE_DATA` for ``"whole"``, :data:`IVON_MINIBATCH` for ``"client"``).

    With whole-data steps and a cohort of ``M`` of ``K`` clients (``participation = M / K``), the
    default step is ``IVON_WHOLE_DATA.lr * M / K``: the combined step is then the cohort's estimate
    of the pooled one, a stochastic step over clients whose noise does not shrink at a fixed step,
    and the scaled step moves the posterior as far in ``K / M`` rounds (a pass over the federation
    in expectation) as one round of all clients at the full step."""
    base = IVON_WHOLE_DATA if batch == "whole" else IVON_MINIBATCH
    if batch == "whole":
        base = base._replace(lr=base.lr * min(1.0, max(participation, 0.0)))
    given = {"lr": hp.ivon_lr, "beta2": hp.ivon_beta2, "hess_init": hp.ivon_hess_init, "samples": hp.ivon_samples}
    return base._replace(beta1=hp.ivon_beta1, antithetic=hp.ivon_antithetic, clip=hp.ivon_clip, **{k: v for k, v in given.items() if v is not None})


def build(hp: VBNNConfig, ctx: BuildContext) -> Algorithm:
    if ctx.keyed_apply_fn is None:
        raise ValueError("vbnn needs a variational model's keyed apply function (model.variational = true)")
    method, batch = resolve_client(hp.method, hp.ivon_batch, ctx.hidden_layers, hp.variant)
    trainer = ctx.trainer
    if batch == "whole":  # one step an epoch on every client's whole data
        trainer = trainer._replace(batch_size=max((*ctx.federation.client_sizes, 1)))
    return vbnn(
        trainer, ctx.keyed_apply_fn, aggregation=hp.aggregation, population=hp.population, prior_variance=hp.prior_variance,
        accumulation=hp.accumulation, variant=hp.variant, total_examples=ctx.federation.total_examples, logvar_lr=hp.logvar_lr,
        kl_weight=hp.kl_weight, method=method, logvar_optimizer=hp.logvar_optimizer,
        ivon_settings=ivon_settings_for(hp, batch, ctx.clients_per_round / max(ctx.federation.num_clients, 1)),
    )  # fmt: skip


def _stored_meaning(table: dict, stored: dict) -> dict:
    """A config written before the variants ran the published code's (``variant = "paper"``); one
    written before ``logvar_optimizer`` trained the log-variances with Adam; one written before
    ``method`` had ``"auto"`` stored its client (Bayes-by-backprop where it lacks the key), and
    one written before ``ivon_batch`` ran IVON on the ``[client]`` minibatches."""
    del stored
    table.setdefault("variant", "paper")
    table.setdefault("logvar_optimizer", "adam")
    table.setdefault("method", "bbb")
    table.setdefault("ivon_batch", "client")
    return table


SPEC = AlgorithmSpec(
    "vbnn", VBNNConfig, build, "variational BNN clients (IVON on a linear model, Bayes-by-backprop on a network; the prior once); six rules to combine their posteriors",
    bayesian=True, aggregator_policy="own",
    aggregator_note="combines variational parameters with its own rule (algorithm.aggregation), not natural-parameter deltas that a robust rule, a precision cap or DP noise could act on",
    needs_variational_model=True, stored_meaning=_stored_meaning,
)  # fmt: skip
SPECS = (SPEC,)
