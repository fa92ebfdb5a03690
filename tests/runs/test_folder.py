"""The run-folder format (fedbayes.runs.folder): names, metrics reading and writing, atomic writes,
strict JSON; reading a run folder loads neither the simulator nor the run loop."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from fedbayes.runs import folder
from fedbayes.runs.strictjson import loads_strict


def test_the_file_names():
    assert (folder.CONFIG, folder.METRICS, folder.CLIENTS, folder.MODEL) == ("config.toml", "metrics.jsonl", "clients.jsonl", "model.npz")
    assert (folder.SUMMARY, folder.CURVES, folder.CHECKPOINTS, folder.RESUME_CHANGES) == ("summary.json", "curves.png", "checkpoints", "resume_changes.jsonl")
    assert (folder.COMPARISON, folder.SWEEP, folder.CLIENT_STORE) == ("comparison.toml", "sweep.toml", "client_store")
    assert (folder.COMPARE_MD, folder.COMPARE_JSON, folder.COMPARE_PLOT, folder.SWEEP_MD, folder.SWEEP_JSON) == (
        "compare.md",
        "compare.json",
        "compare.png",
        "sweep.md",
        "sweep.json",
    )
    assert folder.checkpoint_name(7) == "round_000007.npz" and folder.CHECKPOINT_NAME.match("round_000007.npz").group(1) == "000007"
    assert Path("x").joinpath(folder.checkpoint_name(3)).match(folder.CHECKPOINT_GLOB)
    assert folder.seed_folder(Path("out/fedavg"), 2) == Path("out/fedavg/seed_2")


def test_has_checkpoint(tmp_path):
    assert not folder.has_checkpoint(tmp_path)
    (tmp_path / folder.CHECKPOINTS).mkdir()
    (tmp_path / folder.CHECKPOINTS / (folder.checkpoint_name(2) + ".tmp")).write_bytes(b"torn")
    assert not folder.has_checkpoint(tmp_path)  # a temporary file is not a checkpoint
    (tmp_path / folder.CHECKPOINTS / folder.checkpoint_name(2)).write_bytes(b"")
    assert folder.has_checkpoint(tmp_path)


def test_metrics_written_and_read_back_with_non_finite_values(tmp_path):
    path = tmp_path / folder.METRICS
    assert folder.read_metrics(path) == []  # no file: no records
    writer = folder.MetricsWriter(path)
    writer.rewrite([{"round": 0, "accuracy": 0.1}])
    writer.append({"round": 1, "accuracy": 0.5, "nll": float("nan")})
    text = path.read_text()
    assert "NaN" not in text and all(loads_strict(line) for line in text.splitlines())
    back = folder.read_metrics(path)
    assert back[0] == {"round": 0, "accuracy": 0.1} and back[1]["accuracy"] == 0.5 and math.isnan(back[1]["nll"])
    writer.rewrite(back[:1])  # a resume cuts the file back to its checkpoint's records
    assert folder.read_metrics(path) == [{"round": 0, "accuracy": 0.1}]


def test_read_metrics_stops_at_a_torn_line(tmp_path):
    """A line torn by a kill ends the records: it and every line after it are dropped; blank lines are skipped."""
    path = tmp_path / folder.METRICS
    lines = [json.dumps({"round": 0, "accuracy": 0.1}), "", json.dumps({"round": 1, "accuracy": 0.2}), '{"round": 2, "accur', json.dumps({"round": 3})]
    path.write_text("\n".join(lines) + "\n")
    assert [r["round"] for r in folder.read_metrics(path)] == [0, 1]
    path.write_text('{"round": 0, "nll": NaN}\n' + json.dumps({"round": 1}) + "\n")  # non-strict JSON counts as damaged
    assert folder.read_metrics(path) == []


def test_an_atomic_write_that_fails_leaves_the_old_file(tmp_path):
    path = tmp_path / "summary.json"
    folder.write_atomic(path, "old\n")

    def torn(f):
        f.write(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        folder.write_atomic(path, torn)
    assert path.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left behind
    folder.write_atomic(path, b"new bytes", durable=True)
    assert path.read_bytes() == b"new bytes"
    folder.write_atomic(path, lambda f: np.save(f, np.arange(3)))
    assert np.array_equal(np.load(path), np.arange(3))


def test_summaries_and_logs_are_strict_json(tmp_path):
    folder.write_json(tmp_path / folder.SUMMARY, {"final": {"nll": float("inf"), "accuracy": 0.5}})
    back = loads_strict((tmp_path / folder.SUMMARY).read_text())
    assert back["final"] == {"nll": None, "accuracy": 0.5} and back["nonfinite"] == ["final.nll"]
    assert folder.read_summary(tmp_path)["final"]["accuracy"] == 0.5
    folder.append_jsonl(tmp_path / folder.RESUME_CHANGES, {"round": 2, "changed": {"rounds": [2, 4]}})
    folder.append_jsonl(tmp_path / folder.RESUME_CHANGES, {"round": 4, "changed": {}})
    assert [loads_strict(line)["round"] for line in (tmp_path / folder.RESUME_CHANGES).read_text().splitlines()] == [2, 4]
    with pytest.raises(ValueError):
        folder.append_jsonl(tmp_path / "x.jsonl", {"nll": float("nan")})
