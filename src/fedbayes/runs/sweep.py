"""Hyperparameter sweeps over a grid of settings, several seeds each (``fedbayes sweep``).

A sweep takes a run config or a comparison (several variants), grid axes such as
``algorithm.delta=0.1,1,10`` and ``client.epochs=1,2,5`` (every combination is a **cell**; an axis
``VARIANT.key=...`` applies to that variant only) and seeds. Every (variant, cell, seed) is its
own run folder, ``<out>/<variant>/<cell>/seed_<s>/``; a run already finished with the same
config is not run again and an interrupted one resumes from its checkpoint, so a sweep that
stopped continues where it stopped and ends with the same tables.

The best cell of each variant is the one with the highest mean accuracy over rounds ``R-2..R``
(Swaroop et al. 2025 (ADMM and Bayes), Table 1, :mod:`fedbayes.runs.summaries`; the lowest MSE for regression), averaged
over the seeds, on the **validation split** held out from the clients' training data
(``data.validation_fraction``, :mod:`fedbayes.data.holdout`) by default, or on the test set
(``select_on = "test"``), as the papers choose; the tables then say so. A cell with a diverged
seed is never selected. The test metrics of every cell are reported either way.

No command line here: :func:`prepare` validates a sweep (:func:`plan`: its cells) into a
:class:`SweepPlan`; :func:`run_sweep` checks every unfinished run's data, writes ``sweep.toml``,
runs what is not finished through a ``run_one`` callable (the CLI passes one that reports progress
and writes run folders) and builds and writes the two tables (every cell; the best cell per
variant, :func:`tables`) as Markdown and JSON; :func:`load_sweep` reads ``sweep.toml`` back for a
resume.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedbayes.config.schema import ConfigError, RunConfig, read_toml, same_config, validate
from fedbayes.runs import folder as run_folder
from fedbayes.runs import report, summaries
from fedbayes.runs.compare import check_data, check_seeds, is_regression, toml_text
from fedbayes.runs.resume import finished
from fedbayes.runs.strictjson import dumps_record

SELECT_ON = ("validation", "test")
DEFAULT_VALIDATION_FRACTION = 0.1  # held out when selecting on validation and the config holds out none
SWEEP_FILE = run_folder.SWEEP
NOT_A_GRID_AXIS = {"seed": "seeds are not a grid axis; use --seeds", "name": "the run's name is not a setting to sweep"}


class SweepError(ConfigError):
    """Bad sweep input (a grid key, a value, the seeds), one line naming it (exit code 2)."""


@dataclasses.dataclass(frozen=True)
class Axis:
    """One ``--grid`` item: a dotted key, its values (read as TOML) and as written, and the
    variant it is limited to (None: every variant)."""

    key: str
    values: tuple
    raw: tuple[str, ...]
    variant: str | None = None

    @property
    def label(self) -> str:
        return f"{self.variant}.{self.key}" if self.variant else self.key


@dataclasses.dataclass(frozen=True)
class Cell:
    """One combination of grid values for one variant."""

    variant: str
    name: str  # its folder: key=value pairs joined by "__"
    settings: tuple[tuple[str, Any], ...]  # (key, value) in axis order
    config: RunConfig  # the variant's config with these settings (its own seed)

    def folder(self, out: Path, seed: int) -> Path:
        return run_folder.seed_folder(Path(out) / self.variant / self.name, seed)

    def config_for(self, seed: int) -> RunConfig:
        return self.config.model_copy(update={"seed": seed})


def _split_values(text: str) -> list[str]:
    """``"0.1,1,[2,3]"`` -> ``["0.1", "1", "[2,3]"]``: commas inside brackets or quotes do not split."""
    out, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i])
            start = i + 1
    out.append(text[start:])
    return [v.strip() for v in out]


def _value(raw: str):
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare string, as --set reads it


GRID_EXAMPLE = "e.g. --grid algorithm.delta=0.1,1,10"


MAX_SEED_COUNT = 10_000  # --seeds N: more runs than any sweep means (and a list that would not fit in memory)


def parse_seeds(text: str) -> list[int]:
    """``"3"`` -> ``[0, 1, 2]`` (that many seeds from 0); ``"0,4,7"`` -> those seeds."""
    text = text.strip()
    items = [t.strip() for t in text.split(",")] if "," in text else None
    try:
        count = int(text) if items is None else None
        seeds = [int(t) for t in items] if items is not None else None
    except ValueError:
        raise SweepError(f"error: --seeds {text!r}: expected a count N (seeds 0..N-1) or a list of seeds, e.g. --seeds 3 or --seeds 0,1,2") from None
    if count is not None and count > MAX_SEED_COUNT:
        raise SweepError(f"error: --seeds {text}: at most {MAX_SEED_COUNT} seeds (a count N runs N runs per cell)")
    seeds = seeds if seeds is not None else list(range(count))
    try:
        return check_seeds(seeds, "--seeds")
    except ConfigError as exc:
        raise SweepError(str(exc)) from None


def parse_grid(items: Sequence[str], variants: Sequence[str]) -> list[Axis]:
    """Reads ``--grid`` items (``key=v1,v2,...`` or ``VARIANT.key=v1,...``) into axes.

    Raises:
      SweepError: no item, an item without ``=``, no or empty values, a repeated value or key, or
        a key that is not a grid axis (``seed``: use the seeds; ``name``); one line naming it.
    """
    if not items:
        raise SweepError(f"error: --grid: a sweep needs at least one --grid key=v1,v2,... ({GRID_EXAMPLE})")
    axes: list[Axis] = []
    seen: set[tuple[str | None, str]] = set()
    for item in items:
        if "=" not in item:
            raise SweepError(f"error: --grid {item!r}: expected key=v1,v2,... ({GRID_EXAMPLE})")
        key, text = (part.strip() for part in item.split("=", 1))
        variant = None
        head, _, rest = key.partition(".")
        if head in variants and rest:
            variant, key = head, rest
        label = f"{variant}.{key}" if variant else key
        if not key or any(not part for part in key.split(".")):
            raise SweepError(f"error: --grid {item!r}: the key is empty or has an empty part ({GRID_EXAMPLE})")
        if key in NOT_A_GRID_AXIS:
            raise SweepError(f"error: --grid {label}: {NOT_A_GRID_AXIS[key]}")
        raw = _split_values(text) if text else []
        if not raw or any(not v for v in raw):
            raise SweepError(f"error: --grid {label}: {'no values' if not text else 'an empty value'}; expected {label}=v1,v2,... ({GRID_EXAMPLE})")
        values = tuple(_value(v) for v in raw)
        dup = next((r for i, (r, v) in enumerate(zip(raw, values)) if any(v == w and type(v) is type(w) for w in values[:i])), None)
        if dup is not None:
            raise SweepError(f"error: --grid {label}: the value {dup} is given twice")
        if (variant, key) in seen:
            raise SweepError(f"error: --grid {label}: given twice; give all its values in one --grid {label}=v1,v2,...")
        seen.add((variant, key))
        axes.append(Axis(key, values, tuple(raw), variant))
    return axes


def _settings(config: RunConfig) -> dict:
    return config.model_dump(mode="json")


def _leaf_keys(d: Mapping, prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out += _leaf_keys(v, f"{prefix}{k}.") if isinstance(v, Mapping) else [f"{prefix}{k}"]
    return out


def check_key(key: str, variant: str, config: RunConfig) -> None:
    """Raises a one-line :class:`SweepError` when ``key`` is not a setting of the variant's config,
    naming the key, the variant and the settings allowed in that section."""
    node: Any = _settings(config)
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, Mapping) or part not in node:
            section = ".".join(parts[:i])
            where = f"under {section}" if section else "at the top level"
            names = [k for k in node if i > 0 or k not in NOT_A_GRID_AXIS] if isinstance(node, Mapping) else []
            names = [k for k in names if not (section == "algorithm" and k == "name")]
            allowed = ", ".join(names) or "none"
            what = f"algorithm {config.algorithm.name!r}"
            hint = f"; to sweep it only in the variants that have it: --grid VARIANT.{key}=..." if section else ""
            raise SweepError(f"config error: --grid {key}: not a setting of variant {variant!r} ({what}); its settings {where}: {allowed}{hint}")
        node = node[part]
    if isinstance(node, Mapping):
        raise SweepError(f"config error: --grid {key}: a section, not a setting; its settings: {', '.join(_leaf_keys(node, key + '.'))}")


_SAFE = re.compile(r"[^A-Za-z0-9._=+-]")


def cell_name(pairs: Sequence[tuple[str, str]]) -> str:
    """A cell's folder name: ``algorithm.delta=0.1__client.epochs=1`` (other characters as ``_``)."""
    return "__".join(_SAFE.sub("_", f"{k}={v}") for k, v in pairs) or "base"


