"""Multi-layer perceptron.

Swaroop et al. 2025 (ADMM and Bayes) (Swaroop et al. 2025 (ADMM and Bayes), App. E, MNIST and Fashion-MNIST) trains "a two-hidden layer multi-layer
perceptron, with 200 hidden units in the first layer, and 100 units in the second layer", as in
Acar et al. (2021) and McMahan et al. (2016); that is the default here.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax


class MLP(nn.Module):
    """Fully connected network: flatten, then ``[Dense(h) -> relu]`` per hidden width, then
    ``Dense(num_classes)``.

    Attributes:
        num_classes: number of output logits C.
        hidden: hidden-layer widths, input side first; ``(200, 100)`` is Swaroop et al. 2025 (ADMM and Bayes)'s network.
    """

    num_classes: int
    hidden: Sequence[int] = (200, 100)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``."""
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden):
            x = nn.relu(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.num_classes, name="output")(x)
