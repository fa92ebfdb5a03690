"""benchmarks/peers/run.py: the table and the ratios from known per-process results, and the one
line (exit 0) when a peer's interpreter is missing."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "peers" / "run.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers_run", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record(workload, framework, key, repeat, round_s, examples=6000, accuracy=0.8):
    result = {"round_s": round_s, "examples": [examples] * len(round_s), "first_round_s": 9.0, "accuracy": accuracy, "rounds": len(round_s) + 1}
    return {"workload": workload, "framework": framework, "config": f"{framework} {key}", "key": key, "repeat": repeat, "result": result}


def test_throughput_is_the_steady_rounds_examples_over_their_time(peers):
    assert peers.throughput(record("fedavg", "pfl", "a", 0, [0.1, 0.2, 0.3])["result"]) == pytest.approx(18000 / 0.6)


def test_rows_and_ratios_to_each_peers_best_configuration_paired_by_repeat(peers):
    records = []
    for repeat, (ours, slow, fast, flower) in enumerate([(0.1, 0.6, 0.2, 0.3), (0.2, 0.6, 0.25, 0.3), (0.15, 0.6, 0.5, 0.3)]):
        records += [
            record("fedavg", "fedbayes", "fb", repeat, [ours, ours]),
            record("fedavg", "pfl", "slow", repeat, [slow, slow]),
            record("fedavg", "pfl", "fast", repeat, [fast, fast]),
            record("fedavg", "flower", "c1", repeat, [flower, flower], accuracy=0.7),
        ]
    rows = peers.summarize(records)
    assert [(r["framework"], r["key"]) for r in rows] == [("fedbayes", "fb"), ("pfl", "slow"), ("pfl", "fast"), ("flower", "c1")]
    fb = rows[0]
    assert fb["examples_per_s"] == pytest.approx({"median": 40000.0, "min": 30000.0, "max": 60000.0})
    assert fb["round_s"] == pytest.approx(0.15) and fb["repeats"] == 3 and fb["rounds"] == 3
    assert rows[3]["accuracy"] == pytest.approx(0.7)
    q = {r["peer"]: r for r in peers.ratios(rows)}
    # pfl's best is "fast" (median 24,000/s); per repeat: 0.2/0.1, 0.25/0.2, 0.5/0.15
    assert q["pfl"]["best"] == "pfl fast"
    assert (q["pfl"]["median"], q["pfl"]["min"], q["pfl"]["max"]) == pytest.approx((2.0, 1.25, 0.5 / 0.15))
    assert q["pfl"]["of_medians"] == pytest.approx(40000 / 24000)
    assert (q["flower"]["median"], q["flower"]["min"], q["flower"]["max"]) == pytest.approx((2.0, 1.5, 3.0))
    table = peers.markdown(rows, peers.ratios(rows))
    assert "| fedbayes | fedbayes fb | 10 of 10 IID clients | 40,000 [30,000, 60,000] | 0.150 | 0.8000 (N = 3) |" in table
    assert "| 10 of 10 IID clients | fedbayes / pfl | pfl fast | 2.00 [1.25, 3.33] | 1.67 |" in table


def test_a_workload_without_a_peer_gets_no_ratio_for_it(peers):
    rows = peers.summarize([record("fedavg_100", "fedbayes", "fb", 0, [0.1]), record("fedavg_100", "pfl", "t1", 0, [0.2])])
    assert [r["peer"] for r in peers.ratios(rows)] == ["pfl"]


def test_a_missing_peer_interpreter_is_one_line_and_exit_0(tmp_path):
    broken = tmp_path / "python"  # an interpreter that imports nothing
    broken.write_text("#!/bin/sh\nexit 1\n")
    broken.chmod(0o755)
    argv = [sys.executable, str(SCRIPT), "--pfl-python", str(broken), "--flower-python", str(tmp_path / "nowhere" / "python")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("peers: no usable interpreter for pfl") and "flower" in lines[0], res.stdout
