"""StackOverflow tag prediction at its full federation size, read on demand (``data.on_demand``):
one ``fedbayes run`` per method and federation size, each in a fresh process, timed per round with
its peak resident set.

``--write`` writes synthetic files in TFF's layout (:mod:`fedbayes.data.writers`):
``--users`` training users (default 342,477, the real count) whose numbers of posts follow
StackOverflow's heavy tail (log-normal, :func:`fedbayes.data.federation.heavy_tailed_sizes`)
scaled by ``--scale`` (the real law: mean 397, std 1,300 posts a user; ``--scale 0.01`` keeps the
users and divides every user's expected posts by 100), ``--test-users`` test users of the same
law, and the count files of the real vocabularies (10,000 words, 500 tags; twice as many in the
files, as TFF's hold more). Posts are drawn from a pool of random posts over those words.

``--measure`` runs the paper configs' FedAvg (``fedpa_stackoverflow_lr.toml``, ``fedavg_me``) and
FedSEP (``fedep_stackoverflow_lr.toml``, ``fedsep_i``, burn-in cut to one round so rounds 2 and 3
are FedSEP's own) for ``--rounds`` rounds, evaluated at the start and the end, with every user
(``--users``) and with the first ``--small`` users (``data.max_clients``), the same cohort size
(10): the round's time (``seconds`` of ``metrics.jsonl``: training only, compilation and
evaluation excluded), the cohort's posts and local steps (``clients.jsonl``; a step is one batch
of 100 posts, or fewer, through the 5.0M-parameter model, so ``ms_per_step`` compares rounds of
different cohorts),
the process's wall time and its peak resident set (``ru_maxrss`` of the child, from ``wait4``).
``open_s`` is reading every training user's number of posts from the file (the only work that
grows with the users; done once per run).

    PYTHONPATH=src .venv/bin/python benchmarks/federation_size.py --write /tmp/so --measure --json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
REAL_MEAN, REAL_STD = 397.0, 1300.0  # posts per training user (135.8M posts over 342,477 users)
VOCAB, TAGS, POOL = 10_000, 500, 8192
RUNS = (("fedpa_stackoverflow_lr.toml", "fedavg_me", "FedAvg"), ("fedep_stackoverflow_lr.toml", "fedsep_i", "FedSEP (I)"))


def write(folder: Path, users: int, test_users: int, scale: float, seed: int = 0) -> dict:
    """The synthetic files; returns their sizes (users, posts, bytes) and the time taken."""
    from fedbayes.data.federation import heavy_tailed_sizes
    from fedbayes.data.writers import write_tff

    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "stackoverflow.word_count", "w", encoding="utf-8") as f:
        f.writelines(f"w{i} {10 * (2 * VOCAB - i)}\n" for i in range(2 * VOCAB))
    with open(folder / "stackoverflow.tag_count", "w", encoding="utf-8") as f:
        json.dump({f"t{i}": 10 * (2 * TAGS - i) for i in range(2 * TAGS)}, f)
    words = np.array([f"w{i}" for i in range(2 * VOCAB)])
    posts = np.array([" ".join(words[rng.integers(0, 2 * VOCAB, rng.integers(3, 26))]).encode() for _ in range(POOL)], object)
    titles = np.array([" ".join(words[rng.integers(0, 2 * VOCAB, 3)]).encode() for _ in range(POOL)], object)
    tags = np.array(["|".join(f"t{t}" for t in rng.choice(2 * TAGS, rng.integers(1, 4), replace=False)).encode() for _ in range(POOL)], object)
    out = {}
    for split, n in (("train", users), ("test", test_users)):
        sizes = heavy_tailed_sizes(n, rng, REAL_MEAN * scale, REAL_STD * scale)

        def clients(sizes=sizes):
            for i, k in enumerate(sizes):
                pick = rng.integers(0, POOL, (3, k))
                yield f"{i:08d}", {"tokens": posts[pick[0]], "title": titles[pick[1]], "tags": tags[pick[2]]}

        path = write_tff(folder / f"stackoverflow_{split}.h5", clients())
        out[split] = {"users": n, "posts": int(sizes.sum()), "max_posts": int(sizes.max()), "gb": round(path.stat().st_size / 1e9, 3)}
    out["write_s"] = round(time.perf_counter() - start, 1)
    return out


def _merged(paper: str, variant: str) -> dict:
    raw = tomllib.loads((ROOT / "examples" / "papers" / paper).read_text())
    config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw["base"].items()}
    for key, value in raw["variants"][variant].items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    return config


def _toml(config: dict) -> str:
    def value(v):
        return ("true" if v else "false") if isinstance(v, bool) else json.dumps(v) if isinstance(v, str) else repr(v)

    lines = [f"{k} = {value(v)}" for k, v in config.items() if not isinstance(v, dict)]
    for key, table in config.items():
        if isinstance(table, dict):
            lines += [f"[{key}]", *(f"{k} = {value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def measure_one(folder: Path, work: Path, paper: str, variant: str, users: int, total_users: int, rounds: int) -> dict:
    """One ``fedbayes run`` in a fresh process: its rounds' seconds, wall time and peak RSS."""
    config = _merged(paper, variant)
    config.update(rounds=rounds, checkpoint_every=0, eval_every=1, name=f"{variant}_{users}")
    config["data"].update(data_dir=str(folder), num_clients=users, on_demand=True)
    if users < total_users:
        config["data"]["max_clients"] = users
    if "burn_in_rounds" in config["algorithm"]:
        config["algorithm"]["burn_in_rounds"] = 1
    cfg, out = work / f"{variant}_{users}.toml", work / f"{variant}_{users}"
    cfg.write_text(_toml(config))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), FEDBAYES_CACHE="off")
    start = time.perf_counter()
    child = subprocess.Popen(
        [sys.executable, "-m", "fedbayes.cli", "run", str(cfg), "--out", str(out), "--overwrite"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"fedbayes run failed:\n{output.decode()[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["seconds"] for r in records]
    per_round = np.diff(seconds).round(3).tolist()
    posts, steps = [0] * rounds, [0] * rounds
    for line in (out / "clients.jsonl").read_text().splitlines():
        c = json.loads(line)
        posts[c["round"] - 1] += c["examples"]
        steps[c["round"] - 1] += c["steps"]
    last = records[-1]
    return {
        "method": variant,
        "users": users,
        "round_s": per_round,
        "cohort_posts": posts,
        "cohort_steps": steps,
        "ms_per_step": [round(1e3 * s / k, 1) for s, k in zip(per_round, steps)],
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
        "micro_f1": last.get("micro_f1"),
    }


def open_seconds(folder: Path, users: int) -> float:
    from fedbayes.data.tff import client_sizes

    start = time.perf_counter()
    client_sizes(folder / "stackoverflow_train.h5", ("tokens", "title", "tags"), users)
    return round(time.perf_counter() - start, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the files' folder")
    parser.add_argument("--write", action="store_true", help="write the synthetic files first")
    parser.add_argument("--measure", action="store_true", help="run the methods on them")
    parser.add_argument("--users", type=int, default=342_477)
    parser.add_argument("--test-users", type=int, default=4_000)
    parser.add_argument("--scale", type=float, default=0.01, help="each user's expected posts, as a fraction of the real law's")
    parser.add_argument("--small", type=int, default=10_000, help="the smaller federation: the first users only")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result: dict = {}
    if args.write:
        result["files"] = write(args.folder, args.users, args.test_users, args.scale)
        print(json.dumps(result["files"]), file=sys.stderr)
    if args.measure:
        work = args.folder / "runs"
        work.mkdir(exist_ok=True)
        result["open_s"] = {n: open_seconds(args.folder, n) for n in (args.small, args.users)}
        result["runs"] = []
        for paper, variant, _ in RUNS:
            for users in (args.small, args.users):
                one = measure_one(args.folder, work, paper, variant, users, args.users, args.rounds)
                print(json.dumps(one), file=sys.stderr)
                result["runs"].append(one)
        result["uptime"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    if args.json:
        print(json.dumps(result))
    else:
        for r in result.get("runs", []):
            print(f"{r['method']:10s} {r['users']:>8,d} users  rounds {r['round_s']} s  wall {r['wall_s']} s  peak RSS {r['peak_rss_mb']} MB")


if __name__ == "__main__":
    main()
