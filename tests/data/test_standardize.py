"""Feature scaling (fedbayes.data.standardize): statistics from the clients' sums equal the pooled
ones, only training rows count, the default follows the features' scales, and scikit-learn's wine
table, written as a CSV file, trains at the defaults."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from fedbayes.data.dataset import Dataset
from fedbayes.data.standardize import SCALE_RATIO, client_moments, combine, scale_ratio, should_standardize, standardize


def _dataset(x_train, x_test):
    n, m = len(x_train), len(x_test)
    return Dataset("t", x_train.astype(np.float32), np.arange(n) % 2, x_test.astype(np.float32), np.arange(m) % 2, 2, "classification")


def test_the_clients_sums_give_the_pooled_mean_and_std():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)) * [1.0, 10.0, 1000.0, 0.01] + [0.0, 5.0, 2000.0, -1.0]
    parts = [np.arange(0, 7), np.arange(7, 30), np.arange(30, 50)]
    mean, std = combine([client_moments(x, rows) for rows in parts])
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(std, x.std(axis=0), rtol=1e-7)


def test_a_constant_feature_is_centred_not_divided_by_zero():
    x = np.column_stack([np.full(10, 3.0), np.arange(10.0)])
    mean, std = combine([client_moments(x, np.arange(10))])
    assert std[0] == 1.0 and mean[0] == 3.0
    out = standardize(_dataset(x, x[:3]), [np.arange(10)])
    assert np.all(out.x_train[:, 0] == 0) and np.isfinite(out.x_train).all()


def test_only_the_clients_training_rows_count():
    """Rows outside every part (a validation split) and the test split are scaled, not counted."""
    x_train = np.array([[0.0], [2.0], [100.0]])  # row 2: held out for validation
    x_test = np.array([[1.0], [500.0]])
    out = standardize(_dataset(x_train, x_test), [np.array([0]), np.array([1])])
    np.testing.assert_allclose(out.x_train[:, 0], [-1.0, 1.0, 99.0])
    np.testing.assert_allclose(out.x_test[:, 0], [0.0, 499.0])


def test_the_default_is_on_for_own_data_whose_scales_differ_by_orders_of_magnitude():
    wide = [client_moments(np.array([[1000.0, 0.5], [1200.0, 0.1]]), np.arange(2))]
    alike = [client_moments(np.array([[1.0, 0.5, 0.0], [16.0, 0.1, 0.0]]), np.arange(2))]  # 0.5 to 16; an all-zero column is left out
    assert scale_ratio(wide) > SCALE_RATIO > scale_ratio(alike)
    assert should_standardize("auto", "files", wide) and should_standardize("auto", "arrays", wide)
    assert not should_standardize("auto", "files", alike)
    assert not should_standardize("auto", "digits", wide)  # the built-in datasets come scaled by their loaders
    assert should_standardize(True, "digits", alike) and not should_standardize(False, "files", wide)


def test_a_run_written_before_the_option_resumes_unscaled():
    """Its stored config lacks the key: own data then was not scaled, so it is not on resume."""
    from fedbayes.config.schema import stored_meaning, validate

    own = {"data": {"dataset": "files", "path": "x.csv"}}
    assert validate(stored_meaning(own)).data.standardize is False
    assert validate(stored_meaning({"data": {"dataset": "digits"}})).data.standardize == "auto"
    assert validate(own).data.standardize == "auto" and validate({**own, "data": {**own["data"], "standardize": "auto"}}) == validate(own)


def test_word_ids_are_not_scaled():
    from fedbayes.config.schema import ConfigError, validate

    with pytest.raises(ConfigError, match="data.standardize"):
        validate({"data": {"dataset": "stackoverflow_nwp", "standardize": True}, "model": {"name": "lstm_nwp"}})


@pytest.fixture(scope="module")
def wine_csv(tmp_path_factory):
    """scikit-learn's wine data as a user would export it: one feature near 1000, others near 0.1."""
    from sklearn.datasets import load_wine

    wine = load_wine()
    path = tmp_path_factory.mktemp("wine") / "wine.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*wine.feature_names, "label"])
        writer.writerows([*row, label] for row, label in zip(wine.data, wine.target))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fedavg", "fedlap_cov"])
def test_a_wine_csv_trains_at_the_defaults(wine_csv, tmp_path, method):
    """Unscaled, both methods stay at a third (the majority class or worse) every round."""
    from fedbayes.config.schema import validate
    from fedbayes.runs.loop import run_experiment

    config = validate({"data": {"dataset": "files", "path": str(wine_csv)}, "algorithm": {"name": method}})
    summary = run_experiment(config, tmp_path / "run", warn=lambda s: None)
    assert summary["final"]["accuracy"] >= 0.9
