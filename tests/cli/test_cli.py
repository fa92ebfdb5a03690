"""The command line: run, compare, resume, datasets; exit code 2 on bad configs before any work."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedbayes.cli import app
from fedbayes.runs.folder import read_metrics

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()

DIGITS = """
name = "digits_test"
rounds = {rounds}
checkpoint_every = {ckpt}
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
[algorithm]
name = "{algorithm}"
{extra}
"""


def write(tmp_path, rounds=4, ckpt=2, algorithm="fedavg", extra=""):
    p = tmp_path / "c.toml"
    p.write_text(DIGITS.format(rounds=rounds, ckpt=ckpt, algorithm=algorithm, extra=extra))
    return p


@pytest.mark.parametrize(
    "override,needle",
    [
        ("server.clients_per_round=50", "server.clients_per_round: must be <= data.num_clients (6); got 50"),
        ("client.lr=0", "client.lr: Input should be greater than 0"),
        ("data.alpha=-1", "data.alpha: Input should be greater than 0"),
        ("data.bogus=1", "data.bogus: unknown key"),
        ("rounds=abc", "rounds: Input should be a valid integer"),
    ],
)
def test_bad_config_exits_2_with_one_line_before_any_work(tmp_path, override, needle):
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(write(tmp_path)), "--out", str(out), "--set", override])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.output
    assert not out.exists()  # nothing was started


def test_run_writes_every_output(tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["run", str(write(tmp_path)), "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("metrics.jsonl", "summary.json", "config.toml", "curves.png"):
        assert (out / name).is_file(), name
    recs = read_metrics(out / "metrics.jsonl")
    assert [r["round"] for r in recs] == [0, 1, 2, 3, 4]
    for key in ("accuracy", "nll", "ece", "seconds", "bytes_up", "bytes_down"):
        assert key in recs[-1]
    assert "loss" not in recs[-1]  # it was the NLL again
    assert recs[-1]["accuracy"] > recs[0]["accuracy"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["round_000002.npz", "round_000004.npz"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final"]["accuracy"] == recs[-1]["accuracy"]
    # the resolved config runs as it is
    assert runner.invoke(app, ["run", str(out / "config.toml"), "--out", str(tmp_path / "again")]).exit_code == 0
    assert read_metrics(tmp_path / "again" / "metrics.jsonl")[-1]["accuracy"] == recs[-1]["accuracy"]


def test_compare_prints_one_table_and_one_plot(tmp_path):
    base = DIGITS.format(rounds=2, ckpt=0, algorithm="fedavg", extra="").replace("[", "[base.").replace('name = "digits_test"', "")
    spec = (
        "[base]\nrounds = 2\n"
        + base.replace("rounds = 2\n", "")
        + """
