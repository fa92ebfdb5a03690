"""Plots of training curves (matplotlib, headless)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
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
# Lower is better and unbounded: past the untrained model's value a curve says only "worse than not
# training", so that value caps the axis and one diverging method cannot flatten the others.
CAPPED_AT_UNTRAINED = ("nll", "loss", "mse", "rmse")
# Line style says the family, colour the method; the marginalised predictive is dotted.
POINT_STYLE, BAYESIAN_STYLE, MARGINAL_STYLE = "-", "--", ":"
_MARKERS = ("o", "^", "D", "v")


def method_styles(names: Sequence[str], bayesian: Collection[str] = ()) -> dict[str, tuple[str, str, str]]:
    """``name -> (colour, line style, marker)``: solid for a point method, dashed for a Bayesian one
    (those in ``bayesian``: :attr:`fedbayes.algorithms.base.AlgorithmSpec.bayesian`); the 10 tab10
    colours in order, then again with the next marker, so that 40 methods stay apart."""
    return {n: (f"C{i % 10}", BAYESIAN_STYLE if n in bayesian else POINT_STYLE, _MARKERS[(i // 10) % len(_MARKERS)]) for i, n in enumerate(names)}


def untrained_value(runs: Mapping[str, Sequence[dict]], key: str) -> float | None:
    """The median over the runs of ``key`` at round 0, the untrained model's (the runs of a comparison
    start alike, but for a method with its own initialisation); ``None`` when no run has it."""
    values = [r[key] for records in runs.values() for r in records[:1] if r.get("round") == 0 and r.get(key) is not None and math.isfinite(r[key])]
    return statistics.median(values) if values else None


def panel_limits(
    series: Sequence[tuple[str, bool, Sequence[float], Sequence[float]]], start: float, ceiling: float | None = None
) -> tuple[tuple[float, float] | None, list[str]]:
    """A panel's y-limits and the curves drawn clipped.

    Args:
      series: ``(label, is_point_curve, rounds, values)`` per curve.
      start: the first round that sets the limits.
      ceiling: values above it set no limit (the untrained model's NLL: a curve above it is worse than
        not training); ignored when every point curve lies above it.

    Returns:
      ``(lo, hi)``: the range of the point curves' values from round ``start`` on (those up to
      ``ceiling``), stretched to the other curves' values (the marginalised predictions) that lie
      within one such range of it and below ``ceiling``, then widened by 5% on each side (``None``:
      no point curve there); and ``"label above"`` / ``"label below"`` for every curve with a value
      outside ``(lo, hi)`` from round ``start`` on (a point curve only when it passes ``ceiling``; a
      curve far off, such as a broken predictive, is).
    """
    settled = [y for _, point, xs, ys in series if point for x, y in zip(xs, ys) if x >= start and math.isfinite(y)]
    below = [y for y in settled if ceiling is None or y <= ceiling]
    if not below:
        return (None, []) if not settled else panel_limits(series, start)
    lo, hi = min(below), max(below)
    near = [
        y
        for _, point, xs, ys in series
        if not point
        for x, y in zip(xs, ys)
        if x >= start and lo - (hi - lo) <= y <= hi + (hi - lo) and (ceiling is None or y <= ceiling)
    ]
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


def legend_title(point: bool, bayesian: bool, marginal: bool) -> str:
    """What the line styles mean, for the families drawn."""
    parts = [
        ("solid: point methods", point),
        ("dashed: Bayesian methods (their posterior mean)", bayesian),
        ("dotted: averaged over the posterior (marg.)", marginal),
    ]
    return "; ".join(text for text, drawn in parts if drawn)


def curves_figure(
    runs: Mapping[str, Sequence[dict]],
    *,
    title: str = "",
    task: str = "classification",
    bands: Mapping[str, Sequence[dict]] | None = None,
    bayesian: Collection[str] = (),
):
    """The evaluation curves of several runs overlaid, one panel per metric: a matplotlib figure.

    Each run has its own colour; its line style says its family: solid for a point method, dashed for
    a Bayesian one (the names in ``bayesian``), whose marginalised predictions ("marg.") are drawn
    dotted in the same colour, thinner, with square markers. The legend sits below the panels, off
    the data, point methods first, and its title says what the styles mean. Each panel's y-axis spans
    the point curves after the first :data:`SETTLED_SHARE` of the rounds (:func:`panel_limits`), so
    that the methods stand apart; for the metrics of :data:`CAPPED_AT_UNTRAINED` (NLL) it ends at the
    untrained model's value (round 0, :func:`untrained_value`). A curve outside that range there is
    drawn clipped at the panel's edge and named in the panel ("clipped above: ..."), with the cap
    when it is what clipped it; the early rounds leave the panel as they fall.

    Args:
      runs: label -> the run's ``metrics.jsonl`` records (each with ``round`` and the metrics).
      title: figure title (what was run).
      task: ``"classification"`` or ``"regression"`` (which metrics to draw).
      bands: label -> records of the same rounds holding a spread (the standard deviation over
        seeds, :func:`fedbayes.runs.summaries.mean_curves`): drawn as a shaded band of +-1 spread
        around that run's curve (the mean over seeds).
      bayesian: the labels of the runs of Bayesian methods.
    """
    import matplotlib  # imported here: pyplot costs about a second at start-up

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _PANELS[task]
    styles = method_styles(list(runs), bayesian)
    rounds = [r["round"] for records in runs.values() for r in records]
    start = min(rounds, default=0) + SETTLED_SHARE * (max(rounds, default=0) - min(rounds, default=0))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), constrained_layout=True, squeeze=False)
    entries: dict[str, tuple[int, object]] = {}  # legend label -> (order, handle)
    for ax, (key, label, scale, marg_key) in zip(axes[0], panels):
        curves = []  # (run, suffix, width, marker, xs, ys)
        for name, records in runs.items():
            for k, suffix, width, marker in ((key, "", 1.6, styles[name][2]), (marg_key, " (marg.)", 1.0, "s")):
                pts = [(r["round"], r[k] * scale) for r in records if k is not None and k in r and r[k] is not None]
                if pts:
                    curves.append((name, suffix, width, marker, *zip(*pts)))
        untrained = untrained_value(runs, key) if key in CAPPED_AT_UNTRAINED else None
        ceiling = None if untrained is None else untrained * scale
        limits, clipped = panel_limits([(name + suffix, not suffix, xs, ys) for name, suffix, _, _, xs, ys in curves], start, ceiling)
        for name, suffix, width, marker, xs, ys in curves:
            colour, style, _ = styles[name]
            spread = {r["round"]: r[k] * scale for k in ((marg_key if suffix else key),) for r in (bands or {}).get(name, ()) if k in r}
            if spread and all(x in spread for x in xs):
                lo = [y - spread[x] for x, y in zip(xs, ys)]
                hi = [y + spread[x] for x, y in zip(xs, ys)]
                ax.fill_between(xs, lo, hi, color=colour, alpha=0.15 if not suffix else 0.08, linewidth=0)
            if any(c.startswith(name + suffix + " ") for c in clipped):  # drawn along the edge it leaves by, not lost
                ys = [min(max(y, limits[0]), limits[1]) if x >= start else y for x, y in zip(xs, ys)]
            line_style = MARGINAL_STYLE if suffix else style
            (line,) = ax.plot(xs, ys, color=colour, linestyle=line_style, linewidth=width, marker=marker if len(xs) <= 30 else None, markersize=3)
            order = 2 * list(runs).index(name) + bool(suffix) + (2 * len(runs) if name in bayesian else 0)
            entries.setdefault(name + suffix, (order, line))
        if limits is not None:
            ax.set_ylim(*limits)
        late = {name + suffix: [y for x, y in zip(xs, ys) if x >= start] for name, suffix, _, _, xs, ys in curves}
        for side, y, va in (("below", 0.04, "bottom"), ("above", 0.96, "top")):  # beside the edge the curves run along
            names = [c.removesuffix(" " + side) for c in clipped if c.endswith(" " + side)]
            if not names:
                continue
            capped = side == "above" and ceiling is not None and any(not math.isfinite(v) or v > ceiling for n in names for v in late[n])
            note = f" (worse than the untrained model's {ceiling:.3g})" if capped else ""
            ax.text(0.98, y, f"clipped {side}{note}: " + ", ".join(names), transform=ax.transAxes, fontsize=6, ha="right", va=va, wrap=True)
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    labels = sorted(entries, key=lambda text: entries[text][0])
    families = legend_title(any(n not in bayesian for n in runs), any(n in bayesian for n in runs), any(t.endswith(" (marg.)") for t in labels))
    _decorate(fig, [entries[t][1] for t in labels], labels, title, ncols=5, legend_title=families)
    return fig


def plot_curves(
    path: str | Path,
    runs: Mapping[str, Sequence[dict]],
    *,
    title: str = "",
    task: str = "classification",
    bands: Mapping[str, Sequence[dict]] | None = None,
    bayesian: Collection[str] = (),
) -> Path:
    """:func:`curves_figure` saved as a PNG at ``path``."""
    return _save(curves_figure(runs, title=title, task=task, bands=bands, bayesian=bayesian), path, dpi=120)


def _decorate(fig, handles: list, labels: list, title: str, *, ncols: int, legend_title: str = "") -> None:
    """The figure's shared legend below the panels and its title."""
    if handles:
        fig.legend(
            handles, labels, loc="outside lower center", ncols=min(len(labels), ncols), fontsize=8, frameon=False, title=legend_title or None, title_fontsize=8
        )
    if title:
        fig.suptitle(title)


def _save(fig, path: str | Path, *, dpi: int) -> Path:
    """Writes the figure to ``path`` and closes it."""
    import matplotlib.pyplot as plt

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
    _decorate(fig, handles, labels, title, ncols=6)
    return _save(fig, path, dpi=90)  # twelve panels: a smaller file at the same legibility
