"""A run's conformal sets (fedbayes.runs.conformal): the calibration examples each client keeps
are never trained on and leave the validation split alone, conformal.json and the summary agree,
`compare --conformal` adds the columns and the shift table its coverage, and bad settings are one
line with exit 2."""

import json

import numpy as np
import pytest
from helpers import HELD_OUT_RUN
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import validate
from fedbayes.data.holdout import held_out_count
from fedbayes.evaluation import conformal as cf
from fedbayes.evaluation.evaluators import make_probabilities
from fedbayes.runs.build import DataSpec, build_experiment, build_model, prepare_splits
from fedbayes.runs.export import load_model
from fedbayes.runs.loop import run_experiment

runner = CliRunner()

BASE = HELD_OUT_RUN


def test_calibration_examples_are_held_out_of_training_and_leave_the_validation_split_alone():
    plain = prepare_splits(validate(BASE))
    cfg = validate({**BASE, "evaluation": {"conformal_alpha": 0.1, "calibration_fraction": 0.2}})
    split = prepare_splits(cfg)
    assert plain.calibration is None
    np.testing.assert_array_equal(split.validation, plain.validation)
    for before, train, cal in zip(plain.parts, split.parts, split.calibration, strict=True):
        assert len(cal) == held_out_count(len(before), 0.2)
        assert not set(cal) & set(train) and set(cal) | set(train) == set(before)
    exp = build_experiment(cfg)
    trained = np.concatenate(exp.federation.client_indices)
    assert not set(trained) & set(np.concatenate(exp.calibration))


def test_conformal_json_holds_the_federated_threshold_and_the_summary_its_coverage(tmp_path):
    cfg = validate({**BASE, "evaluation": {"conformal_alpha": 0.2}})
    summary = run_experiment(cfg, tmp_path / "run")
    body = json.loads((tmp_path / "run" / "conformal.json").read_text())
    point = body["predictives"]["point"]
    n = body["calibration_examples"]
    assert body["calibration_per_client"] and sum(body["calibration_per_client"]) == n
    assert point["rank"] == cf.conformal_rank(n, 0.2) and point["queries"] <= 65
    assert body["bound"] == pytest.approx([0.8, 0.8 + 1 / (n + 1)])
    assert summary["final"]["coverage"] == point["coverage"] and summary["final"]["set_size"] == point["set_size"]
    assert sum(point["set_size_counts"]) == body["test_examples"]
    assert point["client_coverage"]["min"] <= point["client_coverage"]["median"] <= point["client_coverage"]["max"]
    assert summary["final"]["coverage_client_min"] == point["client_coverage"]["min"]
    # the threshold is the pooled quantile of the clients' calibration scores under the final model
    exp = build_experiment(cfg)
    model = build_model(cfg, DataSpec.of(exp.dataset))
    probs = make_probabilities(model.apply_fn)(load_model(tmp_path / "run" / "model.npz")["params"], exp.dataset.x_train[np.concatenate(exp.calibration)])
    scores = cf.label_scores(probs, exp.dataset.y_train[np.concatenate(exp.calibration)])
    assert point["threshold"] == cf.pooled_quantile(scores, 0.2)


def test_compare_conformal_adds_the_columns_and_the_shift_table_its_coverage(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        '[base]\nrounds = 1\n[base.data]\ndataset = "digits"\nnum_clients = 2\n[base.model]\nname = "logreg"\n[base.server]\nclients_per_round = 2\n'
        '[variants.fedavg.algorithm]\nname = "fedavg"\n[shift]\nkinds = ["contrast"]\n'
    )
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out), "--conformal", "0.1", "--shift"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    md = (out / "compare.md").read_text()
    assert "coverage" in md and "set size" in md
    own = json.loads((out / "fedavg" / "conformal.json").read_text())["predictives"]["point"]
    recs = json.loads((out / "shift.json").read_text())["methods"]["fedavg"]["records"]
    assert recs[0]["coverage"] == pytest.approx(own["coverage"]) and recs[0]["set_size"] == pytest.approx(own["set_size"])  # level 0: the run's own sets
    assert "conformal coverage" in (out / "shift.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--conformal", "0"], "error: --conformal: the miscoverage alpha must be in (0, 1)"),
        (["--set", "evaluation.conformal_alpha=0.001"], "config error: evaluation.calibration_fraction: 0.1 of the clients' examples gives"),
    ],
)
def test_bad_conformal_settings_are_one_line(tmp_path, args, message):
    p = tmp_path / "c.toml"
    p.write_text('[base.data]\ndataset = "digits"\nnum_clients = 2\n[base.server]\nclients_per_round = 2\n[variants.fedavg.algorithm]\nname = "fedavg"\n')
    res = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "out"), *args])
    assert res.exit_code == 2 and message in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1