def plan(variants: Mapping[str, RunConfig], axes: Sequence[Axis]) -> list[Cell]:
    """Every cell of every variant, in variant order then grid order (the last axis fastest).

    Raises:
      SweepError: a key that is not a setting of some variant it applies to, a value its field
        does not allow (the config error, with the axis and the variant), or two cells whose
        folder names collide.
    """
    cells: list[Cell] = []
    for variant, config in variants.items():
        mine = [a for a in axes if a.variant in (None, variant)]
        for a in mine:
            check_key(a.key, variant, config)
        base = config.model_dump(mode="json", exclude_none=True)
        names: dict[str, tuple] = {}
        for combo in itertools.product(*(range(len(a.values)) for a in mine)):
            raw = copy.deepcopy(base)
            for a, i in zip(mine, combo):
                _set(raw, a.key, a.values[i])
            try:
                cfg = validate(raw)
            except ConfigError as exc:
                given = ", ".join(f"{a.label}={a.raw[i]}" for a, i in zip(mine, combo))
                raise SweepError(f"{exc} (--grid {given}, variant {variant!r})") from None
            name = cell_name([(a.key, a.raw[i]) for a, i in zip(mine, combo)])
            settings = tuple((a.key, a.values[i]) for a, i in zip(mine, combo))
            if name in names and names[name] != settings:
                raise SweepError(f"error: --grid: the cells {dict(names[name])} and {dict(settings)} of variant {variant!r} get the same folder name {name!r}")
            names[name] = settings
            same = next((c for c in cells if c.variant == variant and c.config == cfg), None)
            if same is not None:  # e.g. 1 and 1.0 for a float setting
                raise SweepError(f"error: --grid: {dict(same.settings)} and {dict(settings)} give variant {variant!r} the same config; give each value once")
            cells.append(Cell(variant, name, settings, cfg))
    return cells


