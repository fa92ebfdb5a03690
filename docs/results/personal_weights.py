"""How much of a client's own data to add back: personalisation against its weight.

Trains each variant of a comparison file once per seed (as `fedbayes compare` does) and then
personalises the same final state several ways: a site method with q_k = q_g t_k^w for several
weights w (evaluation.personal_weight), every other variant (and one with evaluation.personal_by =
"fine_tune") by fine-tuning for several epochs (evaluation.personal_epochs). Prints one Markdown table of the mean over clients and the worst 10%
of clients' accuracy (point predictive), averaged over the seeds.

    PYTHONPATH=src python docs/results/personal_weights.py docs/results/personal_digits.toml --personal 0.2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fedbayes.runs.build import DataSpec, build_experiment, build_model
from fedbayes.runs.compare import file_seeds, load_comparison
from fedbayes.runs.personal import build_personalisation

WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)
EPOCHS = (1, 5, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("comparison", type=Path)
    parser.add_argument("--personal", type=float, default=0.2)
    parser.add_argument("--only", default="", help="comma-separated variants (default: all)")
    args = parser.parse_args()
    runs = load_comparison([args.comparison], [f"evaluation.personal_fraction={args.personal!r}"])
    if args.only:
        runs = {name: runs[name] for name in args.only.split(",")}
    seeds = file_seeds([args.comparison]) or [0]
    rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for name, config in runs.items():
        for seed in seeds:
            cfg = config.model_copy(update={"seed": seed})
            exp = build_experiment(cfg)
            sim = exp.simulator
            state = sim.init(exp.params)
            for state, _ in sim.rounds(state, cfg.rounds):
                pass
            model = build_model(cfg, DataSpec.of(exp.dataset))
            site = exp.algorithm.personal_posterior is not None and cfg.evaluation.personal_by == "site"
            for value in WEIGHTS if site else EPOCHS:
                key = "personal_weight" if site else "personal_epochs"
                varied = cfg.model_copy(update={"evaluation": cfg.evaluation.model_copy(update={key: value})})
                body = build_personalisation(varied, exp.algorithm, model, exp.dataset, exp.federation, exp.personal)(
                    state.server_state, state.client_states, cfg.rounds
                )
                point = body["predictives"]["point"]
                label = f"w = {value:g}" if site else f"{value} epochs"
                rows.setdefault((name, label), []).append(
                    (point["global"]["accuracy"]["mean"], point["personal"]["accuracy"]["mean"], point["personal"]["accuracy"]["worst10"])
                )
    print("| method | personalisation | global acc (mean over clients) | personal acc | personal acc, worst 10% |")
    print("|---|---|---|---|---|")
    for (name, label), values in rows.items():
        g, p, w = np.mean(values, axis=0)
        print(f"| {name} | {label} | {g:.3f} | {p:.3f} | {w:.3f} |")


if __name__ == "__main__":
    main()
