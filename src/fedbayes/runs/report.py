"""Result tables of runs and comparisons: plain text that fits the terminal, Markdown and JSON.

A table never cuts a method name or a number. When the columns do not fit the width, optional
columns are left out (least useful first, a footnote says which); when even the essential columns
do not fit, every method is printed as a block of ``column: value`` lines instead. Marginalised
columns ("marg.") appear only when some method has marginalised predictions, and the conformal
sets' coverage and size only when some run has them, and the personalisation columns (the global
and the personalised model's mean accuracy over the clients' own test examples) only when some run
has them; a regression run
gets its own columns (MSE, RMSE). Swaroop et al. 2025 (ADMM and Bayes)'s curve summaries (the mean and max accuracy over
rounds R-2..R, :mod:`fedbayes.runs.summaries`) appear when the summaries carry curves. A summary over
several seeds (:func:`fedbayes.runs.summaries.aggregate`) shows each number as ``mean±std`` and a
"seeds" column.

The width is the terminal's; when the output is not a terminal, ``$COLUMNS`` when set, else
:data:`PIPE_WIDTH`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence

PIPE_WIDTH = 160  # logs and CI: do not squeeze tables into 80 columns unless COLUMNS says so
GAP = 2  # spaces between columns


@dataclasses.dataclass(frozen=True)
class Column:
    """One table column.

    Attributes:
      header: the column title (may wrap at spaces).
      value: ``(name, summary, records) -> str``.
      left: left-aligned (text) rather than right-aligned (numbers).
      keep: rank when columns must be left out: 0 is never left out; higher ranks go first.
    """

    header: str
    value: Callable[[str, dict, Sequence[dict]], str]
    left: bool = False
    keep: int = 0


def format_value(v, pct: bool = False, digits: int = 4) -> str:
    """One table cell: a number (``digits`` decimals; ``pct``: as a percentage), ``—`` for None, or
    a mean over seeds (:func:`fedbayes.runs.summaries.mean_std`) with its standard deviation as
    ``mean±std`` (one token; ``[n/of]`` follows when only ``n`` of ``of`` seeds have a value)."""
    if isinstance(v, Mapping) and "mean" in v:
        if v.get("mean") is None:
            return "—"
        text = format_value(v["mean"], pct, digits) + ("" if v.get("std") is None else "±" + format_value(v["std"], pct, digits))
        return text if v.get("n", 0) == v.get("of", 0) else f"{text}[{v['n']}/{v['of']}]"
    if v is None:
        return "—"
    return f"{100 * v:.2f}" if pct else f"{v:.{digits}f}"


def _mean(v):
    """A plain number, or the mean of a :func:`fedbayes.runs.summaries.mean_std`."""
    return v.get("mean") if isinstance(v, Mapping) else v


def _final(key: str, pct: bool = False, digits: int = 4):
    return lambda name, s, recs: format_value(s.get("final", {}).get(key), pct, digits)


def is_regression(summary: dict) -> bool:
    return "mse" in summary.get("final", {}) and "accuracy" not in summary.get("final", {})


def rounds_to_value(threshold: float):
    """The "rounds to" cell at ``threshold``: the first evaluated round whose accuracy reaches it (the
    mean over seeds for a summary over seeds), ``—`` when never reached."""
    from fedbayes.evaluation.metrics import rounds_to_threshold

    def value(name, s, recs):
        if "curve" in s:  # over seeds (fedbayes.runs.summaries.aggregate): the mean of each seed's round
            rt = s["curve"].get("rounds_to") if s["curve"].get("threshold") == threshold else None
            return "—" if rt is None else format_value(rt, digits=1)
        if recs:
            try:
                rt = rounds_to_threshold([r["round"] for r in recs], [r["accuracy"] for r in recs], threshold, window=1)
            except (KeyError, ValueError):  # a damaged metrics file must not lose the whole table
                rt = s.get("rounds_to", {}).get(f"{threshold:.2f}")
        else:
            rt = s.get("rounds_to", {}).get(f"{threshold:.2f}")
        return "—" if rt is None else str(rt)

    return value


def _curve(field: str, digits: int = 4):
    """Swaroop et al. 2025 (ADMM and Bayes)'s curve summaries (:mod:`fedbayes.runs.summaries`): the mean or max of the metric over
    rounds R-2..R; over seeds when the summary has them, else from the run's records."""
    from fedbayes.runs.summaries import curve_summary

    def value(name, s, recs):
        if "curve" in s:
            return format_value(s["curve"].get(field), digits=digits)
        if recs:
            try:
                c = curve_summary(recs)
            except (KeyError, TypeError, ValueError):
                c = None
            if c is not None:
                return format_value(c[field], digits=digits)
        return format_value(s.get("final_mean_3"), digits=digits) if field == "mean_last" else "—"

    return value


