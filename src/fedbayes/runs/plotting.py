"""Plots of training curves (matplotlib, headless)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

# (metric, axis label, scale, its marginalised form)
_PANELS = {
    "classification": (
        ("accuracy", "test accuracy", 1.0, "accuracy_marg"),
        ("nll", "test NLL", 1.0, "nll_marg"),
        ("ece", "test ECE (%)", 100.0, "ece_marg"),
    ),
    "regression": (("mse", "test MSE", 1.0, None), ("rmse", "test RMSE", 1.0, None)),
    "multilabel": (("micro_f1", "test micro-F1", 1.0, None), ("recall_at_5", "test recall@5", 1.0, None), ("loss", "test loss", 1.0, None)),
    "next_word": (("accuracy", "test accuracy (no pad/oov/bos/eos)", 1.0, None), ("loss", "test loss", 1.0, None)),
}
_STYLES = ("-", "--", "-.", ":")


def line_styles(n: int) -> list[tuple[str, str]]:
    """``n`` distinct (colour, line style) pairs: the 10 tab10 colours, then again with the next
    dash pattern, so 10+ methods stay distinguishable in print and for colour-blind readers."""
    colours = [f"C{i}" for i in range(10)]
    # The style also changes within the first ten, so neighbours differ in two ways; the pair
    # (i mod 10, (i + i // 10) mod 4) is distinct for the first 40 runs.
    return [(colours[i % 10], _STYLES[(i + i // 10) % len(_STYLES)]) for i in range(n)]


# The y-axes are set by the point curves over the rounds after this share of the run: early rounds
# (every method near chance) and curves far outside (a broken marginalised predictive) would
# otherwise squash the differences between methods into one bundle.
SETTLED_SHARE = 0.2
_MARGIN = 0.05


def panel_limits(series: Sequence[tuple[str, bool, Sequence[float], Sequence[float]]], start: float) -> tuple[tuple[float, float] | None, list[str]]:
    """A panel's y-limits and the curves drawn clipped.

    Args:
      series: ``(label, is_point_curve, rounds, values)`` per curve.
      start: the first round that sets the limits.

    Returns:
      ``(lo, hi)``: the range of the point curves' values from round ``start`` on, stretched to the
      other curves' values (the marginalised predictions) that lie within one such range of it, then
      widened by 5% on each side (``None``: no point curve there); and ``"label above"`` /
      ``"label below"`` for every curve with a value outside ``(lo, hi)`` from round ``start`` on (a
      point curve never is; a curve far off, such as a broken predictive, is).
    """
    settled = [y for _, point, xs, ys in series if point for x, y in zip(xs, ys) if x >= start and math.isfinite(y)]
    if not settled:
        return None, []
    lo, hi = min(settled), max(settled)
    near = [y for _, point, xs, ys in series if not point for x, y in zip(xs, ys) if x >= start and lo - (hi - lo) <= y <= hi + (hi - lo)]
    lo, hi = min([lo, *near]), max([hi, *near])
    pad = _MARGIN * (hi - lo) or _MARGIN * max(abs(hi), 1e-3)
    lo, hi = lo - pad, hi + pad
    clipped = []
    for label, _, xs, ys in series:
        late = [y for x, y in zip(xs, ys) if x >= start]
        if any(not math.isfinite(y) or y > hi for y in late):
            clipped.append(f"{label} above")
        elif any(y < lo for y in late):
            clipped.append(f"{label} below")
    return (lo, hi), clipped


def plot_curves(
    path: str | Path,
    runs: Mapping[str, Sequence[dict]],
    *,
    title: str = "",
    task: str = "classification",
    bands: Mapping[str, Sequence[dict]] | None = None,
) -> Path:
    """Overlays the evaluation curves of several runs, one panel per metric, and saves a PNG.

    Each run has its own colour and line style; a run with marginalised predictions (Bayesian
    methods) also gets its "marg." curve in the same colour, thinner and with square markers.
    The legend sits below the panels, off the data. Each panel's y-axis spans the point curves
    after the first :data:`SETTLED_SHARE` of the rounds (:func:`panel_limits`), so that the methods
    stand apart; a curve outside that range there is drawn clipped at the panel's edge and named
    in the panel ("clipped: ... above/below"); the early rounds leave the panel as they fall.

    Args:
      path: output file.
      runs: label -> the run's ``metrics.jsonl`` records (each with ``round`` and the metrics).
      title: figure title (the experiment's name).
      task: ``"classification"`` or ``"regression"`` (which metrics to draw).
      bands: label -> records of the same rounds holding a spread (the standard deviation over
        seeds, :func:`fedbayes.runs.summaries.mean_curves`): drawn as a shaded band of +-1 spread
        around that run's curve (the mean over seeds).
    """
    import matplotlib  # imported here: pyplot costs about a second at start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _PANELS[task]
    styles = dict(zip(runs, line_styles(len(runs))))
    rounds = [r["round"] for records in runs.values() for r in records]
    start = min(rounds, default=0) + SETTLED_SHARE * (max(rounds, default=0) - min(rounds, default=0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), constrained_layout=True)
    handles, labels = [], []
    for ax, (key, label, scale, marg_key) in zip(axes, panels):
        curves = []  # (run, suffix, width, marker, xs, ys)
        for name, records in runs.items():
            for k, suffix, width, marker in ((key, "", 1.6, "o"), (marg_key, " (marg.)", 1.0, "s")):
                pts = [(r["round"], r[k] * scale) for r in records if k is not None and k in r and r[k] is not None]
                if pts:
                    curves.append((name, suffix, width, marker, *zip(*pts)))
        limits, clipped = panel_limits([(name + suffix, not suffix, xs, ys) for name, suffix, _, _, xs, ys in curves], start)
        for name, suffix, width, marker, xs, ys in curves:
            colour, style = styles[name]
            spread = {r["round"]: r[k] * scale for k in ((marg_key if suffix else key),) for r in (bands or {}).get(name, ()) if k in r}
            if spread and all(x in spread for x in xs):
                lo = [y - spread[x] for x, y in zip(xs, ys)]
                hi = [y + spread[x] for x, y in zip(xs, ys)]
                ax.fill_between(xs, lo, hi, color=colour, alpha=0.15 if not suffix else 0.08, linewidth=0)
            if any(c.startswith(name + suffix + " ") for c in clipped):  # drawn along the edge it leaves by, not lost
                ys = [min(max(y, limits[0]), limits[1]) if x >= start else y for x, y in zip(xs, ys)]
            (line,) = ax.plot(xs, ys, color=colour, linestyle=style, linewidth=width, marker=marker if len(xs) <= 30 else None, markersize=3)
            if ax is axes[0] and name + suffix not in labels:
                handles.append(line)
                labels.append(name + suffix)
        if limits is not None:
            ax.set_ylim(*limits)
        for side, y, va in (("below", 0.04, "bottom"), ("above", 0.96, "top")):  # beside the edge the curves run along
            names = [c.removesuffix(" " + side) for c in clipped if c.endswith(" " + side)]
            if names:
                ax.text(0.98, y, f"clipped {side}: " + ", ".join(names), transform=ax.transAxes, fontsize=6, ha="right", va=va, wrap=True)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    return _save(fig, path, handles, labels, title, ncols=5, dpi=120)


def _save(fig, path: str | Path, handles: list, labels: list, title: str, *, ncols: int, dpi: int) -> Path:
    """The figure's shared legend below the panels, its title, written to ``path`` and closed."""
    import matplotlib.pyplot as plt

    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), ncols), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


