"""Plots of training curves (matplotlib, headless)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

_PANELS = {
    "classification": (("accuracy", "test accuracy", 1.0), ("nll", "test NLL", 1.0), ("ece", "test ECE (%)", 100.0)),
    "regression": (("mse", "test MSE", 1.0), ("loss", "test loss", 1.0)),
}


def plot_curves(path: str | Path, runs: Mapping[str, Sequence[dict]], *, title: str = "", task: str = "classification") -> Path:
    """Overlays the evaluation curves of several runs, one panel per metric, and saves a PNG.

    Args:
      path: output file.
      runs: label -> the run's ``metrics.jsonl`` records (each with ``round`` and the metrics).
      title: figure title.
      task: ``"classification"`` or ``"regression"`` (which metrics to draw).
    """
    import matplotlib  # imported here: pyplot costs about a second at start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _PANELS[task]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), constrained_layout=True)
    for ax, (key, label, scale) in zip(axes, panels):
        for name, records in runs.items():
            pts = [(r["round"], r[key] * scale) for r in records if key in r]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(xs) <= 30 else None, markersize=3, label=name)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
