"""Multi-label tag-prediction metrics against scikit-learn, and next-word accuracy by hand."""

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn.metrics import f1_score, precision_score, recall_score

from fedbayes.evaluation.evaluators import make_evaluator
from fedbayes.evaluation.next_word import finalize_next_word, next_word_stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multilabel_metrics_equal_scikit_learns(seed):
    rng = np.random.default_rng(seed)
    n, labels = 57, 12
    logits = rng.normal(-0.8, 1.5, (n, labels)).astype(np.float32)
    y = (rng.random((n, labels)) < 0.2).astype(np.float32)
    y[:, 3] = 0  # a label nobody has: macro-F1 counts it as 0, as scikit-learn does
    pred = (logits >= 0).astype(int)
    top5 = np.zeros_like(pred)
    np.put_along_axis(top5, np.argsort(-logits, axis=1)[:, :5], 1, axis=1)
    # evaluated in batches of 10 with a padded last batch: the counts must sum exactly
    out = make_evaluator(lambda p, x: x, logits, y, task="multilabel", batch_size=10)(None)
    yi = y.astype(int)
    assert out["precision"] == pytest.approx(precision_score(yi, pred, average="micro", zero_division=0), abs=1e-6)
    assert out["recall"] == pytest.approx(recall_score(yi, pred, average="micro", zero_division=0), abs=1e-6)
    assert out["recall_at_5"] == pytest.approx(recall_score(yi, top5, average="micro", zero_division=0), abs=1e-6)
    assert out["micro_f1"] == pytest.approx(f1_score(yi, pred, average="micro", zero_division=0), abs=1e-6)
    assert out["macro_f1"] == pytest.approx(f1_score(yi, pred, average="macro", zero_division=0), abs=1e-6)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    bce = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
    assert out["loss"] == pytest.approx(bce, rel=1e-5)


def test_next_word_accuracy_skips_pad_oov_bos_eos():
    # vocabulary of 3 words: pad 0, words 1..3, oov 4, bos 5, eos 6 (7 logits)
    targets = jnp.array([[1, 2, 4, 6, 0], [3, 3, 5, 0, 0]])
    guess = jnp.array([[1, 3, 4, 6, 0], [3, 1, 5, 2, 2]])  # right on 1 of the 2 words in row 0, 1 of 2 in row 1
    logits = 10.0 * jnp.eye(7)[guess]
    out = finalize_next_word(next_word_stats(logits, targets, jnp.ones(2)))
    assert float(out["accuracy"]) == pytest.approx(2 / 4)
    masked = finalize_next_word(next_word_stats(logits, targets, jnp.array([1.0, 0.0])))
    assert float(masked["accuracy"]) == pytest.approx(1 / 2)
