"""Linear models: multinomial logistic regression and linear (least-squares) regression.

Logistic regression is the model of Swaroop et al. 2025 (ADMM and Bayes)'s UCI Credit and FLamby-Heart experiments (Swaroop et al. 2025 (ADMM and Bayes),
Sec. 4) and of Guo et al. 2023 (FedEP)'s StackOverflow tag prediction (docs/algorithms.md §13.1); linear regression is the
model of the federated least-squares problem of Al-Shedivat et al. 2021 (FedPA), App. A (docs/algorithms.md §15.4).
"""

from __future__ import annotations

import flax.linen as nn
import jax


class LogisticRegression(nn.Module):
    """Multinomial logistic regression, ``logits = W x + b``.

    The input is flattened, so any feature shape works. With ``num_classes = 2`` this is the
    (over-parameterised but equivalent) softmax form of binary logistic regression.

    Attributes:
        num_classes: number of output logits C.
    """

    num_classes: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``."""
        x = x.reshape((x.shape[0], -1))
        return nn.Dense(self.num_classes, name="dense")(x)


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
