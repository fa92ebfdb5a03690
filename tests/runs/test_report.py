"""Result tables fit the width and never cut a method name or a number."""

import json
import re

import jax
import pytest
from helpers import single_client_data

from fedbayes import protocol, tree
from fedbayes.algorithms import sites
from fedbayes.config.schema import validate
from fedbayes.runs import folder, report
from fedbayes.runs.build import build_experiment
from fedbayes.runs.loop import run_experiment
from fedbayes.runs.summaries import aggregate

NAMES = [
    "fedavg",
    "fedavgm_heavy_ball_lr0.5",
    "fedprox_mu0.01",
    "feddyn",
    "fedpa_rho0.1_burnin5",
    "fedep_identity_scale500",
    "fedep_laplace",
    "fedep_mcmc",
    "fedep_ngvi",
    "fedsep_identity",
    "fedsep_laplace",
    "fedsep_ngvi_long_variant_name",
]


def _summaries(marg=True):
    out = {}
    for i, name in enumerate(NAMES):
        final = {"accuracy": 0.8812345 - i / 1000, "nll": 0.35 + i / 97, "ece": 0.0348 + i / 1000, "seconds": 280.123 + i, "bytes_up": 1.2e9 + i}
        if marg and name.startswith("fed") and ("ep" in name or "sep" in name):
            final.update(accuracy_marg=0.86 - i / 1000, nll_marg=0.3764 + i / 100, ece_marg=0.0076)
        out[name] = {
            "algorithm": name.split("_")[0],
            "server_optimizer": "momentum",
            "final": final,
            "best_accuracy": 0.8873 - i / 1000,
            "rounds_to": {"0.80": 6 + i},
        }
    return out


def _shown(text):
    """Which columns a rendered table left out (from its footnote)."""
    m = re.search(r"left out to fit \d+ columns: (.*); all in --json", " ".join(text.split()))
    return set(m.group(1).split(", ")) if m else set()


@pytest.mark.parametrize("width", [80, 100, 160])
@pytest.mark.parametrize("marg", [True, False])
def test_tables_fit_and_keep_every_name_and_number_whole(width, marg):
    summaries = _summaries(marg)
    text = report.render(summaries, width=width)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), max(map(len, lines))
    tokens = set(text.split())
    cols = report.columns(summaries)
    dropped = _shown(text)
    assert "accuracy" not in dropped and "method" not in dropped
    for (name, s), row in zip(summaries.items(), report.cells(summaries, cols)):
        assert name in tokens
        for col, cell in zip(cols, row):
            if col.header not in dropped:
                assert cell in tokens, (width, col.header, cell)
    if width == 160:
        assert not dropped  # everything fits in a wide terminal


def test_marginal_columns_only_when_some_method_has_them():
    assert "marg." in report.render(_summaries(marg=True), width=200)
    assert "marg." not in report.render(_summaries(marg=False), width=200)


def test_too_narrow_for_a_grid_prints_blocks_with_every_value():
    summaries = _summaries()
    text = report.render(summaries, width=30)
    tokens = set(text.split())
    cols = report.columns(summaries)
    for (name, _), row in zip(summaries.items(), report.cells(summaries, cols)):
        assert name in tokens and all(cell in tokens for cell in row[1:])


def test_regression_table_shows_mse_and_rmse():
    s = {"ls": {"algorithm": "fedavg", "server_optimizer": "sgd", "final": {"mse": 0.123456, "rmse": 0.351363, "seconds": 1.0, "bytes_up": 10}}}
    text = report.render(s, width=100, curves={"ls": [{"round": 0, "mse": 0.5}, {"round": 1, "mse": 0.123456}]})
    assert "MSE" in text and "RMSE" in text and "accuracy" not in text
    assert "0.12346" in text and "0.35136" in text


def test_width_follows_columns_when_piped(monkeypatch):
    class Pipe:
        def isatty(self):
            return False

    monkeypatch.setenv("COLUMNS", "93")
    assert report.terminal_width(Pipe()) == 93
    monkeypatch.delenv("COLUMNS")
    assert report.terminal_width(Pipe()) == report.PIPE_WIDTH


def test_markdown_has_every_column():
    md = report.markdown(_summaries())
    header = md.splitlines()[0]
    for col in report.columns(_summaries()):
        assert col.header in header
    assert md.count("\n") == len(NAMES) + 2


