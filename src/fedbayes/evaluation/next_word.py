"""Next-word prediction accuracy as Reddi et al. 2021 define it for StackOverflow (and
Al-Shedivat et al. 2021, Table 3, report it): top-1 accuracy over the target tokens that are not
padding, out-of-vocabulary, begin- or end-of-sentence (their ``accuracy_no_oov_or_eos``), and the
mean cross-entropy over the non-padding tokens (``loss``).

The special ids are those of :mod:`fedbayes.data.stackoverflow`: padding 0, the words
``1..V``, then out-of-vocabulary ``V+1``, begin ``V+2`` and end ``V+3``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

__all__ = ["NextWordStats", "finalize_next_word", "init_next_word", "next_word_stats"]


class NextWordStats(NamedTuple):
    correct: jax.Array  # right predictions among the counted tokens
    counted: jax.Array  # tokens that are none of pad / oov / bos / eos
    loss_sum: jax.Array  # cross-entropy summed over non-padding tokens
    tokens: jax.Array  # non-padding tokens


def init_next_word() -> NextWordStats:
    z = jnp.zeros((), jnp.float32)
    return NextWordStats(z, z, z, z)


def next_word_stats(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> NextWordStats:
    """The counts of one batch: ``logits`` ``[batch, T, V+4]``, ``targets`` ``[batch, T]``,
    ``mask`` ``[batch]``. The vocabulary size ``V`` is read off the logits."""
    words = logits.shape[-1] - 4
    real = mask[:, None] * (targets != 0).astype(jnp.float32)
    scored = real * ((targets >= 1) & (targets <= words)).astype(jnp.float32)
    correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(real > 0, targets, 0))
    return NextWordStats(jnp.sum(scored * correct), jnp.sum(scored), jnp.sum(jnp.where(real > 0, ce, 0.0) * real), jnp.sum(real))


def finalize_next_word(stats: NextWordStats) -> dict[str, jax.Array]:
    """``accuracy`` (without pad, oov, bos, eos) and ``loss`` (mean over non-padding tokens)."""
    return {
        "accuracy": stats.correct / jnp.maximum(stats.counted, 1.0),
        "loss": stats.loss_sum / jnp.maximum(stats.tokens, 1.0),
    }
