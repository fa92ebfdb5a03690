"""A flax model of your own, for examples/own_data/: a small MLP with LayerNorm.

fedbayes imports it from the config (`model.module = "examples/own_data/model.py:SmallNet"`)
and sets `num_classes` from the data. It must map [batch, features] to logits [batch, classes]
and keep only parameters: LayerNorm or GroupNorm, not BatchNorm (whose running statistics are
state that the methods do not federate; such a model is refused with one line).
"""

import flax.linen as nn


class SmallNet(nn.Module):
    num_classes: int
    width: int = 32

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.LayerNorm()(nn.Dense(self.width)(x)))
        return nn.Dense(self.num_classes)(x)
