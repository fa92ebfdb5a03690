"""The main job's committed table is what the code prints: the short version of the job, rerun,
gives the committed fmnist_compare_check.md (written with fmnist_compare.md by `make results`)."""

from __future__ import annotations

import importlib.metadata
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
TOLERANCE = 2e-3  # printed to 4 decimals; about 1e-7 between device layouts on one CPU (docs/design.md)
# On another CPU type XLA:CPU rounds differently and six rounds of training carry it (up to 0.01 in
# an NLL; docs/results/fmnist_compare.md, "Across CPU types"): the short job's table on a second CPU
# type, used while it pairs with CHECK's commit.
OTHER_CPU = ROOT / "docs/results/fmnist_compare_check_zen4.md"
CONSTRAINTS = ROOT / "constraints.txt"


def _pins() -> dict[str, str]:
    """constraints.txt: package -> pinned version."""
    lines = [line.split("#")[0].strip() for line in CONSTRAINTS.read_text().splitlines()]
    return dict(line.split("==") for line in lines if line)


def _made_with(markdown: str) -> dict[str, str]:
    """The versions the provenance line names: "with jax 0.10.2, numpy 2.4.6 (constraints.txt)"."""
    listed = re.search(r"^> Provenance: .*?, with (.*?) \(constraints\.txt\)", markdown, re.M).group(1)
    return dict(item.split(" ") for item in listed.split(", "))


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
    if OTHER_CPU.is_file():  # the second CPU type's table: the same methods and versions, and the command as CHECK's
        other = OTHER_CPU.read_text()
        assert list(_table(other)) == variants
        assert _made_with(other) == _made_with(check)
        command = re.compile(r"^Command: .*$", re.M)
        assert command.search(other).group(0) == command.search(check).group(0)
    provenance = re.compile(r"^> Provenance: .*$", re.M)
    assert provenance.search(check).group(0) == provenance.search(page).group(0), "regenerate both with `make results`"
    assert "uncommitted changes" not in provenance.search(page).group(0)
    made_with, pins = _made_with(check), _pins()
    assert {"jax", "jaxlib", "numpy", "flax", "optax"} <= set(made_with)
    differ = {name: (version, pins.get(name)) for name, version in made_with.items() if pins.get(name) != version}
    assert not differ, f"made with versions that constraints.txt does not pin (made with, pinned): {differ}; `make env` then `make results`"


def test_the_pins_are_exact_releases_inside_the_packages_ranges():
    """Every pin of constraints.txt is one release, and one that pyproject.toml's range for that
    package allows (else `make env` cannot resolve); the packages the job computes with are pinned."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = _pins()
    assert {"jax", "jaxlib", "numpy", "flax", "optax"} <= set(pins)
    for name, version in pins.items():
        assert re.fullmatch(r"\d+(\.\d+)*", version), f"{name}=={version}: pin an exact release"
    ranged = [Requirement(spec) for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]]
    checked = [r.name for r in ranged if r.name in pins]
    assert {"jax", "numpy", "flax", "optax"} <= set(checked)
    for requirement in ranged:
        if requirement.name in pins:
            assert requirement.specifier.contains(pins[requirement.name]), (
                f"constraints.txt pins {requirement.name}=={pins[requirement.name]}, outside pyproject's {requirement}"
            )


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
    made_with = _made_with(check)
    installed = {name: importlib.metadata.version(name) for name in made_with}
    versions = "" if installed == made_with else f" (this environment has {installed}, the table was made with {made_with}: install with `-c constraints.txt`)"
    rerun = _table((tmp_path / "short" / "compare.md").read_text())
    references = {CHECK.name: _table(check)}
    if OTHER_CPU.is_file() and _pairs_with(OTHER_CPU.read_text(), check):
        references[OTHER_CPU.name] = _table(OTHER_CPU.read_text())
    failures = {name: _differences(committed, rerun) for name, committed in references.items()}
    assert any(not found for found in failures.values()), (
        "; ".join(f"against {name}: {'; '.join(found)}" for name, found in failures.items()) + f"; regenerate with `make results`{versions}"
    )


def _pairs_with(other: str, check: str) -> bool:
    """Whether the second CPU type's table names the committed check table's commit."""
    commit = re.search(r"^> Provenance: measured on .*? at commit (\w+)", check, re.M).group(1)
    return re.search(rf"^> Provenance: .*Pairs with: fmnist_compare_check\.md at commit {commit}\.", other, re.M) is not None


def _differences(committed: dict, rerun: dict) -> list[str]:
    """The cells of ``rerun`` that are not ``committed``'s (numbers: within TOLERANCE)."""
    if list(rerun) != list(committed):
        return [f"methods {list(rerun)} now, {list(committed)} committed"]
    found = []
    for method, row in committed.items():
        for column, cell in row.items():
            if column in NOT_COMPARED:
                continue
            now, then = rerun[method][column], _number(cell)
            same = now == cell if then is None or _number(now) is None else abs(_number(now) - then) <= TOLERANCE
            if not same:
                found.append(f"{method} {column}: {now} now, {cell} committed")
    return found
