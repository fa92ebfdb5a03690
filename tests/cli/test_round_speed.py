"""scripts/round_speed.py: rounds per second of a comparison's methods, from their metrics.jsonl."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "round_speed.py"


def _compare_folder(root: Path, methods: dict[str, list[float]]) -> Path:
    """A comparison folder whose methods took the given seconds per round (cumulative in the file)."""
    root.mkdir()
    (root / "compare.json").write_text(json.dumps({m: {} for m in methods}))
    for m, per_round in methods.items():
        (root / m).mkdir()
        total, lines = 0.0, [json.dumps({"round": 0, "accuracy": 0.1, "nll": 2.3, "ece": 0.05, "seconds": 0.0})]
        for r, s in enumerate(per_round, start=1):
            total += s
            lines.append(json.dumps({"round": r, "accuracy": 0.5 + r / 100, "nll": 1.0 / r, "ece": 0.02, "seconds": round(total, 3)}))
        (root / m / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_rounds_per_second_median_and_ratio(tmp_path):
    slow = _compare_folder(tmp_path / "cpu", {"fedavg": [0.2, 0.1, 0.1, 0.3], "pvi": [0.5, 0.5, 0.5, 0.5]})
    fast = _compare_folder(tmp_path / "gpu", {"fedavg": [0.02, 0.01, 0.01, 0.01], "pvi": [0.1, 0.1, 0.1, 0.1]})
    res = _run(f"cpu={slow}", f"gpu={fast}")
    assert res.returncode == 0, res.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in res.stdout.splitlines()[2:]}
    fedavg, pvi = rows["fedavg"], rows["pvi"]
    # cpu: 4 rounds in 0.7 s, median round 0.15 s, range 0.1-0.3; final accuracy 0.54, NLL 0.25
    assert fedavg[1:8] == ["4", "0.5400", "0.2500", "2.00", "0.70", "150.0 ms (100.0-300.0)", "5.7"]
    # gpu: 4 rounds in 0.05 s: 80 rounds a second, 14x the cpu's
    assert fedavg[8:15] == ["4", "0.5400", "0.2500", "2.00", "0.05", "10.0 ms (10.0-20.0)", "80.0"]
    assert fedavg[15].strip(" |") == "14.00x"
    assert pvi[7] == "2.0" and pvi[14] == "10.0" and pvi[15].strip(" |") == "5.00x"


def test_an_unfinished_comparison_gives_the_rounds_it_reached(tmp_path):
    """Without compare.json, every run folder up to its last whole line."""
    folder = _compare_folder(tmp_path / "gpu", {"fedavg": [0.1, 0.1], "vbnn": [0.2]})
    (folder / "compare.json").unlink()
    with open(folder / "fedavg" / "metrics.jsonl", "a") as f:
        f.write('{"round": 3, "accuracy": 0.5')  # the line a kill tore: not a round
    res = _run(f"gpu={folder}")
    assert res.returncode == 0, res.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in res.stdout.splitlines()[2:]}
    assert rows["fedavg"][1] == "2" and rows["vbnn"][1] == "1" and rows["vbnn"][7].strip(" |") == "5.0"


def test_refuses_a_folder_that_is_not_a_comparison(tmp_path):
    res = _run(f"gpu={tmp_path}")
    assert res.returncode == 1 and "neither a compare.json" in res.stderr
    assert _run(str(tmp_path)).returncode == 2


def test_rounds_between_evaluations_and_seed_folders(tmp_path):
    """Evaluated every 2nd round: a round's time is the seconds between evaluations over 2; a
    comparison over seeds gives a row per seed."""
    root = tmp_path / "cmp"
    root.mkdir()
    (root / "compare.json").write_text(json.dumps({"fedavg": {}}))
    for seed, step in ((0, 0.1), (1, 0.3)):
        run = root / "fedavg" / f"seed_{seed}"
        run.mkdir(parents=True)
        lines = [{"round": 0, "accuracy": 0.1, "nll": 2.3, "ece": 0.0, "seconds": 0.0}]
        lines += [{"round": r, "accuracy": 0.5, "nll": 1.0, "ece": 0.01, "seconds": round(step * r, 3)} for r in (2, 4, 6)]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    res = _run(f"a={root}")
    assert res.returncode == 0, res.stderr
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in res.stdout.splitlines()[2:]}
    assert rows["fedavg/seed_0"][1] == "6" and rows["fedavg/seed_0"][6] == "100.0 ms (100.0-100.0)" and rows["fedavg/seed_0"][7].strip(" |") == "10.0"
    assert rows["fedavg/seed_1"][6] == "300.0 ms (300.0-300.0)"