def seeds_value(name, s, recs):
    """The "seeds" cell of a summary over seeds: their count, or ``ok/all`` when some diverged."""
    seeds, bad = s.get("seeds") or [], s.get("diverged_seeds") or {}
    return str(len(seeds)) if not bad else f"{len(seeds) - len(bad)}/{len(seeds)}"


def _fixed_points(s) -> list:
    """The ``fixed_point`` verdicts of a summary's runs: each seed's for a summary over seeds."""
    return [r.get("fixed_point") for r in s["runs"].values()] if "runs" in s else [s.get("fixed_point")]


def fixed_point_value(name, s, recs):
    """The "fixed point" cell (:class:`fedbayes.runs.health.FixedPointCheck`): "yes" when the
    posterior only jittered over the run's last rounds, "no (drift)" when it still drifted at this
    round budget (the larger of the drifts that counted: the mean's relative drift, the variances'
    log drift), "—" when not judged (a point method, a short run); over seeds, "no k/n" with the
    largest such drift."""
    per_run = _fixed_points(s)
    judged = [f for f in per_run if f]
    if not judged:
        return "—"
    moving = [f for f in judged if not f["settled"]]
    if not moving:
        return "yes"
    drift = max(f[f"{kind}_drift"] for f in moving for kind in f.get("moved") or ("mean", "var"))
    count = f" {len(moving)}/{len(judged)}" if len(per_run) > 1 else ""
    return f"no{count} ({100 * drift:.1f}%)"


def _best_mse(name, s, recs):
    values = [r["mse"] for r in recs if "mse" in r]
    return format_value(min(values), digits=5) if values else "—"


def seconds_value(name, s, recs):
    """The "train s" cell: the run's total training seconds (the mean over seeds for a summary over seeds)."""
    f = s.get("final", {})
    return f"{_mean(f.get('seconds_total', f.get('seconds', 0.0))) or 0.0:.1f}"


def compile_value(name, s, recs):
    """The "compile s" cell: JAX's compilation during the run, which "train s" leaves out
    (:mod:`fedbayes.runs.compile_clock`); "—" for a run finished earlier, whose process is gone."""
    v = s.get("compile_seconds")
    return "—" if v is None else f"{v:.1f}"


def _mb_up(name, s, recs):
    f = s.get("final", {})
    return f"{(_mean(f.get('bytes_up_total', f.get('bytes_up', 0))) or 0) / 1e6:.1f}"


def bytes_text(n: int) -> str:
    """A byte count for a cell: whole bytes under 1 kB, else three significant digits in kB, MB or
    GB (powers of 1000, as "MB up (total)")."""
    if n < 1000:
        return f"{n} B"
    for unit, scale in (("kB", 1e3), ("MB", 1e6)):
        if n < 999.5 * scale:  # what rounds to 1000 kB is 1 MB
            return f"{n / scale:.3g} {unit}"
    return f"{n / 1e9:.3g} GB"


def message_value(name, s, recs):
    """The "up per message" cell: the bytes of one client's message, what each client uploads per
    round (``summary.json``'s ``message_bytes``, from the run's message template; "—" for a run
    recorded before the field existed). A site method's structure sets it: its natural-parameter
    difference is ``2 D`` float32 numbers with ``covariance = "diagonal"``, ``D + D^2`` with
    ``"full"``, ``2 D - B + B^2`` with ``"last_layer"`` (``B`` the last layer's weights), beside a few
    scalars (the validity flag, the loss)."""
    up = (s.get("message_bytes") or {}).get("up")
    return "—" if up is None else bytes_text(int(up))


