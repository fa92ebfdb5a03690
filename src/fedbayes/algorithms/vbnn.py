"""Federated variational Bayesian neural networks (Ozer et al. 2022 (VBNN aggregation); docs/algorithms.md §12): Bayes-by-backprop clients
and the server's aggregation rules for variational weights.

Clients start from the broadcast variational parameters (means, log-variances and deterministic
weights, :mod:`fedbayes.models.variational`), minimise the mean cross-entropy of one stochastic
forward pass per minibatch plus ``KL(q || N(0, 1)) / n_k`` (docs/algorithms.md §12.1), and send their
parameters. The server combines them with one rule of docs/algorithms.md §12.3 applied elementwise to every
variational weight; deterministic leaves (biases, convolutions) always by the weighted mean,
exactly as FedAvg's :func:`fedbayes.tree.weighted_mean`. The weights ``beta_k`` are the round's
client weights normalised to sum 1: uniform gives Ozer et al. 2022 (VBNN aggregation)'s FVBA, ``n_k``-proportional its FVBWA
(the simulator's ``weighting``).

The rules, ``aggregation`` and ``accumulation``, are :mod:`fedbayes.aggregators.variational`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from pydantic import Field

from fedbayes.aggregators.variational import ACCUMULATIONS, RULES, variational_rule
from fedbayes.algorithms.base import Algorithm, AlgorithmSpec, BuildContext, finite_message, stateless_client_init
from fedbayes.hparams import HParams
from fedbayes.inference.sgd import LocalTrainer, run_sgd
from fedbayes.models.variational import kl_to_prior, split_variational

__all__ = ["VBNNState", "variational_data_loss", "variational_objective", "vbnn"]

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


def variational_objective(apply_fn: Callable, prior_variance: float = 1.0) -> Callable:
    """The client objective of docs/algorithms.md §12.1 for one minibatch.

    Args:
        apply_fn: ``(params, key, x) -> logits``, one stochastic forward pass
            (:func:`fedbayes.models.variational.apply_with_key`).
        prior_variance: the prior ``N(0, prior_variance)`` per variational weight.

    Returns:
        ``f(params, key, x, y, mask, num_examples)`` = masked mean cross-entropy of the batch +
        ``KL(q || prior) / num_examples`` (the client's ``n_k``; at least 1).
    """
    data_loss = variational_data_loss(apply_fn)

    def objective(params, key, x, y, mask, num_examples):
        n = jnp.maximum(jnp.asarray(num_examples, jnp.float32), 1.0)
        return data_loss(params, key, x, y, mask) + kl_to_prior(params, prior_variance) / n

    return objective


# ----- the algorithm ----------------------------------------------------------------------------


class VBNNState(NamedTuple):
    """Server state: the global variational parameters and the round counter."""

    params: Any
    round: jax.Array


def vbnn(
    trainer: LocalTrainer,
    apply_fn: Callable,
    *,
    aggregation: str = "gaa",
    population: int = 1000,
    prior_variance: float = 1.0,
    accumulation: str = "exact",
) -> Algorithm:
    """Federated VBNN with one of the rules of :data:`RULES` (FVBA / FVBWA by the round's weights).

    Clients train their variational parameters by Bayes-by-backprop from the broadcast ones
    (:func:`fedbayes.inference.sgd.run_sgd` with the keyed loss of :func:`variational_data_loss`,
    fresh noise at every step, and ``KL / n_k`` as the penalty) and send them; the server combines
    them with the rule (the algorithm's aggregator, :mod:`fedbayes.aggregators.variational`).

    The client is not :func:`fedbayes.inference.vi.reparameterised_vi` (PVI's local VI), for three
    reasons. It has no cavity: its KL is to a fixed prior ``N(0, prior_variance)``
    (:func:`fedbayes.models.variational.kl_to_prior`), not to ``q_g / t_k``, so it is not a
    :class:`~fedbayes.inference.base.CavityInference`. Its variational parameters are the
    model's own ``*_mean``/``*_logvar`` leaves (log-variances clamped in the forward pass, the
    server's rules combine them as such), where PVI's are ``(mean, raw_std)`` beside a
    deterministic model. And the model draws its own noise inside the forward pass from the
    step's key (``apply_fn(params, key, x)``), where PVI draws weights outside it
    (:func:`fedbayes.inference.vi.draw_weights`). Sharing ``vi.py`` would change all three, and
    with them every VBNN result.

    Args:
        trainer: the client optimizer, epochs and batch size (``trainer.loss_fn`` is replaced by
            the variational loss of ``apply_fn``).
        apply_fn: ``(params, key, x) -> logits`` of a variational model.
        aggregation: the server's rule.
        population: PPA's ``N``.
        prior_variance: the prior's variance per weight (Ozer et al. 2022: 1).
        accumulation: ``"exact"`` or ``"reference_code"`` (module docstring).

    Raises:
        ValueError: for an unknown aggregation, a population below 1 or a prior variance <= 0.
    """
    if prior_variance <= 0:
        raise ValueError(f"prior_variance must be > 0, got {prior_variance}")
    local = trainer._replace(loss_fn=variational_data_loss(apply_fn))

    def server_init(key, params):
        del key
        if not split_variational(params)[0]:
            raise ValueError("vbnn needs a variational model (leaves <name>_mean and <name>_logvar); got none")
        return VBNNState(params=params, round=jnp.zeros((), jnp.int32))

    def client_update(key, params, client_state, data):
        n = jnp.maximum(data.num_examples.astype(jnp.float32), 1.0)
        new, info = run_sgd(key, params, data, local, lambda p: kl_to_prior(p, prior_variance) / n)
        return new, client_state, info

    def server_update(key, state, aggregate):
        del key  # PPA's draws use the aggregator's key
        any_accepted = aggregate.count > 0  # none accepted: keep the old parameters
        params = jax.tree.map(lambda n, o: jnp.where(any_accepted, n, o), aggregate.mean, state.params)
        return VBNNState(params=params, round=state.round + 1), {}

    return Algorithm(
        name="vbnn",
        server_init=server_init,
        broadcast=lambda state: state.params,
        client_init=stateless_client_init,
        client_update=client_update,
        server_update=server_update,
        server_params=lambda state: state.params,
        message_ok=finite_message,
        local_epochs=trainer.num_epochs,
        local_batch_size=trainer.batch_size,
        aggregator=variational_rule(aggregation, population, accumulation),
    )


class VBNNConfig(HParams):
    """Federated variational BNNs (docs/algorithms.md §12): the server's aggregation rule; the
    model must be variational (``model.variational = true``)."""

    name: Literal["vbnn"]
    aggregation: Literal[RULES] = Field("gaa", description="eaa, gaa, aalv, ppa, cf or merging")  # type: ignore[valid-type]
    accumulation: Literal[ACCUMULATIONS] = Field(  # type: ignore[valid-type]
        "exact", description="exact (the paper's equations) or reference_code (the published code's running clamp in eaa, gaa, merging)"
    )
    population: int = Field(1000, ge=1, description="PPA: samples drawn from the clients' posteriors")
    prior_variance: float = Field(1.0, gt=0, description="the prior N(0, prior_variance) per variational weight")


def build(hp: VBNNConfig, ctx: BuildContext) -> Algorithm:
    if ctx.keyed_apply_fn is None:
        raise ValueError("vbnn needs a variational model's keyed apply function (model.variational = true)")
    return vbnn(
        ctx.trainer, ctx.keyed_apply_fn, aggregation=hp.aggregation, population=hp.population, prior_variance=hp.prior_variance, accumulation=hp.accumulation
    )


SPEC = AlgorithmSpec(
    "vbnn", VBNNConfig, build, "variational BNN clients (Bayes-by-backprop); six rules to combine their posteriors",
    aggregator_policy="own",
    aggregator_note="combines variational parameters with its own rule (algorithm.aggregation), not natural-parameter deltas that a robust rule, a precision cap or DP noise could act on",
    needs_variational_model=True,
)  # fmt: skip
SPECS = (SPEC,)
