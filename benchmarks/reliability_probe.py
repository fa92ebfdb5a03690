"""Reruns the reliability cases (damaged folders, concurrent runs, bad configs and data) against the CLI and counts tracebacks and silent wrong results.

Each case runs ``python -m fedbayes.cli`` in a subprocess (small data: digits, tiny LEAF and IDX
files written here) and is classified as

* ``recovered``: exit 0 and the metrics equal an uninterrupted reference run (``seconds`` aside);
* ``clean error``: the expected exit code and exactly one line on stderr, no traceback;
* ``TRACEBACK`` or ``SILENT WRONG``: the failures the issue counts.

Usage: ``PYTHONPATH=src python benchmarks/reliability_probe.py [--only SUBSTRING] [--json FILE]``
(about 5 minutes on 2 cores with the compilation cache warm).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"  # the fedbayes the commands run (--src: another tree's, for a "before" count)
KILLED_RUN = ROOT / "tests" / "killed_run.py"  # the CLI, killed abruptly after a given round

BASE = """
name = "probe"
rounds = {rounds}
checkpoint_every = 2
{top}
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
clients_per_round = 3
[algorithm]
name = "{algorithm}"
{extra}
"""


def config(tmp: Path, name="c.toml", rounds=6, algorithm="fedavg", extra="", top="") -> Path:
    p = tmp / name
    p.write_text(BASE.format(rounds=rounds, algorithm=algorithm, extra=extra, top=top))
    return p


def cli(args, env_extra=None, cache=None, timeout=300, die_after=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(cache or "off"), **(env_extra or {}))
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    entry = ["-m", "fedbayes.cli"] if die_after is None else [str(KILLED_RUN), str(die_after)]
    return subprocess.run([sys.executable, *entry, *map(str, args)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)


def metrics(folder: Path) -> list[dict]:
    out = []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        r.pop("seconds", None)
        out.append(r)
    return out


def stderr_lines(r) -> list[str]:
    return [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("WARNING:") and "round " not in x[:12]]


class Probe:
    def __init__(self, tmp: Path, cache: Path):
        self.tmp, self.cache, self.rows = tmp, cache, []
        self.refs: dict[str, list[dict]] = {}

    def ref(self, key: str, cfg: Path) -> list[dict]:
        if key not in self.refs:
            out = self.tmp / f"ref_{key}"
            r = cli(["run", cfg, "--out", out], cache=self.cache)
            assert r.returncode == 0, r.stderr
            self.refs[key] = metrics(out)
        return self.refs[key]

    def killed(self, name: str, cfg: Path, after: int = 5) -> Path:
        out = self.tmp / name
        r = cli(["run", cfg, "--out", out], cache=self.cache, die_after=after)
        assert r.returncode == 137, r.stderr
        return out

    def record(self, group, case, command, r, expect, ok_extra=True, reference=None, folder=None):
        tb = "Traceback" in r.stderr
        if expect == 0:
            same = r.returncode == 0 and reference is not None and metrics(folder) == reference
            outcome = "TRACEBACK" if tb else ("recovered" if same and ok_extra else ("SILENT WRONG" if r.returncode == 0 else f"exit {r.returncode}"))
        else:
            lines = [x for x in r.stderr.splitlines() if x.strip()]
            one = len([x for x in lines if "error" in x.lower() or "interrupted" in x or "in use" in x]) == 1
            outcome = (
                "TRACEBACK"
                if tb
                else (
                    "clean error"
                    if r.returncode == expect and one and ok_extra
                    else ("SILENT WRONG" if r.returncode == 0 else f"exit {r.returncode} (expected {expect})")
                )
            )
        last = (r.stderr.strip().splitlines() or [""])[-1][:220]
        self.rows.append({"group": group, "case": case, "command": command, "exit": r.returncode, "outcome": outcome, "message": last})
        print(f"[{outcome:>12}] {group} / {case}: exit {r.returncode}: {last}", flush=True)


def damaged_folders(p: Probe):
    g = "damaged folder"
    cfg = config(p.tmp)
    ref = p.ref("fedavg", cfg)

    def newest(out):
        return sorted((out / "checkpoints").glob("round_*.npz"))[-1]

    cases = {
        "newest checkpoint truncated": lambda o: newest(o).write_bytes(newest(o).read_bytes()[:-300]),
        "newest checkpoint garbled (bytes flipped mid-file)": lambda o: _flip(newest(o)),
        "newest checkpoint 0 bytes": lambda o: newest(o).write_bytes(b""),
        "metrics.jsonl deleted": lambda o: (o / "metrics.jsonl").unlink(),
        "metrics.jsonl torn mid-line": lambda o: (o / "metrics.jsonl").write_text((o / "metrics.jsonl").read_text()[:-40]),
        "metrics.jsonl line duplicated": lambda o: (o / "metrics.jsonl").write_text(_dup((o / "metrics.jsonl").read_text())),
        "metrics.jsonl with bare NaN line": lambda o: (o / "metrics.jsonl").write_text((o / "metrics.jsonl").read_text() + '{"round": 9, "accuracy": NaN}\n'),
    }
    for i, (case, damage) in enumerate(cases.items()):
        out = p.killed(f"dmg{i}", cfg)
        damage(out)
        r = cli(["resume", out], cache=p.cache)
        extra = True
        if "duplicated" in case:  # a second resume must work too
            extra = cli(["resume", out], cache=p.cache).returncode == 0
        p.record(g, case, "kill after round 5; damage; fedbayes resume DIR", r, 0, extra, ref, out)
    # every checkpoint damaged: nothing to fall back to
    out = p.killed("dmg_all", cfg)
    for c in (out / "checkpoints").glob("round_*.npz"):
        c.write_bytes(b"garbage")
    p.record(g, "every checkpoint damaged", "fedbayes resume DIR", cli(["resume", out], cache=p.cache), 4)
    # edited config.toml
    out = p.killed("dmg_cfg", cfg)
    (out / "config.toml").write_text((out / "config.toml").read_text().replace("lr = 0.1", "lr = 0.3"))
    p.record(g, "config.toml edited (client.lr 0.1 -> 0.3)", "fedbayes resume DIR", cli(["resume", out], cache=p.cache), 2)
    r = cli(["resume", out, "--set", "client.lr=0.3"], cache=p.cache)
    ok = r.returncode == 0 and (out / "resume_changes.jsonl").is_file()
    p.rows.append(
        {
            "group": g,
            "case": "config change given with --set",
            "command": "fedbayes resume DIR --set client.lr=0.3",
            "exit": r.returncode,
            "outcome": "accepted, recorded" if ok else "FAILED",
            "message": "",
        }
    )
    print(f"[accepted] --set: exit {r.returncode}", flush=True)

    # disk store (FedEP identity)
    dcfg = config(p.tmp, "disk.toml", algorithm="fedep", extra="burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3", top='store = "disk"')
    dref = p.ref("fedep_disk", dcfg)
    out = p.killed("disk_newest_gone", dcfg)
    newest(out).unlink()
    r = cli(["resume", out], cache=p.cache)
    p.record(g, "disk store: newest checkpoint deleted", "fedbayes resume DIR", r, 0, True, dref, out)
    out = p.killed("disk_newest_garbled", dcfg)
    _flip(newest(out))
    r = cli(["resume", out], cache=p.cache)
    p.record(g, "disk store: newest checkpoint garbled", "fedbayes resume DIR", r, 0, True, dref, out)
    for case, damage in {
        "disk store: leaf file truncated": lambda s: (s / "leaf_00000.bin").write_bytes((s / "leaf_00000.bin").read_bytes()[:-100]),
        "disk store: leaf file garbled (same size)": lambda s: _flip(s / "leaf_00000.bin", every=True),
        "disk store: store.json deleted": lambda s: (s / "store.json").unlink(),
        "disk store: needed undo log deleted": lambda s: [u.unlink() for u in s.glob("undo_*.bin")],
        "disk store: undo log truncated": lambda s: [u.write_bytes(u.read_bytes()[:-50]) for u in s.glob("undo_*.bin")],
    }.items():
        out = p.killed("disk_" + case.split(": ")[1].replace(" ", "_").replace("(", "").replace(")", ""), dcfg)
        damage(out / "client_store")
        p.record(g, case, "fedbayes resume DIR", cli(["resume", out], cache=p.cache), 4)


def _flip(path: Path, every=False):
    b = bytearray(path.read_bytes())
    positions = range(0, len(b), max(1, len(b) // 50)) if every else [len(b) // 2 + k for k in range(16)]
    for i in positions:
        b[i] ^= 0xFF
    path.write_bytes(bytes(b))


def _dup(text: str) -> str:
    lines = text.splitlines(keepends=True)
    return "".join(lines[:2] + lines[1:2] + lines[2:])


def two_runs(p: Probe):
    cfg = config(p.tmp, "long.toml", rounds=100000)  # still running when the three probes (~30 s each) and the SIGINT come
    out = p.tmp / "shared"
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(p.cache), PYTHONPATH=str(ROOT / "src"))
    first = subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", "run", str(cfg), "--out", str(out)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "metrics.jsonl").is_file():
        time.sleep(0.2)
    for cmd in (["run", cfg, "--out", out], ["resume", out], ["compare", cfg, "--out", out]):
        r = cli(cmd, cache=p.cache)
        ok = str(first.pid) in r.stderr
        p.record("two processes", f"second `{cmd[0]}` while a run holds the folder", f"fedbayes {cmd[0]} ... (same folder)", r, 5, ok)
    first.send_signal(signal.SIGINT)
    _, err = first.communicate(timeout=120)
    fake = subprocess.CompletedProcess([], first.returncode, "", err)
    p.record("other", "Ctrl-C (SIGINT) during a run", "fedbayes run ...; kill -INT PID", fake, 130, "fedbayes resume" in err)
    r = cli(["resume", out, "--set", "rounds=6"], cache=p.cache)
    ok = r.returncode == 0 and "Traceback" not in r.stderr
    p.rows.append(
        {
            "group": "other",
            "case": "resume after Ctrl-C",
            "command": "fedbayes resume DIR --set rounds=6",
            "exit": r.returncode,
            "outcome": "recovered" if ok else "FAILED",
            "message": (r.stderr.strip().splitlines() or [""])[-1][:200],
        }
    )


def bad_configs(p: Probe):
    g = "bad config"
    cfg = config(p.tmp)
    binary = p.tmp / "binary.toml"
    binary.write_bytes(bytes(range(256)) * 4)
    empty = p.tmp / "empty.toml"
    empty.write_text("")
    afile = p.tmp / "afile"
    afile.write_text("x")
    cases = [
        ("binary config file", ["run", binary], 2),
        ("empty config file", ["run", empty], 2),
        ("--out is a file", ["run", cfg, "--out", afile], 2),
        (
            "store_dir is a file",
            ["run", cfg, "--out", p.tmp / "sd", "--set", 'store="disk"', "--set", 'algorithm.name="admm"', "--set", f'store_dir="{afile}"'],
            2,
        ),
        ("rounds = true", ["run", cfg, "--set", "rounds=true"], 2),
        ("client.lr = inf", ["run", cfg, "--set", "client.lr=inf"], 2),
        ("server.lr = inf", ["run", cfg, "--set", "server.lr=inf"], 2),
        ("server.lr = nan", ["run", cfg, "--set", "server.lr=nan"], 2),
        ('name = "../../x"', ["run", cfg, "--set", 'name="../../x"'], 2),
        ('name = ""', ["run", cfg, "--set", 'name=""'], 2),
        ("model.hidden = [true]", ["run", cfg, "--set", "model.hidden=[true]"], 2),
        ("resume of a folder without config.toml", ["resume", p.tmp / "nothing"], 2),
    ]
    if os.geteuid() != 0:
        locked = p.tmp / "ro"
        locked.mkdir()
        os.chmod(locked, 0o555)
        cases.append(("unwritable output folder", ["run", cfg, "--out", locked / "x"], 2))
    for case, args, code in cases:
        p.record(g, case, "fedbayes " + " ".join(str(a).replace(str(p.tmp), "$TMP") for a in args), cli(args, cache=p.cache), code)


def write_leaf(folder: Path, train_users: dict, test_users: dict):
    for split, users in (("train", train_users), ("test", test_users)):
        (folder / split).mkdir(parents=True, exist_ok=True)
        blob = {"users": list(users), "num_samples": [len(v[1]) for v in users.values()], "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()}}
        (folder / split / "data.json").write_text(json.dumps(blob))


def leaf_users(n_users=4, n=12, dim=5, classes=3, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    return {f"u{i}": (rng.normal(size=(n, dim)).round(3).tolist(), rng.integers(0, classes, n).tolist()) for i in range(n_users)}


def write_idx(folder: Path, labels_test=None, compress=True):
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    arrays = [
        rng.integers(0, 255, (60, 28, 28), dtype=np.uint8),
        rng.integers(0, 10, 60).astype(np.uint8),
        rng.integers(0, 255, (20, 28, 28), dtype=np.uint8),
        labels_test if labels_test is not None else rng.integers(0, 10, 20).astype(np.uint8),
    ]
    names = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
    for name, a in zip(names, arrays):
        raw = struct.pack(">BBBB", 0, 0, 0x08, a.ndim) + struct.pack(f">{a.ndim}I", *a.shape) + a.tobytes()
        (folder / (name + ".gz")).write_bytes(gzip.compress(raw))
    return folder


def bad_data(p: Probe):
    g = "bad data"
    cfgs = {}

    def leaf_run(case, train, test, expect=3):
        folder = p.tmp / ("leaf_" + str(len(cfgs)))
        write_leaf(folder, train, test)
        cfg = p.tmp / f"leaf{len(cfgs)}.toml"
        cfgs[case] = cfg
        cfg.write_text(
            BASE.format(rounds=2, algorithm="fedavg", extra="", top="")
            .replace('dataset = "digits"', f'dataset = "leaf"\ndata_dir = "{folder}"')
            .replace('partition = "dirichlet"', 'partition = "natural"')
            .replace("num_clients = 6", "num_clients = 4")
        )
        p.record(g, case, "fedbayes run leaf.toml (tiny LEAF folder)", cli(["run", cfg, "--out", p.tmp / f"lo{len(cfgs)}"], cache=p.cache), expect)

    good = leaf_users()
    leaf_run("LEAF: empty test split", good, {u: ([], []) for u in good})
    nan_test = leaf_users(seed=1)
    nan_test["u1"][0][3][2] = float("nan")
    leaf_run("LEAF: NaN in the test set", good, nan_test)
    big = leaf_users(seed=2)
    big["u2"][1][0] = 1000
    leaf_run("LEAF: label 1000 among labels 0..2", big, leaf_users(seed=3))
    for what, value in (("NaN", float("nan")), ("Infinity", float("inf")), ("null", None)):
        bad = leaf_users(seed=4)
        bad["u0"][0][1][1] = value
        leaf_run(f"LEAF: {what} in training features", bad, leaf_users(seed=5))
    # damaged JSON
    folder = p.tmp / "leaf_badjson"
    write_leaf(folder, good, good)
    (folder / "train" / "data.json").write_text((folder / "train" / "data.json").read_text()[:-30])
    cfg = p.tmp / "leafbj.toml"
    cfg.write_text(cfgs["LEAF: empty test split"].read_text().replace(str(p.tmp / "leaf_0"), str(folder)))
    p.record(g, "LEAF: truncated JSON file", "fedbayes run leaf.toml", cli(["run", cfg, "--out", p.tmp / "lbj"], cache=p.cache), 3)

    import numpy as np

    def idx_run(case, folder):
        cfg = p.tmp / f"idx_{folder.name}.toml"
        cfg.write_text(BASE.format(rounds=2, algorithm="fedavg", extra="", top="").replace('dataset = "digits"', f'dataset = "mnist"\ndata_dir = "{folder}"'))
        p.record(g, case, "fedbayes run mnist.toml (tiny IDX files)", cli(["run", cfg, "--out", p.tmp / f"io_{folder.name}"], cache=p.cache), 3)

    f = write_idx(p.tmp / "idx_garbled")
    path = f / "train-images-idx3-ubyte.gz"
    b = bytearray(path.read_bytes())
    for i in range(20, 60):
        b[i] ^= 0x5A
    path.write_bytes(bytes(b))
    idx_run("IDX: garbled gzip", f)
    f = write_idx(p.tmp / "idx_crc")
    path = f / "train-labels-idx1-ubyte.gz"
    b = bytearray(path.read_bytes())
    b[-8] ^= 0xFF  # the CRC-32 in the gzip trailer
    path.write_bytes(bytes(b))
    idx_run("IDX: bad gzip CRC", f)
    labels = np.random.default_rng(1).integers(0, 10, 20).astype(np.uint8)
    labels[7] = 42
    idx_run("IDX: label 42", write_idx(p.tmp / "idx_label", labels_test=labels))
    f = write_idx(p.tmp / "idx_trunc")
    path = f / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    idx_run("IDX: truncated gzip", f)


def other(p: Probe):
    cfg = config(p.tmp, "nan.toml", rounds=3)
    out = p.tmp / "nanrun"
    r = cli(["run", cfg, "--out", out, "--set", "client.lr=3e38"], cache=p.cache)  # overflows float32: NaN metrics
    strict = True
    for f in list(out.glob("*.json")) + list(out.glob("*.jsonl")):
        for line in [f.read_text()] if f.suffix == ".json" else f.read_text().splitlines():
            try:
                json.loads(line, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
            except ValueError:
                strict = False
    p.rows.append(
        {
            "group": "other",
            "case": "NaN metrics (lr 1e30): files are strict JSON",
            "command": "fedbayes run c.toml --set client.lr=3e38",
            "exit": r.returncode,
            "outcome": ("TRACEBACK" if "Traceback" in r.stderr else ("strict JSON" if strict else "SILENT WRONG")),
            "message": "",
        }
    )
    print(f"[strict json] {strict} exit {r.returncode}", flush=True)
    r = cli(["run", cfg, "--out", p.tmp / "ff", "--set", "server.fail_fast=true", "--set", "client.lr=3e38"], cache=p.cache)
    p.record("other", "server.fail_fast with rejected messages", "fedbayes run c.toml --set server.fail_fast=true --set client.lr=3e38", r, 3)


# ----- the edges (issue "Reliability at the edges"): files outside the checkpoint, signals, divergence,
# resource limits, stores ------------------------------------------------------------------------


def _files(folder: Path) -> dict:
    """What a run folder holds, for an exact comparison: the logs' text (wall-clock seconds aside),
    summary.json (its seconds aside), the model's arrays."""
    import numpy as np

    out = {"metrics": metrics(folder), "clients": (folder / "clients.jsonl").read_bytes()}
    summary = json.loads((folder / "summary.json").read_text())
    summary.get("final", {}).pop("seconds", None)
    out["summary"] = summary
    with np.load(folder / "model.npz") as z:
        out["model"] = {k: z[k].tobytes() for k in z.files}
    out["curves"] = (folder / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return out


def _record_exact(p: Probe, group: str, case: str, command: str, r, folder: Path, reference: dict, expect_warning: bool | None = None):
    """A resume that must end with every file as the reference run's (one warning line at most)."""
    warnings = [x for x in r.stderr.splitlines() if x.startswith("warning:")]
    tb = "Traceback" in r.stderr
    same = r.returncode == 0 and _files(folder) == reference if (folder / "summary.json").is_file() else False
    named = expect_warning is None or (len(warnings) == 1) == expect_warning
    outcome = "TRACEBACK" if tb else ("recovered" if same and named else ("SILENT WRONG" if r.returncode == 0 else f"exit {r.returncode}"))
    last = (r.stderr.strip().splitlines() or [""])[-1][:220]
    p.rows.append({"group": group, "case": case, "command": command, "exit": r.returncode, "outcome": outcome, "message": last})
    print(f"[{outcome:>12}] {group} / {case}: exit {r.returncode}: {last}", flush=True)


def _line(p: Probe, group: str, case: str, command: str, r, expect: int, needle: str = "", absent: str = ""):
    """A command that must give one line with exit ``expect`` (0 included), holding ``needle``."""
    tb = "Traceback" in r.stderr or "please report" in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith(("warning:", "round ", "["))]
    if expect == 0:
        lines = [x for x in (r.stdout + r.stderr).splitlines() if x.strip() and not x.startswith("WARNING:")]
    ok = r.returncode == expect and len(lines) == 1 and needle in lines[0] and not (absent and absent in lines[0])
    outcome = (
        "TRACEBACK"
        if tb
        else ("clean error" if ok and expect else "one line" if ok else ("SILENT WRONG" if r.returncode == 0 else f"exit {r.returncode} (expected {expect})"))
    )
    last = (lines or [""])[-1][:220]
    p.rows.append({"group": group, "case": case, "command": command, "exit": r.returncode, "outcome": outcome, "message": last})
    print(f"[{outcome:>12}] {group} / {case}: exit {r.returncode}: {last}", flush=True)