[variants.fedavg]
[variants.fedavgm]
server = { optimizer = "momentum", lr = 1.0 }
[variants.fedprox]
algorithm = { name = "fedprox", mu = 0.1 }
[reference]
source = "a paper, Table 9"
values = { fedavg = 50.0, fedprox = "60.5(1.5)" }
"""
    )
    p = tmp_path / "cmp.toml"
    p.write_text(spec)
    out = tmp_path / "cmp"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out)])
    assert res.exit_code == 0, res.output
    for name in ("fedavg", "fedavgm", "fedprox"):
        assert name in res.output and (out / name / "metrics.jsonl").is_file()
    assert (out / "compare.png").is_file() and (out / "compare.md").is_file()
    table = json.loads((out / "compare.json").read_text())
    assert table["fedavgm"]["server_optimizer"] == "momentum" and table["fedprox"]["algorithm"] == "fedprox"
    # the paper's numbers beside ours: mean accuracy over rounds R-2..R (here rounds 1-2) in percent
    md = (out / "compare.md").read_text()
    assert "a paper, Table 9" in res.output and "Beside the paper** (a paper, Table 9)" in md
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in md.split("Beside the paper")[1].splitlines()
        if line.startswith("| fed")
    }
    acc = [r["accuracy"] for r in read_metrics(out / "fedavg" / "metrics.jsonl") if r["round"] >= 1]
    assert rows["fedavg"][0] == f"{100 * sum(acc) / len(acc):.2f}" and rows["fedavg"][1] == "50.0"
    assert rows["fedavg"][2] == f"{100 * sum(acc) / len(acc) - 50.0:+.2f}"
    assert rows["fedprox"][1] == "60.5(1.5)" and rows["fedavgm"][1:] == ["—", "—"]
    # a name in the reference that is no variant: one line naming the field and the variants
    p.write_text(spec.replace("fedprox = ", "fedlap = "))
    res = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "o2")])
    assert res.exit_code == 2 and "reference.values: unknown variant(s) ['fedlap']; allowed: fedavg, fedavgm, fedprox" in res.output


def test_compare_rejects_bad_variant(tmp_path):
    p = tmp_path / "cmp.toml"
    p.write_text('[base]\nrounds = 2\n[base.data]\ndataset = "digits"\n[variants.x]\nserver = { lr = -1 }\n')
    res = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "server.lr" in res.output and "variant 'x'" in res.output


def test_datasets_lists_presence():
    res = runner.invoke(app, ["datasets"])
    assert res.exit_code == 0
    assert "digits" in res.output and "fashion_mnist" in res.output


def test_datasets_fits_80_columns_and_names_each_datasets_own_archive():
    """Each hint whole (a URL on a line of its own, never cut) within 80 columns, and the TFF
    archive of that dataset: not EMNIST's for CIFAR-100 or StackOverflow. The data folder has a
    short name: its paths are printed whole (pytest's own tmp_path can pass 80 columns by itself)."""
    import shutil
    import tempfile

    data = tempfile.mkdtemp(prefix="fb")
    try:
        res = runner.invoke(app, ["datasets"], env={"COLUMNS": "80", "FEDBAYES_DATA": data, "FEDBAYES_NO_SYSTEM_DATA": "1"})
    finally:
        shutil.rmtree(data, ignore_errors=True)
    assert res.exit_code == 0, res.output
    assert all(len(line) <= 80 for line in res.output.splitlines()), max(res.output.splitlines(), key=len)
    blocks = re.split(r"\n(?=\S)", res.output)
    hint = {block.split()[0]: " ".join(block.split()) for block in blocks if block.strip()}
    url = "https://storage.googleapis.com/tff-datasets-public/"
    assert f"{url}fed_emnist.tar.bz2 " in hint["emnist"]
    assert f"{url}fed_cifar100.tar.bz2 " in hint["fed_cifar100"]
    assert f"{url}stackoverflow.tar.bz2 " in hint["stackoverflow_nwp"] and f"{url}stackoverflow.tar.bz2 " in hint["stackoverflow_lr"]
    assert "https://www.cs.toronto.edu/~kriz/cifar.html " in hint["cifar10"]


def _cli(args, env_extra=None, cache="off", die_after=None):
    """The CLI in its own process; ``die_after=R`` kills it abruptly after round R (tests/killed_run.py)."""
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"], JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(cache), **(env_extra or {}))
    entry = ["-m", "fedbayes.cli"] if die_after is None else [str(Path(__file__).resolve().parents[1] / "killed_run.py"), str(die_after)]
    return subprocess.run([sys.executable, *entry, *args], capture_output=True, text=True, env=env, cwd=ROOT)


def _strip(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.mark.slow
def test_killed_run_resumes_to_the_same_metrics(tmp_path):
    """A process killed between checkpoints and resumed ends exactly as an uninterrupted run.

    FedEP (stateful sites) with partial participation exercises the client store, the switch
    from burn-in to EP (after round 2) and the marginalised metrics (their samples' key depends
    on the round only). The kill is abrupt (``os._exit`` after round 3, checkpoints every 2
    rounds), so the last checkpoint is at round 2 and round 3's metric line must be dropped and
    recomputed.
    """
    cfg = write(tmp_path, rounds=6, ckpt=2, algorithm="fedep", extra="burn_in_rounds = 2\nscale = 50.0\nweight_decay = 1e-3")
    full, broken = tmp_path / "full", tmp_path / "broken"
    cache = tmp_path / "xla-cache"  # the later processes reuse the first one's compiled programs
    r = _cli(["run", str(cfg), "--out", str(full)], cache=cache)
    assert r.returncode == 0, r.stderr
    assert any(cache.iterdir())  # the persistent compilation cache was written
    r = _cli(["run", str(cfg), "--out", str(broken)], cache=cache, die_after=3)
    assert r.returncode == 137
    assert [x["round"] for x in read_metrics(broken / "metrics.jsonl")] == [0, 1, 2, 3]
    assert not (broken / "summary.json").exists()
    r = _cli(["resume", str(broken)], cache=cache)
    assert r.returncode == 0, r.stderr
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(broken / "metrics.jsonl")
    assert _strip(a) == _strip(b)
    assert json.loads((full / "summary.json").read_text())["final"]["accuracy"] == json.loads((broken / "summary.json").read_text())["final"]["accuracy"]
    assert "accuracy_marg" in a[-1] and a[-1]["rejected"] == 0
    # the client store was restored too: final checkpoints agree array by array
    with np.load(full / "checkpoints" / "round_000006.npz") as fa, np.load(broken / "checkpoints" / "round_000006.npz") as fb:
        assert set(fa.files) == set(fb.files)
        for k in fa.files:
            if k not in ("meta", "checksum"):  # the metadata holds wall-clock seconds
                np.testing.assert_array_equal(fa[k], fb[k])


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    cfg = write(tmp_path, rounds=2, ckpt=1)
    out = tmp_path / "o"
    assert runner.invoke(app, ["run", str(cfg), "--out", str(out)]).exit_code == 0
    before = read_metrics(out / "metrics.jsonl")
    assert runner.invoke(app, ["resume", str(out)]).exit_code == 0
    assert read_metrics(out / "metrics.jsonl") == before


def test_resume_needs_a_run_folder(tmp_path):
    res = runner.invoke(app, ["resume", str(tmp_path)])
    assert res.exit_code == 2 and "config.toml" in res.output
    (tmp_path / ".fedbayes.lock").write_text("")  # a run killed before it wrote its config
    res = runner.invoke(app, ["resume", str(tmp_path)])
    assert res.exit_code == 2 and "holds nothing to resume" in res.output and "fedbayes run CONFIG --out" in res.output


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["model.name=cnn", "data.dataset=breast_cancer"], "model.name: 'cnn' needs image data"),
        (["data.num_clients=5000", "server.clients_per_round=4"], "data.partition (dirichlet, data.num_clients = 5000"),
    ],
)
def test_data_dependent_config_errors_exit_2_naming_the_field(tmp_path, overrides, needle):
    args = ["run", str(write(tmp_path)), "--out", str(tmp_path / "o")]
    for o in overrides:
        args += ["--set", o]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert needle in res.output and res.output.startswith("config error: ")
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_compare_checks_every_variant_before_training_any(tmp_path):
    p = tmp_path / "cmp.toml"
    p.write_text(
        '[base]\nrounds = 2\n[base.data]\ndataset = "digits"\nnum_clients = 5\n[base.server]\nclients_per_round = 5\n'
        '[variants.good]\n[variants.bad]\nmodel = { name = "cnn" }\ndata = { dataset = "breast_cancer" }\n'
    )
    out = tmp_path / "o"
    res = runner.invoke(app, ["compare", str(p), "--out", str(out)])
    assert res.exit_code == 2 and "variant 'bad'" in res.output and "model.name" in res.output
    assert not (out / "good").exists()  # nothing trained


