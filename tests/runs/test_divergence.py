"""The divergence guard: a non-finite loss or server model stops the run (exit 3, one line, last good
checkpoint kept) or warns (``server.on_divergence = "warn"``); ``resume --set`` continues it."""

import json

import numpy as np
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.runs.checkpoint import latest_checkpoint
from fedbayes.runs.folder import read_metrics

runner = CliRunner()

DIGITS = """
name = "digits_div"
rounds = {rounds}
checkpoint_every = 1
[data]
dataset = "digits"
num_clients = 6
partition = "dirichlet"
alpha = 0.5
[model]
name = "logreg"
[client]
lr = 0.1
batch_size = 16
[server]
clients_per_round = 4
lr = {lr}
{server}
"""
# A server step this large overflows float32 in the server model (non-finite client messages would
# be rejected by the message validation instead, so the client lr cannot make the model diverge).
HUGE = "1e38"


def write(tmp_path, rounds=2, lr="1.0", server=""):
    p = tmp_path / "c.toml"
    p.write_text(DIGITS.format(rounds=rounds, lr=lr, server=server))
    return p


def test_divergence_stops_with_exit_3_and_resume_with_a_smaller_lr_continues(tmp_path):
    out = tmp_path / "o"
    assert runner.invoke(app, ["run", str(write(tmp_path)), "--out", str(out)]).exit_code == 0
    good = latest_checkpoint(out / "checkpoints")
    good_bytes = good.read_bytes()

    res = runner.invoke(app, ["resume", str(out), "--set", "rounds=5", "--set", f"server.lr={HUGE}"])
    assert res.exit_code == 3, res.output
    lines = [line for line in res.output.splitlines() if "diverged" in line]
    assert len(lines) == 1
    assert "round 3" in lines[0] and "non-finite" in lines[0] and "likely cause" in lines[0] and "checkpoint: round 2" in lines[0]
    # the last good checkpoint is the newest one, untouched
    assert latest_checkpoint(out / "checkpoints") == good and good.read_bytes() == good_bytes
    assert json.loads((out / "summary.json").read_text())["diverged"]["round"] == 3

    res = runner.invoke(app, ["resume", str(out), "--set", "server.lr=0.5"])
    assert res.exit_code == 0, res.output
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4, 5]
    assert all(np.isfinite(r["nll"]) for r in recs) and recs[-1]["accuracy"] > 0.5
    assert "diverged" not in json.loads((out / "summary.json").read_text())


def test_divergence_in_the_first_round_says_no_checkpoint(tmp_path):
    res = runner.invoke(app, ["run", str(write(tmp_path, lr=HUGE)), "--out", str(tmp_path / "o")])
    assert res.exit_code == 3, res.output
    assert "diverged at round 1" in res.output and "no checkpoint" in res.output


def test_warn_goes_on_and_saves_no_diverged_checkpoint(tmp_path):
    out = tmp_path / "o"
    res = runner.invoke(app, ["run", str(write(tmp_path, rounds=3, lr=HUGE, server='on_divergence = "warn"')), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "warning: diverged at round 1" in res.output
    assert len(read_metrics(out / "metrics.jsonl")) == 4
    assert latest_checkpoint(out / "checkpoints") is None


def test_compare_marks_a_diverged_variant(tmp_path):
    p = tmp_path / "cmp.toml"
    p.write_text(
        '[base]\nrounds = 2\ncheckpoint_every = 1\n[base.data]\ndataset = "digits"\nnum_clients = 5\n[base.server]\nclients_per_round = 5\n'
        f"[variants.good]\n[variants.bad]\nserver = {{ clients_per_round = 5, lr = {HUGE} }}\n"
    )
    out = tmp_path / "o"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out)])
    assert res.exit_code == 3, res.output
    table = (out / "compare.md").read_text()
    bad_row = next(line for line in table.splitlines() if line.startswith("| bad "))
    assert "diverged (round 1" in bad_row and "nan" not in bad_row.lower()
    summaries = json.loads((out / "compare.json").read_text())
    assert summaries["bad"]["diverged"]["round"] == 1 and "final" not in summaries["bad"]
    assert summaries["good"]["final"]["accuracy"] > 0.3
