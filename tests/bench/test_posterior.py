"""``fedbayes bench posterior`` in small: a tiny logistic regression over 3 clients, a few rounds, a
short NUTS run; the table's structure, the references' rows and the per-row cache."""

import json

import numpy as np
import pytest

from fedbayes.bench import posterior
from fedbayes.bench.truth import NUTSSettings

SETTINGS = posterior.PosteriorBenchSettings(max_rounds=3, check_every=1, nuts=NUTSSettings(chains=2, warmup=150, draws=200))


def _write_tiny(folder):
    rng = np.random.default_rng(0)
    w = np.array([1.5, -1.0, 0.5])
    x = rng.normal(size=(90, 3))
    y = (x @ w + rng.logistic(size=90) > 0).astype(int)
    posterior.write_leaf(folder / "data", x[:60], y[:60], x[60:], y[60:])


TINY = posterior.Problem(
    "tiny",
    lambda folder: {"dataset": "leaf", "data_dir": str(folder / "data"), "num_classes": 2},
    split={"num_clients": 3, "partition": "dirichlet", "alpha": 5.0},
    write=_write_tiny,
)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("posterior")
    log = []
    result = posterior.run_posterior_bench(out, SETTINGS, ["tiny"], ["fedep_laplace"], extra_problems={"tiny": TINY}, log=log.append)
    return out, result, log


def test_the_table_has_the_reference_and_method_rows(bench):
    out, result, _ = bench
    (problem,) = result["problems"]
    assert problem["num_train"] == 60 and problem["num_features"] == 3 and problem["num_params"] == 8
    assert len(problem["client_sizes"]) == 3 and sum(problem["client_sizes"]) == 60
    keys = [row["key"] for row in problem["rows"]]
    assert keys == [
        "nuts", "central_map", "central_laplace_marginals", "central_diag_laplace", "central_mfvi", "central_full_vi", "central_ngvi", "fedep_laplace",
    ]  # fmt: skip
    method = problem["rows"][-1]
    assert method["family"] == "diag_laplace" and 1 <= method["rounds"] <= 3
    assert [t["round"] for t in method["trajectory"]] == list(range(1, method["rounds"] + 1))
    assert set(method["predictive"]) == {"accuracy", "nll", "ece"} and method["seconds"] > 0
    table = (out / "posterior_quality.md").read_text()
    assert table.count("| FedEP (laplace) |") == 1 and "### tiny" in table
    header = next(line for line in table.splitlines() if line.startswith("| method"))
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert len(rows) == 8 and all(row.count("|") == header.count("|") for row in rows)
    assert json.loads((out / "posterior_quality.json").read_text()) == json.loads(json.dumps(result, default=float))


def test_the_references_rows_are_right(bench):
    _, result, _ = bench
    rows = {row["key"]: row for row in result["problems"][0]["rows"]}
    nuts = result["problems"][0]["nuts"]
    assert nuts["max_split_rhat"] < 1.05 and nuts["divergences"] == 0 and nuts["min_ess"] > 100
    assert rows["central_map"]["vs_family"] == {"mean_rel_l2": 0.0}
    # 60 examples, 8 parameters: the posterior is close to Gaussian, so NUTS agrees with the Laplace marginals
    assert rows["central_map"]["vs_nuts"]["mean_rel_l2"] < 0.1
    median, low, high = rows["central_laplace_marginals"]["vs_nuts"]["var_ratio"]
    assert 0.8 < median < 1.25 and 0.6 < low and high < 1.5
    # the diagonal approximations are narrower than the true marginals (correlated softmax weights)
    assert rows["central_diag_laplace"]["vs_nuts"]["var_ratio"][0] < median
    assert rows["central_diag_laplace"]["kl_nuts_q"] > rows["central_laplace_marginals"]["kl_nuts_q"] > 0


def test_a_rerun_reuses_nuts_and_finished_rows(bench):
    out, result, _ = bench
    log = []
    again = posterior.run_posterior_bench(out, SETTINGS, ["tiny"], ["fedep_laplace"], extra_problems={"tiny": TINY}, log=log.append)
    assert any("NUTS: cached" in line for line in log) and any("FedEP (laplace): cached" in line for line in log)
    assert again["problems"][0]["rows"][-1]["seconds"] == result["problems"][0]["rows"][-1]["seconds"]