def _epsilon(name, s, recs):
    final = s.get("final", {})
    if "epsilon" not in final:
        return "—"
    v = _mean(final["epsilon"])  # a mean over seeds (the same for every seed) or one run's
    return "inf" if v is None or v == float("inf") else f"{v:.2f}"


# (header, metric, keep) of a multi-label run (fedbayes.evaluation.multilabel)
_MULTILABEL_COLUMNS = (
    ("precision", "precision", 0),
    ("recall", "recall", 2),
    ("recall@5", "recall_at_5", 0),
    ("micro-F1", "micro_f1", 0),
    ("macro-F1", "macro_f1", 0),
    ("loss", "loss", 3),
)


def columns(summaries: Mapping[str, dict], threshold: float = 0.8) -> list[Column]:
    """The columns for these summaries: classification or regression; "marg." only when present.

    When the table must be narrowed, the Bayesian columns (the marginalised predictions and
    whether the posterior reached its fixed point), which this library exists for, are left out
    last, after the point predictions' secondary columns, the curve summaries, time and upload."""
    cols = [
        Column("method", lambda n, s, r: n, left=True),
        Column("algorithm", lambda n, s, r: str(s.get("algorithm", "")), left=True, keep=9),
        Column("server opt", lambda n, s, r: str(s.get("server_optimizer", "")), left=True, keep=10),
    ]
    over_seeds = any("seeds" in s for s in summaries.values())
    if over_seeds:
        cols.append(Column("seeds", seeds_value, keep=8))
    # Swaroop et al. 2025 (ADMM and Bayes)'s curve summaries (mean and max over rounds R-2..R), when some summary has a curve
    curves_known = any("curve" in s or "final_mean_3" in s for s in summaries.values())
    if summaries and all("micro_f1" in s.get("final", {}) for s in summaries.values()):  # multi-label tag prediction
        cols += [Column(label, _final(key), keep=k) for label, key, k in _MULTILABEL_COLUMNS]
    elif summaries and all(is_regression(s) for s in summaries.values()):
        cols += [
            Column("MSE", _final("mse", digits=5)),
            Column("RMSE", _final("rmse", digits=5), keep=3),
            Column("best MSE", _best_mse, keep=5),
        ]
        if curves_known:
            cols.append(Column("MSE mean R-2..R", _curve("mean_last", digits=5), keep=6))
    else:
        cols += [
            Column("accuracy", _final("accuracy")),
            Column("NLL", _final("nll"), keep=3),
            Column("ECE (%)", _final("ece", pct=True), keep=4),
        ]
        if any("accuracy_marg" in s.get("final", {}) for s in summaries.values()):
            cols += [
                Column("acc marg.", _final("accuracy_marg"), keep=2),
                Column("NLL marg.", _final("nll_marg"), keep=1),
                Column("ECE marg. (%)", _final("ece_marg", pct=True), keep=2),
            ]
        if any("coverage" in s.get("final", {}) for s in summaries.values()):  # conformal sets (fedbayes.runs.conformal)
            cols += [
                Column("coverage", _final("coverage"), keep=1),
                Column("set size", _final("set_size", digits=2), keep=1),
                Column("cov. client min", _final("coverage_client_min"), keep=5),
            ]
            if any("coverage_marg" in s.get("final", {}) for s in summaries.values()):
                cols += [Column("cov. marg.", _final("coverage_marg"), keep=2), Column("set size marg.", _final("set_size_marg", digits=2), keep=2)]
        if any("personal_accuracy" in s.get("final", {}) for s in summaries.values()):  # personalisation (fedbayes.runs.personal)
            cols += [
                Column("client acc", _final("client_accuracy"), keep=1),
                Column("personal acc", _final("personal_accuracy"), keep=1),
                Column("personal acc worst 10%", _final("personal_accuracy_worst10"), keep=2),
                Column("personal NLL", _final("personal_nll"), keep=3),
            ]
        if curves_known:
            cols += [Column("acc mean R-2..R", _curve("mean_last"), keep=5), Column("acc max R-2..R", _curve("max_last"), keep=7)]
        if any("epsilon" in s.get("final", {}) for s in summaries.values()):
            cols += [Column("epsilon", _epsilon, keep=4)]  # client-level DP (fedbayes.aggregators.dp); inf: no noise
        cols += [
            Column("best acc", lambda n, s, r: format_value(s.get("best_accuracy")), keep=7),
            Column(f"rounds to {threshold:.0%}", rounds_to_value(threshold), keep=6),
        ]
    if any(any(_fixed_points(s)) for s in summaries.values()):
        cols.append(Column("fixed point", fixed_point_value, keep=1))
    cols.append(Column("train s (total)", seconds_value, keep=6))
    if any("compile_seconds" in s for s in summaries.values()):
        cols.append(Column("compile s", compile_value, keep=8))
    if any("message_bytes" in s for s in summaries.values()):
        # one message's size tells the structures apart (diagonal vs full); kept longer than the totals
        cols.append(Column("up per message", message_value, keep=7))
    cols.append(Column("MB up (total)", _mb_up, keep=8))
    return cols