def _set(raw: dict, key: str, value) -> None:
    *path, last = key.split(".")
    for part in path:
        raw = raw.setdefault(part, {})
    raw[last] = copy.deepcopy(value)


def _toml_value(v) -> str:
    import tomli_w

    return tomli_w.dumps({"v": v}).split("=", 1)[1].strip()


def select_key(select_on: str) -> str:
    """The curve summary a cell is chosen by: ``val_curve`` (validation) or ``curve`` (test)."""
    if select_on not in SELECT_ON:
        raise SweepError(f"error: --select-on {select_on!r}: allowed: {', '.join(SELECT_ON)}")
    return "val_curve" if select_on == "validation" else "curve"


def _score(summary: dict, select_on: str) -> tuple[float | None, bool]:
    """``(score, higher_is_better)`` of a cell's summary over seeds; None when it cannot be chosen."""
    curve = summary.get(select_key(select_on))
    if summary.get("diverged") or summary.get("diverged_seeds") or not curve:
        return None, True
    higher = curve["metric"].endswith("accuracy")
    return curve["mean_last"]["mean"], higher


def best_cells(cells: Sequence[Cell], results: Mapping[tuple[str, str], dict], select_on: str) -> dict[str, Cell | None]:
    """The best cell of each variant by :func:`_score` (the first in grid order on a tie); None
    when no cell of the variant can be chosen (every one has a diverged seed)."""
    best: dict[str, tuple[float, Cell] | None] = {}
    for cell in cells:
        best.setdefault(cell.variant, None)
        score, higher = _score(results[(cell.variant, cell.name)], select_on)
        if score is None:
            continue
        value = score if higher else -score
        if best[cell.variant] is None or value > best[cell.variant][0]:
            best[cell.variant] = (value, cell)
    return {v: (b[1] if b is not None else None) for v, b in best.items()}