def test_unknown_names_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="allowed: breast_cancer"):
        posterior.run_posterior_bench(tmp_path, SETTINGS, ["nope"])
    with pytest.raises(ValueError, match="unknown method"):
        posterior.run_posterior_bench(tmp_path, SETTINGS, ["breast_cancer"], ["nope"])


def test_every_method_has_a_prior_match_and_a_family():
    for method in posterior.METHODS:
        assert method.family in posterior.FAMILIES
        assert method.algorithm["name"] in posterior.PRIOR_MATCH


def test_the_command_line_names_what_it_accepts(tmp_path):
    from typer.testing import CliRunner

    from fedbayes.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["bench", "nope"])
    assert res.exit_code == 2 and "unknown suite 'nope'; allowed: posterior" in res.output
    res = runner.invoke(app, ["bench", "posterior", "--out", str(tmp_path), "--dataset", "nope"])
    assert res.exit_code == 2 and "allowed: breast_cancer, digits_3v8" in res.output


@pytest.mark.parametrize(
    "client, needle",
    [
        ('{"epochs": -1}', "--client: client.epochs: Input should be greater than or equal to 1"),
        ('{"nosuch": 1}', "--client: client.nosuch: unknown key; allowed keys here: epochs"),
        ('{"lr": "fast"}', "--client: client.lr: Input should be a valid number"),
        ("[1, 2]", "--client must be a JSON object of [client] settings"),
        ('[["epochs", 2]]', "--client must be a JSON object of [client] settings"),
    ],
)
def test_client_settings_are_checked_before_any_work(tmp_path, client, needle):
    from typer.testing import CliRunner

    from fedbayes.cli import app

    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bench", "posterior", "--quick", "--out", str(out), "--client", client])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and needle in lines[0], res.output
    assert not out.exists()


def test_keep_going_runs_every_round_and_says_how_far_the_method_strays_after_the_bar(bench):
    import dataclasses

    out, _, _ = bench
    # PVI with minibatches of 8 meets the bar on the tiny problem at about round 20
    settings = dataclasses.replace(SETTINGS, max_rounds=30, stop_at_bar=False, client={"batch_size": 8})
    result = posterior.run_posterior_bench(out, settings, ["tiny"], ["pvi"], extra_problems={"tiny": TINY})
    row = result["problems"][0]["rows"][-1]
    assert [t["round"] for t in row["trajectory"]] == list(range(1, 31)) and row["rounds"] == 30  # not stopped at the bar
    reached = row["reached_round"]
    assert reached is not None and reached < 30
    later = [t for t in row["trajectory"] if t["round"] > reached]
    after = row["after_bar"]
    assert after["checks"] == len(later) and after["max_mean_rel_l2"] == max(t["mean_rel_l2"] for t in later)
    assert after["var_ratio_range"] == [min(t["var_ratio"][0] for t in later), max(t["var_ratio"][0] for t in later)]
    assert 0 <= after["share_meeting_bar"] <= 1
    assert f"after round {reached}" in (out / "posterior_quality.md").read_text()
    # a row cached under the usual rule is not taken for a run past the bar, nor the other way round
    again = posterior.run_posterior_bench(out, dataclasses.replace(settings, stop_at_bar=True), ["tiny"], ["pvi"], extra_problems={"tiny": TINY})
    assert "after_bar" not in again["problems"][0]["rows"][-1] and again["problems"][0]["rows"][-1]["rounds"] == reached


def test_a_dense_posterior_row_is_predicted_with_its_full_covariance(tmp_path):
    result = posterior.run_posterior_bench(tmp_path, SETTINGS, ["tiny"], ["fedlap_cov_full", "pvi_full"], extra_problems={"tiny": TINY})
    rows = {row["key"]: row for row in result["problems"][0]["rows"]}
    assert rows["central_full_vi"]["vs_nuts"]["mean_rel_l2"] < 0.1  # 8 parameters, 60 examples: full VI is nearly exact
    for key, family in (("fedlap_cov_full", "laplace"), ("pvi_full", "full_vi")):
        row = rows[key]
        assert "error" not in row and row["family"] == family and row["rounds"] >= 1
        # the full predictive and the marginal-only one are both reported, and they differ
        assert set(row["predictive_marginals"]) == set(row["predictive"]) == {"accuracy", "nll", "ece"}
        assert row["predictive"]["nll"] != row["predictive_marginals"]["nll"]


