"""A run's personalisation (fedbayes.runs.personal): each client's own test examples are seeded,
never trained on and leave the other splits alone; personal.json and the summary agree; `compare
--personal` adds the columns; bad settings are one line naming the field."""

import json

import numpy as np
import pytest
from helpers import HELD_OUT_RUN
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError, validate
from fedbayes.data.holdout import held_out_count
from fedbayes.runs.build import build_experiment, prepare_splits
from fedbayes.runs.loop import run_experiment

runner = CliRunner()

BASE = HELD_OUT_RUN


def _with(evaluation: dict, **top) -> dict:
    return {**BASE, **top, "evaluation": evaluation}


def test_own_test_examples_are_seeded_held_out_of_training_and_leave_the_other_splits_alone():
    plain = prepare_splits(validate(_with({"conformal_alpha": 0.2})))
    cfg = validate(_with({"conformal_alpha": 0.2, "personal_fraction": 0.25}))
    split = prepare_splits(cfg)
    assert plain.personal is None
    np.testing.assert_array_equal(split.validation, plain.validation)
    for a, b in zip(split.calibration, plain.calibration, strict=True):
        np.testing.assert_array_equal(a, b)
    for before, train, own in zip(plain.parts, split.parts, split.personal, strict=True):
        assert len(own) == held_out_count(len(before), 0.25)
        assert not set(own) & set(train) and set(own) | set(train) == set(before)
    again = prepare_splits(cfg)
    other = prepare_splits(validate({**_with({"conformal_alpha": 0.2, "personal_fraction": 0.25}), "seed": 1}))
    assert all(np.array_equal(a, b) for a, b in zip(split.personal, again.personal, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(split.personal, other.personal, strict=True))
    exp = build_experiment(cfg)
    assert not set(np.concatenate(exp.federation.client_indices)) & set(np.concatenate(exp.personal))


def test_personal_json_scores_both_models_and_the_summary_has_its_means(tmp_path):
    summary = run_experiment(validate(_with({"personal_fraction": 0.2, "personal_epochs": 2})), tmp_path / "run")
    body = json.loads((tmp_path / "run" / "personal.json").read_text())
    assert body["personalisation"] == "fine_tune" and body["epochs"] == 2 and "marginal" not in body["predictives"]
    point = body["predictives"]["point"]
    accs = [c["accuracy"] for c in point["per_client"]["personal"]]
    assert len(accs) == len(body["clients"]) == len(body["test_per_client"])
    assert point["personal"]["accuracy"]["mean"] == pytest.approx(np.mean(accs))
    assert point["personal"]["accuracy"]["worst10"] == min(accs)  # 4 clients: the worst one
    final = summary["final"]
    assert final["personal_accuracy"] == point["personal"]["accuracy"]["mean"]
    assert final["client_accuracy"] == point["global"]["accuracy"]["mean"]
    assert summary["personal"]["personalisation"] == "fine_tune"


def test_a_run_without_personalisation_writes_nothing_of_it(tmp_path):
    summary = run_experiment(validate(BASE), tmp_path / "run")
    assert not (tmp_path / "run" / "personal.json").exists()
    assert "personal" not in summary and not any(k.startswith(("personal_", "client_")) for k in summary["final"])


def test_compare_personal_adds_the_columns_and_a_site_method_uses_its_sites(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(
        '[base]\nrounds = 1\n[base.data]\ndataset = "digits"\nnum_clients = 3\n[base.model]\nname = "logreg"\n[base.server]\nclients_per_round = 3\n'
        '[variants.fedavg.algorithm]\nname = "fedavg"\n[variants.fedlap_cov.algorithm]\nname = "fedlap_cov"\n'
        '[variants.fedlap_cov.evaluation]\npersonal_by = "site"\n'
    )
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out), "--personal", "0.2"], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    md = (out / "compare.md").read_text()
    assert "client acc" in md and "personal acc" in md
    site = json.loads((out / "fedlap_cov" / "personal.json").read_text())
    assert site["personalisation"] == "site" and site["weight"] == 0.5 and "marginal" in site["predictives"]
    bad = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "bad"), "--personal", "1.5"])
    assert bad.exit_code == 2 and "--personal" in bad.output


def test_a_site_method_is_fine_tuned_by_default():
    cfg = validate(_with({"personal_fraction": 0.2}, algorithm={"name": "fedlap_cov"}))
    assert cfg.evaluation.personal_by == "fine_tune"
    exp = build_experiment(cfg)
    state = exp.simulator.init(exp.params)
    body = exp.personalise(state.server_state, state.client_states, 0)
    assert body["personalisation"] == "fine_tune" and body["epochs"] == 1
    point = body["predictives"]["point"]
    assert point["personal"]["accuracy"]["mean"] != point["global"]["accuracy"]["mean"]  # the untrained model moved


@pytest.mark.parametrize(
    "evaluation, top, field",
    [
        ({"personal_fraction": 1.0}, {}, "evaluation.personal_fraction"),
        ({"personal_fraction": -0.1}, {}, "evaluation.personal_fraction"),
        ({"personal_fraction": 0.2, "personal_weight": -1}, {}, "evaluation.personal_weight"),
        ({"personal_fraction": 0.2, "personal_epochs": 0}, {}, "evaluation.personal_epochs"),
        ({"personal_fraction": 0.2, "personal_by": "sites"}, {}, "evaluation.personal_by"),
        ({"personal_fraction": 0.9}, {}, "evaluation.personal_fraction"),  # with the validation split's 0.1 nothing is left
        ({"personal_fraction": 0.2}, {"data": {"dataset": "least_squares"}, "model": {"name": "linear"}}, "evaluation.personal_fraction"),
    ],
)
def test_bad_settings_are_one_line_naming_the_field(evaluation, top, field):
    with pytest.raises(ConfigError) as err:
        validate(_with(evaluation, **top))
    message = str(err.value)
    assert field in message and "\n" not in message
