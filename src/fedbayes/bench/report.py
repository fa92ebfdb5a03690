"""From raw timings to what ``fedbayes bench`` reports: entries, summaries over repeats, tables.

:func:`federated_entry` and :func:`limit_entry` turn one run's raw timings (from
:mod:`fedbayes.bench.measure`) into its entry; :func:`summarize` combines repeats into the JSON
object keyed by workload (the keys are described in :mod:`fedbayes.bench`);
:func:`add_paired` adds the interleaved runs' ratios; :func:`relative_entry` makes a relative
workload's entry; :func:`markdown` and :func:`text_tables` present the object as a table of
:data:`COLUMNS` (throughput) and, when relative workloads ran, a table of
:data:`RELATIVE_COLUMNS`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from fedbayes.bench.workloads import REFERENCE, WORKLOADS, BenchError, BenchSettings, baseline_of
from fedbayes.sim.hostdevices import num_cores

BASELINE_RATIO = "ratio_to_fedavg"  # a workload's examples_per_s over its baseline's, same repeat
PAIRED_RATIO = "paired_ratio_to_fedavg"  # the same, from rounds interleaved in one process
OWN_LIMIT_RATIO = "ratio_to_own_limit"  # the plain loop's round time over the simulator's, paired blocks


def federated_entry(raw: dict[str, Any]) -> dict[str, Any]:
    """The reported numbers of one federated run (see the module docstring)."""
    round_s = statistics.median(raw["round_s"])
    rates = [n / t for n, t in zip(raw["examples"], raw["round_s"])]
    entry = {
        "examples_per_s": statistics.median(rates),
        "round_s": round_s,
        "compile_s": raw["first_round_s"] - round_s,
        "first_round_s": raw["first_round_s"],
        "startup_s": raw["startup_s"],
        "startup_parts": dict(raw["startup_parts"]),
        "peak_rss_mb": raw["peak_rss_mb"],
        "examples_per_round": statistics.median_low(raw["examples"]),
        "rounds": len(raw["round_s"]),
        "padding_waste": statistics.median(raw["padding_waste"]),
        "step_waste": statistics.median(raw["step_waste"]),
    }
    if raw.get("device_busy_s"):
        # The share of the client phase the devices spend waiting for the slowest one, and the
        # slowest device's busy time over the round's time.
        idle = [1.0 - sum(b) / (len(b) * max(b)) for b in raw["device_busy_s"]]
        entry["device_idle"] = statistics.median(idle)
        entry["device_idle_max"] = max(idle)
        entry["device_busy_s"] = [statistics.median(col) for col in zip(*raw["device_busy_s"])]
    if raw.get("own_limit_sim_s"):
        entry[OWN_LIMIT_RATIO + "s"] = [p / t for t, p in zip(raw["own_limit_sim_s"], raw["own_limit_plain_s"])]
        entry[OWN_LIMIT_RATIO] = statistics.median(entry[OWN_LIMIT_RATIO + "s"])
        entry["own_limit_round_s"] = statistics.median(raw["own_limit_plain_s"])
    for k in (
        "num_clients",
        "clients_per_round",
        "epochs",
        "algorithm",
        "partition",
        "layout",
        "store",
        "devices",
        "device_kind",
        "client_sizes",
        "rejected",
        "profile",
    ):
        if k in raw:
            entry[k] = raw[k]
    return entry


def limit_entry(raws: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The reported numbers of one limit run from its processes' raw timings (rates summed)."""
    medians = [statistics.median(r["rep_s"]) for r in raws]
    return {
        "examples_per_s": sum(r["examples"] / m for r, m in zip(raws, medians)),
        "round_s": max(medians),
        "compile_s": statistics.median([r["first_s"] - m for r, m in zip(raws, medians)]),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in raws),
        "examples_per_round": sum(r["examples"] for r in raws),
        "rounds": min(len(r["rep_s"]) for r in raws),
        "batch_size": raws[0]["batch_size"],
        "processes": len(raws),
    }


def _median_tree(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, bool) or first is None:
        return first
    if isinstance(first, int):
        return statistics.median_low(values)  # counts stay integers
    if isinstance(first, float):
        return statistics.median(values)
    if isinstance(first, dict):
        return {k: _median_tree([v[k] for v in values if k in v]) for k in first}
    return first