def cells(summaries: Mapping[str, dict], cols: Sequence[Column], curves: Mapping[str, Sequence[dict]] | None = None) -> list[list[str]]:
    """The table's cells; a diverged run shows where it diverged instead of its numbers."""
    curves = curves or {}
    rows = []
    for name, s in summaries.items():
        if s.get("diverged"):
            d = s["diverged"]
            row = [c.value(name, s, []) if c.left else "—" for c in cols]
            row[next(i for i, c in enumerate(cols) if not c.left)] = f"diverged (round {d['round']}: {d['metric']})"
        else:
            row = [c.value(name, s, curves.get(name) or []) for c in cols]
        rows.append(row)
    return rows


def terminal_width(stream=None) -> int:
    """The terminal's width; when not a terminal, ``$COLUMNS`` if set, else :data:`PIPE_WIDTH`."""
    stream = stream or sys.stdout
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        if stream.isatty():
            return shutil.get_terminal_size((PIPE_WIDTH, 24)).columns
    except (AttributeError, ValueError, OSError):
        pass
    return PIPE_WIDTH


def _wrap_header(header: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in header.split(" "):
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]


def _widths(cols: Sequence[Column], rows: Sequence[Sequence[str]]) -> list[int]:
    """Each column as wide as its widest cell or the longest word of its header."""
    return [max([len(r[i]) for r in rows] + [max(len(w) for w in c.header.split(" "))]) for i, c in enumerate(cols)]


def _grid(cols: Sequence[Column], rows: Sequence[Sequence[str]], widths: Sequence[int]) -> list[str]:
    headers = [_wrap_header(c.header, w) for c, w in zip(cols, widths)]
    height = max(len(h) for h in headers)
    headers = [[""] * (height - len(h)) + h for h in headers]  # bottom-aligned titles

    def line(parts):
        text = (" " * GAP).join(p.ljust(w) if c.left else p.rjust(w) for c, p, w in zip(cols, parts, widths))
        return text.rstrip()

    out = [line([h[i] for h in headers]) for i in range(height)]
    out.append((" " * GAP).join("-" * w for w in widths))
    out += [line(r) for r in rows]
    return out


def render(
    summaries: Mapping[str, dict],
    *,
    width: int | None = None,
    threshold: float = 0.8,
    curves: Mapping[str, Sequence[dict]] | None = None,
    title: str | None = None,
    full: str = "--json",
) -> str:
    """The table as plain text no wider than ``width`` (default :func:`terminal_width`); ``full``:
    where every column is (named in the note on the columns left out)."""
    cols = columns(summaries, threshold)
    return render_rows(cols, cells(summaries, cols, curves), width=width, title=title, full=full)


