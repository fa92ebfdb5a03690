"""Signals at any moment: Ctrl-C (SIGINT) and SIGTERM during start-up (imports), the run and its
shutdown, once or twice in quick succession, end the command with one line, no traceback, and
exit 130 (or 0 when the run had already finished); the line says how to resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import DIGITS_RUN

ROOT = Path(__file__).resolve().parents[2]


def _start(tmp_path: Path, out: Path, rounds: int) -> subprocess.Popen:
    cfg = tmp_path / "c.toml"
    cfg.write_text(DIGITS_RUN.format(rounds=rounds, top="", algorithm="fedavg", extra=""))
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", "run", str(cfg), "--out", str(out), "--overwrite"],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists() and proc.poll() is None:
        time.sleep(0.02)


def _wait_for_handler(proc: subprocess.Popen, sig: int, timeout: float = 60) -> None:
    """Until the child catches ``sig`` (its bit in ``SigCgt`` of ``/proc/PID/status``): the CLI
    installs its handlers before its first imports, but a loaded machine can take longer than the
    first delay to start the interpreter, and a signal before then is the default action's (exit
    -15 for SIGTERM), which no program can handle. Without ``/proc``: returns at once."""
    status = Path(f"/proc/{proc.pid}/status")
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and status.exists():
        caught = next((line.split()[1] for line in status.read_text().splitlines() if line.startswith("SigCgt:")), "0")
        if int(caught, 16) >> (int(sig) - 1) & 1:
            return
        time.sleep(0.005)


def _check(proc: subprocess.Popen, out: Path, finished_ok: bool = False) -> str:
    _, err = proc.communicate(timeout=120)
    lines = [x for x in err.splitlines() if x.strip() and not x.startswith(("round ", "[", "warning:"))]
    assert "Traceback" not in err and "Exception ignored" not in err, err
    if finished_ok and proc.returncode == 0:
        return ""
    assert proc.returncode == 130, (proc.returncode, err)
    assert len(lines) == 1 and lines[0].startswith("interrupted"), err
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_start_up_is_one_line_and_exit_130(tmp_path, sig):
    """From the first imports (the handlers go in before them) to the first round: each delay
    counts from the moment the child catches the signal."""
    for i, delay in enumerate((0.15, 0.4, 0.8, 1.5)):
        proc = _start(tmp_path, tmp_path / f"o{i}", rounds=400)
        _wait_for_handler(proc, sig)
        time.sleep(delay)
        proc.send_signal(sig)
        _check(proc, tmp_path / f"o{i}")


@pytest.mark.slow
def test_a_signal_during_the_run_names_the_resume_and_a_second_one_is_ignored(tmp_path):
    out = tmp_path / "o"
    proc = _start(tmp_path, out, rounds=400)
    _wait_for(out / "checkpoints" / "round_000002.npz", proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    proc.send_signal(signal.SIGINT)  # during the clean-up of the first
    line = _check(proc, out)
    assert f"fedbayes resume {out}" in line and "round_" in line


@pytest.mark.slow
def test_a_signal_as_the_run_ends_exits_130_or_0_never_a_traceback(tmp_path):
    for i, wait_for in enumerate(("summary.json", "curves.png")):
        out = tmp_path / f"o{i}"
        proc = _start(tmp_path, out, rounds=2)
        _wait_for(out / wait_for, proc)
        proc.send_signal(signal.SIGINT)
        _check(proc, out, finished_ok=True)


def test_an_interrupted_plain_comparison_names_the_comparison_and_its_resume_finishes_it(tmp_path, monkeypatch):
    """No seeds: the line says `fedbayes resume OUT` (not the variant's folder), and following it
    runs the variant never started and writes compare.json."""
    from typer.testing import CliRunner

    import fedbayes.runs.loop as loop
    from fedbayes.cli import app

    runner = CliRunner()
    base = DIGITS_RUN.format(rounds=2, top="", algorithm="fedavg", extra="").split("[algorithm]")[0].replace('name = "rel"\n', "")
    for section in ("data", "model", "client", "server"):
        base = base.replace(f"[{section}]", f"[base.{section}]")
    comp = tmp_path / "comp.toml"
    comp.write_text("[base]\n" + base + '\n[variants.a.algorithm]\nname = "fedavg"\n[variants.b.algorithm]\nname = "fedprox"\n')
    out = tmp_path / "out"
    real = loop.run_experiment

    def second_interrupted(config, out_dir, **kw):
        if config.name == "b":
            raise KeyboardInterrupt
        return real(config, out_dir, **kw)

    monkeypatch.setattr(loop, "run_experiment", second_interrupted)
    res = runner.invoke(app, ["compare", str(comp), "--out", str(out)])
    assert res.exit_code == 130 and f"`fedbayes resume {out}` continues it" in res.stderr, res.output
    monkeypatch.setattr(loop, "run_experiment", real)
    res = runner.invoke(app, ["resume", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "b" / "summary.json").is_file() and (out / "compare.json").is_file()


def test_resume_of_a_deployed_run_goes_to_flower(tmp_path):
    """A run folder written by `fedbayes deploy` (it holds flower/) is resumed on Flower, not by the
    simulator (whose checkpoint layout differs); without Flower installed that is one line, exit 2."""
    pytest.importorskip("typer")
    try:
        import flwr  # noqa: F401

        pytest.skip("Flower is installed: tests/flower resumes a deployed run for real")
    except ImportError:
        pass
    from typer.testing import CliRunner

    from fedbayes.cli import app

    out = tmp_path / "o"
    (out / "flower").mkdir(parents=True)
    (out / "config.toml").write_text(DIGITS_RUN.format(rounds=2, top="", algorithm="fedavg", extra=""))
    res = CliRunner().invoke(app, ["resume", str(out)])
    assert res.exit_code == 2 and res.stderr.strip().startswith("error: fedbayes deploy needs Flower"), res.output


def test_an_interrupt_that_python_could_only_drop_is_delivered_again():
    """Raised where C code runs Python code (the unraisable hook's case), the interrupt is not
    printed and lost: the signal is re-armed DEFER_S later, and the alarm delivers it. Other
    unraisable exceptions, and an interrupt once the command's line is out, go to the previous
    hook. In a process of its own: the handlers and the hook are the process's."""
    code = """if True:
        import json, signal, sys, types
        from fedbayes.cli import interrupts

        previous, timers = [], []
        sys.unraisablehook = previous.append
        signal.setitimer = lambda which, seconds: timers.append([which, seconds])
        interrupts.install()
        out = {}
        try:
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            out["first"] = interrupts.stopping()
        sys.unraisablehook(types.SimpleNamespace(exc_value=KeyboardInterrupt(), object="Path"))  # dropped by Python
        out["rearmed"] = [interrupts.stopping(), timers == [[signal.ITIMER_REAL, interrupts.DEFER_S]], len(previous)]
        try:
            signal.raise_signal(signal.SIGALRM)  # the timer's alarm
        except KeyboardInterrupt:
            out["again"] = interrupts.stopping()
        other = types.SimpleNamespace(exc_value=ValueError("x"), object="Path")
        sys.unraisablehook(other)
        out["other"] = [previous == [other], len(timers)]
        interrupts.say_line("interrupted")  # the line is out: the command is ending anyway
        late = types.SimpleNamespace(exc_value=KeyboardInterrupt(), object="Path")
        sys.unraisablehook(late)
        out["late"] = [previous == [other, late], len(timers)]
        print(json.dumps(out))
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"first": True, "rearmed": [False, True, 0], "again": True, "other": [True, 1], "late": [True, 1]}
