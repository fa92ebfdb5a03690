"""The README's Python snippets run as written; the docs point only at files the project has."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _snippets():
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(_snippets()) == 3


@pytest.mark.slow
def test_every_readme_snippet_runs_verbatim(tmp_path, monkeypatch, capsys):
    """In order and in one namespace, as a reader pastes them, from a folder holding examples/."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, code in enumerate(_snippets()):
        exec(compile(code, f"README.md python snippet {i + 1}", "exec"), namespace)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("{", "fedprox "))]
    fedavg, fedep, loaded = printed  # the snippets' own prints (run_experiment also reports progress)
    assert eval(fedavg)["accuracy"] > 0.8  # FedAvgM on digits after 20 rounds
    assert eval(fedep)["accuracy"] > 0.8
    assert loaded.startswith("fedprox ")
    mean, variance = namespace["mean"], namespace["variance"]
    assert all(bool((v > 0).all()) for v in jax.tree.leaves(variance))
    assert jax.tree.structure(mean) == jax.tree.structure(namespace["sim"].server_params(namespace["state"]))


def test_no_file_points_outside_the_project():
    """No links to the shared folder, paper or spec numbers, or issue numbers (scripts/decite.py --check);
    every "docs/algorithms.md §N" names a section that exists."""
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "decite.py"), "--check"], cwd=ROOT, capture_output=True, text=True)
    left = [line for line in res.stdout.splitlines() if not line.startswith(("src/fedbayes/bench", "tests/bench/test_bench"))]
    assert not left, "\n".join(left[:20])
    headings = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", (ROOT / "docs" / "algorithms.md").read_text(), flags=re.M))
    cited = set()
    for path in ROOT.rglob("*"):
        if path.is_file() and path.suffix in (".py", ".md", ".toml") and not {".git", ".venv", "runs"} & set(path.parts):
            cited |= set(re.findall(r"docs/algorithms\.md §(\d+(?:\.\d+)?)", path.read_text(errors="ignore")))
    assert cited and cited <= headings, sorted(cited - headings)


def _cli_lines():
    """The README's `fedbayes` commands, in order, as argument lists (continuation lines joined)."""
    import shlex

    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    lines = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith(".venv/bin/fedbayes "):
                lines.append(shlex.split(line.split(">")[0])[1:])
    return lines


def test_readme_commands_parse_and_run_in_the_state_earlier_ones_leave():
    """Every option exists; a file named exists or an earlier command writes it; `resume DIR` and
    `--resume` follow a command that wrote DIR; a resumed comparison that changes a variant names it
    with --rerun (else it refuses the finished run of the old config)."""
    import typer

    from fedbayes.cli import app
    from fedbayes.config.schema import read_toml

    group = typer.main.get_command(app)  # typer's commands (on a click of its own since typer 0.2x: no `import click`)
    assert "compare examples/fmnist_compare.toml --out runs/demo --resume" in (ROOT / "scripts" / "demo").read_text()
    written: set[str] = {"runs/demo"}  # `make demo`, the README's first command
    lines = _cli_lines()
    assert len(lines) >= 15
    for args in lines:
        name, rest = args[0], args[1:]
        command = group.get_command(group.context_class(group), name)
        assert command is not None, args
        if hasattr(command, "list_commands"):  # a group
            command = command.get_command(command.context_class(command), rest[0])
            rest = rest[1:]
        ctx = command.make_context(name, list(rest))  # unknown options or bad values raise here
        params = ctx.params
        out = params.get("out")
        if name == "resume":
            assert str(params["out"]) in written, f"{args}: nothing earlier writes {params['out']}"
            continue
        for path in [p for p in (params.get("config"), *(params.get("configs") or ())) if p is not None]:
            assert (ROOT / path).is_file(), args
        if params.get("resume"):
            assert str(out) in written, f"{args}: nothing earlier writes {out}"
            changed = {s.split(".")[0] for s in params.get("set_") or () if s.count(".") >= 2}
            assert changed <= set(params.get("rerun") or ()), f"{args}: a changed variant needs --rerun"
        if name in ("run", "compare", "sweep"):
            default = f"runs/{read_toml(ROOT / params['config'])['name']}" if name == "run" and out is None else None
            written.add(str(out) if out is not None else default)


# Commands that read and write no run folder, so no earlier command's state: bench (minutes of
# timing; tests/bench runs each of its paths on small sizes) and toy (tests/toys).
SKIPPED = ("bench", "toy")


def _small_examples(folder: Path) -> None:
    """examples/ as the README's commands read it, shrunk: 3 rounds, burn-in 1, Fashion-MNIST
    replaced by digits (as `make demo` does without it), so every command runs in seconds."""
    folder.mkdir()
    for path in (ROOT / "examples").iterdir():
        if path.suffix != ".toml":
            (folder / path.name).symlink_to(path)
            continue
        text = re.sub(r"(?m)^rounds = \d+", "rounds = 3", path.read_text())
        text = re.sub(r"burn_in_rounds = \d+", "burn_in_rounds = 1", text)
        text = re.sub(r'dataset = "fashion_mnist"(\s+)fraction = [0-9.]+', r'dataset = "digits"\1fraction = 1.0', text, count=1)
        (folder / path.name).write_text(text)


@pytest.mark.slow
def test_readme_commands_run_in_the_order_written(tmp_path, monkeypatch):
    """`make demo`'s comparison, then every README `fedbayes` command but SKIPPED's, executed
    in the README's order in one folder, so each meets the state the earlier ones leave (resumes of finished runs and
    comparisons, a --rerun after a changed variant, --overwrite of a finished run): each exits 0.
    The examples are shrunk (:func:`_small_examples`); the commands are run as written."""
    from typer.testing import CliRunner

    from fedbayes.cli import app

    _small_examples(tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("fedbayes.data.shift.SHIFTS", ("rotation",))  # --shift: one kind of shift instead of four
    runner = CliRunner()
    ran = []
    make_demo = ["compare", "examples/fmnist_compare.toml", "--out", "runs/demo", "--resume"]  # scripts/demo, the README's first command
    for args in [make_demo, *_cli_lines(), make_demo]:  # and `make demo` again, after the README's --set
        if args[0] in SKIPPED:
            continue
        res = runner.invoke(app, args, env={"COLUMNS": "100", "FEDBAYES_NO_SYSTEM_DATA": "1"})
        assert res.exit_code == 0, f"fedbayes {' '.join(args)} (after {len(ran)} commands): exit {res.exit_code}\n{res.output[-3000:]}"
        ran.append(args[0])
    assert ran.count("resume") == 2 and ran.count("compare") >= 6 and ran.count("sweep") == 2
    assert (tmp_path / "runs/demo/compare.md").is_file() and (tmp_path / "runs/digits_sweep").is_dir()
    # the last `make demo` kept FedProx's --set from the README and marked it
    assert "fedprox: runs with its earlier --set algorithm.mu=0.1" in res.output
    assert "fedprox*" in res.output and "fedprox*" in (tmp_path / "runs/demo/compare.md").read_text()
