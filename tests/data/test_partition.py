"""Tests for fedbayes.data.partition (docs/algorithms.md §14): coverage, skew, determinism, validation."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fedbayes.data import (
    PARTITIONERS,
    PartitionError,
    dirichlet_label,
    iid,
    label_distribution,
    label_skew,
    natural,
    partition,
    shards,
    two_level_dirichlet,
)


def make_labels(seed: int, num_examples: int, num_classes: int) -> np.ndarray:
    """Random labels in which every class occurs at least once."""
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, num_classes, num_examples - num_classes)
    labels = np.concatenate([np.arange(num_classes), extra])
    return rng.permutation(labels).astype(np.int32)


def assert_exact_cover(parts, num_examples: int) -> None:
    assert all(p.dtype == np.int64 and p.ndim == 1 for p in parts)
    together = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(together), np.arange(num_examples))


def assert_at_most_once(parts, num_examples: int) -> np.ndarray:
    together = np.concatenate(parts)
    assert len(np.unique(together)) == len(together)
    assert together.min(initial=0) >= 0 and together.max(initial=0) < num_examples
    return together


def balanced_labels(num_classes=10, per_class=200) -> np.ndarray:
    return np.repeat(np.arange(num_classes), per_class).astype(np.int32)


seeds = st.integers(0, 2**32 - 1)


# -------------------------------------------------------------------------- every example once


@given(num_examples=st.integers(1, 500), num_clients=st.integers(1, 50), seed=seeds)
def test_iid_covers_exactly_once_in_near_equal_chunks(num_examples, num_clients, seed):
    num_clients = min(num_clients, num_examples)
    parts = iid(num_examples, num_clients, np.random.default_rng(seed))
    assert len(parts) == num_clients
    assert_exact_cover(parts, num_examples)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


@given(
    num_examples=st.integers(100, 400),
    num_classes=st.integers(1, 10),
    num_clients=st.integers(1, 8),
    alpha=st.sampled_from([0.3, 1.0, 5.0, 100.0]),
    min_size=st.integers(0, 5),
    seed=seeds,
)
def test_dirichlet_covers_exactly_once_and_respects_min_size(num_examples, num_classes, num_clients, alpha, min_size, seed):
    labels = make_labels(seed, num_examples, num_classes)
    rng = np.random.default_rng(seed)
    parts = dirichlet_label(labels, num_clients, alpha, rng, min_size=min_size)
    assert len(parts) == num_clients
    assert_exact_cover(parts, num_examples)
    assert min(len(p) for p in parts) >= min_size
    # Step 2 stops feeding a client once it holds N / K points, so it can overshoot by less than
    # one class.
    assert max(len(p) for p in parts) < num_examples / num_clients + np.bincount(labels).max()


@given(
    num_examples=st.integers(20, 400),
    num_classes=st.integers(1, 10),
    num_clients=st.integers(1, 10),
    classes_per_client=st.integers(1, 3),
    seed=seeds,
)
def test_shards_cover_exactly_once(num_examples, num_classes, num_clients, classes_per_client, seed):
    classes_per_client = min(classes_per_client, num_classes)
    labels = make_labels(seed, num_examples, num_classes)
    parts = shards(labels, num_clients, classes_per_client, np.random.default_rng(seed))
    assert len(parts) == num_clients
    assert_exact_cover(parts, num_examples)
    # A shard is a run of sorted labels, so it spans at most two labels unless it is longer than
    # the smallest class; with shards no longer than any class, each client sees <= 2 per shard.
    shard_len = -(-num_examples // (num_clients * classes_per_client))
    if shard_len <= np.bincount(labels).min():
        assert max(len(np.unique(labels[p])) for p in parts) <= 2 * classes_per_client


@given(client_ids=st.lists(st.integers(-5, 40), min_size=1, max_size=200))
def test_natural_groups_by_sorted_id(client_ids):
    ids = np.array(client_ids, dtype=np.int64)
    parts = natural(ids)
    assert_exact_cover(parts, len(ids))
    distinct = np.unique(ids)
    assert len(parts) == len(distinct)
    for value, part in zip(distinct, parts):
        np.testing.assert_array_equal(part, np.flatnonzero(ids == value))


@given(
    num_examples=st.integers(50, 600),
    num_classes=st.integers(1, 10),
    num_clients=st.integers(1, 20),
    alpha1=st.sampled_from([0.1, 1.0, 10.0]),
    alpha2=st.sampled_from([0.1, 0.5, 10.0]),
    seed=seeds,
)
def test_two_level_assigns_at_most_once_and_nearly_all(num_examples, num_classes, num_clients, alpha1, alpha2, seed):
    labels = make_labels(seed, num_examples, num_classes)
    parts = two_level_dirichlet(labels, num_clients, np.random.default_rng(seed), alpha1, alpha2, min_size=0)
    assert len(parts) == num_clients
    together = assert_at_most_once(parts, num_examples)
    # Per class, K rounded lengths each lose at most 1/2 (bumping 1 -> 2 and clipping only
    # add or trim at the end), so at most floor(K / 2) examples of a class stay unassigned.
    assigned = np.bincount(labels[together], minlength=num_classes)
    missing = np.bincount(labels, minlength=num_classes) - assigned
    assert missing.min() >= 0 and missing.max() <= num_clients // 2
    # A computed length of 1 is bumped to 2; only the slice clipped at the end of a class can
    # hold a single example of it.
    counts = label_distribution(labels, parts, num_classes, normalize=False)
    assert np.all((counts == 1).sum(axis=0) <= 1)


def test_two_level_dataset_proportion_uses_that_share_of_each_class():
    labels = balanced_labels(per_class=1000)
    parts = two_level_dirichlet(labels, 5, np.random.default_rng(0), dataset_proportion=0.1)
    per_class = np.bincount(labels[assert_at_most_once(parts, labels.size)], minlength=10)
    assert np.all(np.abs(per_class - 100) <= 5 // 2 + 2)  # 100 kept per class, +-rounding and bumps


def test_two_level_homogeneous_split_is_even():
    # Swaroop et al. 2025 (ADMM and Bayes)'s homogeneous split: alpha1 = alpha2 = 1e15 gives every client N_c / K per class.
    labels = balanced_labels(per_class=600)
    parts = two_level_dirichlet(labels, 10, np.random.default_rng(0), 1e15, 1e15)
    counts = label_distribution(labels, parts, 10, normalize=False)
    np.testing.assert_array_equal(counts, np.full((10, 10), 60))


# ----------------------------------------------------------------------------------------- skew


def mean_skew(name: str, labels: np.ndarray, num_clients: int, **params) -> float:
    skews = []
    for seed in range(5):
        parts = partition(name, labels, num_clients, np.random.default_rng(seed), **params)
        skews.append(label_skew(labels, parts, 10))
    return float(np.mean(skews))


def test_dirichlet_skew_grows_as_alpha_falls():
    labels = balanced_labels()
    skews = [mean_skew("dirichlet", labels, 10, alpha=a) for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2], skews
    assert skews[0] < 0.1 and skews[2] > 0.5, skews  # near IID vs mostly one or two classes


def test_dirichlet_stops_feeding_full_clients():
    # docs/algorithms.md §14.2 step 2: with alpha = 0.1 a client would often collect several whole classes; the
    # zeroing keeps every client below N / K + N_c = 200 + 200 on every seed.
    labels = balanced_labels()
    for seed in range(10):
        parts = dirichlet_label(labels, 10, 0.1, np.random.default_rng(seed), min_size=0)
        assert max(len(p) for p in parts) < 400


def test_two_level_skew_grows_as_alpha2_falls():
    labels = balanced_labels()
    skews = [mean_skew("two_level_dirichlet", labels, 10, alpha2=a) for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2], skews


def test_iid_and_shards_skew_bracket_the_dirichlets():
    labels = balanced_labels()
    dirichlet_skew = mean_skew("dirichlet", labels, 10, alpha=1.0)
    assert mean_skew("iid", labels, 10) < dirichlet_skew
    assert mean_skew("shards", labels, 10, classes_per_client=1) > dirichlet_skew


def test_two_level_matches_seed_001_statistics():
    # Swaroop et al. 2025 (ADMM and Bayes) App. E.1 reports that about 2 clients hold 50% and 6 clients 90% of the data with
    # alpha1 = 1, alpha2 = 0.5 on 10 clients. With 20 seeds the top-2 share has a standard error
    # of about 0.016 (per-seed std about 0.07); we measured a mean of 0.45, so +-0.1 around 0.5
    # checks the procedure, not the luck of a seed ("usually" in the paper is not more precise).
    labels = balanced_labels(per_class=6000)
    top2, top6 = [], []
    for seed in range(20):
        parts = two_level_dirichlet(labels, 10, np.random.default_rng(seed))
        sizes = np.sort([len(p) for p in parts])[::-1]
        top2.append(sizes[:2].sum() / sizes.sum())
        top6.append(sizes[:6].sum() / sizes.sum())
    assert abs(np.mean(top2) - 0.5) < 0.1, np.mean(top2)
    assert abs(np.mean(top6) - 0.9) < 0.07, np.mean(top6)


def test_label_distribution_and_skew_golden_values():
    labels = balanced_labels(num_classes=4, per_class=5)
    by_class = [np.flatnonzero(labels == c) for c in range(4)]
    dist = label_distribution(labels, by_class, 4)
    np.testing.assert_array_equal(dist, np.eye(4))
    # One class per client: TV to the uniform global mix is 1 - 1/C.
    assert label_skew(labels, by_class, 4) == pytest.approx(0.75)
    stratified = [np.concatenate([b[i::5] for b in by_class]) for i in range(5)]
    assert label_skew(labels, stratified, 4) == pytest.approx(0.0)
    counts = label_distribution(labels, stratified + [np.zeros(0, np.int64)], 4, normalize=False)
    np.testing.assert_array_equal(counts[-1], 0)
    assert counts.sum() == labels.size


# ---------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "name, params",
    [
        ("iid", {}),
        ("dirichlet", {"alpha": 0.5}),
        ("two_level_dirichlet", {}),
        ("shards", {"classes_per_client": 2}),
    ],
)
def test_same_seed_same_partition(name, params):
    labels = make_labels(0, 300, 5)
    first = partition(name, labels, 6, np.random.default_rng(11), **params)
    second = partition(name, labels, 6, np.random.default_rng(11), **params)
    other = partition(name, labels, 6, np.random.default_rng(12), **params)
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_dispatch_matches_direct_calls():
    labels = make_labels(1, 200, 4)
    ids = np.arange(200) % 7
    np.testing.assert_array_equal(
        np.concatenate(partition("natural", labels, 7, np.random.default_rng(0), client_ids=ids)),
        np.concatenate(natural(ids)),
    )
    direct = dirichlet_label(labels, 4, 2.0, np.random.default_rng(3), min_size=3)
    via = partition("dirichlet", labels, 4, np.random.default_rng(3), alpha=2.0, min_size=3)
    assert all(np.array_equal(a, b) for a, b in zip(direct, via))
    assert set(PARTITIONERS) == {"iid", "dirichlet", "two_level_dirichlet", "shards", "natural"}


# ----------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "name, num_clients, params, field",
    [
        ("random", 2, {}, "name must be one of"),
        ("iid", 0, {}, "num_clients"),
        ("iid", 101, {}, "num_clients"),
        ("iid", 2.5, {}, "num_clients"),
        ("dirichlet", 3, {"alpha": 0.0}, "alpha"),
        ("dirichlet", 3, {"alpha": -1.0}, "alpha"),
        ("dirichlet", 3, {"alpha": float("nan")}, "alpha"),
        ("dirichlet", 3, {}, "alpha"),
        ("dirichlet", 3, {"alpha": 1.0, "min_size": 40}, "min_size"),
        ("dirichlet", 3, {"beta": 1.0}, "unknown parameter.*beta.*allowed"),
        ("two_level_dirichlet", 3, {"alpha1": 0.0}, "alpha1"),
        ("two_level_dirichlet", 3, {"alpha2": -0.5}, "alpha2"),
        ("two_level_dirichlet", 3, {"dataset_proportion": 0.0}, "dataset_proportion"),
        ("two_level_dirichlet", 3, {"dataset_proportion": 1.5}, "dataset_proportion"),
        ("shards", 3, {"classes_per_client": 0}, "classes_per_client"),
        ("shards", 3, {"classes_per_client": 6}, "classes_per_client"),
        ("shards", 60, {"classes_per_client": 2}, "classes_per_client = 120 shards"),
        ("shards", 3, {}, "classes_per_client"),
        ("natural", 3, {"client_ids": np.arange(100) % 4}, "num_clients must equal the 4"),
        ("natural", 3, {"client_ids": np.arange(5)}, "client_ids"),
    ],
)
def test_invalid_parameters_raise_value_error_naming_the_field(name, num_clients, params, field):
    labels = make_labels(0, 100, 5)
    with pytest.raises(ValueError, match=field):
        partition(name, labels, num_clients, np.random.default_rng(0), **params)


def test_dirichlet_gives_up_with_a_clear_error():
    # Two clients, one class: Dir(1e-3) puts almost everything on one client on every try.
    labels = np.zeros(100, np.int32)
    with pytest.raises(PartitionError, match="min_size=40"):
        dirichlet_label(labels, 2, 1e-3, np.random.default_rng(0), min_size=40, max_tries=20)


def test_labels_must_be_integers():
    with pytest.raises(ValueError, match="labels"):
        shards(np.linspace(0, 1, 10), 2, 1, np.random.default_rng(0))


def test_two_level_dirichlet_never_leaves_a_client_empty():
    """Swaroop et al. 2025 (ADMM and Bayes)'s procedure alone leaves a client empty for some seeds (about 23% of seeds with
    100 clients on 60,000 labels); the redraw loop must give every client min_size examples."""
    labels = make_labels(0, 6000, 10)
    for seed in range(30):
        parts = two_level_dirichlet(labels, 100, np.random.default_rng(seed), min_size=1)
        assert min(len(p) for p in parts) >= 1
        flat = np.concatenate(parts)
        assert len(flat) == len(np.unique(flat))  # still at most once
    parts = two_level_dirichlet(labels, 10, np.random.default_rng(0), min_size=50)
    assert min(len(p) for p in parts) >= 50


def test_two_level_dirichlet_reports_impossible_min_size():
    labels = make_labels(0, 200, 10)
    with pytest.raises(PartitionError, match="min_size=150"):
        two_level_dirichlet(labels, 10, np.random.default_rng(0), min_size=150, max_tries=5)