def test_compilation_cache_folder_and_off_switch(tmp_path, monkeypatch):
    import jax

    from fedbayes.cli import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    try:
        monkeypatch.setenv("FEDBAYES_CACHE", "off")
        assert enable_compilation_cache() is None
        monkeypatch.setenv("FEDBAYES_CACHE", str(tmp_path / "c"))
        assert enable_compilation_cache() == str(tmp_path / "c") and (tmp_path / "c").is_dir()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "c")
        monkeypatch.delenv("FEDBAYES_CACHE")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
        assert enable_compilation_cache() == str(tmp_path / "xdg" / "fedbayes" / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


class _Shell:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_a_cifar_batch_that_runs_code_exits_3_naming_the_file_and_runs_nothing(tmp_path):
    import pickle

    from fedbayes.data import writers

    writers.write_cifar_python(tmp_path / "cf", np.random.default_rng(0), num_classes=10, num_train=50, num_test=10)
    batch = tmp_path / "cf" / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({b"data": _Shell(f"touch {tmp_path / 'PWNED'}"), b"labels": []}))
    config = write(tmp_path, rounds=1).read_text().replace('dataset = "digits"', f'dataset = "cifar10"\ndata_dir = "{tmp_path / "cf"}"')
    (tmp_path / "c.toml").write_text(config)
    res = runner.invoke(app, ["run", str(tmp_path / "c.toml"), "--out", str(tmp_path / "o")])
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 3 and len(lines) == 1, res.output
    assert str(batch) in lines[0] and "refused" in lines[0]
    assert not (tmp_path / "PWNED").exists()


