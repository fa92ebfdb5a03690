"""Linear models: multinomial logistic regression and linear (least-squares) regression.

Logistic regression is the model of Swaroop et al. 2025 (ADMM and Bayes)'s UCI Credit and FLamby-Heart experiments (Swaroop et al. 2025 (ADMM and Bayes),
Sec. 4) and of Guo et al. 2023 (FedEP)'s StackOverflow tag prediction (docs/algorithms.md §13.1); linear regression is the
model of the federated least-squares problem of Al-Shedivat et al. 2021 (FedPA), App. A (docs/algorithms.md §15.4).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def centred_over_classes(init: nn.initializers.Initializer) -> nn.initializers.Initializer:
    """``init`` with each input's weights centred over the classes (the last axis).

    A softmax's logits can all move by the same amount without changing its probabilities, so
    ``W + v 1^T`` (any ``v``, one value per input) predicts exactly as ``W`` does: the likelihood
    has no curvature in that direction and only the prior determines it, at ``v = 0`` under a
    zero-mean Gaussian prior. The cross-entropy's gradient has no component there (its entries
    for one input sum to ``x (sum_c p_c - 1) = 0``), so a start's component stays, except for
    the prior's slow pull. For the diagonal site methods it decays at the prior's rate: on a
    20-feature logistic regression the mean was still 0.23 from its optimum after 300 rounds
    (docs/results/posterior_unseen.md). Centring the start puts that component at its optimum.
    """

    def centred(key, shape, dtype=jnp.float32):
        w = init(key, shape, dtype)
        return w - jnp.mean(w, axis=-1, keepdims=True)

    return centred


class LogisticRegression(nn.Module):
    """Multinomial logistic regression, ``logits = W x + b``.

    The input is flattened, so any feature shape works. With ``num_classes = 2`` this is the
    (over-parameterised but equivalent) softmax form of binary logistic regression. The weights
    start at LeCun-normal draws centred over the classes (:func:`centred_over_classes`).

    Attributes:
        num_classes: number of output logits C.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``."""
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.num_classes, name="dense", kernel_init=centred_over_classes(nn.initializers.lecun_normal()))(x)


class LinearRegression(nn.Module):
    """Linear regression, ``f(x) = w^T x + b``, one scalar prediction per example.

    Trained with the loss ``0.5 (f(x) - y)^2`` (see :func:`fedbayes.models.loss_fn`), i.e. a
    Gaussian likelihood with unit noise variance up to a constant.
    """

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps float32 inputs ``[batch, *feature_shape]`` to predictions ``[batch]``."""
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(1, name="dense")(x)[:, 0]