def render_rows(cols: Sequence[Column], rows: Sequence[Sequence[str]], *, width: int | None = None, title: str | None = None, full: str = "--json") -> str:
    """Any table of cells as plain text no wider than ``width``, by the rules of :func:`render`
    (optional columns left out by rank, else one block per row); the first column names the row.
    ``full`` says where the columns left out can be read (an option or a file that exists)."""
    width = width or terminal_width()
    keep = list(range(len(cols)))
    dropped: list[str] = []

    def total(idx):
        w = _widths([cols[i] for i in idx], [[r[i] for i in idx] for r in rows])
        return sum(w) + GAP * (len(w) - 1)

    for rank in sorted({c.keep for c in cols if c.keep}, reverse=True):
        if total(keep) <= width:
            break
        for i in [i for i in keep if cols[i].keep == rank][::-1]:
            if total(keep) <= width:
                break
            keep.remove(i)
            dropped.append(cols[i].header)
    lines = textwrap.wrap(title, width, break_long_words=False, break_on_hyphens=False) if title else []
    if total(keep) <= width:
        sub_cols = [cols[i] for i in keep]
        sub_rows = [[r[i] for i in keep] for r in rows]
        lines += _grid(sub_cols, sub_rows, _widths(sub_cols, sub_rows))
        if dropped:
            note = f"({len(dropped)} column(s) left out to fit {width} columns: {', '.join(dropped)}; all in {full})"
            lines += textwrap.wrap(note, width, break_long_words=False, break_on_hyphens=False)
    else:  # too narrow for a grid: one block per method, every value whole (wrapped at spaces)
        wrap = functools.partial(textwrap.wrap, width=width, break_long_words=False, break_on_hyphens=False)
        for r in rows:
            lines += wrap(r[0])
            for c, v in zip(cols[1:], r[1:]):
                lines += wrap(f"{c.header}: {v}", initial_indent="  ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"


def markdown(summaries: Mapping[str, dict], *, threshold: float = 0.8, curves: Mapping[str, Sequence[dict]] | None = None) -> str:
    """Every column as a Markdown table (for ``compare.md``)."""
    cols = columns(summaries, threshold)
    return markdown_rows(cols, cells(summaries, cols, curves))


def markdown_rows(cols: Sequence[Column], rows: Sequence[Sequence[str]]) -> str:
    """Any table of cells as Markdown, every column kept."""
    md = ["| " + " | ".join(c.header for c in cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(md) + "\n"


def markdown_as_text(md: str, *, width: int | None = None, full: str = "the Markdown file") -> str:
    """A Markdown report (paragraphs, ``###`` headings, tables) as plain text no wider than
    ``width`` (default :func:`terminal_width`): paragraphs wrapped at spaces, each table by the
    rules of :func:`render_rows` (its first column kept; the others left out from the right, with
    a note naming them and ``full``)."""
    width = width or terminal_width()
    out: list[str] = []
    table: list[list[str]] = []

    def flush():
        if table:
            header, rows = table[0], [r for r in table[2:]]
            cols = [Column(h, lambda n, s, r: "", left=(i == 0), keep=i) for i, h in enumerate(header)]
            out.append(render_rows(cols, rows, width=width, full=full).rstrip("\n"))
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
            continue
        flush()
        text = line.lstrip("#").strip() if line.startswith("#") else line
        out += textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False) or [""]
    flush()
    return "\n".join(out) + "\n"


def reference_table(summaries: Mapping[str, dict], curves: Mapping[str, Sequence[dict]], reference) -> tuple[list[Column], list[list[str]]]:
    """Our curve summary beside a paper's number for each variant of a comparison.

    ``reference`` is a :class:`fedbayes.config.schema.ReferenceTable`. Ours is the test accuracy's mean
    (or max) over rounds R-2..R in percent, ``mean±std`` over seeds when the comparison has them;
    "difference" is ours minus the paper's mean. Variants the paper has no number for show "—".
    """
    from fedbayes.runs.summaries import curve_summary

    field = reference.summary

    def ours(name, s):
        if s.get("diverged"):
            return None
        if "curve" in s:
            return s["curve"].get(field)
        c = curve_summary(curves.get(name) or [])
        return None if c is None else c[field]

    def paper_mean(v):
        if isinstance(v, (int, float)):
            return float(v)
        head = str(v).split("(")[0].split("±")[0].strip()
        try:
            return float(head)
        except ValueError:
            return None

    label = {"mean_last": "mean", "max_last": "max"}[field]
    cols = [
        Column("method", lambda n, s, r: n, left=True),
        Column(f"ours: acc {label} R-2..R (%)", lambda n, s, r: ""),
        Column("paper (%)", lambda n, s, r: ""),
        Column("difference", lambda n, s, r: "", keep=1),
    ]
    rows = []
    for name, s in summaries.items():
        v = ours(name, s)
        text = "diverged" if s.get("diverged") else format_value(v, pct=True).replace("±", " ± ") if v is not None else "—"
        p = reference.values.get(name)
        pm = paper_mean(p) if p is not None else None
        m = _mean(v) if v is not None else None
        diff = f"{100 * m - pm:+.2f}" if (m is not None and pm is not None) else "—"
        rows.append([name, text, "—" if p is None else str(p), diff])
    return cols, rows


# ----- the shift table (fedbayes.runs.shift) ------------------------------------------------------


def shift_rows(body: Mapping) -> list[tuple[str, str, dict]]:
    """The rows of the shift tables: ``(label, metric suffix, method)``: each method's point
    predictions, and beside them its marginalised ones (``*_marg``) when it has a posterior. A
    variational model's one row is its marginalised predictive (its only metrics)."""
    rows = []
    for name, m in body["methods"].items():
        recs = m["records"]
        rows.append((f"{name} (marg.)" if m.get("variational") else name, "", m))
        if any("accuracy_marg" in r for r in recs):
            rows.append((f"{name} marg.", "_marg", m))
    return rows


def _shift_value(record: Mapping | None, metric: str) -> str:
    if record is None or metric not in record:
        return "—"
    v = record[metric]
    return f"{100 * v:.1f}" if metric.startswith("ece") else f"{v:.3f}"


def shift_markdown(body: Mapping) -> str:
    """``shift.md``: for each metric, its mean over the shifted levels of each shift (and the clean
    value), one row per method (and per marginalised predictive); then one table per shift with
    ``accuracy / NLL / ECE (%)`` at every level."""
    shifts = body["shifts"]
    rows = shift_rows(body)
    seeds = body.get("seeds")
    out = [
        f"Dataset shift (Ovadia et al. 2019): {body['dataset']} test set; "
        + ", ".join(f"{k} at {', '.join(f'{v:g}' for v in s['intensities'])} ({s['unit']})" for k, s in shifts.items())
        + ". Level 0 is the clean test set. "
        + (f"Means over seeds {seeds} (their standard deviations are in shift.json). " if seeds else "")
        + "A row `NAME marg.` is the method's marginalised predictive over its posterior; `(marg.)` marks a variational model, whose metrics are all marginalised.\n"
    ]
    shown = [("accuracy", "accuracy"), ("nll", "NLL"), ("ece", "ECE (%)")]
    if any("coverage" in r for m in body["methods"].values() for r in m["records"]):  # conformal sets (fedbayes.runs.conformal)
        shown += [("coverage", "conformal coverage"), ("set_size", "conformal set size")]
    for metric, title in shown:
        cols = ["method", "clean"] + [f"{k} (mean of levels 1-{len(s['intensities']) - 1})" for k, s in shifts.items()]
        lines = [f"\n**{title}**, clean and averaged over each shift's levels:\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for label, suffix, m in rows:
            key = metric + suffix
            clean = next((r for r in m["records"] if r["level"] == 0), None)
            cells = [label, _shift_value(clean, key)]
            for kind in shifts:
                values = [r[key] for r in m["records"] if r["shift"] == kind and r["level"] > 0 and key in r]
                cells.append(_shift_value({key: float(sum(values) / len(values))}, key) if values else "—")
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    for kind, s in shifts.items():
        cols = ["method"] + [f"{v:g}" for v in s["intensities"]]
        lines = [f"\n**{kind}** ({s['unit']}): accuracy / NLL / ECE (%) at each level:\n", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for label, suffix, m in rows:
            by_level = {r["level"]: r for r in m["records"] if r["shift"] == kind}
            cells = [label] + [
                " / ".join(_shift_value(by_level.get(level), metric + suffix) for metric in ("accuracy", "nll", "ece"))
                for level in range(len(s["intensities"]))
            ]
            lines.append("| " + " | ".join(cells) + " |")
        out.append("\n".join(lines) + "\n")
    return "".join(out)