def test_every_commands_help_shows_brackets_as_written():
    """Under the typer releases flwr pins (0.13-0.20), plain help escapes "[required]" and
    "[default: ...]" for rich (``\\[required]``); every command's help is a PlainHelpCommand's,
    which shows them as written. Through typer's public names only: since typer 0.2x its commands
    are built on a click of its own, not the click package (which it no longer installs)."""
    import copy

    import typer

    from fedbayes.cli.base import PlainHelpCommand

    def commands(group):
        for name in group.list_commands(group.context_class(group)):
            command = group.get_command(group.context_class(group), name)
            yield from commands(command) if hasattr(command, "list_commands") else [command]  # a group

    found = list(commands(typer.main.get_command(app)))
    assert len(found) > 8 and all(isinstance(c, PlainHelpCommand) for c in found)

    # one of fedbayes's own options (typer's class, whatever click it is built on), its help escaped
    # as such a typer gives it to click's formatter
    real = next(p for c in found for p in c.params if p.param_type_name == "option")

    class Escaped(type(real)):
        def get_help_record(self, ctx):
            return "--config", "the run's TOML  \\[required]"

    escaped = copy.copy(real)
    escaped.__class__ = Escaped
    command = PlainHelpCommand("deploy", params=[escaped], help="Run on [flower].", rich_markup_mode=None)
    text = command.get_help(command.context_class(command, info_name="deploy"))
    assert "the run's TOML  [required]" in text and "Run on [flower]." in text and "\\[" not in text


def test_a_gpu_run_notes_once_how_to_repeat_it_bit_for_bit(tmp_path, monkeypatch):
    """On a GPU (JAX's backend faked here), a command prints the repeatability note once, however
    many runs it makes; with XLA's deterministic GPU kernels asked for, or on the CPU, none."""
    import jax

    from fedbayes.cli.common import DETERMINISTIC_GPU_FLAG

    base = DIGITS.format(rounds=1, ckpt=0, algorithm="fedavg", extra="").replace("[", "[base.").replace('name = "digits_test"', "")
    p = tmp_path / "cmp.toml"
    p.write_text("[base]\nrounds = 1\n" + base.replace("rounds = 1\n", "") + "\n[variants.a]\n[variants.b]\nseed = 1\n")
    cpu = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "cpu")])
    assert cpu.exit_code == 0, cpu.output
    assert "note: on a GPU" not in cpu.output
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "gpu")])
    assert gpu.exit_code == 0, gpu.output
    assert gpu.output.count("note: on a GPU") == 1 and DETERMINISTIC_GPU_FLAG in gpu.output
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " " + DETERMINISTIC_GPU_FLAG)
    asked = runner.invoke(app, ["compare", str(p), "--out", str(tmp_path / "asked")])
    assert asked.exit_code == 0, asked.output
    assert "note: on a GPU" not in asked.output
