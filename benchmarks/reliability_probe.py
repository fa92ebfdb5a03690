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
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated parts to run (damaged_folders, two_runs, bad_configs, bad_data, other)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fb_probe_"))
    cache = tmp / "xla"
    p = Probe(tmp, cache)
    t0 = time.time()
    for part in (damaged_folders, two_runs, bad_configs, bad_data, other):
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