def test_at_80_columns_the_bayesian_columns_are_kept_and_others_left_out_with_a_note():
    """The main job's methods: the marginalised columns and the fixed point stay; the footnote
    names the columns left out instead (the curve summaries, time, upload, ...)."""
    summaries = {}
    for i, name in enumerate(["fedavg", "fedprox", "fedep", "fedsep", "fedlap_cov", "fedlap_func", "vbnn_cf"]):
        final = {"accuracy": 0.83 + i / 1000, "nll": 0.47 + i / 100, "ece": 0.0296, "seconds": 11.5, "bytes_up": 7.124e8}
        bayes = name in ("fedep", "fedsep", "fedlap_cov")
        if bayes:
            final.update(accuracy_marg=0.8357, nll_marg=0.4711, ece_marg=0.0223)
        summaries[name] = {
            "algorithm": name.split("_")[0],
            "server_optimizer": "sgd",
            "final": final,
            "best_accuracy": 0.8418,
            "rounds_to": {"0.80": 11},
            "final_mean_3": 0.8412,
            "fixed_point": {"settled": False, "mean_drift": 0.071, "var_drift": 0.01, "moved": ["mean"]} if bayes else None,
        }
    text = report.render(summaries, width=80)
    assert all(len(line) <= 80 for line in text.splitlines())
    dropped = _shown(text)
    assert dropped and not dropped & {"NLL marg.", "ECE marg. (%)", "acc marg.", "fixed point", "accuracy", "NLL"}, dropped
    assert "no (7.1%)" in text and "0.4711" in text


def test_a_markdown_report_as_text_fits_and_says_what_its_tables_left_out():
    """fedbayes bench posterior prints its Markdown this way: paragraphs wrapped, each table
    narrowed from the right with a note naming the file that has every column."""
    header = "| method | " + " | ".join(f"column number {i}" for i in range(12)) + " |"
    rows = [f"| method_{k} | " + " | ".join(f"{k}.{i:03d}" for i in range(12)) + " |" for k in range(3)]
    md = "\n".join(["### a problem", "", "word " * 40, "", header, "|" + "---|" * 13, *rows, ""])
    text = report.markdown_as_text(md, width=60, full="runs/posterior/posterior_quality.md")
    assert all(len(line) <= 60 for line in text.splitlines()), text
    assert "a problem" in text and text.count("word") == 40
    assert all(f"method_{k}" in text and f"{k}.000" in text for k in range(3))
    assert "left out to fit 60 columns: column number 11" in " ".join(text.split()) and "posterior_quality.md" in text


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1 kB"), (5205, "5.21 kB"), (999_499, "999 kB"), (999_500, "1 MB"), (1_692_605, "1.69 MB"), (2_500_000_000, "2.5 GB")],
)
def test_bytes_text(n, text):
    assert report.bytes_text(n) == text


@pytest.mark.parametrize("covariance", ["diagonal", "full"])
def test_up_per_message_is_the_bytes_of_a_message_the_algorithm_builds(covariance, tmp_path):
    """``summary.json``'s ``message_bytes.up`` and the table's "up per message" are the bytes of a
    real FedEP message (one client, round 0, on digits' logistic regression, D = 650): its
    difference is ``2 D`` float32 numbers (diagonal) or ``D + D^2`` (full); the run's ``bytes_up``
    is that times the messages sent (2 rounds of 3 clients)."""
    cfg = validate({
        "name": covariance, "rounds": 2, "checkpoint_every": 0, "algorithm": {"name": "fedep", "covariance": covariance},
        "data": {"dataset": "digits", "num_clients": 4}, "model": {"name": "logreg"}, "server": {"clients_per_round": 3},
        "client": {"epochs": 1, "batch_size": 32}, "evaluation": {"marginal_samples": 2},
    })  # fmt: skip
    run_experiment(cfg, tmp_path)
    summary = json.loads((tmp_path / folder.SUMMARY).read_text())
    exp = build_experiment(cfg)
    sim, alg = exp.simulator, exp.simulator.algorithm
    state = sim.init(exp.params)
    message, _, _ = jax.jit(alg.client_update)(
        protocol.client_key(sim.seed, 0, 0), alg.broadcast(state.server_state), jax.tree.map(lambda a: a[0], state.client_states), single_client_data(sim, 0, 0)
    )
    up = tree.tree_bytes(message)
    assert tree.tree_bytes(message.difference) == sites.natural_bytes(650, covariance) == {"diagonal": 5200, "full": 1_692_600}[covariance]
    assert summary["message_bytes"]["up"] == up and summary["message_bytes"]["down"] == tree.tree_bytes(alg.broadcast(state.server_state))
    assert summary["final"]["bytes_up"] == 2 * 3 * up
    for shown in ({covariance: summary}, {covariance: aggregate(covariance, {0: summary}, {0: []})}):  # one run, and over seeds
        cols = report.columns(shown)
        cell = dict(zip([c.header for c in cols], report.cells(shown, cols)[0]))["up per message"]
        assert cell == report.bytes_text(up) == {"diagonal": "5.21 kB", "full": "1.69 MB"}[covariance]
    assert "up per message" not in [c.header for c in report.columns(_summaries())]  # runs recorded before the field: no column
