"""Are a comparison's calibration examples exchangeable with its test set? (docs/results/conformal.md)

    .venv/bin/python docs/results/conformal_exchangeable.py runs/conformal_fmnist fedavg

For each seed of the variant: the final model's accuracy on the clients' calibration examples, the
test set and the training examples; the pooled threshold q and the test coverage it gives; the
two-sample Kolmogorov-Smirnov p-value of the calibration scores against the test scores (LAC); and
the fraction of calibration scores at most the test scores' 0.9-quantile.
"""

import sys
from pathlib import Path

import numpy as np
from scipy import stats

from fedbayes.config.schema import load_config
from fedbayes.evaluation import conformal as cf
from fedbayes.evaluation.evaluators import make_probabilities
from fedbayes.runs.build import DataSpec, build_experiment, build_model
from fedbayes.runs.export import load_model


def main(out: Path, variant: str) -> None:
    print(
        "| seed | N | accuracy calibration / test / training | q | test coverage | KS p | calibration scores <= test 0.9-quantile |\n|---|---|---|---|---|---|---|"
    )
    for run in sorted((out / variant).glob("seed_*")):
        cfg = load_config(run / "config.toml")
        exp = build_experiment(cfg)
        predict = make_probabilities(build_model(cfg, DataSpec.of(exp.dataset)).apply_fn)
        params = load_model(run / "model.npz")["params"]
        d = exp.dataset
        cal, train = np.concatenate(exp.calibration), np.concatenate(exp.federation.client_indices)
        p_cal, p_test, p_train = predict(params, d.x_train[cal]), predict(params, d.x_test), predict(params, d.x_train[train])
        s_cal, s_test = cf.label_scores(p_cal, d.y_train[cal]), cf.label_scores(p_test, d.y_test)
        q = cf.pooled_quantile(s_cal, cfg.evaluation.conformal_alpha)
        acc = [np.mean(p.argmax(1) == y) for p, y in ((p_cal, d.y_train[cal]), (p_test, d.y_test), (p_train, d.y_train[train]))]
        print(
            f"| {cfg.seed} | {len(cal)} | {' / '.join(f'{a:.3f}' for a in acc)} | {q:.4f} | {np.mean(s_test <= q):.3f} | "
            f"{stats.ks_2samp(s_cal, s_test).pvalue:.2f} | {np.mean(s_cal <= np.quantile(s_test, 0.9)):.3f} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