def selection_label(select_on: str, cells: Sequence[Cell], seeds: Sequence[int] | None) -> str:
    """One line saying what the best cells were chosen on (the Markdown and JSON say it too)."""
    n = (f"{len(seeds)} seeds" if len(seeds) > 1 else f"1 seed ({seeds[0]})") if seeds else "one seed per run (each config's own)"
    what = "the mean accuracy over rounds R-2..R (lowest mean MSE for regression), averaged over " + n
    if select_on == "test":
        return f"selected on the TEST set, as the papers do ({what}): optimistic, the test set chose the hyperparameters"
    fractions = sorted({c.config.data.validation_fraction for c in cells})
    share = " or ".join(f"{100 * f:g}%" for f in fractions)
    return f"selected on the validation split ({share} of each client's training examples held out, data.validation_fraction; {what}); test metrics reported"


# ----- running ----------------------------------------------------------------------------------


def conflicts(cells: Sequence[Cell], seeds_of: Callable[[Cell], Sequence[int]], out: Path) -> list[Path]:
    """Run folders of this sweep that hold a run of another config (never overwritten)."""
    bad = []
    for cell in cells:
        for seed in seeds_of(cell):
            stored = cell.folder(out, seed) / run_folder.CONFIG
            if stored.is_file() and not same_config(stored, cell.config_for(seed)):
                bad.append(stored.parent)
    return bad


def run(
    cells: Sequence[Cell],
    seeds_of: Callable[[Cell], Sequence[int]],
    out: Path,
    run_one: Callable[[RunConfig, Path, bool], dict],
    on_skip: Callable[[Cell, int], None] = lambda cell, seed: None,
) -> dict[tuple[str, str], dict[int, dict]]:
    """Runs every (cell, seed) not finished yet; returns (variant, cell name) -> seed -> summary.

    ``run_one(config, folder, resume)`` runs one config into its folder (``resume`` when the
    folder holds a checkpoint) and returns its summary, also for a run that diverged.
    """
    results: dict[tuple[str, str], dict[int, dict]] = {}
    for cell in cells:
        for seed in seeds_of(cell):
            config, folder = cell.config_for(seed), cell.folder(out, seed)
            done = finished(config, folder)
            if done is not None:
                on_skip(cell, seed)
            else:
                done = run_one(config, folder, run_folder.has_checkpoint(folder))
            results.setdefault((cell.variant, cell.name), {})[seed] = done
    return results


def cell_summaries(cells: Sequence[Cell], results, out: Path, threshold: float) -> dict[tuple[str, str], dict]:
    """Each cell's runs over its seeds as one summary (:func:`fedbayes.runs.summaries.aggregate`)."""
    agg = {}
    for cell in cells:
        runs = results[(cell.variant, cell.name)]
        curves = {s: run_folder.read_metrics(cell.folder(out, s) / run_folder.METRICS) for s in runs}
        agg[(cell.variant, cell.name)] = summaries.aggregate(cell.variant, runs, curves, threshold)
    return agg


# ----- tables -----------------------------------------------------------------------------------


def _value_text(v) -> str:
    return json.dumps(v) if isinstance(v, str) else _toml_value(v)


