"""Small LeNet-5-style convolutional network.

Ozer et al. 2022 (VBNN aggregation) (Ozer et al. 2022 (VBNN aggregation), App. "Architectures") follows Li et al. (2022, NIID-Bench): "two 5x5
convolutional layers. ReLU activation function and 2x2 max-pooling operation follows the
convolutional layers. [...] three linear layers with 400, 120, and 84 hidden dimensions", with
ReLU between dense layers. The channel counts (6 and 16) are not in the seed; they are those of
NIID-Bench's ``SimpleCNN`` (LeNet-5). The "400" is the flattened input of the first linear layer
on 32x32x3 CIFAR-10 images (16 channels x 5 x 5) with unpadded ("VALID") convolutions.

Padding (a deliberate departure): by default the convolutions use "SAME" padding, so that the
network is defined on small inputs such as scikit-learn's 8x8 digits (8 -> 4 -> 2 spatially),
where the paper's unpadded convolutions would leave no pixels after the second convolution.
On 28x28 Fashion-MNIST this makes the flattened feature 16 x 7 x 7 = 784 rather than the
paper's 16 x 4 x 4 = 256, so the first dense layer is larger. ``padding="VALID"`` reproduces the
NIID-Bench network exactly (flattened 256 on 28x28x1, 400 on 32x32x3).

Convolutions are computed as patch extraction plus a dot (:mod:`fedbayes.models.conv`): XLA:CPU's
own convolutions run 3.5-4x slower inside the simulator's per-client loops. ``conv="xla"`` keeps
``nn.Conv`` (same parameters, outputs equal up to float32 reassociation), for comparison.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedbayes.models.conv import PatchConv

CONV_IMPLS: tuple[str, ...] = ("patches", "xla")


class CNN(nn.Module):
    """``[Conv5x5(6) -> relu -> maxpool2x2] -> [Conv5x5(16) -> relu -> maxpool2x2] -> flatten ->
    Dense(120) -> relu -> Dense(84) -> relu -> Dense(num_classes)``.

    Pooling uses stride 2 with no padding (odd sizes are floored, as in PyTorch's ``MaxPool2d``).

    Attributes:
        num_classes: number of output logits C.
        padding: convolution padding, "SAME" (default; valid on inputs as small as 1x1) or
            "VALID" (the paper's network; needs inputs of at least 16x16).
        conv: ``"patches"`` (default, :class:`~fedbayes.models.conv.PatchConv`, full speed inside
            loops on CPU) or ``"xla"`` (``nn.Conv``); the parameters are the same.
    """

    num_classes: int
    padding: str = "SAME"
    conv: str = "patches"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """Maps images ``[batch, H, W, C]`` (or ``[batch, H, W]``, read as one channel) to
        logits ``[batch, num_classes]``.

        Raises:
            ValueError: if the input is not a batch of images.
        """
        if x.ndim == 3:
            x = x[..., None]
        if x.ndim != 4:
            raise ValueError(f"CNN expects images [batch, H, W] or [batch, H, W, C]; got shape {x.shape}")
        x = conv_features(x, self.padding, self.conv)
        x = nn.relu(nn.Dense(120, name="dense_0")(x))
        x = nn.relu(nn.Dense(84, name="dense_1")(x))
        return nn.Dense(self.num_classes, name="output")(x)


def conv_features(x: jax.Array, padding: str, conv: str) -> jax.Array:
    """The convolutional trunk, called inside a compact module: two ``[conv5x5 -> relu ->
    maxpool2x2]`` blocks (6 and 16 channels, submodules ``conv_0``, ``conv_1``), flattened.

    Raises:
        ValueError: for a ``conv`` not in :data:`CONV_IMPLS`.
    """
    if conv not in CONV_IMPLS:
        raise ValueError(f"conv must be one of {', '.join(CONV_IMPLS)}, got {conv!r}")
    for i, features in enumerate((6, 16)):
        if conv == "patches":
            layer = PatchConv(features, kernel_size=(5, 5), padding=padding, name=f"conv_{i}")
        else:
            layer = nn.Conv(features, kernel_size=(5, 5), padding=padding, name=f"conv_{i}")
        x = nn.max_pool(nn.relu(layer(x)), window_shape=(2, 2), strides=(2, 2), padding="VALID")
    return x.reshape((x.shape[0], -1))
