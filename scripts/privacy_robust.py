"""The experiments of docs/results/privacy_robust.md: accuracy against epsilon (client-level DP),
under attackers of each kind for each aggregation rule, and against client dropout.

Resumable: every run has its own folder under ``--out``; a finished run (``summary.json``) is
skipped, an interrupted one resumes from its last checkpoint. ``--table`` writes the tables of
whatever has finished (markdown on stdout) without running anything.

    python scripts/privacy_robust.py --out runs/privacy_robust --parts dp,coords,attack,dropout
    python scripts/privacy_robust.py --out runs/privacy_robust --table > tables.md

The base setting is small so that it finishes on a shared 2-core machine (``--full`` is the
issue's: all of Fashion-MNIST, 100 clients, 10 per round, more rounds). Methods are names from the
registry; one that is not registered (FedLap while it is being built) is skipped with a note, and
runs once it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from fedbayes.sim import hostdevices  # noqa: E402

hostdevices.configure()  # one XLA device per core, as the CLI

from fedbayes.cli import enable_compilation_cache  # noqa: E402
from fedbayes.config.schema import ALGORITHMS, validate  # noqa: E402
from fedbayes.runs.loggers import PlainReporter  # noqa: E402
from fedbayes.runs.loop import run_experiment  # noqa: E402
from fedbayes.runs.summaries import mean_std  # noqa: E402

BASE = {
    "seed": 0,
    "rounds": 15,
    "eval_every": 5,
    "checkpoint_every": 5,
    "data": {"dataset": "fashion_mnist", "fraction": 0.1, "num_clients": 100, "partition": "dirichlet", "alpha": 1.0},
    "model": {"name": "mlp", "hidden": [100]},
    "client": {"epochs": 3, "batch_size": 32, "optimizer": "sgd", "lr": 0.05, "momentum": 0.5},
    # uniform weights everywhere: DP needs them, and the other runs compare on the same footing
    "server": {"clients_per_round": 10, "weighting": "uniform", "optimizer": "sgd", "lr": 1.0, "on_divergence": "warn"},
}
FULL = {"rounds": 50, "eval_every": 5, "data": {"fraction": 1.0}}

METHODS = {
    "fedavg": {"name": "fedavg"},
    "fedpa": {"name": "fedpa", "rho": 0.1, "burn_in_rounds": 3},
    "fedep": {"name": "fedep", "method": "identity", "burn_in_rounds": 3},
    # rho = 1 / (clients per round): the default 1 / K moves the global by a tenth of a round's change
    # when 10 of 100 clients take part (19% accuracy after 15 rounds, against 72% for FedAvg)
    "fedlap": {"name": "fedlap", "rho": 0.1},
    # FedEP (I) without burn-in: one clip fits all of its rounds (burn-in messages are FedAvg
    # deltas, ten times smaller than EP's natural-parameter deltas)
    "fedep_noburn": {"name": "fedep", "method": "identity", "burn_in_rounds": 0},
}
# Clip C per method: about the median norm of a round's messages in this setting (measured by
# --calibrate; natural-parameter messages of FedEP are dominated by their precisions).
CLIP = {"fedavg": 0.5, "fedpa": 0.5, "fedep": 7.0, "fedlap": 0.05, "fedep_noburn": 7.0}
NOISE = (0.5, 1.0, 2.0)
FRACTIONS = (0.1, 0.3)
KINDS = ("scaled", "sign_flip", "nan", "huge_precision", "label_flip")
AGGREGATORS = {
    "mean": {"aggregator": "mean"},
    "median": {"aggregator": "median"},
    "trimmed_mean": {"aggregator": "trimmed_mean", "trim_fraction": 0.3},
    "norm_bound": {"aggregator": "norm_bound"},  # bound = the method's clip
    "mean+share": {"aggregator": "mean", "max_precision_share": 0.05},  # Gaussian methods only
    "mean+share0.005": {"aggregator": "mean", "max_precision_share": 0.005},  # below an honest client's damped share
}
DROPOUTS = (0.0, 0.3, 0.6)
GAUSSIAN = ("fedep", "fedep_noburn")  # messages with a precision (FedLap's site change is a point)


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


ALIASES: dict[str, str] = {}  # a run whose config equals an earlier one's -> that run (filled by runs())


def seeded(name: str, seed: int) -> str:
    """The folder of run ``name`` with seed ``seed`` (seed 0 keeps the bare name)."""
    return name if seed == 0 else f"{name}_seed{seed}"


def runs(parts: list[str], methods: list[str], full: bool, seeds: int = 1) -> dict[str, dict]:
    """name -> raw config of every run of the chosen parts, for seeds ``0 .. seeds-1`` (names from
    :func:`seeded`); a run with the same config as an earlier one is not repeated (``ALIASES``: the
    attack part's ``none`` row with the mean rule, dropout 0, natural coordinates are DP runs
    already)."""
    out: dict[str, dict] = {}
    seen: dict[str, str] = {}
    for seed in range(seeds):
        _runs_of_seed(parts, methods, _merge(_merge(BASE, FULL) if full else BASE, {"seed": seed}), seed, out, seen)
    return out


def _runs_of_seed(parts, methods, base, seed, out, seen) -> None:
    def add(name, method, **sections):
        name = seeded(name, seed)
        raw = _merge(base, {"algorithm": METHODS[method], **sections})
        key = json.dumps(validate(raw).model_dump(mode="json"), sort_keys=True)
        if key in seen:
            ALIASES[name] = seen[key]
            return
        seen[key] = name
        out[name] = {**raw, "name": name}

    for m in methods:
        if "dp" in parts:
            add(f"dp_{m}_none", m)
            for s in NOISE:
                add(f"dp_{m}_s{s}", m, privacy={"clip": CLIP[m], "noise_multiplier": s})
        if "coords" in parts and m in GAUSSIAN:
            for s in (0.0, 1.0):
                for c in ("natural", "moments"):
                    add(f"coords_{m}_{c}_s{s}", m, privacy={"clip": CLIP[m], "noise_multiplier": s, "coordinates": c})
        if "attack" in parts:
            for agg, settings in AGGREGATORS.items():
                if agg.startswith("mean+share") and m not in GAUSSIAN:
                    continue
                server = {**settings, **({"norm_bound": CLIP[m]} if agg == "norm_bound" else {})}
                add(f"attack_{m}_{agg}_none", m, server=server)
                for kind in KINDS:
                    if kind == "huge_precision" and m not in GAUSSIAN:
                        continue
                    for f in FRACTIONS:
                        add(f"attack_{m}_{agg}_{kind}_{f}", m, server=server, attack={"fraction": f, "kind": kind})
        if "dropout" in parts:
            for p in DROPOUTS:
                add(f"dropout_{m}_{p}", m, server={"dropout": p})


def run_one(name: str, raw: dict, out: Path) -> str:
    folder = out / name
    if (folder / "summary.json").is_file():
        return "done"
    config = validate(raw)
    resume = (folder / "checkpoints").is_dir() and any((folder / "checkpoints").glob("*.npz"))
    if folder.exists() and not resume:
        import shutil

        shutil.rmtree(folder)
    t0 = time.time()
    run_experiment(config, folder, resume=resume, reporter=PlainReporter(lambda s: None))
    return f"{time.time() - t0:.0f} s"


MAX_SEEDS = 10


def _one_final(folder: Path) -> dict | None:
    folder = folder.with_name(ALIASES.get(folder.name, folder.name))
    path = folder / "summary.json"
    if not path.is_file():
        return None
    final = json.loads(path.read_text()).get("final", {})
    for k in json.loads(path.read_text()).get("final", {}).get("nonfinite", []):
        final[k] = float("inf") if k == "epsilon" else float("nan")
    return final


def _final(folder: Path) -> list[dict] | None:
    """The final metrics of run ``folder`` on every seed that finished (``None``: none did)."""
    found = [f for s in range(MAX_SEEDS) if (f := _one_final(folder.with_name(seeded(folder.name, s)))) is not None]
    return found or None


def _acc(finals: list[dict] | None, key: str = "accuracy") -> str:
    """The mean accuracy over seeds, with the sample standard deviation and the seed count when
    there is more than one seed."""
    if finals is None:
        return "—"
    vals = [f.get(key) for f in finals]
    vals = [float("nan") if v is None else v for v in vals]
    if any(v != v for v in vals):
        return "nan"
    if len(vals) == 1:
        return f"{vals[0]:.3f}"
    stats = mean_std(vals)  # the sample standard deviation, as `fedbayes compare` reports it
    return f"{stats['mean']:.3f}±{stats['std']:.3f} ({stats['n']})"


def table(out: Path, methods: list[str]) -> str:
    lines = []
    lines.append("### Accuracy against epsilon (client-level DP)\n")
    lines.append("| method | clip C | no DP | " + " | ".join(f"sigma {s}: acc [eps]" for s in NOISE) + " |")
    lines.append("|---|---|---|" + "---|" * len(NOISE))
    for m in methods:
        cells = [_acc(_final(out / f"dp_{m}_none"))]
        for s in NOISE:
            f = _final(out / f"dp_{m}_s{s}")
            cells.append("—" if f is None else f"{_acc(f)} [{f[0].get('epsilon', float('nan')):.1f}]")
        lines.append(f"| {m} | {CLIP[m]} | " + " | ".join(cells) + " |")
    lines.append("\n### Gaussian clipping coordinates (FedEP: natural parameters or mean and log precision)\n")
    lines.append("| method | coordinates | sigma 0 | sigma 1 | acc marg. sigma 1 |")
    lines.append("|---|---|---|---|---|")
    for m in methods:
        if m not in GAUSSIAN:
            continue
        for c in ("natural", "moments"):
            f0, f1 = _final(out / f"coords_{m}_{c}_s0.0"), _final(out / f"coords_{m}_{c}_s1.0")
            marg = "—" if f1 is None or f1[0].get("accuracy_marg") is None else _acc(f1, "accuracy_marg")
            lines.append(f"| {m} | {c} | {_acc(f0)} | {_acc(f1)} | {marg} |")
    lines.append("\n### Accuracy under attack (fraction of clients attacking; columns: aggregation rule)\n")
    aggs = list(AGGREGATORS)
    lines.append("| method | attack | fraction | " + " | ".join(aggs) + " |")
    lines.append("|---|---|---|" + "---|" * len(aggs))
    for m in methods:
        lines.append(f"| {m} | none | 0 | " + " | ".join(_acc(_final(out / f"attack_{m}_{a}_none")) for a in aggs) + " |")
        for kind in KINDS:
            for fr in FRACTIONS:
                row = [_acc(_final(out / f"attack_{m}_{a}_{kind}_{fr}")) for a in aggs]
                if all(c == "—" for c in row):
                    continue
                lines.append(f"| {m} | {kind} | {fr} | " + " | ".join(row) + " |")
    lines.append("\n### Accuracy against dropout probability\n")
    lines.append("| method | " + " | ".join(f"p = {p}" for p in DROPOUTS) + " | clients dropped (p = 0.6) |")
    lines.append("|---|" + "---|" * (len(DROPOUTS) + 1))
    for m in methods:
        last = _final(out / f"dropout_{m}_{DROPOUTS[-1]}")
        dropped = "—" if last is None else str(last[0].get("dropped", "—"))
        lines.append(f"| {m} | " + " | ".join(_acc(_final(out / f"dropout_{m}_{p}")) for p in DROPOUTS) + f" | {dropped} |")
    return "\n".join(lines) + "\n"


def calibrate(methods: list[str], rounds: int = 5) -> None:
    """Prints each method's message norms (median and range over clients, per round) in the base
    setting without DP, from which CLIP was chosen."""
    import jax
    import numpy as np

    from fedbayes.aggregators import Rule, weighted
    from fedbayes.aggregators.robust import row_norms
    from fedbayes.runs.build import build_experiment

    for m in methods:
        config = validate(_merge(BASE, {"name": f"calibrate_{m}", "algorithm": METHODS[m]}))
        exp = build_experiment(config)
        seen: list[np.ndarray] = []

        def recording(key, messages, weights):
            jax.debug.callback(lambda n, w: seen.append(np.asarray(n)[np.asarray(w) > 0]), row_norms(messages), weights)
            return weighted(key, messages, weights)

        sim = exp.simulator
        sim.aggregator = Rule(recording)
        state = sim.init(exp.params)
        for _ in range(rounds):
            state, _ = sim.run_round(state)
        jax.effects_barrier()
        for r, n in enumerate(seen):
            print(f"{m} round {r}: message norm median {np.median(n):.4g} (min {n.min():.4g}, max {n.max():.4g})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/privacy_robust")
    ap.add_argument("--parts", default="dp,coords,attack,dropout", help="comma-separated: dp, coords, attack, dropout")
    ap.add_argument("--methods", default="fedavg,fedpa,fedep,fedlap")
    ap.add_argument("--only", default="", help="comma-separated: run only the runs whose names contain one of these")
    ap.add_argument("--full", action="store_true", help="all of Fashion-MNIST, 50 rounds")
    ap.add_argument("--seeds", type=int, default=1, help="seeds 0 .. N-1 of every run (tables: mean±std (n) over the seeds that finished)")
    ap.add_argument("--table", action="store_true", help="print the tables of finished runs and stop")
    ap.add_argument("--list", action="store_true", help="list the runs and stop")
    ap.add_argument("--calibrate", action="store_true", help="print the methods' message norms without DP (how CLIP was chosen) and stop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    methods = []
    for m in args.methods.split(","):
        if METHODS.get(m, {}).get("name", m) not in ALGORITHMS:
            print(f"note: method {m!r} is not registered here; skipped (allowed: {', '.join(ALGORITHMS)})", file=sys.stderr)
        else:
            methods.append(m)
    if args.calibrate:
        calibrate(methods)
        return 0
    if args.table:
        runs(["dp", "coords", "attack", "dropout"], methods, args.full, MAX_SEEDS)  # the aliases
        print(table(out, methods), end="")
        return 0
    only = [o for o in args.only.split(",") if o]
    plan = {k: v for k, v in runs(args.parts.split(","), methods, args.full, args.seeds).items() if not only or any(o == k or o in k for o in only)}
    if args.list:
        print("\n".join(plan))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    enable_compilation_cache()
    for i, (name, raw) in enumerate(plan.items()):
        status = run_one(name, raw, out)
        print(f"[{i + 1}/{len(plan)}] {name}: {status}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