_SHIFT_METRICS = (("accuracy", "accuracy", 1.0), ("nll", "NLL", 1.0), ("ece", "ECE (%)", 100.0))


def plot_shift(path: str | Path, body: Mapping, *, title: str = "") -> Path:
    """The shift table as a grid: one column of panels per shift, one row per metric (accuracy,
    NLL, ECE); each method's metric against the shift's intensity, in its own colour and line
    style, and its marginalised predictive (a method with a posterior) in the same colour,
    thinner, with square markers. NLL is drawn on a log scale when it spans more than a factor 10. ``body`` is ``shift.json``'s content (:func:`fedbayes.runs.shift.shift_body`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shifts = body["shifts"]
    methods = body["methods"]
    styles = dict(zip(methods, line_styles(len(methods))))
    fig, axes = plt.subplots(len(_SHIFT_METRICS), len(shifts), figsize=(3.6 * len(shifts), 2.8 * len(_SHIFT_METRICS)), constrained_layout=True, squeeze=False)
    handles, labels = [], []
    for col, (kind, spec) in enumerate(shifts.items()):
        for row, (metric, label, scale) in enumerate(_SHIFT_METRICS):
            ax = axes[row][col]
            for name, m in methods.items():
                colour, style = styles[name]
                recs = [r for r in m["records"] if r["shift"] == kind]
                point = f"{name} (marg.)" if m.get("variational") else name
                for key, text, width, marker in ((metric, point, 1.6, "o"), (metric + "_marg", f"{name} marg.", 1.0, "s")):
                    pts = [(r["level"], r[key] * scale) for r in recs if key in r]
                    if not pts:
                        continue
                    xs, ys = zip(*pts)
                    (line,) = ax.plot(xs, ys, color=colour, linestyle=style, linewidth=width, marker=marker, markersize=3)
                    if text not in labels:
                        handles.append(line)
                        labels.append(text)
            ax.set_xticks(range(len(spec["intensities"])), [f"{v:g}" for v in spec["intensities"]], fontsize=7)
            values = [y for line in ax.get_lines() for y in line.get_ydata()]
            if metric == "nll" and values and min(values) > 0 and max(values) / min(values) > 10:  # a broken predictive's NLL would flatten the others
                ax.set_yscale("log")
            if row == len(_SHIFT_METRICS) - 1:
                ax.set_xlabel(f"{kind}: {spec['unit']}")
            if col == 0:
                ax.set_ylabel(label)
            if row == 0:
                ax.set_title(kind)
            ax.grid(alpha=0.3)
    return _save(fig, path, handles, labels, title, ncols=6, dpi=90)  # twelve panels: a smaller file at the same legibility
