"""Compares two trees of fedbayes run folders bit for bit, timings aside.

``python scripts/compare_runs.py BEFORE AFTER``: every ``metrics.jsonl``, ``clients.jsonl``,
``summary.json``, ``compare.json`` and ``sweep.json`` under BEFORE against the same file under AFTER
with every timing key removed (keys naming seconds), and every ``model.npz`` array by
``numpy.array_equal``; checkpoints and client stores are left out (their metadata holds paths and
config hashes). Prints one line per differing or missing file and a count; exits 1 if any differs.
"""

import json
import sys
from pathlib import Path

import numpy as np


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if "second" not in k}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _same(a: Path, b: Path) -> bool:
    if a.suffix == ".jsonl":
        lines = [[_strip(json.loads(line)) for line in p.read_text().splitlines() if line.strip()] for p in (a, b)]
        return lines[0] == lines[1]
    if a.suffix == ".json":
        return _strip(json.loads(a.read_text())) == _strip(json.loads(b.read_text()))
    with np.load(a) as za, np.load(b) as zb:
        return sorted(za.files) == sorted(zb.files) and all(np.array_equal(za[k], zb[k], equal_nan=True) for k in za.files)


def main(before: Path, after: Path) -> int:
    equal = differ = 0
    for a in sorted(before.rglob("*")):
        rel = a.relative_to(before)
        if not a.is_file() or a.suffix not in (".jsonl", ".json", ".npz") or {"checkpoints", "client_store"} & set(rel.parts):
            continue
        b = after / rel
        if not b.is_file():
            print(f"missing: {rel}")
            differ += 1
        elif _same(a, b):
            equal += 1
        else:
            print(f"differs: {rel}")
            differ += 1
    print(f"{equal} files equal, {differ} different or missing")
    return 1 if differ or not equal else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