def _columns(keys: Sequence[str], select_on: str, threshold: float, regression: bool, best_marker: bool) -> list[report.Column]:
    C = report.Column
    metric = "MSE" if regression else "acc"
    cols = [C("method", lambda n, r, _: r["variant"], left=True)]
    cols += [C(k, (lambda k: lambda n, r, _: _value_text(r["settings"][k]) if k in r["settings"] else "—")(k)) for k in keys]
    cols.append(C("seeds", lambda n, r, _: report.seeds_value(n, r["summary"], None), keep=8))
    digits = 5 if regression else 4
    if select_on == "validation":
        cols.append(C(f"val {metric} mean R-2..R", lambda n, r, _: report.format_value((r["summary"].get("val_curve") or {}).get("mean_last"), digits=digits)))
    cols.append(C(f"test {metric} mean R-2..R", lambda n, r, _: report.format_value((r["summary"].get("curve") or {}).get("mean_last"), digits=digits)))
    cols.append(C(f"test {metric} max R-2..R", lambda n, r, _: report.format_value((r["summary"].get("curve") or {}).get("max_last"), digits=digits), keep=4))
    if not regression:
        cols.append(C(f"rounds to {threshold:.0%}", lambda n, r, _: report.rounds_to_value(threshold)(n, r["summary"], []), keep=5))
        cols.append(C("test NLL", lambda n, r, _: report.format_value(r["summary"].get("final", {}).get("nll")), keep=6))
    cols.append(C("train s", lambda n, r, _: report.seconds_value(n, r["summary"], []), keep=7))
    if best_marker:
        cols.append(C("best", lambda n, r, _: "*" if r.get("best") else "", left=True))
    return cols


def _rows(cells: Sequence[Cell], agg, best: Mapping[str, Cell | None]) -> list[dict]:
    rows = []
    for cell in cells:
        s = agg[(cell.variant, cell.name)]
        b = best.get(cell.variant)
        rows.append({"variant": cell.variant, "cell": cell.name, "settings": dict(cell.settings), "summary": s, "best": b is not None and b.name == cell.name})
    return rows


def _cells_of(cols, rows, num_keys: int) -> list[list[str]]:
    """The cells; a cell whose every seed diverged shows where it diverged instead of its numbers."""
    out = []
    for r in rows:
        if r["summary"].get("diverged"):
            d = r["summary"]["diverged"]
            ident = 2 + num_keys  # method, the grid keys, seeds
            row = [c.value(r["variant"], r, None) if i < ident else "—" for i, c in enumerate(cols)]
            row[ident] = f"diverged (round {d['round']}: {d['metric']})"
        else:
            row = [c.value(r["variant"], r, None) for c in cols]
        out.append(row)
    return out


@dataclasses.dataclass
class Tables:
    """The sweep's two tables: every cell, and the best cell of each variant."""

    label: str
    all_cols: list
    all_rows: list[list[str]]
    best_cols: list
    best_rows: list[list[str]]
    missing: list[str]  # variants with no cell to choose
    data: dict  # the JSON form

    def markdown(self, title: str) -> str:
        parts = [f"# {title}", "", f"Best cell per method, {self.label}.", "", report.markdown_rows(self.best_cols, self.best_rows)]
        if self.missing:
            parts += [f"No cell could be chosen for: {', '.join(self.missing)} (every cell has a diverged seed).", ""]
        parts += ["## Every cell", "", "(`*`: the best cell of its method; mean±std over seeds, sample standard deviation)", ""]
        parts.append(report.markdown_rows(self.all_cols, self.all_rows))
        return "\n".join(parts)

    def render(self, width: int | None = None, full: str = "sweep.md") -> str:
        """Both tables to fit ``width``; ``full``: the file that has every column."""
        text = report.render_rows(self.all_cols, self.all_rows, width=width, title="every cell (* = best of its method; mean±std over seeds)", full=full)
        text += "\n" + report.render_rows(self.best_cols, self.best_rows, width=width, title=f"best cell per method, {self.label}", full=full)
        if self.missing:
            text += f"no cell could be chosen for: {', '.join(self.missing)} (every cell has a diverged seed)\n"
        return text


