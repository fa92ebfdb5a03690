"""Multi-label metrics of StackOverflow tag prediction (docs/algorithms.md §13.1).

Al-Shedivat et al. 2021 (FedPA, Table 3) report precision, recall@5, macro-F1 and micro-F1;
Guo et al. 2023 (FedEP, Table 3) precision, recall, micro-F1 and macro-F1, thresholded. With
``p_il = sigmoid(logit_il)`` and the prediction ``yhat_il = [p_il >= 0.5]`` (Keras' default
threshold, used by Reddi et al. 2021's tag-prediction code):

* precision ``= sum TP / sum (TP + FP)`` and recall ``= sum TP / sum (TP + FN)`` over every
  (example, label) pair (micro-averaged; Keras' ``Precision()`` / ``Recall()``);
* recall@5: the same recall with ``yhat_il = 1`` for the 5 labels of largest ``p_il`` of each
  example (Keras' ``Recall(top_k=5)``);
* micro-F1 ``= 2 TP / (2 TP + FP + FN)`` over all pairs; macro-F1: the mean over labels of each
  label's ``2 TP_l / (2 TP_l + FP_l + FN_l)``, 0 for a label with no true and no predicted
  positive (scikit-learn's ``f1_score(average="macro")`` with its default ``zero_division``).

Every count is a sum over examples, so the statistics accumulate over padded test batches
(:func:`multilabel_stats`, masked) and are finalised once (:func:`finalize_multilabel`).
tests/evaluation/test_multilabel.py checks each number against scikit-learn.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["TOP_K", "MultilabelStats", "finalize_multilabel", "init_multilabel", "multilabel_stats"]

TOP_K = 5  # recall@5


class MultilabelStats(NamedTuple):
    """Summable counts: per-label true/false positives and false negatives at the threshold,
    the top-k hits, the sum of the loss and the number of examples."""

    tp: jax.Array  # [L]
    fp: jax.Array  # [L]
    fn: jax.Array  # [L]
    top_k_hits: jax.Array  # scalar: true labels among each example's top k
    loss_sum: jax.Array  # scalar: sum over examples of the mean sigmoid cross-entropy
    count: jax.Array  # scalar


def init_multilabel(num_labels: int) -> MultilabelStats:
    zeros = jnp.zeros((num_labels,), jnp.float32)
    scalar = jnp.zeros((), jnp.float32)
    return MultilabelStats(zeros, zeros, zeros, scalar, scalar, scalar)


def multilabel_stats(logits: jax.Array, labels: jax.Array, mask: jax.Array, top_k: int = TOP_K) -> MultilabelStats:
    """The counts of one batch: ``logits`` and 0/1 ``labels`` ``[batch, L]``, ``mask`` ``[batch]``."""
    m = mask[:, None]
    labels = labels.astype(jnp.float32)
    pred = (logits >= 0.0).astype(jnp.float32)  # sigmoid(z) >= 0.5  <=>  z >= 0
    _, top = jax.lax.top_k(logits, top_k)
    hits = jnp.sum(jnp.take_along_axis(labels, top, axis=1), axis=1)
    bce = jnp.mean(jnp.maximum(logits, 0.0) - logits * labels + jnp.log1p(jnp.exp(-jnp.abs(logits))), axis=1)
    return MultilabelStats(
        tp=jnp.sum(m * pred * labels, axis=0),
        fp=jnp.sum(m * pred * (1.0 - labels), axis=0),
        fn=jnp.sum(m * (1.0 - pred) * labels, axis=0),
        top_k_hits=jnp.sum(mask * hits),
        loss_sum=jnp.sum(mask * bce),
        count=jnp.sum(mask),
    )


def _ratio(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.maximum(den, 1.0), 0.0)


def finalize_multilabel(stats: MultilabelStats) -> dict[str, jax.Array]:
    """``precision``, ``recall``, ``recall_at_5``, ``micro_f1``, ``macro_f1`` (fractions) and
    ``loss`` (the mean sigmoid cross-entropy) from the summed counts."""
    tp, fp, fn = jnp.sum(stats.tp), jnp.sum(stats.fp), jnp.sum(stats.fn)
    per_label = _ratio(2.0 * stats.tp, 2.0 * stats.tp + stats.fp + stats.fn)
    return {
        "precision": _ratio(tp, tp + fp),
        "recall": _ratio(tp, tp + fn),
        f"recall_at_{TOP_K}": _ratio(stats.top_k_hits, tp + fn),
        "micro_f1": _ratio(2.0 * tp, 2.0 * tp + fp + fn),
        "macro_f1": jnp.mean(per_label),
        "loss": stats.loss_sum / jnp.maximum(stats.count, 1.0),
    }
