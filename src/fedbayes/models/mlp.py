"""Multi-layer perceptron.

Swaroop et al. 2025 (ADMM and Bayes) (Swaroop et al. 2025 (ADMM and Bayes), App. E, MNIST and Fashion-MNIST) trains "a two-hidden layer multi-layer
perceptron, with 200 hidden units in the first layer, and 100 units in the second layer", as in
Acar et al. (2021) and McMahan et al. (2016); that is the default here.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax

ACTIVATIONS = {"relu": nn.relu, "sigmoid": nn.sigmoid, "tanh": nn.tanh}


def activation_fn(name: str):
    """The hidden-layer nonlinearity called ``name`` (one of :data:`ACTIVATIONS`)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation: must be one of {', '.join(ACTIVATIONS)}; got {name!r}") from None


class MLP(nn.Module):
    """Fully connected network: flatten, then ``[Dense(h) -> activation]`` per hidden width, then
    ``Dense(num_classes)``.

    Attributes:
        num_classes: number of output logits C.
        hidden: hidden-layer widths, input side first; ``(200, 100)`` is Swaroop et al. 2025 (ADMM and Bayes)'s network.
        activation: ``"relu"`` (default), ``"sigmoid"`` (the nonlinearity of the FedLap authors'
            code) or ``"tanh"``.
    """

    num_classes: int
    hidden: Sequence[int] = (200, 100)
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps float32 inputs ``[batch, *feature_shape]`` to logits ``[batch, num_classes]``."""
        act = activation_fn(self.activation)
        x = x.reshape((x.shape[0], -1))
        for i, width in enumerate(self.hidden):
            x = act(nn.Dense(width, name=f"hidden_{i}")(x))
        return nn.Dense(self.num_classes, name="output")(x)
