"""What a row of FedPA's and FedEP's benchmark tables costs: each paper config (examples/papers/)
run for a few rounds on synthetic files of the real shapes, timed per round, with the device's peak
memory. Writes the Markdown table of docs/results/papers_gpu.md to OUT.

    python scripts/papers_gpu.py OUT.md            # the real models and client sizes (a GPU)
    python scripts/papers_gpu.py --tiny OUT.md     # tiny files and models, three runs: a check on CPU

Each run goes in its own process (the peak memory is that run's). The files are written to a
temporary folder: EMNIST writers of about the real mean size (198 examples), TFF's CIFAR-100 client
size (100 images), StackOverflow users of 128 posts with the 10,000-word and 500-tag vocabularies.
Rounds run the real clients per round and local epochs; FedPA's and FedEP's burn-in is cut to 1
round so that the timed rounds are their sampling rounds. The first round (compilation) is
reported apart; "s / round" is the median of the following rounds (evaluation excluded).
``--budget`` seconds: no run starts after it is spent (the rows done so far are written).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's fedbayes, installed or not
PAPERS = ROOT / "examples" / "papers"
# (config, variant): one row each; the methods whose cost differs (FedPA's sampling, FedEP's
# curvature and NGVI passes), not every row of every table.
RUNS = [
    ("fedpa_emnist", "fedavg_me"),
    ("fedpa_emnist", "fedpa_me"),
    ("fedep_emnist", "fedsep_l"),
    ("fedpa_cifar100", "fedavg_me"),
    ("fedep_cifar100", "fedep_i"),
    ("fedep_cifar100", "fedep_l"),
    ("fedpa_stackoverflow_nwp", "fedavg_me"),
    ("fedpa_stackoverflow_lr", "fedavg_me"),
    ("fedep_stackoverflow_lr", "fedsep_v"),
]
# --tiny runs these (the others' settings are still built and validated): a check of the script on CPU.
TINY_RUNS = [("fedpa_stackoverflow_lr", "fedavg_me"), ("fedep_stackoverflow_lr", "fedsep_v"), ("fedpa_stackoverflow_nwp", "fedavg_me")]
DATASET_CLIENTS = {"emnist": 120, "fed_cifar100": 40, "stackoverflow_nwp": 24, "stackoverflow_lr": 24}


def write_files(folder: Path, tiny: bool) -> None:
    import numpy as np

    from fedbayes.data import writers

    rng = np.random.default_rng(0)
    if tiny:
        writers.write_fed_emnist(folder, rng, num_clients=6, per_client=(3, 5))
        writers.write_fed_cifar100(folder, rng, train_clients=6, test_clients=2, per_client=4)
        writers.write_stackoverflow(folder, rng, num_clients=6, posts_per_client=(2, 4), vocab=30, tags=8)
        return
    writers.write_fed_emnist(folder, rng, num_clients=DATASET_CLIENTS["emnist"], per_client=(120, 276))
    writers.write_fed_cifar100(folder, rng, train_clients=DATASET_CLIENTS["fed_cifar100"], test_clients=10, per_client=100)
    writers.write_stackoverflow(
        folder, rng, num_clients=DATASET_CLIENTS["stackoverflow_lr"], posts_per_client=128, vocab=10_000, tags=500, words_per_post=(10, 40)
    )


def settings(config: str, variant: str, data_dir: Path, store_dir: Path, tiny: bool, per_round: int | None = None):
    from fedbayes.config.schema import deep_merge, read_toml, validate

    raw = read_toml(PAPERS / f"{config}.toml")
    merged = deep_merge(raw["base"], raw["variants"][variant])
    data = merged["data"]
    clients = 6 if tiny else DATASET_CLIENTS[data["dataset"]]
    over = {"rounds": 3, "checkpoint_every": 0, "store_dir": str(store_dir), "data": {"data_dir": str(data_dir), "num_clients": clients}}
    over["server"] = {"clients_per_round": min(merged["server"]["clients_per_round"], clients if not tiny else 2, per_round or clients)}
    if "burn_in_rounds" in merged.get("algorithm", {}):
        over["algorithm"] = {"burn_in_rounds": 1}
    if data["dataset"].startswith("stackoverflow"):
        over["data"].update({"vocab_size": 30 if tiny else 10_000, "test_examples": 20 if tiny else 1000})
        if data["dataset"] == "stackoverflow_lr":
            over["data"]["num_tags"] = 8 if tiny else 500
    if tiny:
        over["client"] = {"epochs": min(merged["client"].get("epochs", 1), 3)}
        if merged["model"]["name"] == "resnet18_gn":
            over["model"] = {"width": 4}
        if merged["model"]["name"] == "lstm_nwp":
            over["model"] = {"width": 8, "embed_dim": 4}
    return validate({**deep_merge(merged, over), "name": f"{config}.{variant}"})


def one_run(config: str, variant: str, data_dir: Path, tiny: bool, per_round: int | None = None) -> dict:
    """Runs one config in this process; returns its row."""
    import jax
    import numpy as np

    from fedbayes.runs.build import build_experiment

    with tempfile.TemporaryDirectory() as store:
        cfg = settings(config, variant, data_dir, Path(store), tiny, per_round)
        exp = build_experiment(cfg, store_dir=Path(store))
        sim = exp.simulator
        state = sim.init(exp.params)
        times = []
        for _ in range(cfg.rounds):
            start = time.perf_counter()
            state, _ = sim.run_round(state, donate=True)
            jax.block_until_ready(sim.server_params(state))
            times.append(time.perf_counter() - start)
        device = jax.devices()[0]
        stats = device.memory_stats() or {}
        peak = stats.get("peak_bytes_in_use")
        return {
            "config": config,
            "variant": variant,
            "params": int(sum(np.prod(p.shape) for p in jax.tree.leaves(exp.params))),
            "clients_per_round": cfg.server.clients_per_round,
            "epochs": cfg.client.epochs,
            "examples": int(exp.federation.sizes.sum()),
            "first_round_s": times[0],
            "round_s": float(np.median(times[1:])),
            "full_rounds": _full_rounds(config),
            "paper_clients_per_round": _paper(config)["server"]["clients_per_round"],
            "peak_mb": None if peak is None else peak / 2**20,
            "device": device.device_kind if device.platform != "cpu" else f"CPU ({os.cpu_count()} cores)",
        }


def _paper(config: str) -> dict:
    from fedbayes.config.schema import read_toml

    return read_toml(PAPERS / f"{config}.toml")["base"]


def _full_rounds(config: str) -> int:
    return int(_paper(config)["rounds"])


def table(rows: list[dict], command: str) -> str:
    lines = [
        f"Command: `{command}`; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        "| config | variant | parameters | clients / round | epochs | first round (s) | s / round | rounds / s | full run (h) | peak device memory (MB) | device |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['config']} | {r['variant']} | failed: {r['error']} |||||||||")
            continue
        # a round with fewer clients than the paper's: the full run scaled by the cohort's size
        # (clients run one after another on CPU; a GPU's vmapped cohort scales less than that)
        scale = r["paper_clients_per_round"] / r["clients_per_round"]
        hours = r["full_rounds"] * r["round_s"] * scale / 3600
        note = f", x{scale:g} clients" if scale != 1 else ""
        peak = "n/a" if r["peak_mb"] is None else f"{r['peak_mb']:,.0f}"
        lines.append(
            f"| {r['config']} | {r['variant']} | {r['params']:,} | {r['clients_per_round']} | {r['epochs']} | {r['first_round_s']:.1f} | "
            f"{r['round_s']:.3f} | {1 / r['round_s']:.2f} | {hours:.1f} ({r['full_rounds']} rounds{note}) | {peak} | {r['device']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="where the Markdown table goes")
    parser.add_argument("--tiny", action="store_true", help="tiny files and models (a CPU check)")
    parser.add_argument("--budget", type=float, default=220.0, help="seconds after which no run starts")
    parser.add_argument("--only", default="", help="comma-separated config.variant names to run (default: all)")
    parser.add_argument("--per-round", type=int, help="at most this many clients per round (CPU measurements; default: the paper's)")
    parser.add_argument("--one", nargs=2, metavar=("CONFIG", "VARIANT"), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(*args.one, args.data, args.tiny, args.per_round)))
        return 0
    start = time.perf_counter()
    runs = [r for r in (TINY_RUNS if args.tiny else RUNS) if not args.only or ".".join(r) in args.only.split(",")]
    rows = []
    command = (
        "python scripts/papers_gpu.py"
        + (" --tiny" if args.tiny else "")
        + (f" --per-round {args.per_round}" if args.per_round else "")
        + (f" --only {args.only}" if args.only else "")
        + " OUT.md"
    )
    with tempfile.TemporaryDirectory() as tmp:
        write_files(Path(tmp), args.tiny)
        for config, variant in RUNS:  # every run's settings are valid before any starts
            settings(config, variant, Path(tmp), Path(tmp), args.tiny)
        print(f"files written in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        for config, variant in runs:
            if time.perf_counter() - start > args.budget:
                print(f"budget spent: skipping {config}.{variant}", file=sys.stderr, flush=True)
                continue
            cmd = [sys.executable, __file__, str(args.out), "--one", config, variant, "--data", tmp] + (["--tiny"] if args.tiny else [])
            cmd += ["--per-round", str(args.per_round)] if args.per_round else []
            try:
                left = max(args.budget - (time.perf_counter() - start), 0.0) + 60.0
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    timeout=left,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))},
                )
            except subprocess.TimeoutExpired:
                rows.append({"config": config, "variant": variant, "error": f"stopped after {left:.0f} s (the budget)"})
                continue
            if proc.returncode == 0:
                rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            else:
                rows.append({"config": config, "variant": variant, "error": " ".join(proc.stderr.strip().splitlines()[-1:])[:200]})
            print(f"{config}.{variant}: {rows[-1]}", file=sys.stderr, flush=True)
            args.out.write_text(table(rows, command))
    print(table(rows, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
