"""Runs under dataset shift (fedbayes.runs.shift): `fedbayes compare --shift` writes the shift table
and plot from the runs' own evaluators (level 0 is each run's last evaluation), and refuses data
without images in one line before any run trains."""

import json

import pytest
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import ConfigError
from fedbayes.runs import compare as cmp
from fedbayes.runs import report
from fedbayes.runs import shift as rs
from fedbayes.runs.folder import read_metrics

runner = CliRunner()

TINY = """
[base]
rounds = 1
[base.data]
dataset = "{dataset}"
num_clients = 2
[base.model]
name = "logreg"
[base.server]
clients_per_round = 2
[variants.fedavg.algorithm]
name = "fedavg"
[variants.fedprox]
algorithm = {{ name = "fedprox", mu = 0.1 }}
{shift}
"""


def test_compare_with_shift_writes_the_table_and_the_plot(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(TINY.format(dataset="digits", shift='[shift]\nkinds = ["contrast"]'))
    out = tmp_path / "out"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out), "--shift"])
    assert res.exit_code == 0, res.output
    assert "shift table:" in res.output and (out / "shift.png").stat().st_size > 0
    body = json.loads((out / "shift.json").read_text())
    assert list(body["shifts"]) == ["contrast"] and body["shifts"]["contrast"]["intensities"] == [1.0, 0.4, 0.3, 0.2, 0.1, 0.05]
    for name in ("fedavg", "fedprox"):
        recs = body["methods"][name]["records"]
        assert [r["level"] for r in recs] == list(range(6))
        # level 0 is the clean test set through the run's own evaluator: its last row of metrics.jsonl
        last = read_metrics(out / name / "metrics.jsonl")[-1]
        assert all(recs[0][k] == pytest.approx(last[k], abs=1e-6) for k in rs.METRICS if k in last)
    md = (out / "shift.md").read_text()
    assert "| fedprox | 0." in md and "**contrast** (contrast factor)" in md
    # comparison.toml keeps the shifts, so `fedbayes resume OUT` evaluates them again
    assert cmp.file_shift([out / "comparison.toml"]) == ("contrast",)


def test_a_posterior_gets_its_marginalised_metrics_under_shift(tmp_path):
    p = tmp_path / "fedep.toml"
    p.write_text(
        TINY.format(dataset="digits", shift="").split("[variants")[0].replace("[base.", "[").replace("[base]\n", 'name = "fedep"\n')
        + '[algorithm]\nname = "fedep"\nmethod = "laplace"\nburn_in_rounds = 0\n[evaluation]\nmarginal_samples = 2\n'
    )
    out = tmp_path / "run"
    res = runner.invoke(app, ["run", str(p), "--out", str(out)])
    assert res.exit_code == 0, res.output
    steps = []
    (recs,) = rs.evaluate_runs([out], kinds=("noise",), levels=(0, 5), progress=lambda done, total: steps.append((done, total)))
    assert steps == [(0, 2), (1, 2), (2, 2)]  # the comparison's bar under shift
    last = read_metrics(out / "metrics.jsonl")[-1]
    assert [r["level"] for r in recs] == [0, 5] and set(rs.METRICS) <= set(recs[0])
    assert all(recs[0][k] == pytest.approx(last[k], abs=1e-6) for k in rs.METRICS)  # the run's own evaluator, its key
    assert recs[1]["nll_marg"] != recs[0]["nll_marg"]


def test_shift_on_data_without_images_is_one_line_before_any_run(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text(TINY.format(dataset="breast_cancer", shift=""))
    res = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "out"), "--shift"])
    assert res.exit_code == 2, res.output
    assert res.output.strip().count("\n") == 0 and "--shift: shift: dataset 'breast_cancer' holds no images" in res.output
    assert not (tmp_path / "out" / "fedavg").exists()
    p.write_text(TINY.format(dataset="digits", shift='[shift]\nkinds = ["fog"]'))
    with pytest.raises(ConfigError, match=r"shift.kinds: allowed: a non-empty list of distinct shifts from rotation, noise, blur, contrast; got \['fog'\]"):
        cmp.file_shift([p])


def test_the_tables_put_the_marginalised_rows_beside_the_point_ones():
    recs = [
        {"shift": "noise", "level": lv, "intensity": v, "accuracy": 0.9 - lv / 10, "nll": 0.3 + lv, "ece": 0.01 * (lv + 1)}
        for lv, v in enumerate((0.0, 0.1, 0.2))
    ]
    marg = [r | {"accuracy_marg": r["accuracy"], "nll_marg": r["nll"] / 2, "ece_marg": r["ece"] / 2} for r in recs]
    body = {
        "dataset": "digits",
        "shifts": {"noise": {"unit": "noise std", "intensities": [0.0, 0.1, 0.2]}},
        "methods": {"a": {"variational": False, "records": recs}, "b": {"variational": False, "records": marg}, "v": {"variational": True, "records": recs}},
    }
    assert [label for label, _, _ in report.shift_rows(body)] == ["a", "b", "b marg.", "v (marg.)"]
    md = report.shift_markdown(body)
    # NLL: clean 0.3; the mean over levels 1-2 is (1.3 + 2.3) / 2 = 1.8, halved for b's marginal
    assert "| a | 0.300 | 1.800 |" in md and "| b marg. | 0.150 | 0.900 |" in md
    assert "| b marg. | 0.900 / 0.150 / 0.5 | 0.800 / 0.650 / 1.0 | 0.700 / 1.150 / 1.5 |" in md
    assert rs.mean_over_seeds([recs, marg])[1]["nll_marg"] == pytest.approx(0.65)
