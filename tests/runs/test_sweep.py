"""Seeds and sweeps: mean and std over seeds, Swaroop et al. 2025's curve summaries, the held-out validation
split, grid parsing and its one-line errors, selection on validation or test, resumable sweeps."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.config.schema import resolved, same_config, to_toml, validate
from fedbayes.data.holdout import held_out_count, hold_out
from fedbayes.runs import report, summaries
from fedbayes.runs import sweep as sw
from fedbayes.runs.build import build_experiment, prepare_data, prepare_split
from fedbayes.runs.folder import read_metrics

runner = CliRunner()

BASE = {
    "rounds": 2,
    "checkpoint_every": 1,
    "data": {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5},
    "model": {"name": "logreg"},
    "client": {"lr": 0.1, "batch_size": 16},
    "server": {"clients_per_round": 4},
}

COMPARISON = """
{seeds}
[base]
rounds = 2
checkpoint_every = 1
[base.data]
dataset = "digits"
num_clients = 6
partition = "dirichlet"
alpha = 0.5
[base.model]
name = "logreg"
[base.client]
lr = 0.1
batch_size = 16
[base.server]
clients_per_round = 4
[variants.fedavg]
{more}
"""

PROX = '[variants.fedprox]\nalgorithm = { name = "fedprox", mu = 0.1 }\n'


def _write(tmp_path, seeds="", more="", name="cmp.toml"):
    p = tmp_path / name
    p.write_text(COMPARISON.format(seeds=seeds, more=more))
    return p


def _one_line(res):
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    return lines[0]


# ----- curve summaries and statistics over seeds (no training) ---------------------------------


def test_curve_summary_on_a_hand_made_curve():
    acc = [0.1, 0.5, 0.62, 0.7, 0.66, 0.74]
    recs = [{"round": r, "accuracy": a, "nll": 1.0} for r, a in enumerate(acc)]
    c = summaries.curve_summary(recs, 0.6)
    assert c["final_round"] == 5 and c["metric"] == "accuracy"
    assert c["mean_last"] == pytest.approx((0.7 + 0.66 + 0.74) / 3)  # rounds R-2..R = 3, 4, 5
    assert c["max_last"] == pytest.approx(0.74)
    assert c["rounds_to"] == 2  # the first round reaching 0.6, unsmoothed (Swaroop et al. 2025, Table 3)
    assert summaries.curve_summary(recs, 0.75)["rounds_to"] is None
    # evaluated every other round: the window holds the evaluated rounds among R-2..R
    every_other = [{"round": r, "accuracy": a} for r, a in ((0, 0.1), (2, 0.4), (4, 0.6), (6, 0.8))]
    assert summaries.curve_summary(every_other, 0.5)["mean_last"] == pytest.approx(0.7)
    assert summaries.curve_summary(every_other, 0.5)["rounds_to"] == 4
    # R = 2: the initial model (round 0) is not a round of training
    short = [{"round": 0, "accuracy": 0.1}, {"round": 1, "accuracy": 0.3}, {"round": 2, "accuracy": 0.5}]
    assert summaries.curve_summary(short)["mean_last"] == pytest.approx(0.4)
    # the validation curve, and regression
    val = [{"round": r, "accuracy": a, "val_accuracy": a - 0.1} for r, a in enumerate(acc)]
    assert summaries.curve_summary(val, prefix="val_")["max_last"] == pytest.approx(0.64)
    assert summaries.curve_summary(recs, prefix="val_") is None
    mse = [{"round": r, "mse": m} for r, m in enumerate((4.0, 2.0, 1.0, 0.5))]
    c = summaries.curve_summary(mse, 0.8)
    assert c["metric"] == "mse" and c["mean_last"] == pytest.approx(3.5 / 3) and c["rounds_to"] is None


def test_mean_and_sample_std_over_seeds():
    s = summaries.mean_std([0.80, 0.82, 0.87])
    assert s["mean"] == pytest.approx(0.83) and s["n"] == 3 and s["of"] == 3
    assert s["std"] == pytest.approx(np.sqrt(((0.03**2) + (0.01**2) + (0.04**2)) / 2))  # n - 1
    partial = summaries.mean_std([12, None, 14])  # a seed that never reached the threshold
    assert partial == {"mean": 13.0, "std": pytest.approx(np.sqrt(2)), "n": 2, "of": 3}
    assert summaries.mean_std([0.5])["std"] is None and summaries.mean_std([None])["mean"] is None
    assert report.format_value(partial, digits=1) == "13.0±1.4[2/3]"


def _run(final_acc, curve, diverged=False):
    summary = {"name": "m", "algorithm": "fedavg", "server_optimizer": "sgd", "rounds": len(curve) - 1}
    summary["final"] = {"accuracy": final_acc, "nll": 1.0 - final_acc, "seconds": 2.0}
    summary["best_accuracy"] = max(curve)
    if diverged:
        summary["diverged"] = {"round": 2, "metric": "training loss", "checkpoint": 1}
    return summary, [{"round": r, "accuracy": a, "val_accuracy": a / 2} for r, a in enumerate(curve)]


def test_aggregate_over_seeds_by_hand():
    runs, curves = {}, {}
    for seed, curve in enumerate(([0.1, 0.5, 0.6, 0.7], [0.1, 0.4, 0.7, 0.8], [0.1, 0.6, 0.6, 0.9])):
        runs[seed], curves[seed] = _run(curve[-1], curve)
    agg = summaries.aggregate("m", runs, curves, threshold=0.65)
    assert agg["seeds"] == [0, 1, 2] and agg["diverged_seeds"] == {}
    assert agg["final"]["accuracy"]["mean"] == pytest.approx(0.8)
    assert agg["final"]["accuracy"]["std"] == pytest.approx(0.1)  # sample std of 0.7, 0.8, 0.9
    window_means = [np.mean([r["accuracy"] for r in c[1:]]) for c in curves.values()]  # rounds R-2..R = 1..3
    assert agg["curve"]["mean_last"]["mean"] == pytest.approx(np.mean(window_means))
    assert agg["curve"]["mean_last"]["std"] == pytest.approx(np.std(window_means, ddof=1))
    assert agg["curve"]["max_last"]["mean"] == pytest.approx(0.8)
    assert agg["curve"]["rounds_to"] == {"mean": pytest.approx(8 / 3), "std": pytest.approx(np.std([3, 2, 3], ddof=1)), "n": 3, "of": 3}
    high = summaries.aggregate("m", runs, curves, threshold=0.85)["curve"]["rounds_to"]  # one seed of three reaches it
    assert high == {"mean": 3.0, "std": None, "n": 1, "of": 3}
    assert agg["val_curve"]["max_last"]["mean"] == pytest.approx(0.4)
    text = report.render({"m": agg}, width=200, threshold=0.65)
    assert "0.8000±0.1000" in text and "seeds" in text and "2.7±0.6" in text
    assert "3.0[1/3]" in report.render({"m": summaries.aggregate("m", runs, curves, threshold=0.85)}, width=200, threshold=0.85)
    # a diverged seed is left out of the statistics and shown
    runs[1], curves[1] = _run(0.2, [0.1, 0.2, 0.2, 0.2], diverged=True)
    agg = summaries.aggregate("m", runs, curves, threshold=0.65)
    assert agg["final"]["accuracy"]["mean"] == pytest.approx(0.8) and agg["final"]["accuracy"]["n"] == 2
    assert list(agg["diverged_seeds"]) == ["1"] and report.seeds_value("m", agg, None) == "2/3"
    mean, std = summaries.mean_curves([curves[0], curves[2]])
    assert [r["accuracy"] for r in mean] == pytest.approx([0.1, 0.55, 0.6, 0.8])
    assert std[3]["accuracy"] == pytest.approx(np.std([0.7, 0.9], ddof=1))


# ----- grids: parsing, planning, one-line errors -----------------------------------------------


@pytest.mark.parametrize(
    "items,needle",
    [
        ([], "--grid: a sweep needs at least one --grid"),
        (["algorithm.delta"], "--grid 'algorithm.delta': expected key=v1,v2"),
        (["client.lr="], "--grid client.lr: no values"),
        (["client.lr=0.1,,1"], "--grid client.lr: an empty value"),
        (["client.lr=1,1"], "--grid client.lr: the value 1 is given twice"),
        (["client.lr=1", "client.lr=2"], "--grid client.lr: given twice"),
        (["seed=1,2"], "--grid seed: seeds are not a grid axis; use --seeds"),
        (["client..lr=1"], "the key is empty or has an empty part"),
    ],
)
def test_bad_grids_are_one_line_errors_naming_the_field(items, needle):
    with pytest.raises(sw.SweepError) as err:
        sw.parse_grid(items, ["fedavg"])
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_grid_values_are_toml_and_brackets_keep_commas():
    (a,) = sw.parse_grid(["model.hidden=[100],[200,100]"], [])
    assert a.values == ([100], [200, 100]) and a.raw == ("[100]", "[200,100]")
    (b,) = sw.parse_grid(["client.optimizer=sgd,adam"], [])
    assert b.values == ("sgd", "adam")


def test_plan_crosses_the_axes_per_variant_and_checks_every_key():
    variants = {"fedavg": validate({**BASE, "name": "fedavg"}), "fedprox": validate({**BASE, "name": "fedprox", "algorithm": {"name": "fedprox"}})}
    axes = sw.parse_grid(["client.lr=0.05,0.2", "client.epochs=1,2", "fedprox.algorithm.mu=0.01,1"], list(variants))
    cells = sw.plan(variants, axes)
    assert [c.variant for c in cells].count("fedavg") == 4 and [c.variant for c in cells].count("fedprox") == 8
    first = next(c for c in cells if c.variant == "fedprox")
    assert first.name == "client.lr=0.05__client.epochs=1__algorithm.mu=0.01"
    assert first.config.client.lr == 0.05 and first.config.algorithm.mu == 0.01 and first.config.client.epochs == 1
    with pytest.raises(sw.SweepError, match=r"--grid algorithm\.mu: not a setting of variant 'fedavg'.*none.*--grid VARIANT\.algorithm\.mu"):
        sw.plan(variants, sw.parse_grid(["algorithm.mu=0.1,1"], list(variants)))
    with pytest.raises(sw.SweepError, match=r"client\.lr: Input should be greater than 0.*--grid client\.lr=-1, variant 'fedavg'"):
        sw.plan(variants, sw.parse_grid(["client.lr=0.1,-1"], list(variants)))
    with pytest.raises(sw.SweepError, match=r"give variant 'fedavg' the same config"):
        sw.plan(variants, sw.parse_grid(["client.lr=1,1.0"], list(variants)))
    with pytest.raises(sw.SweepError, match=r"--grid client: a section, not a setting; its settings: client\.epochs"):
        sw.plan(variants, sw.parse_grid(["client=1"], list(variants)))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--grid", "client.bogus=1,2"], "config error: --grid client.bogus: not a setting of variant 'fedavg'"),
        (["--grid", "client.lr=0,1"], "client.lr: Input should be greater than 0"),
        (["--grid", "client.lr="], "--grid client.lr: no values"),
        ([], "--grid: a sweep needs at least one --grid"),
        (["--grid", "client.lr=1", "--seeds", "0,0"], "--seeds: a seed is repeated"),
        (["--grid", "client.lr=1", "--select-on", "train"], "--select-on 'train': allowed: validation, test"),
        (["--grid", "client.lr=1", "--validation-fraction", "1.5"], "data.validation_fraction: Input should be less than 1"),
    ],
)
def test_sweep_bad_input_exits_2_with_one_line_before_any_run(tmp_path, args, needle):
    out = tmp_path / "out"
    res = runner.invoke(app, ["sweep", str(_write(tmp_path)), "--out", str(out), *args])
    assert res.exit_code == 2, res.output
    assert needle in _one_line(res)
    assert not out.exists()


def test_bad_seeds_in_a_comparison_file_are_one_line(tmp_path):
    res = runner.invoke(app, ["compare", str(_write(tmp_path, seeds="seeds = [0, -1]")), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "seeds: allowed: a non-empty list of distinct integers from 0 to 2**63 - 1" in _one_line(res)


# ----- the validation split ---------------------------------------------------------------------


def test_validation_split_is_disjoint_from_training_and_reproducible_by_seed():
    cfg = validate({**BASE, "data": {**BASE["data"], "validation_fraction": 0.2}})
    _, full = prepare_data(validate(BASE))
    exp = build_experiment(cfg)
    train = np.concatenate(exp.federation.client_indices)
    assert exp.validation.size > 0 and not np.intersect1d(exp.validation, train).size  # clients never see it
    assert np.array_equal(np.sort(np.concatenate([train, exp.validation])), np.sort(np.concatenate(full)))  # the same partition, split
    for part, kept in zip(full, exp.federation.client_indices):
        assert len(part) - len(kept) == held_out_count(len(part), 0.2) and len(kept) >= 1
    _, parts_again, again = prepare_split(cfg)
    assert np.array_equal(again, exp.validation) and all(np.array_equal(a, b) for a, b in zip(parts_again, exp.federation.client_indices))
    _, _, other = prepare_split(cfg.model_copy(update={"seed": 1}))
    assert not np.array_equal(other, exp.validation)
    # a tiny client keeps one training example
    small, val = hold_out([np.array([5]), np.arange(10, 20)], 0.5, lambda k: np.random.default_rng(k))
    assert small[0].tolist() == [5] and len(small[1]) == 5 and len(val) == 5
    with pytest.raises(ValueError):
        held_out_count(10, 1.0)


def test_a_validation_fraction_holding_out_nothing_is_a_config_error():
    cfg = validate({**BASE, "data": {**BASE["data"], "validation_fraction": 1e-4}})
    with pytest.raises(Exception, match=r"data\.validation_fraction: 0\.0001 of each client's examples holds out none"):
        prepare_split(cfg)


# ----- selection --------------------------------------------------------------------------------


def _cell_summary(val, test, diverged=False):
    curve = lambda v: {
        "metric": "accuracy",
        "final_round": 2,
        "threshold": 0.8,
        **{k: summaries.mean_std([v]) for k in ("mean_last", "max_last")},
        "rounds_to": summaries.mean_std([None]),
    }  # noqa: E731
    s = {
        "name": "fedavg",
        "seeds": [0],
        "diverged_seeds": {"0": {}} if diverged else {},
        "final": {"accuracy": summaries.mean_std([test])},
        "curve": curve(test),
    }
    s["val_curve"] = curve(val)
    return s


def test_best_cell_on_validation_by_default_and_on_test_when_asked():
    cfg = validate({**BASE, "name": "fedavg"})
    cells = sw.plan({"fedavg": cfg}, sw.parse_grid(["client.lr=0.01,0.1,1"], []))
    agg = {
        ("fedavg", cells[0].name): _cell_summary(val=0.70, test=0.60),
        ("fedavg", cells[1].name): _cell_summary(val=0.60, test=0.70),
        ("fedavg", cells[2].name): _cell_summary(val=0.90, test=0.90, diverged=True),  # never chosen
    }
    assert sw.best_cells(cells, agg, "validation")["fedavg"] is cells[0]
    assert sw.best_cells(cells, agg, "test")["fedavg"] is cells[1]
    t = sw.tables(cells, agg, select_on="test", threshold=0.8, seeds=[0], axes=sw.parse_grid(["client.lr=0.01,0.1,1"], []))
    assert t.data["selected_on"] == "test" and "TEST set, as the papers do" in t.data["selection"]
    assert t.data["best"]["fedavg"]["cell"] == cells[1].name
    assert "selected on the TEST set" in t.render(width=200) and "TEST set" in t.markdown("x")
    t = sw.tables(cells, agg, select_on="validation", threshold=0.8, seeds=[0], axes=sw.parse_grid(["client.lr=0.01,0.1,1"], []))
    assert t.data["best"]["fedavg"]["cell"] == cells[0].name and "validation split" in t.data["selection"]
    assert "val acc mean R-2..R" in t.markdown("x")


# ----- end to end through the CLI (digits, logistic regression, 2 rounds) -----------------------


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    config = _write(tmp)
    out = tmp / "sw"
    args = ["sweep", str(config), "--grid", "client.lr=0.05,0.3", "--seeds", "1", "--out", str(out)]  # 2 runs (seeds: see the compare test)
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    return tmp, config, out, args, res.output


def test_sweep_writes_both_tables_and_selects_on_validation(swept):
    _, _, out, _, output = swept
    data = json.loads((out / "sweep.json").read_text())
    assert data["selected_on"] == "validation" and "10% of each client's training examples held out" in data["selection"]
    assert len(data["cells"]) == 2 and [c["settings"]["client.lr"] for c in data["cells"]] == [0.05, 0.3]
    scores = {c["cell"]: c["summary"]["val_curve"]["mean_last"]["mean"] for c in data["cells"]}
    assert data["best"]["fedavg"]["cell"] == max(scores, key=scores.get)
    recs = read_metrics(out / "fedavg" / "client.lr=0.05" / "seed_0" / "metrics.jsonl")
    assert [r["round"] for r in recs] == [0, 1, 2] and "val_accuracy" in recs[-1]
    cell = next(c for c in data["cells"] if c["cell"] == "client.lr=0.05")
    assert cell["summary"]["seeds"] == [0] and cell["summary"]["final"]["accuracy"]["mean"] == recs[-1]["accuracy"]
    assert cell["summary"]["val_curve"]["mean_last"]["mean"] == pytest.approx(np.mean([r["val_accuracy"] for r in recs[1:]]))
    md = (out / "sweep.md").read_text()
    assert "Best cell per method, selected on the validation split" in md and "## Every cell" in md
    assert "best cell per method, selected on the validation split" in output


def test_resumed_sweep_runs_no_finished_cell_again_and_gives_the_same_tables(swept, monkeypatch):
    tmp, config, out, args, _ = swept
    before = (out / "sweep.json").read_text()
    assert runner.invoke(app, args).exit_code == 2  # never overwrites
    import fedbayes.runs.loop as experiment

    calls = []
    real = experiment.run_experiment
    monkeypatch.setattr(experiment, "run_experiment", lambda cfg, folder, **kw: calls.append((folder, kw["resume"])) or real(cfg, folder, **kw))
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert calls == [] and (out / "sweep.json").read_text() == before
    # an interrupted run (killed after its round-1 checkpoint) resumes from that checkpoint
    folder = out / "fedavg" / "client.lr=0.3" / "seed_0"
    metrics_before = read_metrics(folder / "metrics.jsonl")
    (folder / "summary.json").unlink()
    (folder / "checkpoints" / "round_000002.npz").unlink()
    res = runner.invoke(app, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    assert calls == [(folder, True)]
    strip = lambda recs: [{k: v for k, v in r.items() if k != "seconds"} for r in recs]  # noqa: E731
    assert strip(read_metrics(folder / "metrics.jsonl")) == strip(metrics_before)
    after = json.loads((out / "sweep.json").read_text())
    assert after["best"]["fedavg"]["cell"] == json.loads(before)["best"]["fedavg"]["cell"]
    for a, b in zip(after["cells"], json.loads(before)["cells"]):
        assert a["summary"]["val_curve"] == b["summary"]["val_curve"] and a["summary"]["curve"] == b["summary"]["curve"]


def test_select_on_test_is_labelled(swept):
    _, _, out, args, _ = swept
    res = runner.invoke(app, [*args, "--resume", "--select-on", "test", "--validation-fraction", "0.1"])  # the same runs
    assert res.exit_code == 0, res.output
    assert "selected on the TEST set" in res.output
    data = json.loads((out / "sweep.json").read_text())
    assert data["selected_on"] == "test"
    scores = {c["cell"]: c["summary"]["curve"]["mean_last"]["mean"] for c in data["cells"]}
    assert data["best"]["fedavg"]["cell"] == max(scores, key=scores.get)
    assert "selected on the TEST set" in (out / "sweep.md").read_text()


def test_compare_over_seeds_reports_mean_and_std_and_resumes(tmp_path):
    config = _write(tmp_path, seeds="seeds = [0, 1]")
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", str(config), "--out", str(out)])
    assert res.exit_code == 0, res.output
    finals = [json.loads((out / "fedavg" / f"seed_{s}" / "summary.json").read_text())["final"]["accuracy"] for s in (0, 1)]
    assert finals[0] != finals[1]  # the seeds differ
    table = json.loads((out / "compare.json").read_text())["fedavg"]
    assert table["seeds"] == [0, 1] and table["final"]["accuracy"]["mean"] == pytest.approx(np.mean(finals))
    assert table["final"]["accuracy"]["std"] == pytest.approx(np.std(finals, ddof=1))
    assert set(table["runs"]) == {"0", "1"} and "mean_last" in table["curve"]
    md = (out / "compare.md").read_text()
    assert f"{np.mean(finals):.4f}±{np.std(finals, ddof=1):.4f}" in md and "acc mean R-2..R" in md
    assert (out / "compare.png").is_file()
    assert runner.invoke(app, ["compare", str(config), "--out", str(out)]).exit_code == 2  # never overwrites
    res = runner.invoke(app, ["compare", str(config), "--out", str(out), "--resume", "--seeds", "0,1"])
    assert res.exit_code == 0 and res.output.count("finished earlier, not rerun") == 2, res.output

    # A run written by an older version, before a defaulted key existed, is the same run; a run
    # whose stored config really differs is not (and is never overwritten).
    stored = out / "fedavg" / "seed_0" / "config.toml"
    text = stored.read_text()
    assert 'store = "memory"\n' in text
    stored.write_text(text.replace('store = "memory"\n', ""))
    res = runner.invoke(app, ["compare", str(config), "--out", str(out), "--resume", "--seeds", "0,1"])
    assert res.exit_code == 0 and res.output.count("finished earlier, not rerun") == 2, res.output
    stored.write_text(text.replace('store = "memory"', 'store = "disk"'))
    res = runner.invoke(app, ["compare", str(config), "--out", str(out), "--resume", "--seeds", "0,1"])
    assert res.exit_code == 2 and "holds a run of a different config" in res.output, res.output


def test_same_config_reads_older_files_by_this_versions_schema(tmp_path):
    # what an older version's run evaluated: the sampled predictive at the method's own prior
    cfg = validate(
        {"algorithm": {"name": "fedlap_cov", "delta": 0.5}, "evaluation": {"predictive": "sample", "prior_precision": "fixed", "subset_of_weights": "all"}}
    )
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert same_config(path, cfg)
    path.write_text(to_toml(cfg).replace('predictive = "sample"\n', "").replace('prior_precision = "fixed"\n', "").replace('subset_of_weights = "all"\n', ""))
    assert "predictive" not in path.read_text() and "prior_precision" not in path.read_text() and same_config(path, cfg)
    # ... which is not this version's default run of the same method
    assert not same_config(path, validate({"algorithm": {"name": "fedlap_cov", "delta": 0.5}}))
    assert not same_config(path, validate({"algorithm": {"name": "fedlap_cov", "delta": 0.5, "predictive": "linearised"}}))
    assert not same_config(path, validate({"algorithm": {"name": "fedlap_cov", "delta": 1.0}}))
    path.write_text("rounds = [")  # unreadable
    assert not same_config(path, cfg) and not same_config(tmp_path / "missing.toml", cfg)
    assert resolved({"rounds": "many"}) == {"rounds": "many"}  # invalid: kept as it is, equal to no valid config

    # The same for a checkpoint's recorded config: an added defaulted key is no change on resume.
    from fedbayes.config.schema import ConfigError
    from fedbayes.runs.resume import check_resume_config

    old_meta = cfg.model_dump(mode="json")
    del old_meta["evaluation"]["predictive"], old_meta["evaluation"]["prior_precision"], old_meta["evaluation"]["subset_of_weights"]
    assert check_resume_config(cfg, {"config": old_meta, "config_hash": "older", "round": 3}, tmp_path) == {}
    old_meta["algorithm"]["delta"] = 2.0
    with pytest.raises(ConfigError, match=r"algorithm\.delta \(2\.0 -> 0\.5\)"):
        check_resume_config(cfg, {"config": old_meta, "config_hash": "older", "round": 3}, tmp_path)
