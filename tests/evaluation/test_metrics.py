"""Tests for fedbayes.evaluation.metrics: classification metrics against hand-computed values, sklearn and
an independent NumPy ECE; batch accumulation; regression metrics; curve summaries (docs/algorithms.md §13).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sklearn.metrics import log_loss

from fedbayes.evaluation.metrics import (
    accuracy,
    best_within,
    bin_index,
    classification_metrics,
    classification_stats,
    ece,
    final_max,
    final_mean,
    final_window_mean,
    finalize_stats,
    init_stats,
    merge_stats,
    nll,
    regression_metrics,
    rounds_to_threshold,
    running_mean,
)

# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _softmax64(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


def _ece_reference(probs, labels, num_bins):
    """ECE by an explicit loop over bins, in float64, with np.linspace edges (docs/algorithms.md §13.1)."""
    probs = np.asarray(probs, np.float64)
    conf = probs.max(axis=1)
    correct = probs.argmax(axis=1) == np.asarray(labels)
    edges = np.linspace(0.0, 1.0, num_bins + 1)
    total = 0.0
    for b in range(num_bins):
        in_bin = (conf > edges[b]) & (conf <= edges[b + 1])
        if b == 0:
            in_bin |= conf == 0.0
        if in_bin.any():
            gap = abs(correct[in_bin].mean() - conf[in_bin].mean())
            total += in_bin.mean() * gap
    return total


def _random_problem(seed, n, c, concentration=0.5):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(c, concentration), size=n).astype(np.float32)
    # Mostly the predicted class, sometimes another: accuracy strictly between 0 and 1.
    labels = np.where(rng.random(n) < 0.6, probs.argmax(axis=1), rng.integers(0, c, n))
    return probs, labels.astype(np.int32)


# ------------------------------------------------------------------------------------------------
# Accuracy and NLL
# ------------------------------------------------------------------------------------------------

TINY_PROBS = np.array([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6], [0.25, 0.5, 0.25]], np.float32)
TINY_LABELS = np.array([0, 2, 0], np.int32)


def test_accuracy_and_nll_hand_computed():
    assert accuracy(TINY_PROBS, TINY_LABELS) == pytest.approx(2 / 3)
    expected = -(math.log(0.7) + math.log(0.6) + math.log(0.25)) / 3
    # float32 logs.
    assert nll(TINY_PROBS, TINY_LABELS) == pytest.approx(expected, rel=1e-6)


def test_accuracy_on_logits_and_ties():
    logits = jnp.array([[2.0, 2.0, 0.0], [0.0, -1.0, 3.0]], jnp.float32)
    # A tie goes to the lowest index (class 0): first row correct for label 0, wrong for 1.
    assert accuracy(logits, jnp.array([0, 2], jnp.int32)) == 1.0
    assert accuracy(logits, jnp.array([1, 2], jnp.int32)) == 0.5


def test_nll_eps():
    probs = jnp.array([[1.0, 0.0]], jnp.float32)
    labels = jnp.array([1], jnp.int32)
    assert np.isinf(nll(probs, labels))
    # float32 log of 1e-8.
    assert nll(probs, labels, eps=1e-8) == pytest.approx(-math.log(1e-8), rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_nll_matches_sklearn_log_loss(seed):
    probs, labels = _random_problem(seed, n=50, c=5, concentration=2.0)
    p64 = probs.astype(np.float64)
    expected = log_loss(labels, p64 / p64.sum(axis=1, keepdims=True), labels=np.arange(5))
    # float32 logs and sum.
    np.testing.assert_allclose(nll(probs, labels), expected, rtol=1e-5)


def test_classification_metrics_from_logits_match_sklearn():
    rng = np.random.default_rng(2)
    logits = (3.0 * rng.standard_normal((64, 6))).astype(np.float32)
    labels = rng.integers(0, 6, 64).astype(np.int32)
    metrics = classification_metrics(jnp.asarray(logits), jnp.asarray(labels))
    p64 = _softmax64(logits)
    # float32 log_softmax and sum.
    expected_nll = log_loss(labels, p64, labels=np.arange(6))
    np.testing.assert_allclose(metrics["nll"], expected_nll, rtol=1e-5)
    assert "loss" not in metrics  # the NLL is the loss: kept once
    assert metrics["accuracy"] == pytest.approx(np.mean(p64.argmax(1) == labels))
    # Independent ECE on float64 probabilities; float32 softmax moves confidences by ~1e-7.
    np.testing.assert_allclose(metrics["ece"], _ece_reference(p64, labels, 15), atol=1e-5)


def test_probability_and_logit_paths_agree():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((40, 4)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 4, 40), jnp.int32)
    probs = jax.nn.softmax(logits)
    metrics = classification_metrics(logits, labels)
    assert metrics["accuracy"] == accuracy(probs, labels)
    # exp(log_softmax) vs softmax differ by a few float32 ulps.
    np.testing.assert_allclose(metrics["nll"], nll(probs, labels), rtol=1e-5)
    np.testing.assert_allclose(metrics["ece"], ece(probs, labels), atol=1e-6)


def test_log_probabilities_with_minus_inf_are_accepted():
    log_probs = jnp.log(jnp.array([[1.0, 0.0], [0.25, 0.75]], jnp.float32))
    metrics = classification_metrics(log_probs, jnp.array([0, 1], jnp.int32), num_bins=4)
    assert metrics["accuracy"] == 1.0
    assert metrics["nll"] == pytest.approx(-math.log(0.75) / 2, rel=1e-6)  # float32 log
    # Confidences 1.0 (bin 3) and 0.75 (bin 2), both correct: gaps 0 and 0.25, weight 1/2 each.
    assert metrics["ece"] == pytest.approx(0.125, rel=1e-6)


def test_classification_metrics_inside_jit_and_vmap():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((3, 30, 4)), jnp.float32)  # e.g. three clients
    labels = jnp.asarray(rng.integers(0, 4, (3, 30)), jnp.int32)
    batched = jax.jit(jax.vmap(lambda lg, lb: classification_metrics(lg, lb, num_bins=10)))(logits, labels)
    for i in range(3):
        single = classification_metrics(logits[i], labels[i], num_bins=10)
        for name in ("accuracy", "nll", "ece"):
            # Batched reductions may reorder float32 sums.
            np.testing.assert_allclose(batched[name][i], single[name], rtol=1e-6)
    assert not np.allclose(batched["nll"][0], batched["nll"][1])


# ------------------------------------------------------------------------------------------------
# ECE
# ------------------------------------------------------------------------------------------------


MAX_N, MAX_C = 200, 10


@given(
    n=st.integers(1, MAX_N),
    c=st.integers(2, MAX_C),
    num_bins=st.sampled_from([1, 2, 7, 15, 30]),
    concentration=st.sampled_from([0.1, 0.5, 2.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_ece_matches_numpy_loop(n, c, num_bins, concentration, seed):
    probs, labels = _random_problem(seed, n, c, concentration)
    # Padded to one shape so that the examples share compiled kernels: zero-probability classes
    # (never the argmax or the max) and masked rows holding garbage.
    padded = np.full((MAX_N, MAX_C), np.nan, np.float32)
    padded[:n] = 0.0
    padded[:n, :c] = probs
    padded_labels = np.full(MAX_N, -7, np.int32)
    padded_labels[:n] = labels
    mask = (np.arange(MAX_N) < n).astype(np.float32)
    value = ece(jnp.asarray(padded), jnp.asarray(padded_labels), num_bins, jnp.asarray(mask))
    assert 0.0 <= value <= 1.0
    # float32 sums against the float64 reference.
    np.testing.assert_allclose(value, _ece_reference(probs, labels, num_bins), rtol=1e-5, atol=1e-6)


def test_ece_unmasked_equals_masked_prefix():
    probs, labels = _random_problem(8, n=30, c=4)
    mask = np.concatenate([np.ones(20), np.zeros(10)]).astype(np.float32)
    np.testing.assert_allclose(
        ece(probs, labels, 15, mask),
        ece(probs[:20], labels[:20], 15),
        rtol=1e-6,  # different float32 summation length
    )
    masked_nll, prefix_nll = nll(probs, labels, mask=mask), nll(probs[:20], labels[:20])
    np.testing.assert_allclose(masked_nll, prefix_nll, rtol=1e-6)  # float32 summation length
    masked_acc, prefix_acc = accuracy(probs, labels, mask), accuracy(probs[:20], labels[:20])
    np.testing.assert_allclose(masked_acc, prefix_acc, rtol=1e-6)  # 13/20: XLA may divide by 1/x


def test_ece_perfectly_calibrated_is_zero():
    # Binary predictions at the centres of 10 bins; in each bin exactly a fraction c is correct.
    probs, labels = [], []
    for c in (0.55, 0.65, 0.75, 0.85, 0.95):
        num_correct = round(100 * c)
        probs += [[c, 1.0 - c]] * 100
        labels += [0] * num_correct + [1] * (100 - num_correct)
    value = ece(jnp.asarray(probs, jnp.float32), jnp.asarray(labels, jnp.int32), num_bins=10)
    # Only the float32 rounding of c remains.
    assert value == pytest.approx(0.0, abs=1e-6)


def test_ece_constant_overconfidence_is_the_gap():
    probs = jnp.tile(jnp.array([[0.9, 0.05, 0.05]], jnp.float32), (10, 1))
    labels = jnp.array([0] * 6 + [1] * 4, jnp.int32)  # accuracy 0.6 at confidence 0.9
    for num_bins in (1, 15, 100):
        # float32 representation of 0.9.
        assert ece(probs, labels, num_bins) == pytest.approx(0.3, rel=1e-6)


def test_bin_index_edges_go_to_the_lower_bin():
    edges = np.arange(16, dtype=np.float32) / np.float32(15)
    # Edge e_j (j >= 1) is the upper end of bin j - 1; 0 goes to the first bin.
    expected = np.concatenate([[0], np.arange(15)])
    np.testing.assert_array_equal(bin_index(jnp.asarray(edges), 15), expected)
    above = np.nextafter(edges[:-1], np.float32(2))
    np.testing.assert_array_equal(bin_index(jnp.asarray(above), 15), np.arange(15))
    with pytest.raises(ValueError, match="num_bins"):
        bin_index(jnp.asarray(edges), 0)


def test_ece_bin_edge_convention():
    # Confidence 0.5 (correct) and 0.6 (wrong), 4 bins. With (l, u] they fall in separate bins,
    # (0.25, 0.5] and (0.5, 0.75]: ECE = 0.5 * 0.5 + 0.5 * 0.6 = 0.55. With [l, u) they would
    # share [0.5, 0.75): ECE = |0.5 - 0.55| = 0.05.
    probs = jnp.array([[0.5, 0.5], [0.6, 0.4]], jnp.float32)
    labels = jnp.array([0, 1], jnp.int32)
    assert ece(probs, labels, num_bins=4) == pytest.approx(0.55, rel=1e-6)  # float32 0.6


# ------------------------------------------------------------------------------------------------
# Accumulation over batches
# ------------------------------------------------------------------------------------------------


def test_batched_accumulation_equals_one_shot():
    rng = np.random.default_rng(5)
    n, c, batch, num_bins = 103, 7, 16, 15
    logits = (2.0 * rng.standard_normal((n, c))).astype(np.float32)
    labels = rng.integers(0, c, n).astype(np.int32)
    stats_fn = jax.jit(classification_stats, static_argnames="num_bins")

    stats = init_stats(num_bins)
    for start in range(0, n, batch):
        xb, yb = logits[start : start + batch], labels[start : start + batch]
        pad = batch - len(yb)
        mask = np.concatenate([np.ones(len(yb)), np.zeros(pad)]).astype(np.float32)
        # Garbage in padded rows: NaN logits and an out-of-range label.
        xb = np.concatenate([xb, np.full((pad, c), np.nan, np.float32)])
        yb = np.concatenate([yb, np.full(pad, 99, np.int32)])
        stats = merge_stats(stats, stats_fn(xb, yb, mask, num_bins=num_bins))

    assert stats.count == n
    assert stats.bin_count.sum() == n
    batched = finalize_stats(stats)
    one_shot = classification_metrics(jnp.asarray(logits), jnp.asarray(labels), num_bins)
    for name in ("accuracy", "nll", "ece"):
        assert np.isfinite(batched[name])
        # Different float32 summation order.
        np.testing.assert_allclose(batched[name], one_shot[name], rtol=1e-5, atol=1e-7)


def test_stats_mask_zero_rows_do_not_count():
    logits = jnp.array([[5.0, 0.0], [0.0, 5.0]], jnp.float32)
    labels = jnp.array([0, 0], jnp.int32)  # first right, second wrong
    full = finalize_stats(classification_stats(logits, labels))
    first = finalize_stats(classification_stats(logits, labels, jnp.array([1.0, 0.0], jnp.float32)))
    assert full["accuracy"] == 0.5
    assert first["accuracy"] == 1.0


def test_finalize_empty_is_nan():
    metrics = finalize_stats(init_stats(5))
    assert all(np.isnan(v) for v in metrics.values())


# ------------------------------------------------------------------------------------------------
# Regression
# ------------------------------------------------------------------------------------------------


def test_regression_metrics():
    pred = jnp.array([1.0, 2.0, 3.0, 100.0], jnp.float32)
    y = jnp.array([0.0, 2.0, 5.0, 0.0], jnp.float32)
    m = regression_metrics(pred, y, jnp.array([1.0, 1.0, 1.0, 0.0], jnp.float32))
    assert m["mse"] == pytest.approx((1.0 + 0.0 + 4.0) / 3)
    assert m["rmse"] == pytest.approx(math.sqrt(5.0 / 3))
    assert m["loss"] == pytest.approx(0.5 * 5.0 / 3)
    assert regression_metrics(pred, y)["mse"] == pytest.approx((1.0 + 4.0 + 10000.0) / 4)


# ------------------------------------------------------------------------------------------------
# Curve summaries
# ------------------------------------------------------------------------------------------------


def test_running_mean():
    np.testing.assert_array_equal(running_mean([1, 2, 3, 4, 5], 2), [np.nan, 1.5, 2.5, 3.5, 4.5])
    np.testing.assert_array_equal(running_mean([1, 2, 3], 1), [1, 2, 3])
    np.testing.assert_array_equal(running_mean([1, 2, 3], 3), [np.nan, np.nan, 2])
    assert np.all(np.isnan(running_mean([1, 2, 3], 4)))
    with pytest.raises(ValueError, match="window"):
        running_mean([1, 2], 0)


def test_running_mean_matches_definition():
    v = np.random.default_rng(6).random(50)
    m = running_mean(v, 7)
    for i in range(6, 50):
        assert m[i] == pytest.approx(v[i - 6 : i + 1].mean(), rel=1e-12)


def test_rounds_to_threshold():
    values = [0.1, 0.5, 0.9, 0.9, 0.2, 1.0]
    # Trailing means (window 2): nan, .3, .7, .9, .55, .6 -> first >= .9 at the 4th evaluation.
    assert rounds_to_threshold([1, 2, 3, 4, 5, 6], values, 0.9, window=2) == 4
    # Evaluation every 5 rounds: the answer is a round number, not an index.
    assert rounds_to_threshold([5, 10, 15, 20, 25, 30], values, 0.9, window=2) == 20
    assert rounds_to_threshold([1, 2, 3, 4, 5, 6], values, 0.95, window=2) is None
    assert rounds_to_threshold([1, 2, 3, 4, 5, 6], values, 0.9, window=1) == 3
    # The first window - 1 evaluations have no trailing mean, however high they are.
    assert rounds_to_threshold([1, 2, 3], [1.0, 0.0, 0.0], 0.9, window=2) is None
    assert rounds_to_threshold([], [], 0.5) is None


def test_curve_input_validation():
    with pytest.raises(ValueError, match="increasing"):
        rounds_to_threshold([1, 3, 2], [0.1, 0.2, 0.3], 0.5, window=1)
    with pytest.raises(ValueError, match="equal length"):
        best_within([1, 2], [0.1], 2, window=1)


def test_best_within():
    rounds = [1, 2, 3, 4, 5, 6, 7]
    values = [0, 1, 2, 3, 4, 3, 2]
    # Trailing means (window 3): nan, nan, 1, 2, 3, 10/3, 3.
    assert best_within(rounds, values, 7, window=3) == pytest.approx(10 / 3)
    assert best_within(rounds, values, 4, window=3) == pytest.approx(2.0)
    assert best_within(rounds, values, 100, window=3) == pytest.approx(10 / 3)
    assert best_within(rounds, values, 2, window=3) is None


def test_best_within_is_seed_a_definition():
    # max over 100 <= r <= R of m^(100)_r with evaluation every round, computed independently.
    v = np.random.default_rng(7).random(160)
    rounds = np.arange(1, 161)
    expected = max(v[r - 100 : r].mean() for r in range(100, 151))
    assert best_within(rounds, v, 150, window=100) == pytest.approx(expected, rel=1e-12)


def test_final_summaries():
    assert final_mean([1, 2, 3, 4]) == pytest.approx(3.0)
    assert final_max([1, 5, 3, 4]) == 5.0
    assert final_mean([1, 2]) is None
    assert final_max([1, 2]) is None
    assert final_mean([1, 2, 3, 4], last=1) == 4.0
    assert final_window_mean(list(range(200)), window=100) == pytest.approx(149.5)
    assert final_window_mean(list(range(99)), window=100) is None