def summarize(repeats: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Combines per-repeat entries into one JSON-ready object keyed by workload.

    Each repeat maps workload name -> entry (from :func:`federated_entry` / :func:`limit_entry`)
    and must hold :data:`REFERENCE` if any does (the GPU record runs without it, and has no
    ``ratio_to_limit``). ``ratio_to_limit`` is computed within each repeat, and so is
    ``ratio_to_fedavg`` (a workload's throughput over its ``baseline``'s, when both ran); then
    every numeric field is the median over repeats; with several repeats
    ``examples_per_s_range``, ``ratio_range`` and ``ratio_to_fedavg_range`` give [min, max].
    """
    if not repeats:
        raise BenchError("no measurements to summarize")
    with_reference = any(REFERENCE in rep for rep in repeats)  # the GPU record has none
    for i, rep in enumerate(repeats):
        if with_reference and REFERENCE not in rep:
            raise BenchError(f"repeat {i} lacks {REFERENCE!r}, the denominator of ratio_to_limit")
    out: dict[str, dict[str, Any]] = {}
    for name in repeats[0]:
        entries = []
        for rep in repeats:
            e = dict(rep[name])
            if with_reference:
                e["ratio_to_limit"] = e["examples_per_s"] / rep[REFERENCE]["examples_per_s"]
            base = baseline_of(name)
            if base is not None and base in rep:
                e[BASELINE_RATIO] = e["examples_per_s"] / rep[base]["examples_per_s"]
            entries.append(e)
        merged = _median_tree(entries)
        merged["repeats"] = len(entries)
        if len(entries) > 1:
            merged["examples_per_s_range"] = [min(e["examples_per_s"] for e in entries), max(e["examples_per_s"] for e in entries)]
            if with_reference:
                merged["ratio_range"] = [min(e["ratio_to_limit"] for e in entries), max(e["ratio_to_limit"] for e in entries)]
                merged["ratio_worst"] = merged["ratio_range"][0]  # the slowest repeat's
            if BASELINE_RATIO in merged:
                got = [e[BASELINE_RATIO] for e in entries if BASELINE_RATIO in e]
                merged[BASELINE_RATIO + "_range"] = [min(got), max(got)]
        pairs = [r for e in entries for r in e.get(OWN_LIMIT_RATIO + "s", [])]
        if pairs:  # every pair of blocks of every repeat
            merged[OWN_LIMIT_RATIO + "s"] = pairs
            merged[OWN_LIMIT_RATIO] = statistics.median(pairs)
            merged[OWN_LIMIT_RATIO + "_range"] = [min(pairs), max(pairs)]
        w = WORKLOADS.get(name)
        if w is not None:
            merged["description"] = w.description
            if baseline_of(name) is not None and BASELINE_RATIO in merged:
                merged["baseline"] = baseline_of(name)
        out[name] = merged
    return out


def paired_ratios(raw: dict[str, Any], baseline: str) -> dict[str, list[float]]:
    """Per pass, each workload's throughput over ``baseline``'s in the same pass."""
    rate = {n: [e / t for e, t in zip(raw["examples"][n], raw["round_s"][n])] for n in raw["round_s"]}
    return {n: [a / b for a, b in zip(r, rate[baseline])] for n, r in rate.items() if n != baseline}


def add_paired(results: dict[str, dict[str, Any]], raw: dict[str, Any], baseline: str) -> None:
    """Adds :data:`PAIRED_RATIO` (median over passes), its ``_range`` and ``paired_rounds`` to
    each non-baseline workload's entry of ``results``."""
    for name, ratios in paired_ratios(raw, baseline).items():
        entry = results.setdefault(name, {})
        entry[PAIRED_RATIO] = statistics.median(ratios)
        entry[PAIRED_RATIO + "_range"] = [min(ratios), max(ratios)]
        entry["paired_rounds"] = len(ratios)


def relative_entry(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    """A relative workload's entry: its raw result (``reference``, ``ratios``: label -> median,
    min, max, target, direction, meets) marked ``"kind": "relative"``, with its description."""
    entry = {"kind": "relative", **raw}
    w = WORKLOADS.get(name)
    if w is not None:
        entry["description"] = w.description
    return entry


def _is_relative_entry(e: dict[str, Any]) -> bool:
    return e.get("kind") == "relative"


# ----- presentation -----------------------------------------------------------------------------
COLUMNS = (
    "workload",
    "examples/s",
    "ratio to limit",
    "vs own limit",
    "vs FedAvg",
    "vs FedAvg, paired",
    "round (s)",
    "device idle",
    "compile (s)",
    "start-up (s)",
    "peak RSS (MB)",
    "clients / processes",
)


def _ratio_cell(e: dict[str, Any], key: str) -> str:
    """``median (min-max)`` of ratio ``key`` (the median alone without a range; empty when absent)."""
    if key not in e:
        return ""
    cell = f"{e[key]:.2f}"
    if key + "_range" in e:
        lo, hi = e[key + "_range"]
        cell += f" ({lo:.2f}-{hi:.2f})"
    return cell


def rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Table rows (strings) in :data:`COLUMNS` order."""
    out = []
    for name, e in results.items():
        if _is_relative_entry(e):
            continue
        ratio = f"{e['ratio_to_limit']:.2f}" if "ratio_to_limit" in e else ""
        if "ratio_range" in e and name != REFERENCE:
            ratio += f" ({e['ratio_range'][0]:.2f}-{e['ratio_range'][1]:.2f})"  # the worst repeat first
        vs, own, paired = (_ratio_cell(e, key) for key in (BASELINE_RATIO, OWN_LIMIT_RATIO, PAIRED_RATIO))
        if "clients_per_round" in e:
            clients = f"{e['clients_per_round']} of {e['num_clients']}, {e['partition']}"
            if e.get("epochs", 1) != 1:
                clients += f", {e['epochs']} epochs"
        else:
            clients = f"{e['processes']} process{'es' if e['processes'] > 1 else ''}, batch {e['batch_size']}"
        startup = f"{e['startup_s']:.1f}" if "startup_s" in e else ""
        out.append(
            [
                name,
                f"{e['examples_per_s']:,.0f}",
                ratio,
                own,
                vs,
                paired,
                f"{e['round_s']:.3f}",
                f"{e['device_idle']:.0%}" if "device_idle" in e else "",
                f"{e['compile_s']:.2f}",
                startup,
                f"{e['peak_rss_mb']:,.0f}",
                clients,
            ]
        )
    return out


RELATIVE_COLUMNS = ("workload", "measure", "median", "range", "target", "met", "against")


def relative_rows(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """The relative workloads' rows (strings) in :data:`RELATIVE_COLUMNS` order, one per ratio."""
    out = []
    for name, e in results.items():
        if not _is_relative_entry(e):
            continue
        for label, r in e["ratios"].items():
            target = "" if r["target"] is None else f"{r['direction']} {r['target']:g}"
            met = "" if r["meets"] is None else ("yes" if r["meets"] else "NO")
            out.append([name, label, f"{r['median']:.2f}", f"{r['min']:.2f}-{r['max']:.2f}", target, met, e["reference"]])
    return out


def _markdown_table(columns: Sequence[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + ["| " + " | ".join(r) + " |" for r in body]


def markdown(results: dict[str, dict[str, Any]]) -> str:
    """The tables as Markdown: throughput, then (when any ran) the relative workloads."""
    lines = _markdown_table(COLUMNS, rows(results)) if any(not _is_relative_entry(e) for e in results.values()) else []
    relative = relative_rows(results)
    if relative:
        lines += ([""] if lines else []) + _markdown_table(RELATIVE_COLUMNS, relative)
    return "\n".join(lines) + "\n"


# Which columns go first when a table must fit the terminal (higher first; 0: never): fedbayes.runs.report's rule.
_KEEP = {"vs FedAvg, paired": 2, "round (s)": 3, "device idle": 4, "compile (s)": 5, "start-up (s)": 5, "peak RSS (MB)": 6, "clients / processes": 1}
_RELATIVE_KEEP = {"range": 2, "target": 1, "against": 3}


def text_tables(results: dict[str, dict[str, Any]], title: str | None = None, width: int | None = None) -> str:
    """The tables as plain text no wider than ``width`` (default: the terminal's): the throughput
    table and the relative workloads' table, columns left out with a note rather than a name or a
    number cut (:func:`fedbayes.runs.report.render_rows`)."""
    from fedbayes.runs.report import Column, render_rows

    def columns(names, keep):
        return [Column(c, lambda *a: "", left=c in ("workload", "measure", "against", "clients / processes"), keep=keep.get(c, 0)) for c in names]

    def filled(cols, cells):  # a column no workload of this run fills (an older JSON's) says nothing
        idx = [i for i in range(len(cols)) if i == 0 or any(r[i] for r in cells)]
        return [cols[i] for i in idx], [[r[i] for i in idx] for r in cells]

    parts = []
    if any(not _is_relative_entry(e) for e in results.values()):
        parts.append(render_rows(*filled(columns(COLUMNS, _KEEP), rows(results)), width=width, title=title))
    relative = relative_rows(results)
    if relative:
        parts.append(render_rows(columns(RELATIVE_COLUMNS, _RELATIVE_KEEP), relative, width=width, title="paired ratios in one process" if parts else title))
    return "\n".join(parts)


def describe_run(settings: BenchSettings, quick: bool, suite: str | None = None) -> str:
    """One line: mode, cores, versions, date (jax's version read without importing it)."""
    from importlib.metadata import version

    return (
        f"fedbayes bench{' ' + suite if suite else ''}{' --quick' if quick else ''}: {settings.dataset}, MLP {settings.hidden}, batch {settings.batch_size}, "
        f"{settings.epochs} local epoch unless a workload says otherwise; {num_cores()} cores; jax {version('jax')}; {time.strftime('%Y-%m-%d %H:%M')}; "
        f"{settings.repeats} repeat{'s' if settings.repeats > 1 else ''}"
    )
