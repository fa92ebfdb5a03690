"""Figures of the toy problems (matplotlib, headless): Al-Shedivat et al. 2021 (FedPA) Figs. 1 and 3, Guo et al. 2023 (FedEP) Figs. 1 and 4."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _pyplot():
    import matplotlib  # imported here: pyplot costs about a second at start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def plot_quadratic(result, path: str | Path) -> Path:
    """Three panels: the two clients and the product with every estimate (Guo et al. 2023 (FedEP) Fig. 1), the
    server's distance to ``theta*`` per round (Al-Shedivat et al. 2021 (FedPA) Fig. 1; mean over runs, min-max band),
    and the EP distance per step (diagonal and scaled identity)."""
    plt = _pyplot()
    from scipy.stats import multivariate_normal

    means, covs = result.problem
    opt = result.optimum
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4), constrained_layout=True)

    ax = axes[0]
    pts = np.concatenate([means, opt[None], np.stack(list(result.estimates.values()))])
    lo, hi = pts.min(0) - 6.0, pts.max(0) + 6.0
    xs, ys = np.meshgrid(np.linspace(lo[0], hi[0], 200), np.linspace(lo[1], hi[1], 200))
    grid = np.dstack([xs, ys])
    for m, c in zip(means, covs):
        ax.contour(xs, ys, multivariate_normal(m, c).pdf(grid), levels=4, colors="0.6", linewidths=0.8)
    prec = np.linalg.inv(covs).sum(0)
    ax.contour(xs, ys, multivariate_normal(opt, np.linalg.inv(prec)).pdf(grid), levels=4, colors="k", linewidths=1.0)
    ax.plot(*opt, "k*", markersize=14, label="optimum (product mean)")
    style = {"fedavg_oneshot": ("s", "C0"), "fedpa_oneshot": ("^", "C1"), "fedep_diag": ("o", "C3"), "fedep_iso": ("D", "C2")}
    for name, (marker, color) in style.items():
        if name in result.estimates:
            ax.plot(*result.estimates[name], marker, color=color, markersize=8, label=name, alpha=0.8)
    for name, est in result.estimates.items():
        if name not in style:
            ax.plot(*est, "x", markersize=7, label=f"{name} (fixed point)")
    ax.set_title("clients, product and estimates")
    ax.set_xlabel(r"$\theta_1$")
    ax.set_ylabel(r"$\theta_2$")
    ax.legend(fontsize=6.5, loc="best")

    ax = axes[1]
    for name, dist in result.curves.items():
        rounds = np.arange(dist.shape[0])
        line = ax.plot(rounds, dist.mean(1), label=name)[0]
        ax.fill_between(rounds, dist.min(1), dist.max(1), color=line.get_color(), alpha=0.15)
    ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel(r"$\|\theta_t - \theta^\star\|$")
    s = result.settings
    ax.set_title(f"server loop ({s['inits']} runs, FedPA rho={s['rho']}, {s['sampler']} samples)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)

    ax = axes[2]
    for name, dist in result.ep_curves.items():
        ax.plot(np.arange(1, len(dist) + 1), np.maximum(dist, 1e-17), marker="o" if len(dist) <= 20 else None, markersize=3, label=name)
    ax.set_yscale("log")
    ax.set_xlabel("EP step")
    ax.set_ylabel(r"$\|\mu_g - \theta^\star\|$")
    ax.set_title("EP with exact tilted moments")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_niw(result, path: str | Path) -> Path:
    """Mean distance to the exact global mean per EP step, with FedAvg and FedPA as levels
    (Guo et al. 2023 (FedEP) Fig. 4 left)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    for name, curve in result.curves.items():
        ax.plot(np.arange(1, len(curve) + 1), np.maximum(curve, 1e-17), label=name)
    for name, color in (("fedavg", "C7"), ("fedpa", "C1")):
        ax.axhline(float(np.mean(result.distances[name])), color=color, linestyle="--", label=f"{name} (one shot)")
    s = result.settings
    ax.set_yscale("log")
    ax.set_xlabel("EP step")
    ax.set_ylabel("mean distance to the global mean")
    ax.set_title(f"NIW clients: {s['trials']} trials, K={s['clients']}, d={s['dim']}, damping={s['damping']:.2g}")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_least_squares(result, path: str | Path) -> Path:
    """One row per dimension: FedAvg vs local steps, FedPA vs local steps, FedPA vs shrinkage;
    bias (solid, left axis) and variance (dashed, right axis), as Al-Shedivat et al. 2021 (FedPA) Fig. 3."""
    plt = _pyplot()
    dims = list(result.by_dim)
    fig, axes = plt.subplots(len(dims), 3, figsize=(14, 3.4 * len(dims)), constrained_layout=True, squeeze=False)
    for row, dim in zip(axes, dims):
        r = result.by_dim[dim]
        panels = (
            ("fedavg", r["fedavg"]["steps"], "local steps", "FedAvg"),
            ("fedpa", r["fedpa"]["steps"], "local steps (burn-in excluded)", f"FedPA, rho={r['fedpa']['rho']}"),
            ("fedpa_rho", r["fedpa_rho"]["rho"], "shrinkage rho", f"FedPA, {r['fedpa_rho']['steps']} steps"),
        )
        for ax, (name, xs, xlabel, title) in zip(row, panels):
            ax.plot(xs, r[name]["bias"], "o-", color="C0", label="bias")
            if name == "fedavg":
                ax.plot(xs, r[name]["bias_exact"], ":", color="C0", label="bias (closed form)")
            ax.set_xscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("bias", color="C0")
            ax.set_title(f"d={dim}: {title}")
            ax.grid(alpha=0.3)
            twin = ax.twinx()
            twin.plot(xs, r[name]["variance"], "s--", color="C3", label="variance")
            twin.set_yscale("log")
            twin.set_ylabel(r"variance $\|Cov\|_F$", color="C3")
            lines = ax.get_lines() + twin.get_lines()
            ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="best")
    return _save(fig, path)