def edges(p: Probe):
    # 1. files outside the checkpoint: a finished run's files damaged, then resumed
    g = "run folder files"
    cfg = config(p.tmp, "edge.toml")
    ref_dir = p.tmp / "edge_ref"
    assert cli(["run", cfg, "--out", ref_dir], cache=p.cache).returncode == 0
    reference = _files(ref_dir)

    def line(path: Path, i: int, text: str):
        lines = path.read_text().splitlines(keepends=True)
        lines[i] = text + "\n"
        path.write_text("".join(lines))

    damages = {
        "summary.json cut": (lambda o: (o / "summary.json").write_text((o / "summary.json").read_text()[:40]), True),
        "model.npz cut": (lambda o: (o / "model.npz").write_bytes((o / "model.npz").read_bytes()[:-80]), True),
        "curves.png deleted": (lambda o: (o / "curves.png").unlink(), True),
        "metrics.jsonl line garbled (valid JSON)": (lambda o: line(o / "metrics.jsonl", 3, '{"round": 3, "accuracy": 0.99}'), True),
        "clients.jsonl cut mid-line": (lambda o: (o / "clients.jsonl").write_text((o / "clients.jsonl").read_text()[:333]), True),
        "clients.jsonl line `17`": (lambda o: line(o / "clients.jsonl", 5, "17"), True),
        "clients.jsonl deleted": (lambda o: (o / "clients.jsonl").unlink(), True),
    }
    for i, (case, (damage, warned)) in enumerate(damages.items()):
        out = p.tmp / f"edge_f{i}"
        shutil.copytree(ref_dir, out)
        damage(out)
        _record_exact(p, g, f"finished run: {case}", "damage; fedbayes resume DIR", cli(["resume", out], cache=p.cache), out, reference, warned)
    out = p.tmp / "edge_done"
    shutil.copytree(ref_dir, out)
    _line(p, g, "finished run resumed", "fedbayes resume DIR", cli(["resume", out], cache=p.cache), 0, "finished earlier")
    for i, case in enumerate(("clients.jsonl line `17`",)):
        out = p.killed(f"edge_k{i}", cfg, after=3)
        damages[case][0](out)
        r = cli(["resume", out], cache=p.cache)
        _record_exact(p, g, f"killed after round 3: {case}", "kill; damage; fedbayes resume DIR", r, out, reference, True)

    # kill and resume, summary.json included (PVI's calibration warning at round 1)
    g = "kill and resume"
    for name, algorithm, top, kills in (("fedavg", "fedavg", "", (3,)), ("pvi", "pvi", "", (1, 4)), ("fedep_disk", "fedep", 'store = "disk"', (3,))):
        extra = "burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3" if algorithm == "fedep" else ""
        kcfg = config(p.tmp, f"k_{name}.toml", rounds=6, algorithm=algorithm, extra=extra, top=top)
        kref = p.tmp / f"kref_{name}"
        assert cli(["run", kcfg, "--out", kref], cache=p.cache).returncode == 0
        for after in kills:
            out = p.killed(f"k_{name}_{after}", kcfg, after=after)
            _record_exact(p, g, f"{name}: kill -9 after round {after}, resume", "fedbayes resume DIR", cli(["resume", out], cache=p.cache), out, _files(kref))

    # comparisons
    g = "comparison"
    comp = p.tmp / "comp.toml"
    base = BASE.format(rounds=3, algorithm="fedavg", extra="", top="").split("[algorithm]")[0].replace('name = "probe"\n', "")
    for section in ("data", "model", "client", "server"):
        base = base.replace(f"[{section}]", f"[base.{section}]")
    comp.write_text("[base]\n" + base + '\n[variants.a.algorithm]\nname = "fedavg"\n[variants.b.algorithm]\nname = "fedprox"\n')
    cref = p.tmp / "comp_ref"
    assert cli(["compare", comp, "--out", cref], cache=p.cache).returncode == 0
    for case, damage in {
        "variant a's metrics.jsonl deleted": lambda o: (o / "a" / "metrics.jsonl").unlink(),
        "variant b's clients.jsonl cut, compare.json deleted": lambda o: ((o / "b" / "clients.jsonl").write_text("{"), (o / "compare.json").unlink()),
    }.items():
        out = p.tmp / f"comp_{len(p.rows)}"
        shutil.copytree(cref, out)
        damage(out)
        r = cli(["resume", out], cache=p.cache)
        ok = r.returncode == 0 and all(_files(out / v) == _files(cref / v) for v in "ab") and (out / "compare.json").is_file()
        p.rows.append(
            {
                "group": g,
                "case": case,
                "command": "fedbayes resume OUT",
                "exit": r.returncode,
                "outcome": "TRACEBACK" if "Traceback" in r.stderr else ("recovered" if ok else "SILENT WRONG" if r.returncode == 0 else f"exit {r.returncode}"),
                "message": (r.stderr.strip().splitlines() or [""])[-1][:220],
            }
        )
        print(f"[{p.rows[-1]['outcome']:>12}] {g} / {case}", flush=True)
    long_comp = p.tmp / "comp_long.toml"
    long_comp.write_text(comp.read_text().replace("rounds = 3", "rounds = 100000"))
    out = p.tmp / "comp_sig"
    proc = _popen(p, ["compare", long_comp, "--out", out])
    _wait(out / "a" / "metrics.jsonl", proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    _line(
        p,
        g,
        "plain comparison interrupted",
        "fedbayes compare ...; kill -INT",
        subprocess.CompletedProcess([], proc.returncode, "", err),
        130,
        f"`fedbayes resume {out}` continues it",
    )

    # divergence
    g = "divergence"
    r = cli(["run", cfg, "--out", p.tmp / "pvi_lr", "--set", 'algorithm.name="pvi"', "--set", "client.lr=1e6"], cache=p.cache)
    _line(
        p,
        g,
        "PVI with client.lr 1e6: every message rejected",
        "fedbayes run --set client.lr=1e6 (PVI)",
        r,
        3,
        "every client's message was rejected for 5 rounds",
    )
    r = cli(["run", cfg, "--out", p.tmp / "func_lr", "--set", 'algorithm.name="fedlap_func"', "--set", "client.lr=3e38"], cache=p.cache)
    _line(
        p,
        g,
        "FedLap-Func diverging: advice names its own settings",
        "fedbayes run --set client.lr=3e38 (FedLap-Func)",
        r,
        3,
        "algorithm.server_lr",
        absent=" server.lr",
    )

    # resource limits and bounds
    g = "bad input at the edges"
    for case, sets in {
        "FedLap-Func memory_per_class = 1e9": ['algorithm.name="fedlap_func"', "algorithm.memory_per_class=1000000000"],
        "FedLap-Func memory_per_class = 2**31": ['algorithm.name="fedlap_func"', "algorithm.memory_per_class=2147483648"],
        "seed = 2**63": ["seed=9223372036854775808"],
        "model.hidden = [1e9]": ['model.name="mlp"', "model.hidden=[1000000000]"],
        "PVI samples = 1e9": ['algorithm.name="pvi"', "algorithm.samples=1000000000"],
        "rounds = 2**63": ["rounds=9223372036854775808"],
    }.items():
        args = ["run", cfg, "--out", p.tmp / f"lim_{len(p.rows)}", "--set", "rounds=1"] + [x for s in sets for x in ("--set", s)]
        _line(p, g, case, "fedbayes run " + " ".join(f"--set {s}" for s in sets), cli(args, cache=p.cache), 2, "")
    _line(p, g, "config path is a folder", "fedbayes run DIR", cli(["run", p.tmp], cache=p.cache), 2, "is a folder")
    _line(
        p,
        g,
        "--threshold nan",
        "fedbayes compare c.toml --threshold nan",
        cli(["compare", cfg, "--threshold", "nan", "--out", p.tmp / "thr"], cache=p.cache),
        2,
        "--threshold",
    )
    out = p.tmp / "seedcmp"
    r = cli(["compare", cfg, "--seeds", "0,9223372036854775808", "--out", out], cache=p.cache)
    _line(p, g, "compare --seeds with 2**63 (no folder made)", "fedbayes compare --seeds 0,2**63", r, 2, "2**63 - 1")
    if out.exists():
        p.rows[-1]["outcome"] = "SILENT WRONG"
    _line(
        p,
        g,
        "sweep --seeds 1e14",
        "fedbayes sweep --grid client.lr=0.1 with a count of 10**14 seeds",
        cli(["sweep", cfg, "--grid", "client.lr=0.1", "--seeds", "99999999999999", "--out", p.tmp / "sw"], cache=p.cache),
        2,
        "at most",
    )

    # stores
    g = "disk stores"
    store = p.tmp / "shared_store"
    scfg = config(
        p.tmp,
        "store.toml",
        rounds=4,
        algorithm="fedep",
        extra="burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3",
        top=f'store = "disk"\nstore_dir = "{store}"',
    )
    assert cli(["run", scfg, "--out", p.tmp / "st_a"], cache=p.cache).returncode == 0
    meta = (store / "store.json").read_bytes()
    _line(
        p,
        g,
        "second run on the same absolute store_dir",
        "fedbayes run (same store_dir)",
        cli(["run", scfg, "--out", p.tmp / "st_b"], cache=p.cache),
        2,
        "holds the client store of the run in",
    )
    shutil.copytree(p.tmp / "st_a", p.tmp / "st_c")
    for name in ("summary.json", "model.npz", "curves.png", "checkpoints/round_000004.npz"):
        (p.tmp / "st_c" / name).unlink()
    _line(
        p,
        g,
        "resume of a copied folder sharing the store",
        "cp -r A C; fedbayes resume C",
        cli(["resume", p.tmp / "st_c"], cache=p.cache),
        4,
        "belongs to the run in",
    )
    if (store / "store.json").read_bytes() != meta:
        p.rows[-1]["outcome"] = "SILENT WRONG"
    long_store = config(
        p.tmp,
        "store_long.toml",
        rounds=100000,
        algorithm="fedep",
        extra="burn_in_rounds = 1\nscale = 50.0\nweight_decay = 1e-3",
        top=f'store = "disk"\nstore_dir = "{p.tmp / "store2"}"',
    )
    proc = _popen(p, ["run", long_store, "--out", p.tmp / "st_d"])
    _wait(p.tmp / "st_d" / "metrics.jsonl", proc)
    r = cli(["run", long_store, "--out", p.tmp / "st_e"], cache=p.cache)
    _line(p, g, "two runs at once on one store_dir", "fedbayes run A & fedbayes run B (same store_dir)", r, 5, f"pid {proc.pid}")
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)

    # signals at any moment
    g = "signals"
    scfg_long = config(p.tmp, "sig.toml", rounds=100000)
    for sig, delays in ((signal.SIGINT, (0.15, 0.5, 1.0, 2.0)), (signal.SIGTERM, (0.3, 0.75, 1.5))):
        for delay in delays:
            out = p.tmp / f"sig_{sig.name}_{delay}"
            proc = _popen(p, ["run", scfg_long, "--out", out])
            time.sleep(delay)
            proc.send_signal(sig)
            _, err = proc.communicate(timeout=120)
            _line(
                p,
                g,
                f"{sig.name} at {delay} s (start-up)",
                f"fedbayes run ...; kill -{sig.name[3:]} after {delay} s",
                subprocess.CompletedProcess([], proc.returncode, "", err),
                130,
                "interrupted",
            )
    for gap in (0.01,):
        out = p.tmp / f"sig2_{gap}"
        proc = _popen(p, ["run", scfg_long, "--out", out])
        _wait(out / "checkpoints" / "round_000002.npz", proc)
        proc.send_signal(signal.SIGINT)
        time.sleep(gap)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        _line(
            p,
            g,
            f"second Ctrl-C {gap * 1000:.0f} ms after the first (mid-run)",
            "kill -INT twice",
            subprocess.CompletedProcess([], proc.returncode, "", err),
            130,
            "fedbayes resume",
        )
    for wait_for in ("summary.json",):
        out = p.tmp / f"sig_end_{wait_for}"
        proc = _popen(p, ["run", cfg, "--out", out])
        _wait(out / wait_for, proc, poll=0.005)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        fine = proc.returncode == 0 or (proc.returncode == 130 and len([x for x in err.splitlines() if x.startswith("interrupted")]) == 1)
        p.rows.append(
            {
                "group": g,
                "case": f"Ctrl-C as the run ends ({wait_for} written)",
                "command": "kill -INT",
                "exit": proc.returncode,
                "outcome": "TRACEBACK" if "Traceback" in err else ("exit 0 or one line" if fine else f"exit {proc.returncode}"),
                "message": (err.strip().splitlines() or [""])[-1][:200],
            }
        )
        print(f"[{p.rows[-1]['outcome']:>12}] {g} / {p.rows[-1]['case']}", flush=True)