def test_fedsep_can_be_measured_against_seps_own_fixed_point(bench):
    """A method of family ``sep_laplace`` is compared with SEP's fixed point on the problem's split,
    which gets a central row of its own saying how far it is from EP's answer; the METHODS rows
    (FedSEP's included) keep EP's families and the table computes no SEP reference for them."""
    out, result, _ = bench
    assert not any(row["key"].startswith("central_sep_") for row in result["problems"][0]["rows"])
    assert {m.family for m in posterior.METHODS if m.algorithm["name"] == "fedsep"} <= {"diag_laplace", "ngvi", "map", "full_vi"}
    method = posterior.Method("fedsep_vs_sep", "FedSEP vs SEP", {"name": "fedsep", "method": "laplace"}, "sep_laplace")
    problem = posterior.run_problem(TINY, out, SETTINGS, [method])
    rows = {row["key"]: row for row in problem["rows"]}
    central = rows["central_sep_laplace"]
    assert central["family"] == "sep_laplace" and central["vs_family"]["mean_rel_l2"] == 0.0
    assert 0.01 < central["vs_ep_family"]["mean_rel_l2"] < 0.2  # 3 clients of Dirichlet(5) data: near EP's answer (0.07), not at it
    row = rows["fedsep_vs_sep"]
    assert "error" not in row and row["family"] == "sep_laplace" and row["trajectory"][-1]["mean_rel_l2"] == row["vs_family"]["mean_rel_l2"]
    # the reference follows the cavity's power, so one run cannot mix two
    other = posterior.Method("fedsep_k", "FedSEP 1/K", {"name": "fedsep", "method": "laplace", "sep_power": "one_over_k"}, "sep_laplace")
    with pytest.raises(ValueError, match="must share algorithm.sep_power"):
        posterior.run_problem(TINY, out, SETTINGS, [method, other])


def test_the_vbnn_is_measured_against_its_own_objectives_optimum_and_meets_the_bar(bench):
    """The linear VBNN's bias is a point without a prior: its family is the mean-field optimum
    with that bias (central row ``central_mfvi_point_bias``, which also says how far it is from
    the all-Gaussian one). With only its name set (IVON, one whole-data step a round) it meets
    the bar on the tiny problem."""
    import dataclasses

    out, _, _ = bench
    settings = dataclasses.replace(SETTINGS, max_rounds=300, check_every=10)
    result = posterior.run_posterior_bench(out, settings, ["tiny"], ["vbnn"], extra_problems={"tiny": TINY})
    rows = {row["key"]: row for row in result["problems"][0]["rows"]}
    central = rows["central_mfvi_point_bias"]
    assert central["family"] == "mfvi_point_bias" and 0 < central["vs_mfvi"]["mean_rel_l2"] < 0.2
    row = rows["vbnn"]
    assert row["family"] == "mfvi_point_bias" and row["reached_round"] is not None, row.get("trajectory", [])[-3:]
    assert row["steps_per_client_round"] == 1.0  # one whole-data step per client and round
    assert "| VBNN (linear, kernel only) | MFVI, the bias a point | yes |" in (out / "posterior_quality.md").read_text()


def test_a_cohort_and_a_seed_reach_the_runs_and_their_cache_key(bench):
    import dataclasses

    out, _, _ = bench
    settings = dataclasses.replace(SETTINGS, max_rounds=2, clients_per_round=2, seed=1)
    result = posterior.run_posterior_bench(out, settings, ["tiny"], ["vbnn"], extra_problems={"tiny": TINY})
    row = result["problems"][0]["rows"][-1]
    assert row["resolved_config"]["server"]["clients_per_round"] == 2 and row["resolved_config"]["seed"] == 1
    assert row["rounds"] == 2  # not the cached all-client row of the test before
