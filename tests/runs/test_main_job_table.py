"""The main job's committed table is what the code prints: the short version of the job, rerun,
gives the committed fmnist_compare_check.md (written with fmnist_compare.md by `make results`)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedbayes.config.schema import read_toml

ROOT = Path(__file__).resolve().parents[2]
PAGE, CHECK = ROOT / "docs/results/fmnist_compare.md", ROOT / "docs/results/fmnist_compare_check.md"
NOT_COMPARED = ("train s (total)",)  # the machine's speed and load
TOLERANCE = 2e-3  # printed to 4 decimals; about 1e-7 between device layouts and CPUs (docs/design.md)


def _table(markdown: str) -> dict[str, dict[str, str]]:
    """The first Markdown table: method -> column -> cell."""
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(header) or set(cells[0]) <= {"-"}:
            break
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def test_the_committed_tables_are_one_regeneration_of_the_main_job():
    page, check = PAGE.read_text(), CHECK.read_text()
    variants = list(read_toml(ROOT / "examples" / "fmnist_compare.toml")["variants"])
    assert list(_table(page[page.index("<!-- generated:begin -->") :])) == variants
    assert list(_table(check)) == variants
    provenance = re.compile(r"^> Provenance: .*$", re.M)
    assert provenance.search(check).group(0) == provenance.search(page).group(0), "regenerate both with `make results`"
    assert "uncommitted changes" not in provenance.search(page).group(0)


@pytest.mark.slow
def test_a_rerun_of_the_short_job_prints_the_committed_table(tmp_path):
    from fedbayes.data import dataset_status

    if not dict((n, p) for n, p, _ in dataset_status())["fashion_mnist"]:
        pytest.skip("Fashion-MNIST is not on this machine (Debian's dataset-fashion-mnist); the main job runs on it")
    check = CHECK.read_text()
    command = shlex.split(re.search(r"^Command: `\.venv/bin/fedbayes (.*)`$", check, re.M).group(1))
    out = command.index("--out")
    command[out + 1] = str(tmp_path / "short")
    # As `make results` ran it: a process of its own with the CLI's compiler settings (the tests'
    # XLA_FLAGS lower the optimisation level, which changes the last digits of what XLA computes).
    env = {**os.environ, "XLA_FLAGS": "", "COLUMNS": "200", "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "fedbayes.cli", *command], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    committed, rerun = _table(check), _table((tmp_path / "short" / "compare.md").read_text())
    assert list(rerun) == list(committed)
    for method, row in committed.items():
        for column, cell in row.items():
            if column in NOT_COMPARED:
                continue
            now, then = rerun[method][column], _number(cell)
            if then is None or _number(now) is None:
                assert now == cell, f"{method} {column}: {now} now, {cell} committed; regenerate with `make results`"
            else:
                assert abs(_number(now) - then) <= TOLERANCE, f"{method} {column}: {now} now, {cell} committed; regenerate with `make results`"