def tables(cells: Sequence[Cell], agg, *, select_on: str, threshold: float, seeds: Sequence[int] | None, axes: Sequence[Axis]) -> Tables:
    """Both tables, as text columns and as JSON (see the module docstring for the selection)."""
    best = best_cells(cells, agg, select_on)
    keys = list(dict.fromkeys(a.key for a in axes))
    regression = bool(cells) and all(is_regression(c.config) for c in cells)
    rows = _rows(cells, agg, best)
    label = selection_label(select_on, cells, seeds)
    all_cols = _columns(keys, select_on, threshold, regression, best_marker=True)
    best_rows = [r for r in rows if r["best"]]
    best_cols = _columns(keys, select_on, threshold, regression, best_marker=False)
    missing = [v for v, b in best.items() if b is None]
    data = {
        "selected_on": select_on,
        "selection": label,
        "threshold": threshold,
        "grid": [{"key": a.key, "variant": a.variant, "values": list(a.values)} for a in axes],
        "best": {r["variant"]: {"cell": r["cell"], "settings": r["settings"], "summary": r["summary"]} for r in best_rows},
        "no_cell_chosen": missing,
        "cells": [{"variant": r["variant"], "cell": r["cell"], "settings": r["settings"], "best": r["best"], "summary": r["summary"]} for r in rows],
    }
    return Tables(label, all_cols, _cells_of(all_cols, rows, len(keys)), best_cols, _cells_of(best_cols, best_rows, len(keys)), missing, data)


def write_tables(t: Tables, out: Path, title: str) -> tuple[Path, Path]:
    """Writes ``sweep.md`` and ``sweep.json`` (strict JSON) into the sweep folder."""
    md, js = Path(out) / run_folder.SWEEP_MD, Path(out) / run_folder.SWEEP_JSON
    run_folder.write_atomic(md, t.markdown(title))
    run_folder.write_atomic(js, dumps_record(t.data, indent=2) + "\n")
    return md, js


# ----- the whole sweep --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SweepPlan:
    """A validated sweep: its variants, its settings as ``sweep.toml`` records them (``grid``,
    ``seeds``, ``select_on``, ``threshold``, ``title``), the grid's axes and its cells."""

    runs: dict[str, RunConfig]
    spec: dict
    axes: list[Axis]
    cells: list[Cell]

    @property
    def seeds(self) -> list[int] | None:
        return self.spec.get("seeds")

    def seeds_of(self, cell: Cell) -> list[int]:
        """The seeds a cell runs with: the sweep's, else its config's own."""
        return self.seeds if self.seeds is not None else [cell.config.seed]

    @property
    def total(self) -> int:
        return sum(len(self.seeds_of(c)) for c in self.cells)

    def label(self, cell: Cell, seed: int) -> str:
        """``VARIANT key=value ... seed S``: one run of the sweep, as progress shows it."""
        settings = " ".join(f"{k}={v}" for k, v in cell.settings)
        return f"{cell.variant} {settings} seed {seed}"

    def todo(self, out: Path) -> list[tuple[Cell, int]]:
        """The (cell, seed) runs not finished in ``out`` with their very config."""
        return [(cell, s) for cell in self.cells for s in self.seeds_of(cell) if finished(cell.config_for(s), cell.folder(out, s)) is None]


def prepare(runs: dict[str, RunConfig], spec: dict) -> SweepPlan:
    """Validates a sweep (its grid against every variant, ``select_on``).

    Raises:
      ConfigError: one line naming the bad key or value.
    """
    axes = parse_grid(spec.get("grid") or [], list(runs))
    cells = plan(runs, axes)
    select_key(spec.get("select_on", "validation"))
    threshold = spec.get("threshold", 0.8)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold <= 1:  # NaN fails too
        raise ConfigError(f"config error: threshold: must be a number from 0 to 1; got {threshold!r}")
    return SweepPlan(runs, spec, axes, cells)


