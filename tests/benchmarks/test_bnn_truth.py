"""benchmarks/bnn_truth.py: the function-space distances on hand-made probabilities, and the HMC
cache round trip on a tiny problem."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bnn_truth.py"


@pytest.fixture(scope="module")
def bnn():
    spec = importlib.util.spec_from_file_location("bnn_truth", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


P = np.array([[0.9, 0.1], [0.4, 0.6], [0.5, 0.5], [0.2, 0.8]])
Q = np.array([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5], [0.1, 0.9]])


def test_agreement_counts_the_points_whose_argmax_matches(bnn):
    # rows 0, 2 (a tie: argmax takes the first class in both) and 3 agree; row 1 does not
    assert bnn.agreement(P, Q) == pytest.approx(0.75)
    assert bnn.agreement(P, P) == 1.0


def test_total_variation_is_half_the_l1_distance_averaged_over_points(bnn):
    # per row: 0.2, 0.2, 0.0, 0.1
    assert bnn.total_variation(P, Q) == pytest.approx(0.125)
    assert bnn.total_variation(P, Q) == pytest.approx(bnn.total_variation(Q, P))
    assert bnn.total_variation(P, P) == 0.0
    three = np.array([[1.0, 0.0, 0.0]])
    assert bnn.total_variation(three, np.array([[0.0, 0.5, 0.5]])) == pytest.approx(1.0)


def test_the_distances_refuse_arrays_of_different_shapes(bnn):
    with pytest.raises(ValueError, match="one shape"):
        bnn.agreement(P, Q[:3])
    with pytest.raises(ValueError, match="one shape"):
        bnn.total_variation(P[:, 0], Q[:, 0])


def test_compare_reports_the_predictive_metrics_next_to_the_distances(bnn):
    y = np.array([0, 1, 0, 1])
    row = bnn.compare(P, Q, y)
    assert row["agreement"] == pytest.approx(0.75)
    assert row["accuracy"] == pytest.approx(1.0)  # argmax of P: 0, 1, 0 (the tie), 1
    assert row["nll"] == pytest.approx(-np.mean(np.log([0.9, 0.6, 0.5, 0.8])), rel=1e-5)


@pytest.mark.slow  # NUTS compiles: about 10 s on one core
def test_hmc_is_cached_under_its_fingerprint_which_changes_with_the_settings_and_data(bnn, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 2)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    params0 = {"w": jnp.zeros((2, 2)), "b": jnp.zeros(2)}

    def apply_fn(p, xs):
        return xs @ p["w"] + p["b"][None, :]

    settings = bnn.HMCSettings(chains=2, warmup=10, draws=10, max_tree_depth=3, map_steps=20)
    logs: list[str] = []
    probs, diag = bnn.hmc_predictive(apply_fn, params0, x, y, x[:5], 1.0, settings=settings, cache_dir=tmp_path, log=logs.append)
    assert probs.shape == (2, 5, 2)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, rtol=1e-6)
    assert diag["num_params"] == 6 and len(diag["chains_vs_pooled"]) == 2
    again, diag_again = bnn.hmc_predictive(apply_fn, params0, x, y, x[:5], 1.0, settings=settings, cache_dir=tmp_path, log=logs.append)
    assert logs[-1].startswith("HMC: cached")
    np.testing.assert_array_equal(again, probs)
    assert diag_again == json.loads((tmp_path / "hmc.json").read_text())["diagnostics"] == diag
    # another setting (or another test set) is another fingerprint: the cache does not answer it
    other = dataclasses.replace(settings, seed=1)
    assert bnn.fingerprint(x, y, x[:5], params0, 1.0, other, {}) != diag["fingerprint"]
    assert bnn.fingerprint(x, y, x[:4], params0, 1.0, settings, {}) != diag["fingerprint"]
    assert bnn.fingerprint(x, y, x[:5], params0, 1.0, settings, {}) == diag["fingerprint"]


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--rounds-of", "nope=3"], "--rounds-of"),
        (["--rounds-of", "pvi=0"], "--rounds-of"),
        (["--methods", "pvi,nope"], "--methods"),
        (["--draws", "0"], "--draws"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_naming_the_option(bnn, argv, field, capsys, tmp_path):
    assert bnn.main(["--out", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(field) and "\n" not in err
