"""The CLI keeps its promises: help keeps bracketed words, notes name options and files that
exist, progress bars fit the terminal with the count and the times, install hints work from a clone."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.cli.progress import progress_bar
from fedbayes.runs import report

runner = CliRunner()


@pytest.mark.parametrize(
    "command, words",
    [
        (["deploy", "--help"], ["pip install -e '.[flower]'", ".venv-flower"]),
        (["run", "--help"], ["[privacy]", "[attack]"]),
        (["sweep", "--help"], ["([base] + [variants.NAME])", "model.hidden=[100],[200,100]"]),
        (["compare", "--help"], ["[base] + [variants.NAME]"]),
    ],
)
def test_help_keeps_bracketed_words_at_80_columns(command, words):
    res = runner.invoke(app, command, env={"COLUMNS": "80"})
    assert res.exit_code == 0
    text = " ".join(res.output.split())
    assert all(w in text for w in words), text
    assert max(map(len, res.output.splitlines())) <= 80


def test_every_cli_option_a_table_note_names_exists():
    cols = [report.Column("method", lambda *a: "", left=True), *(report.Column(f"column {i}", lambda *a: "", keep=1) for i in range(12))]
    rows = [["fedavg", *["0.1234"] * 12]]
    assert "all in runs/x/summary.json)" in " ".join(report.render_rows(cols, rows, width=60, full="runs/x/summary.json").split())
    for command in ("run", "sweep", "deploy", "resume"):  # their notes name files, not --json; compare's names --json, which it has
        assert "--json" not in runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    assert "--json" in runner.invoke(app, ["compare", "--help"], env={"COLUMNS": "200"}).output


@pytest.mark.parametrize("width, dropped", [(120, None), (80, None), (60, "the bar"), (40, "the bar and the status")])
def test_progress_bar_fits_the_terminal_with_count_and_times(width, dropped):
    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=True)
    bar = progress_bar(console)
    bar.add_task("fedprox client.lr=0.02 client.epochs=3 fedprox.algorithm.mu=0.1 seed 2", total=100, completed=37, status="acc 0.8123")
    shown = Console(width=width, file=io.StringIO(), color_system=None)
    shown.print(bar.make_tasks_table(bar.tasks))
    lines = shown.file.getvalue().splitlines()
    assert len(lines) == 1 and len(lines[0]) <= width
    assert " 37/100 " in lines[0] and len(re.findall(r"\d:\d\d:\d\d|-:--:--", lines[0])) == 2  # elapsed and left
    note = " ".join(console.file.getvalue().split())
    assert (f"left out to fit {width} columns" in note and dropped in note) if dropped else note == ""


COMPARISON = """
[base]
rounds = 1
[base.data]
dataset = "digits"
num_clients = 4
[base.model]
name = "logreg"
[base.server]
clients_per_round = 2
[variants.fedavg]
algorithm = { name = "fedavg" }
[variants.fedprox]
algorithm = { name = "fedprox", mu = 0.01 }
"""


def test_a_resumed_comparison_reruns_the_changed_variant_named_by_rerun_and_keeps_the_others(tmp_path):
    cfg, out = tmp_path / "c.toml", tmp_path / "cmp"
    cfg.write_text(COMPARISON)
    assert runner.invoke(app, ["compare", str(cfg), "--out", str(out)]).exit_code == 0
    kept = (out / "fedavg" / "metrics.jsonl").read_text()
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume", "--set", "fedprox.algorithm.mu=0.1"])
    assert res.exit_code == 2 and "pass --rerun fedprox to run that variant again" in " ".join(res.output.split())
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--resume", "--set", "fedprox.algorithm.mu=0.1", "--rerun", "fedprox"])
    assert res.exit_code == 0, res.output
    assert "mu = 0.1\n" in (out / "fedprox" / "config.toml").read_text() and (out / "fedavg" / "metrics.jsonl").read_text() == kept
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out), "--rerun", "fedprox"])
    assert res.exit_code == 2 and "pass --resume with it" in res.output


def test_no_paper_table_beside_data_the_paper_did_not_use(tmp_path):
    reference = '[reference]\nsource = "a paper, Table 1"\ndataset = "{ds}"\nvalues = {{ fedavg = 76.0 }}\n'
    for ds, shown in (("fashion_mnist", False), ("digits", True)):
        cfg, out = tmp_path / f"{ds}.toml", tmp_path / ds
        cfg.write_text(COMPARISON + reference.format(ds=ds))
        res = runner.invoke(app, ["compare", str(cfg), "--out", str(out)], env={"COLUMNS": "200"})
        assert res.exit_code == 0, res.output
        assert ("beside the paper" in res.output) == shown and ("Beside the paper" in (out / "compare.md").read_text()) == shown
        assert ("no paper table: the [reference] numbers (a paper, Table 1) are for fashion_mnist; this comparison runs on digits" in res.output) != shown


def test_long_titles_wrap_at_spaces():
    cols = [report.Column("method", lambda *a: "", left=True), report.Column("accuracy", lambda *a: "")]
    title = "beside the paper: Swaroop et al. 2025 (ADMM and Bayes), Table 1: Fashion-MNIST, heterogeneous, 10 clients, R = 50"
    text = report.render_rows(cols, [["fedlap_cov", "0.8406"]], width=40, title=title)
    assert max(map(len, text.splitlines())) <= 40 and " ".join(text.split()).startswith(title)


def test_a_comparison_shows_the_fixed_point_in_its_table_not_as_a_warning():
    from fedbayes.runs.health import UNSETTLED, comparison_warnings
    from fedbayes.runs.report import columns, fixed_point_value

    lines = [f"warning: fedep: {UNSETTLED}: over the last 10 rounds ...", "warning: checkpoint round 5 is damaged", f"warning: fedsep: {UNSETTLED}: ..."]
    assert comparison_warnings(lines) == ["warning: checkpoint round 5 is damaged"]
    settled = {"settled": True, "mean_drift": 0.004, "var_drift": 0.01, "window": 10}
    moving = {"settled": False, "moved": ["mean", "var"], "mean_drift": 0.022, "var_drift": 0.071, "window": 10}
    assert fixed_point_value("a", {"fixed_point": settled}, []) == "yes"
    assert fixed_point_value("a", {"fixed_point": moving}, []) == "no (7.1%)"
    mean_only = {**moving, "moved": ["mean"]}  # the variances' drift was within their jitter: not shown
    assert fixed_point_value("a", {"fixed_point": mean_only}, []) == "no (2.2%)"
    assert fixed_point_value("a", {}, []) == "—"
    over_seeds = {"seeds": [0, 1, 2], "runs": {"0": {"fixed_point": settled}, "1": {"fixed_point": moving}, "2": {}}}
    assert fixed_point_value("a", over_seeds, []) == "no 1/2 (7.1%)"
    assert "fixed point" in [c.header for c in columns({"a": {"fixed_point": settled}, "b": {}})]
    assert "fixed point" not in [c.header for c in columns({"a": {}, "b": {}})]


def test_no_paper_table_beside_another_number_of_rounds(tmp_path):
    cfg, out = tmp_path / "c.toml", tmp_path / "out"
    cfg.write_text(COMPARISON + '[reference]\nsource = "a paper, Table 1"\nrounds = 50\nvalues = { fedavg = 76.0 }\n')
    res = runner.invoke(app, ["compare", str(cfg), "--out", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "beside the paper" not in res.output
    assert "no paper table: the [reference] numbers (a paper, Table 1) are after 50 rounds; this comparison runs 1" in res.output