def with_validation_fraction(runs: dict[str, RunConfig], select_on: str, fraction: float | None) -> dict[str, RunConfig]:
    """Every variant with ``data.validation_fraction`` set: ``fraction`` when given, else (when
    selecting on validation) the config's own or :data:`DEFAULT_VALIDATION_FRACTION`.

    Raises:
      ConfigError: a fraction the data does not allow, naming ``--validation-fraction``.
    """
    if fraction is None and select_on != "validation":
        return runs
    out = {}
    for name, cfg in runs.items():
        value = fraction if fraction is not None else (cfg.data.validation_fraction or DEFAULT_VALIDATION_FRACTION)
        try:
            out[name] = validate(
                {
                    **cfg.model_dump(mode="json", exclude_none=True),
                    "data": {**cfg.data.model_dump(mode="json", exclude_none=True), "validation_fraction": value},
                }
            )
        except ConfigError as exc:
            raise ConfigError(f"{exc} (--validation-fraction)") from None
    return out


def load_sweep(out: Path) -> tuple[dict[str, RunConfig], dict]:
    """The variants and settings of the sweep in ``out`` (its ``sweep.toml``), for a resume.

    Raises:
      ConfigError: an unreadable file or a variant that no longer validates, naming the file.
    """
    path = Path(out) / SWEEP_FILE
    try:
        raw = read_toml(path)
        runs = {name: validate(cfg) for name, cfg in (raw.get("variants") or {}).items()}
    except ConfigError as exc:
        raise ConfigError(f"{exc} ({path})") from None
    return runs, raw.get("sweep") or {}


def clear(out: Path) -> None:
    """Removes everything in a sweep folder but its lock (``--overwrite``: every run of the sweep,
    not only this grid's)."""
    import shutil

    from fedbayes.runs.runlock import LOCK_NAME

    for child in Path(out).iterdir():
        if child.name != LOCK_NAME:
            shutil.rmtree(child) if child.is_dir() else child.unlink()


class SweepResult(NamedTuple):
    """What a sweep wrote, for the caller to print."""

    tables: Tables
    markdown: Path
    json: Path


def run_sweep(
    p: SweepPlan,
    out: Path,
    run_one: Callable[[RunConfig, Path, bool], dict],
    *,
    on_start: Callable[[int, int], None] = lambda total, finished_before: None,
    on_skip: Callable[[Cell, int], None] = lambda cell, seed: None,
) -> SweepResult:
    """Checks the data of every unfinished run, writes ``sweep.toml``, runs what is not finished
    (:func:`run`), and writes the tables (:func:`tables`, :func:`write_tables`).

    ``on_start(total runs, runs finished earlier)`` is called once before the first run.

    Raises:
      ConfigError, DatasetNotFoundError: an unfinished run's data check, before any run.
    """
    out = Path(out)
    todo = p.todo(out)
    check_data([((cell.variant, cell.name, s), cell.config_for(s)) for cell, s in todo], lambda key: f"variant {key[0]!r}, cell {key[1]}, seed {key[2]}")
    out.mkdir(parents=True, exist_ok=True)
    record = {"sweep": p.spec, "variants": {name: cfg.model_dump(mode="json", exclude_none=True) for name, cfg in p.runs.items()}}
    run_folder.write_atomic(out / SWEEP_FILE, "# written by `fedbayes sweep`; `fedbayes resume` continues it\n" + toml_text(record))
    on_start(p.total, p.total - len(todo))
    results = run(p.cells, p.seeds_of, out, run_one, on_skip=on_skip)
    threshold = p.spec.get("threshold", 0.8)
    agg = cell_summaries(p.cells, results, out, threshold)
    t = tables(p.cells, agg, select_on=p.spec.get("select_on", "validation"), threshold=threshold, seeds=p.seeds, axes=p.axes)
    md, js = write_tables(t, out, f"sweep {p.spec.get('title', out.name)}")
    return SweepResult(t, md, js)
