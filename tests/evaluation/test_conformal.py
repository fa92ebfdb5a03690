"""Split conformal sets calibrated by counts (fedbayes.evaluation.conformal): the federated
quantile against the pooled one, the coverage on exchangeable data against its exact finite-sample
value, and hand-computed scores and coverages."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.evaluation import conformal as cf

_scores = st.floats(allow_nan=False, allow_infinity=True, width=64)
_clients = st.lists(st.lists(_scores | st.sampled_from([0.0, -0.0, 0.5, 1.0]), max_size=25), min_size=1, max_size=5)
_alphas = st.floats(0.01, 0.99)


@given(_clients, _alphas)
def test_the_federated_quantile_is_the_pooled_one(clients, alpha):
    count, total = cf.client_counts([np.asarray(c, np.float64) for c in clients])
    q = cf.federated_quantile(count, total, alpha)
    pooled = np.concatenate([np.asarray(c, np.float64) for c in clients])
    expected = cf.pooled_quantile(pooled, alpha)
    assert q.value == expected
    assert q.rank == cf.conformal_rank(total, alpha) and q.num_scores == total
    assert q.queries <= 65  # one check, then at most 64 halvings of the float64 keys
    # the same sets: every score on the same side of the threshold
    np.testing.assert_array_equal(pooled <= q.value, pooled <= expected)


def test_the_quantile_is_infinite_when_too_few_scores():
    count, total = cf.client_counts([np.array([0.1, 0.2]), np.array([0.3] * 6)])  # 8 scores, k = ceil(9 * 0.9) = 9
    q = cf.federated_quantile(count, total, 0.1)
    assert q.value == math.inf and q.queries == 0
    assert cf.pooled_quantile(np.zeros(8), 0.1) == math.inf


def test_a_count_that_misses_scores_is_refused():
    with pytest.raises(ValueError, match="count"):
        cf.federated_quantile(lambda t: 3, 5, 0.5)


def test_the_rank_in_exact_arithmetic():
    assert cf.conformal_rank(9, 0.1) == 9  # (9 + 1) * 0.9 = 9 exactly; floats give 9.000000000000002
    assert cf.conformal_rank(19, 0.05) == 19
    assert cf.conformal_rank(30, 0.2) == 25  # ceil(24.8)
    with pytest.raises(ValueError, match="alpha"):
        cf.conformal_rank(10, 1.0)
    for alpha in (0.1, 0.05, 0.3, 0.37):  # the fewest scores with a finite threshold
        n = cf.min_calibration(alpha)
        assert cf.conformal_rank(n, alpha) <= n and cf.conformal_rank(n - 1, alpha) > n - 1


def test_scores_by_hand():
    p = np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])
    np.testing.assert_allclose(cf.all_scores(p, "lac"), [[0.5, 0.7, 0.8], [0.9, 0.9, 0.2]])
    # APS: the mass of the classes at least as likely as c (ties not counted above c)
    np.testing.assert_allclose(cf.all_scores(p, "aps"), [[0.5, 0.8, 1.0], [0.9, 0.9, 0.8]])
    np.testing.assert_allclose(cf.label_scores(p, np.array([1, 2]), "aps"), [0.8, 0.8])
    with pytest.raises(ValueError, match="score"):
        cf.all_scores(p, "raps")


def test_aps_scores_over_many_rows_and_classes_follow_the_definition():
    """Enough rows and classes that the scores are computed in several blocks."""
    p = np.random.default_rng(1).dirichlet(np.ones(40), size=1500)
    scores = cf.all_scores(p, "aps")
    for i in (0, 624, 625, 1499):  # blocks of 625 rows at 40 classes
        want = [p[i][p[i] > p[i, c]].sum() + p[i, c] for c in range(40)]
        np.testing.assert_allclose(scores[i], want, rtol=1e-12)


def test_sets_coverage_and_per_client_coverage_by_hand():
    sets = cf.prediction_sets(np.array([[0.1, 0.9], [0.6, 0.4], [0.2, 0.3], [0.7, 0.8]]), 0.5)
    labels = np.array([0, 0, 1, 1])
    np.testing.assert_array_equal(cf.set_sizes(sets), [1, 1, 2, 0])
    assert cf.coverage(sets, labels) == 0.5
    per_class = cf.class_coverage(sets, labels, 3)
    np.testing.assert_allclose(per_class[:2], [0.5, 0.5])
    assert np.isnan(per_class[2])  # no test example of class 2
    per_class = np.array([1.0, 0.0, np.nan])
    # a client of classes 0 and 1 (3:1) covers 3/4; one of class 2 only has no known coverage
    np.testing.assert_allclose(cf.mixture_coverage(per_class, np.array([[3, 1, 0], [0, 0, 5], [2, 0, 2]])), [0.75, np.nan, 1.0])


@pytest.mark.parametrize("n, alpha", [(49, 0.1), (30, 0.2)])
def test_coverage_on_exchangeable_data_is_the_finite_sample_value(n, alpha):
    """Calibration and test pairs i.i.d. from one distribution, the calibration split over three
    clients: with continuous scores the coverage's expectation is exactly k / (n + 1), inside
    [1 - alpha, 1 - alpha + 1 / (n + 1)]. Over 2000 draws its Monte Carlo error is about 0.0012,
    so a rank off by one (a shift of 1 / (n + 1) >= 0.02) fails."""
    rng = np.random.default_rng(0)
    draws, num_test, num_classes = 2000, 100, 4
    k = cf.conformal_rank(n, alpha)
    assert 1 - alpha <= k / (n + 1) <= 1 - alpha + 1 / (n + 1)

    def sample(size):
        """A misspecified classifier: labels from p_true, the predictive a tempered, noisy copy."""
        logits = rng.normal(size=(size, num_classes)) * 1.5
        p_true = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
        labels = (rng.random(size)[:, None] > np.cumsum(p_true, 1)).sum(1)
        noisy = 0.5 * logits + rng.normal(size=logits.shape)
        return np.exp(noisy) / np.exp(noisy).sum(1, keepdims=True), labels

    covered, sizes = [], []
    for _ in range(draws):
        probs, labels = sample(n)
        cuts = np.sort(rng.choice(np.arange(1, n), size=2, replace=False))
        clients = np.split(cf.label_scores(probs, labels), cuts)  # unequal clients
        count, total = cf.client_counts(clients)
        q = cf.federated_quantile(count, total, alpha)
        test_probs, test_labels = sample(num_test)
        sets = cf.prediction_sets(cf.all_scores(test_probs), q.value)
        covered.append(cf.coverage(sets, test_labels))
        sizes.append(cf.set_sizes(sets).mean())
    assert abs(np.mean(covered) - k / (n + 1)) < 0.005  # about 4 Monte Carlo standard errors
    assert 1 < np.mean(sizes) < num_classes  # informative sets, not all classes