def _popen(p: Probe, args) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu", FEDBAYES_CACHE=str(p.cache), PYTHONPATH=str(ROOT / "src"))
    return subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", *map(str, args)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def _wait(path: Path, proc: subprocess.Popen, timeout: float = 120, poll: float = 0.05) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and not path.exists() and proc.poll() is None:
        time.sleep(poll)


# ----- hostile input: data that runs code or is coerced,
# a server that chooses a node's files or code, unchecked bench settings ------------------------------


def _bounded(args, timeout=180, **kw):
    """``cli`` with a time limit: a command still running then is a HANG (exit None)."""
    try:
        return cli(args, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return subprocess.CompletedProcess(args, None, "", err)


def _hostile_row(p: Probe, group: str, case: str, command: str, r, expect: int, needle: str, marker: Path | None = None):
    """One line with exit ``expect`` naming ``needle`` (a file, a field); ``marker``: a file whose
    existence means code ran or a file was read that should not have been (SECURITY)."""
    if r.returncode is None:
        p.rows.append({"group": group, "case": case, "command": command, "exit": None, "outcome": "HANG", "message": ""})
        print(f"[{'HANG':>12}] {group} / {case}", flush=True)
        return
    _line(p, group, case, command, r, expect, needle)
    if marker is not None and marker.exists():
        p.rows[-1]["outcome"] = "SECURITY"
        print(f"[{'SECURITY':>12}] {group} / {case}: {marker} exists", flush=True)


def _add_client(path: Path, features: dict) -> None:
    """One more client ``z_bad`` in a TFF file, beside the good ones."""
    import h5py
    import numpy as np

    with h5py.File(path, "a") as f:
        group = f["examples"].create_group("z_bad")
        for k, v in features.items():
            v = np.asarray(v)
            if v.dtype.kind in "OSU":
                group.create_dataset(k, data=np.array([str(e).encode() for e in v.ravel()], object).reshape(v.shape), dtype=h5py.string_dtype())
            else:
                group.create_dataset(k, data=v)


def hostile(p: Probe):
    import pickle

    import numpy as np

    from fedbayes.data import writers

    tmp = p.tmp / "hostile"
    tmp.mkdir()
    run_cfg = BASE.format(rounds=1, algorithm="fedavg", extra="", top="")

    def run(group, case, data: str, expect=3, needle="", marker=None, extra="", name=None, model="logreg", sets=()):
        name = name or f"h{len(p.rows)}"
        cfg = tmp / f"{name}.toml"
        cfg.write_text(run_cfg.replace('dataset = "digits"', data).replace('name = "logreg"', f'name = "{model}"') + extra)
        r = _bounded(["run", cfg, "--out", tmp / f"{name}_out", *(a for v in sets for a in ("--set", v))], cache=p.cache)
        _hostile_row(p, group, case, "fedbayes run c.toml", r, expect, needle, marker)

    def files(case, path, extra_data="", **kw):
        run("own data files", case, f'dataset = "files"\npath = "{path}"{extra_data}', needle=str(path), **kw)

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(200, 4)), rng.integers(0, 3, 200)  # enough for the config's split: a file read silently runs (exit 0)
    cases = {
        "NPZ label 2^32": dict(x=x, y=np.where(np.arange(200) == 5, 2**32, y)),
        "NPZ complex features": dict(x=x + 1j, y=y),
        "NPZ zero features": dict(x=np.zeros((200, 0)), y=y),
        "NPZ no rows": dict(x=np.zeros((0, 4)), y=np.zeros(0, np.int64)),
        "NPZ labels of shape [n, 2]": dict(x=x, y=np.stack([y, y], 1)),
        "NPZ float label 1.7": dict(x=x, y=np.where(np.arange(200) == 3, 1.7, y)),
    }
    for case, arrays in cases.items():
        path = tmp / f"{case.replace(' ', '_').replace('^', '')}.npz"
        np.savez(path, **arrays)
        files(case, path)
    good = tmp / "good.npz"
    np.savez(good, x=x, y=y)
    cut = tmp / "truncated.npz"
    cut.write_bytes(good.read_bytes()[:300])
    files("NPZ truncated", cut)
    obj = tmp / "object.npz"
    np.savez(obj, x=np.array([{"a": 1}] * 200, object), y=y)
    files("NPZ object array (needs pickle)", obj)
    struct_npy = tmp / "structured.npy"
    table = np.zeros(200, dtype=[("a", "f8"), ("b", "c16"), ("label", "i8")])
    table["label"] = y
    np.save(struct_npy, table)
    files("NPY structured array with a complex column", struct_npy)

    def csv_file(case, text: str, **kw):
        path = tmp / f"{case.split(':')[0].replace(' ', '_')}.csv"
        path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
        files(case, path, **kw)

    rows = "\n".join(",".join(f"{v:.3f}" for v in r) + f",{c}" for r, c in zip(x, y))
    csv_file("CSV 64 columns of one name", ",".join(["f"] * 4) + ",label\n" + rows + "\n")
    csv_file("CSV one label 3,000,000 (no num_classes)", "a,b,c,d,label\n" + rows.replace(",0\n", ",3000000\n", 1) + "\n")
    csv_file("CSV header only", "a,b,c,d,label\n")
    csv_file("CSV label 4294967297", "a,b,c,d,label\n" + rows.replace(",1\n", ",4294967297\n", 1) + "\n")
    csv_file("CSV Latin-1 bytes", b"a,b,c,d,label\n0,1,2,3,\xe9\n")
    nan_ids = "a,b,c,d,label,site\n" + "\n".join(f"{r[0]:.3f},1,2,3,{c},{'nan' if i == 4 else i % 3}" for i, (r, c) in enumerate(zip(x, y))) + "\n"
    path = tmp / "nan_client.csv"
    path.write_text(nan_ids)
    run("own data files", "CSV NaN client id (natural partition)", f'dataset = "files"\npath = "{path}"\nclient_column = "site"', needle=str(path))

    # CIFAR's Python batches
    class Shell:
        def __init__(self, command):
            self.command = command

        def __reduce__(self):
            return (os.system, (self.command,))

    class ShellThenBatch:
        def __init__(self, command):
            self.command = command

        def __reduce__(self):
            return (eval, (f"__import__('os').system({self.command!r}) and None or {{b'data': [], b'labels': []}}",))

    def cifar(case, blob, marker=None, raw: bytes | None = None):
        folder = tmp / f"cifar_{len(p.rows)}"
        writers.write_cifar_python(folder, np.random.default_rng(1), num_classes=10, num_train=150, num_test=12)
        batch = folder / "cifar-10-batches-py" / "data_batch_1"
        batch.write_bytes(raw if raw is not None else pickle.dumps(blob))
        run("CIFAR batches", case, f'dataset = "cifar10"\ndata_dir = "{folder}"', needle=str(batch), marker=marker)

    pwned = tmp / "PWNED"
    cifar("pickle whose __reduce__ runs a shell command", {b"data": Shell(f"touch {pwned}"), b"labels": []}, marker=pwned)
    pwned2 = tmp / "PWNED2"
    cifar("pickle that runs a command, then returns a valid batch", ShellThenBatch(f"touch {pwned2}"), marker=pwned2)
    pwned3 = tmp / "PWNED3"
    cifar("pickle naming builtins.exec by GLOBAL", None, marker=pwned3, raw=b"cbuiltins\nexec\n(Vopen(" + repr(str(pwned3)).encode() + b", 'w')\ntR.")
    cifar("float pixels in [-200, 565]", {b"data": np.linspace(-200, 565, 12 * 3072).reshape(12, 3072), b"labels": [0] * 12})
    cifar("label 2^32 + 1", {b"data": np.zeros((12, 3072), np.uint8), b"labels": [2**32 + 1] + [0] * 11})
    cifar("object array of pixels", {b"data": np.array([[1] * 3072] * 12, object), b"labels": [0] * 12})

    # TFF files
    def tff(case, dataset, file, client, marker=None):
        folder = tmp / f"tff_{len(p.rows)}"
        if dataset == "emnist":
            writers.write_fed_emnist(folder, np.random.default_rng(2), num_clients=4, per_client=(20, 24))
        else:
            writers.write_fed_cifar100(folder, np.random.default_rng(3), train_clients=4, test_clients=2, per_client=20)
        path = folder / file
        if isinstance(client, dict):
            _add_client(path, client)
        else:
            client(path)
        run("TFF files", case, f'dataset = "{dataset}"\ndata_dir = "{folder}"', needle=str(path))

    px = np.full((6, 28, 28), 0.5, np.float32)
    lab = np.arange(6, dtype=np.int32) % 3
    tff("EMNIST float label 1.7", "emnist", "fed_emnist_train.h5", {"pixels": px, "label": lab + np.float64(0.7)})
    tff("EMNIST string pixels", "emnist", "fed_emnist_train.h5", {"pixels": np.array([["a"] * 784] * 6, object).reshape(6, 28, 28), "label": lab})
    tff("EMNIST 10x10 images among 28x28", "emnist", "fed_emnist_train.h5", {"pixels": np.zeros((6, 10, 10), np.float32), "label": lab})
    tff("EMNIST labels of shape [n, 2]", "emnist", "fed_emnist_train.h5", {"pixels": px, "label": np.stack([lab, lab], 1)})
    tff("EMNIST NaN pixel", "emnist", "fed_emnist_test.h5", {"pixels": np.where(np.arange(784).reshape(28, 28) == 9, np.nan, px), "label": lab})

    def not_a_group(path):
        import h5py

        with h5py.File(path, "a") as f:
            f["examples"].create_dataset("z_bad", data=np.zeros(3))

    tff("TFF client entry that is a dataset, not a group", "emnist", "fed_emnist_train.h5", not_a_group)

    def examples_dataset(path):
        import h5py

        with h5py.File(path, "w") as f:
            f.create_dataset("examples", data=np.zeros(3))

    tff("TFF /examples that is a dataset", "emnist", "fed_emnist_test.h5", examples_dataset)
    img = np.zeros((6, 32, 32, 3), np.uint8)
    tff("fed_cifar100 int64 label 2^32 + 3", "fed_cifar100", "fed_cifar100_train.h5", {"image": img, "label": np.array([2**32 + 3, 0, 1, 2, 3, 4], np.int64)})
    tff(
        "fed_cifar100 grayscale client",
        "fed_cifar100",
        "fed_cifar100_test.h5",
        {"image": np.zeros((6, 32, 32), np.uint8), "label": np.arange(6, dtype=np.int64)},
    )

    def stackoverflow(case, damage, file):
        folder = tmp / f"so_{len(p.rows)}"
        writers.write_stackoverflow(folder, np.random.default_rng(4), num_clients=4, posts_per_client=(20, 24))
        damage(folder)
        run(
            "StackOverflow",
            case,
            f'dataset = "stackoverflow_nwp"\ndata_dir = "{folder}"\nvocab_size = 5\nmax_len = 4',
            needle=str(folder / file),
            model="lstm_nwp",
        )

    stackoverflow(
        "integer tokens",
        lambda f: _add_client(
            f / "stackoverflow_train.h5", {"tokens": np.arange(4), "title": np.array(["a"] * 4, object), "tags": np.array(["t0"] * 4, object)}
        ),
        "stackoverflow_train.h5",
    )
    stackoverflow(
        "non-UTF-8 word count",
        lambda f: (f / "stackoverflow.word_count").write_bytes(b"w1 9\n\xff\xfe 8\nw2 7\nw3 6\nw4 5\nw5 4\n"),
        "stackoverflow.word_count",
    )

    # LEAF and IDX, newly
    users = {f"u{i}": {"x": [[float(i), 1.0]] * 4, "y": [0, 1, 0, 2**40 if i == 1 else 1]} for i in range(4)}
    folder = tmp / "leaf_big"
    for split in ("train", "test"):
        (folder / split).mkdir(parents=True)
        (folder / split / "a.json").write_text(json.dumps({"users": list(users), "num_samples": [4] * 4, "user_data": users}))
    run("LEAF and IDX", "LEAF label 2^40", f'dataset = "leaf"\ndata_dir = "{folder}"', needle=str(folder))
    folder = write_idx(tmp / "idx_huge")
    path = folder / "train-images-idx3-ubyte.gz"
    with gzip.open(path, "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**31, 2**16, 2**16))
    run("LEAF and IDX", "IDX header claiming 2^63 pixels", f'dataset = "mnist"\ndata_dir = "{folder}"', needle=str(path))

    # configs and bench settings
    run(
        "config",
        "privacy.noise_multiplier = 1e30",
        'dataset = "digits"',
        expect=2,
        needle="privacy.noise_multiplier",
        extra="[privacy]\nclip = 1.0\nnoise_multiplier = 1e30\n",
        sets=('server.weighting="uniform"',),
    )
    for case, client in (("epochs -1", '{"epochs": -1}'), ("unknown key", '{"nosuch": 1}'), ("a list", "[1]")):
        r = _bounded(["bench", "posterior", "--quick", "--out", tmp / "bp", "--client", client], timeout=120, cache=p.cache)
        _hostile_row(p, "bench", f"bench posterior --client {case}", f"fedbayes bench posterior --quick --client '{client}'", r, 2, "--client")

    # a Flower node: the node-side check of a server's config and of its own data file (no flwr needed)
    marker = tmp / "IMPORTED"
    evil = tmp / "evil_model.py"
    evil.write_text(f"open({str(marker)!r}, 'w').close()\n")
    secret = tmp / "secret.csv"
    secret.write_text("a,label\n" + "".join(f"{i},{i % 2}\n" for i in range(200)))  # enough rows for a node to train on it
    # what a node does with a train message's config, up to reading its examples (apps.train_reply
    # without flwr): this tree's check before validation where it has one, then validation, the
    # node's refusal of a path and node_examples; one line and the exit code as the CLI's handler gives
    node = r"""
import sys, tomllib
from pathlib import Path
from fedbayes.config.schema import validate
from fedbayes.errors import exit_code_for, one_line
from fedbayes.flower import nodedata
raw = tomllib.loads(open(sys.argv[1]).read())
source = dict(a.split("=", 1) for a in sys.argv[2:])
try:
    if not raw:
        nodedata.read_file(source["data-file"])
        sys.exit(0)
    accept = getattr(nodedata, "accept_run_config", None)
    config = validate(accept(raw, source) if accept else raw)
    nodedata.refuse_server_path(config, source)
    from fedbayes.flower.node import node_examples
    x, y = node_examples(config, 0, Path(sys.argv[1]).parent / "node_state", source)
    print(f"the node read {len(y)} examples", file=sys.stderr)
except Exception as exc:
    code = 3 if isinstance(exc, nodedata.NodeDataError) else exit_code_for(exc)
    print(f"node error: {one_line(exc)}" + (" (Traceback: an unanticipated error in the node)" if code == 1 else ""), file=sys.stderr)
    sys.exit(code)
"""
    (tmp / "node.py").write_text(node)

    def flower(case, data='dataset = "digits"', top="", model="", source=(), needle="refuses", marker=None, empty=False, read_is_a_leak=False):
        cfg = tmp / f"server_{len(p.rows)}.toml"
        cfg.write_text("" if empty else top + run_cfg.replace('dataset = "digits"', data).replace('name = "logreg"', model or 'name = "logreg"'))
        env = dict(os.environ, PYTHONPATH=str(SRC), JAX_PLATFORMS="cpu")
        try:
            r = subprocess.run([sys.executable, str(tmp / "node.py"), str(cfg), *source], capture_output=True, text=True, env=env, timeout=120)
        except subprocess.TimeoutExpired:
            r = subprocess.CompletedProcess([], None, "", "")
        _hostile_row(p, "Flower node", case, "the node's check of a server's config (nodedata.accept_run_config)", r, 3, needle, marker)
        if read_is_a_leak and r.returncode == 0:  # the node read the file the server named (and would train on it)
            p.rows[-1]["outcome"] = "SECURITY"
            print(f"[{'SECURITY':>12}] {case}: the node read the server's file", flush=True)

    flower(
        "server's model.module (not in the node's model-modules)",
        model=f'name = "module"\nmodule = "{evil}:Net"',
        source=("data-file=mine.npz",),
        marker=marker,
    )
    flower("server's dataset = files, path = a secret file", data=f'dataset = "files"\npath = "{secret}"', read_is_a_leak=True)
    mine = tmp / "mine.npz"
    np.savez(mine, x=np.zeros((4, 64)), y=np.arange(4) % 2)
    flower(
        "server's data.test_path (node with its own data-file)",
        data=f'dataset = "files"\npath = "{mine}"\ntest_path = "{secret}"',
        source=(f"data-file={mine}",),
    )
    flower("server's data.data_dir", data='dataset = "digits"\ndata_dir = "/srv/other"')
    flower("server's store_dir", top='store_dir = "/var/other"\n')
    flower("server's dataset = arrays, node without a data-file", data='dataset = "arrays"')
    np.savez(tmp / "node_obj.npz", x=np.array([{"a": 1}] * 3, object), y=np.zeros(3))
    flower("node's own data-file truncated", source=(f"data-file={cut}",), needle=str(cut), empty=True)
    flower("node's own data-file an object array", source=(f"data-file={tmp / 'node_obj.npz'}",), needle="node_obj.npz", empty=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated parts to run (damaged_folders, two_runs, bad_configs, bad_data, other, edges, hostile)")
    ap.add_argument("--json", default="")
    ap.add_argument("--src", default="", help="the fedbayes source tree the commands run (default: this checkout's src/)")
    args = ap.parse_args()
    global SRC
    SRC = Path(args.src).resolve() if args.src else SRC
    tmp = Path(tempfile.mkdtemp(prefix="fb_probe_"))
    cache = tmp / "xla"
    p = Probe(tmp, cache)
    t0 = time.time()
    for part in (damaged_folders, two_runs, bad_configs, bad_data, other, edges, hostile):
        if any(word in part.__name__ for word in args.only.split(",")):
            part(p)
    counts = {}
    for row in p.rows:
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    print(json.dumps({"cases": len(p.rows), "counts": counts, "seconds": round(time.time() - t0)}))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": p.rows, "counts": counts}, indent=1))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
