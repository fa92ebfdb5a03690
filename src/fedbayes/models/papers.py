"""The models of the federated benchmarks of Al-Shedivat et al. 2021 (FedPA, Table 3) and Guo et
al. 2023 (FedEP, Tables 2, 3, 5, 6), as Reddi et al. 2021 ("Adaptive Federated Optimization",
App. C) define them:

* :class:`EmnistCNN`: EMNIST-62's CNN, ``conv3x3(32) -> conv3x3(64) -> maxpool2x2 -> dropout(0.25)
  -> dense(128) -> dropout(0.5) -> dense(62)``, 1,206,590 parameters ("1.2M");
* :class:`ResNet18GN`: ResNet-18 with GroupNorm (2 groups, Hsieh et al. 2020) for 24x24 CIFAR-100
  crops, the ImageNet stem (7x7 stride-2 convolution, 3x3 stride-2 max pool), 11,227,812
  parameters for 100 classes ("11.2M");
* :class:`NextWordLSTM`: StackOverflow next-word prediction, ``embed(96) -> LSTM(670) -> dense(96)
  -> dense(V)`` over ``V`` = 10,000 words + 4 special tokens, 4,050,748 parameters (Reddi et al.'s
  count).

StackOverflow tag prediction uses :class:`~fedbayes.models.logreg.LogisticRegression` with 500
outputs (5,000,500 parameters, "5.0M") under the ``"multilabel"`` task's sigmoid cross-entropy.

Training-time randomness (dropout; CIFAR's random crops and flips) lives in each model's
``training_apply(params, key, x)``, which :func:`fedbayes.models.loss_fn` calls with the step's
key; ``model.apply`` is the deterministic pass (no dropout, central crop) that evaluation and the
curvature methods use.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from fedbayes.models.conv import PatchConv

__all__ = ["CROP", "EmnistCNN", "NextWordLSTM", "ResNet18GN", "central_crop", "per_image_standardization", "random_crop_flip"]

CROP = 24  # CIFAR-100 crop side (TFF's cifar100 preprocessing, crop_shape (24, 24, 3))


class EmnistCNN(nn.Module):
    """EMNIST's CNN of Reddi et al. 2021 (``create_conv_dropout_model``), on ``[batch, 28, 28(, 1)]``.

    The two unpadded 3x3 convolutions run as :class:`~fedbayes.models.conv.PatchConv` (fast inside
    the simulator's loops on CPU; the parameters of ``nn.Conv``).

    Attributes:
        num_classes: 62 (digits and letters) or 10 (digits only).
    """

    num_classes: int = 62

    @nn.compact
    def __call__(self, x: jax.Array, dropout_key: jax.Array | None = None) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        x = nn.relu(PatchConv(32, kernel_size=(3, 3), padding="VALID", name="conv_0")(x))
        x = nn.relu(PatchConv(64, kernel_size=(3, 3), padding="VALID", name="conv_1")(x))
        x = nn.max_pool(x, window_shape=(2, 2), strides=(2, 2), padding="VALID")
        x = _dropout(x, 0.25, dropout_key, 0)
        x = nn.relu(nn.Dense(128, name="dense_0")(x.reshape((x.shape[0], -1))))
        x = _dropout(x, 0.5, dropout_key, 1)
        return nn.Dense(self.num_classes, name="output")(x)

    def training_apply(self, params, key: jax.Array, x: jax.Array) -> jax.Array:
        """The training pass: dropout drawn from ``key``."""
        return self.apply({"params": params}, x, dropout_key=key)


def _dropout(x: jax.Array, rate: float, key: jax.Array | None, tag: int) -> jax.Array:
    """Inverted dropout with its own key (none: the identity, as at evaluation)."""
    if key is None:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, tag), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros((), x.dtype))


def per_image_standardization(x: jax.Array) -> jax.Array:
    """``tf.image.per_image_standardization``: each image minus its mean, over
    ``max(std, 1/sqrt(num_elements))``; ``x`` is ``[batch, H, W, C]``."""
    n = x.shape[1] * x.shape[2] * x.shape[3]
    mean = jnp.mean(x, axis=(1, 2, 3), keepdims=True)
    std = jnp.std(x, axis=(1, 2, 3), keepdims=True)
    return (x - mean) / jnp.maximum(std, 1.0 / jnp.sqrt(jnp.float32(n)))


def central_crop(x: jax.Array, size: int) -> jax.Array:
    """``tf.image.resize_with_crop_or_pad`` to ``size x size`` for images at least that large:
    the central window (offset ``(H - size) // 2``)."""
    top, left = (x.shape[1] - size) // 2, (x.shape[2] - size) // 2
    return x[:, top : top + size, left : left + size, :]


def random_crop_flip(key: jax.Array, x: jax.Array, size: int) -> jax.Array:
    """``tf.image.random_crop`` to ``size x size`` then ``random_flip_left_right``, independently
    per image (TFF's ``distort`` preprocessing of CIFAR-100's training images)."""
    k_top, k_left, k_flip = jax.random.split(key, 3)
    batch, height, width = x.shape[:3]
    tops = jax.random.randint(k_top, (batch,), 0, height - size + 1)
    lefts = jax.random.randint(k_left, (batch,), 0, width - size + 1)
    flips = jax.random.bernoulli(k_flip, 0.5, (batch,))

    def one(img, top, left, flip):
        crop = jax.lax.dynamic_slice(img, (top, left, 0), (size, size, img.shape[-1]))
        return jnp.where(flip, crop[:, ::-1, :], crop)

    return jax.vmap(one)(x, tops, lefts, flips)


class _BasicBlock(nn.Module):
    features: int
    strides: int
    groups: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        conv = lambda f, k, s, name: nn.Conv(f, (k, k), strides=(s, s), padding="SAME", use_bias=False, name=name)  # noqa: E731
        y = nn.relu(nn.GroupNorm(self.groups, name="norm_0")(conv(self.features, 3, self.strides, "conv_0")(x)))
        y = nn.GroupNorm(self.groups, name="norm_1")(conv(self.features, 3, 1, "conv_1")(y))
        if self.strides != 1 or x.shape[-1] != self.features:
            x = nn.GroupNorm(self.groups, name="norm_skip")(conv(self.features, 1, self.strides, "conv_skip")(x))
        return nn.relu(x + y)


class ResNet18GN(nn.Module):
    """ResNet-18 (He et al. 2016) with GroupNorm in place of BatchNorm, for CIFAR-100.

    The input is raw images ``[batch, H, W, 3]`` (0..255); larger than ``crop`` they are
    centrally cropped, then standardised per image (TFF's test-time preprocessing).
    :meth:`training_apply` draws random crops and flips instead.

    Attributes:
        num_classes: 100 for CIFAR-100.
        crop: the crop side (24).
        width: channels of the first stage (64; the stages double it). Smaller widths give the
            same architecture at test scale.
        groups: GroupNorm groups (2, as Hsieh et al. 2020 and Reddi et al. 2021).
    """

    num_classes: int = 100
    crop: int = CROP
    width: int = 64
    groups: int = 2

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[1] > self.crop or x.shape[2] > self.crop:
            x = central_crop(x, self.crop)
        x = per_image_standardization(x)
        x = nn.Conv(self.width, (7, 7), strides=(2, 2), padding="SAME", use_bias=False, name="stem")(x)
        x = nn.relu(nn.GroupNorm(self.groups, name="stem_norm")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for stage in range(4):
            for block in range(2):
                strides = 2 if stage > 0 and block == 0 else 1
                x = _BasicBlock(self.width * 2**stage, strides, self.groups, name=f"stage{stage}_block{block}")(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="output")(x)

    def training_apply(self, params, key: jax.Array, x: jax.Array) -> jax.Array:
        """The training pass on random ``crop x crop`` windows, flipped at random."""
        if x.shape[1] > self.crop or x.shape[2] > self.crop:
            x = random_crop_flip(key, x, self.crop)
        return self.apply({"params": params}, x)


class NextWordLSTM(nn.Module):
    """Reddi et al. 2021's StackOverflow next-word model: ``embed(V, 96) -> LSTM(670) ->
    dense(96) -> dense(V)`` on token ids ``[batch, T]``, logits ``[batch, T, V]``.

    Token ids may arrive as floats (the initialiser's dummy batch); they are cast to int32.

    Attributes:
        num_classes: ``V``, the extended vocabulary (10,000 words + pad, out-of-vocabulary,
            begin and end: 10,004).
        embed_dim: 96.
        hidden: 670.
    """

    num_classes: int = 10_004
    embed_dim: int = 96
    hidden: int = 670

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        tokens = x.astype(jnp.int32)
        h = nn.Embed(self.num_classes, self.embed_dim, name="embed")(tokens)
        h = nn.RNN(nn.OptimizedLSTMCell(self.hidden), name="lstm")(h)
        h = nn.Dense(self.embed_dim, name="project")(h)
        return nn.Dense(self.num_classes, name="output")(h)
