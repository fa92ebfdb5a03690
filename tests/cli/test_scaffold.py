"""``fedbayes new`` (fedbayes.cli.scaffold): the project it writes runs as written, and it never
overwrites."""

from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.runs.compare import load_comparison

runner = CliRunner()


def test_a_new_project_runs_and_its_comparison_validates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["new", "proj"])
    assert res.exit_code == 0, res.output
    assert {p.relative_to(tmp_path / "proj").as_posix() for p in (tmp_path / "proj").rglob("*") if p.is_file()} == {
        "config.toml", "compare.toml", "model.py", "README.md", "data/clients.csv",
    }  # fmt: skip
    res = runner.invoke(app, ["run", "proj/config.toml", "--set", "rounds=3"])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "runs" / "proj" / "summary.json").is_file()
    runs = load_comparison([tmp_path / "proj" / "compare.toml"], [])
    assert list(runs) == ["fedavg", "fedlap_cov", "fedep"] and all(c.model.module == "proj/model.py:Net" for c in runs.values())


def test_new_never_overwrites(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    res = runner.invoke(app, ["new", str(tmp_path / "taken")])
    assert res.exit_code == 2 and "never overwrites" in res.output
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
