"""Comparisons: several variants (methods or configs) run side by side, one table and one plot.

A comparison comes from one comparison file (``[base]`` + ``[variants.NAME]``, optional ``seeds``
and a ``[reference]`` table of a paper's numbers) or several run files (:func:`load_comparison`).
Every (variant, seed) is one run (:class:`Job`): in ``OUT/VARIANT/`` when the comparison has no
seeds (each variant its config's own seed), in ``OUT/VARIANT/seed_S/`` with seeds, where the
table and plot give the mean and sample standard deviation over seeds
(:mod:`fedbayes.runs.summaries`). One path serves both: without seeds, each variant is a list of
one run whose summary is the variant's.

:func:`run_comparison` runs what is not finished (a resumed comparison skips finished runs and
continues interrupted ones from their checkpoints) through a ``run_one`` callable (the CLI passes
one that reports progress and maps errors to exit codes), writes ``comparison.toml``,
``compare.md``, ``compare.json`` and ``compare.png``, and returns a :class:`ComparisonResult` for
the caller to print. ``comparison.toml`` keeps each variant's ``--set`` items (its ``[overrides]``
table): a later ``compare FILE --resume`` into the same folder applies them again
(:func:`load_comparison_with_overrides`), so a variant changed on the command line stays
changed, and the tables mark it. With ``shift=True`` it then evaluates every finished run under dataset shift
(:mod:`fedbayes.runs.shift`) and writes ``shift.md``, ``shift.json`` and ``shift.png``. No command
line here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from fedbayes.algorithms import registry
from fedbayes.config.schema import ConfigError, RunConfig, apply_overrides, deep_merge, read_reference, read_toml, same_config, validate
from fedbayes.data import registry as data_registry
from fedbayes.hparams import INT_MAX
from fedbayes.runs import folder, report
from fedbayes.runs import summaries as sm
from fedbayes.runs.resume import finished
from fedbayes.runs.strictjson import dumps_record

__all__ = [
    "COMPARISON_KEYS",
    "ComparisonResult",
    "Job",
    "check_data",
    "check_seeds",
    "conflicts",
    "describe",
    "file_reference",
    "file_seeds",
    "file_shift",
    "is_regression",
    "jobs",
    "load_comparison",
    "load_comparison_with_overrides",
    "marked",
    "merge_overrides",
    "overrides_note",
    "stored_overrides",
    "applicable_reference",
    "bayesian_variants",
    "reference_markdown",
    "run_comparison",
    "split_overrides",
    "toml_text",
    "without_numbers",
]

COMPARISON_KEYS = ("base", "variants", "seeds", "reference", "shift", "overrides")  # the top-level keys of a comparison file
OVERRIDES_HELP = 'overrides: a table of variant = ["key=value", ...] (the --set items each variant runs with)'
DIVERGED_KEYS = ("name", "algorithm", "server_optimizer", "rounds", "seeds", "diverged_seeds", "diverged", "runs")


# ----- reading a comparison ----------------------------------------------------------------------


def _is_comparison(raw: dict) -> bool:
    return "variants" in raw or "base" in raw


def split_overrides(overrides: Sequence[str], variants) -> tuple[list[str], dict[str, list[str]]]:
    """``--set`` items for every variant, and those of the form ``VARIANT.key=value`` by variant."""
    common: list[str] = []
    targeted: dict[str, list[str]] = {}
    for item in overrides:
        head, _, rest = item.partition(".")
        if head in variants and rest and "=" in rest and "=" not in head:
            targeted.setdefault(head, []).append(rest)
        else:
            common.append(item)
    return common, targeted


def _override_key(item: str) -> str:
    return item.partition("=")[0].strip()


def merge_overrides(earlier: Sequence[str], later: Sequence[str]) -> list[str]:
    """``--set`` items: ``earlier`` then ``later``, a key given in both only with its later value."""
    again = {_override_key(item) for item in later}
    return [item for item in earlier if _override_key(item) not in again] + list(later)


def _overrides_table(table, where: str) -> dict[str, list[str]]:
    if not isinstance(table, dict) or not all(isinstance(v, list) and all(isinstance(i, str) and "=" in i for i in v) for v in table.values()):
        raise ConfigError(f"config error: {where}: {OVERRIDES_HELP}; got {table!r}")
    return {name: list(items) for name, items in table.items()}


def stored_overrides(out: Path) -> dict[str, list[str]]:
    """The ``--set`` items of each variant of the comparison in ``out`` (its comparison.toml's
    ``[overrides]``); empty when ``out`` holds no comparison.

    Raises:
      ConfigError: a damaged table (one line naming the file).
    """
    path = Path(out) / folder.COMPARISON
    if not path.is_file():
        return {}
    return _overrides_table(read_toml(path).get("overrides", {}), f"{path}: overrides")


def load_comparison(files: Sequence[Path], overrides: Sequence[str]) -> dict[str, RunConfig]:
    """Variant name -> config, from one comparison file ([base] + [variants.*]) or several run files.

    ``--set key=value`` applies to every variant; ``--set VARIANT.key=value`` to that one only.

    Raises:
      ConfigError: one line naming the file, the variant and the field.
    """
    return load_comparison_with_overrides(files, overrides)[0]


def load_comparison_with_overrides(
    files: Sequence[Path], overrides: Sequence[str], remembered: Mapping[str, Sequence[str]] | None = None
) -> tuple[dict[str, RunConfig], dict[str, list[str]]]:
    """:func:`load_comparison`, and the ``--set`` items each variant of a comparison file runs with:
    the file's own ``[overrides]`` table, then ``remembered`` (an earlier comparison's,
    :func:`stored_overrides`), then ``overrides``; a key given again keeps only its last value.
    Variants without any are left out of the second mapping.

    Raises:
      ConfigError: one line naming the file, the variant and the field.
    """
    runs: dict[str, RunConfig] = {}
    items: dict[str, list[str]] = {}
    all_overrides = list(overrides)
    for path in files:
        raw = read_toml(path)
        if _is_comparison(raw):
            unknown = set(raw) - set(COMPARISON_KEYS)
            if unknown:
                raise ConfigError(
                    f"config error: {path}: unknown top-level key(s) {sorted(unknown)} in a comparison file; allowed: {', '.join(COMPARISON_KEYS)}"
                )
            variants = raw.get("variants") or {}
            if not variants:
                raise ConfigError(f"config error: {path}: variants: a comparison needs at least one [variants.NAME] table")
            common, targeted = split_overrides(all_overrides, variants)
            own = _overrides_table(raw.get("overrides", {}), f"{path}: overrides")
            for name, update in variants.items():
                merged = deep_merge(raw.get("base", {}), update)
                merged["name"] = name
                given = merge_overrides(merge_overrides(own.get(name, []), (remembered or {}).get(name, [])), common + targeted.get(name, []))
                try:
                    runs[name] = validate(apply_overrides(merged, given))
                except ConfigError as exc:
                    raise ConfigError(f"{exc} (variant {name!r})") from None
                if given:
                    items[name] = given
        else:
            cfg = validate(apply_overrides(read_toml(path), all_overrides))
            name = cfg.name if cfg.name not in runs else f"{cfg.name}_{len(runs)}"
            runs[name] = cfg
            if all_overrides:
                items[name] = all_overrides
    return runs, items


def _shared(overrides: Mapping[str, Sequence[str]], names) -> set[str]:
    """The ``--set`` items that every one of ``names`` runs with (a setting of the whole comparison,
    such as ``rounds=6``, changes no variant against the others)."""
    sets = [set(overrides.get(name, ())) for name in names]
    return set.intersection(*sets) if sets else set()


def marked(by_variant: Mapping[str, Any], overrides: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """``by_variant`` with each variant that ``--set`` changed against the others named
    ``VARIANT*`` (the tables' rows); items every variant shares mark none."""
    shared = _shared(overrides, list(by_variant))
    return {f"{name}*" if set(overrides.get(name, ())) - shared else name: value for name, value in by_variant.items()}


def overrides_note(overrides: Mapping[str, Sequence[str]], names: Sequence[str] | None = None) -> str:
    """The line under a table that says what ``VARIANT*`` means ("" when no variant is changed
    against the others); ``names``: the table's variants (default: those in ``overrides``)."""
    names = list(overrides) if names is None else list(names)
    shared = _shared(overrides, names)
    changed = [f"{name} ({', '.join(i for i in items if i not in shared)})" for name, items in overrides.items() if set(items) - shared]
    return f"* changed by --set (comparison.toml keeps it): {'; '.join(changed)}" if changed else ""


def file_reference(files: Sequence[Path], variants: Sequence[str]):
    """The ``[reference]`` table of the comparison file (a paper's numbers), else None.

    Raises:
      ConfigError: a bad table, or two files that both hold one.
    """
    found = None
    for path in files:
        raw = read_toml(path)
        if "reference" in raw and _is_comparison(raw):
            if found is not None:
                raise ConfigError(f"config error: {path}: reference: only one comparison file may hold a [reference] table")
            found = read_reference(raw["reference"], path, list(variants))
    return found


def check_seeds(seeds, where: str) -> list[int]:
    """Seeds must be a non-empty list of distinct integers in 0..2**63-1; else a one-line error naming ``where``."""
    allowed = "allowed: a non-empty list of distinct integers from 0 to 2**63 - 1, e.g. seeds = [0, 1, 2]"
    if not isinstance(seeds, list) or not seeds or any(isinstance(s, bool) or not isinstance(s, int) or not 0 <= s <= INT_MAX for s in seeds):
        raise ConfigError(f"config error: {where}: {allowed}; got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"config error: {where}: a seed is repeated ({allowed}); got {seeds!r}")
    return seeds


def file_seeds(files: Sequence[Path]) -> list[int] | None:
    """The ``seeds = [...]`` of the comparison files (one list for all), else None.

    Raises:
      ConfigError: a bad list, or two files with different lists.
    """
    found: list[int] | None = None
    for path in files:
        raw = read_toml(path)
        if "seeds" not in raw or not _is_comparison(raw):
            continue
        seeds = check_seeds(raw["seeds"], f"{path}: seeds")
        if found is not None and seeds != found:
            raise ConfigError(f"config error: {path}: seeds: {seeds} differs from another file's {found}; give one list (or --seeds)")
        found = seeds
    return found


def file_shift(files: Sequence[Path]) -> tuple[str, ...] | None:
    """The shifts of the comparison file's ``[shift]`` table (``kinds = [...]``, default all of
    :data:`fedbayes.data.shift.SHIFTS`): the comparison is then evaluated under them, as with
    ``--shift``. None without a table.

    Raises:
      ConfigError: one line naming the key and the allowed values.
    """
    from fedbayes.data.shift import SHIFTS

    found = None
    for path in files:
        raw = read_toml(path)
        if "shift" not in raw or not _is_comparison(raw):
            continue
        table = raw["shift"]
        allowed = f"allowed: a non-empty list of distinct shifts from {', '.join(SHIFTS)}"
        if not isinstance(table, dict) or set(table) - {"kinds"}:
            raise ConfigError(f"config error: {path}: shift: a table with one optional key, kinds ({allowed}); got {table!r}")
        kinds = table.get("kinds", list(SHIFTS))
        if not isinstance(kinds, list) or not kinds or len(set(map(str, kinds))) != len(kinds) or any(k not in SHIFTS for k in kinds):
            raise ConfigError(f"config error: {path}: shift.kinds: {allowed}; got {kinds!r}")
        found = tuple(kinds)
    return found


def toml_text(data: dict) -> str:
    """``data`` as TOML (the comparison and sweep files)."""
    import tomli_w

    return tomli_w.dumps(data)


# ----- the runs ----------------------------------------------------------------------------------


class Job(NamedTuple):
    """One run of a comparison: a variant with one seed (None: the variant's own) in its folder."""

    variant: str
    seed: int | None
    config: RunConfig
    folder: Path

    @property
    def label(self) -> str:
        return self.variant if self.seed is None else f"{self.variant} seed {self.seed}"


def jobs(runs: dict[str, RunConfig], out: Path, seeds: Sequence[int] | None) -> list[Job]:
    """Every (variant, seed) of a comparison: ``OUT/VARIANT`` without seeds, else ``OUT/VARIANT/seed_S``."""
    if seeds is None:
        return [Job(name, None, cfg, Path(out) / name) for name, cfg in runs.items()]
    return [Job(name, seed, cfg.model_copy(update={"seed": seed}), folder.seed_folder(Path(out) / name, seed)) for name, cfg in runs.items() for seed in seeds]


def conflicts(planned: Sequence[Job]) -> list[Path]:
    """Run folders that hold a run of another config (a resume never overwrites them)."""
    return [j.folder for j in planned if (j.folder / folder.CONFIG).is_file() and not same_config(j.folder / folder.CONFIG, j.config)]


def check_data(configs: Sequence[tuple[Any, RunConfig]], label: Callable[[Any], str]) -> None:
    """Loads and partitions the data of every config (each distinct data setting once) before
    any run trains: a bad data setting fails at once, naming the field.

    Raises:
      ConfigError: the config's error with ``(label(key))`` appended.
      DatasetNotFoundError: a dataset is missing.
    """
    from fedbayes.runs.build import prepare_split

    seen = set()
    for key, cfg in configs:
        ident = (cfg.seed, json.dumps(cfg.data.model_dump(mode="json"), sort_keys=True), json.dumps(cfg.model.model_dump(mode="json"), sort_keys=True))
        if ident in seen:
            continue
        seen.add(ident)
        try:
            prepare_split(cfg)
        except ConfigError as exc:
            raise ConfigError(f"{exc} ({label(key)})") from None


def bayesian_variants(runs: Mapping[str, RunConfig]) -> set[str]:
    """The variants that run a Bayesian method (the registry spec's ``bayesian`` trait): the plot
    draws them apart from the point methods."""
    return {name for name, config in runs.items() if registry.get(config.algorithm.name).bayesian}


def is_regression(config: RunConfig) -> bool:
    """Whether the run's dataset is a regression (its spec's ``task`` trait): its metrics are the
    squared error's, not accuracy's."""
    return data_registry.get(config.data.dataset).task == "regression"


def describe(name: str, runs: Mapping[str, RunConfig]) -> str:
    """What a comparison runs, for its plot's title: its name, the number of methods, the data (a
    file of your own by its name), the clients (and how many train each round, when not all) and
    the rounds; a setting the variants differ in lists each value, e.g. "fmnist_compare: 10
    methods, fashion_mnist (10%), 10 clients, 50 rounds"."""

    def each(values) -> str:
        return ", ".join(map(str, sorted(set(values))))

    def data(c: RunConfig) -> str:
        source = Path(c.data.path).name if data_registry.get(c.data.dataset).file_based and c.data.path else c.data.dataset
        return source + (f" ({c.data.fraction:.0%})" if c.data.fraction < 1 else "")

    def per_round(c: RunConfig) -> int | None:  # None: every client (a cohort of the data's own clients may be all of them)
        k = c.data.num_clients
        return c.server.clients_per_round if k is None or c.server.clients_per_round < k else None

    configs = list(runs.values())
    counts = [c.data.num_clients for c in configs]
    clients = ", ".join([*map(str, sorted({k for k in counts if k is not None})), *(["the data's own"] if None in counts else [])]) + " clients"
    if any(per_round(c) is not None for c in configs):
        clients += f" ({each(per_round(c) or c.data.num_clients for c in configs)} per round)"
    methods = f"{len(runs)} method{'s' if len(runs) > 1 else ''}"
    return f"{name}: {methods}, {each(data(c) for c in configs)}, {clients}, {each(c.rounds for c in configs)} rounds"


def without_numbers(summary: dict) -> dict:
    """A diverged variant's summary keeps its name, settings and where it diverged, not its metrics."""
    if "runs" in summary:  # over seeds: each diverged seed's run loses its numbers too
        summary = {**summary, "runs": {k: without_numbers(v) for k, v in summary["runs"].items()}}
    if not summary.get("diverged"):
        return summary
    return {k: summary[k] for k in DIVERGED_KEYS if k in summary}


def applicable_reference(reference, runs: Mapping[str, RunConfig]):
    """``(reference, note)``: the ``[reference]`` table when every run uses the data set and the
    number of rounds its numbers are for (``reference.dataset``, ``reference.rounds``; unset: any),
    else ``None`` and a one-line note saying why no paper table is printed (a paper's numbers beside
    another setting would read as differences)."""
    if reference is None:
        return reference, None
    other = sorted({c.data.dataset for c in runs.values()} - {reference.dataset}) if reference.dataset is not None else []
    if other:
        return None, f"no paper table: the [reference] numbers ({reference.source}) are for {reference.dataset}; this comparison runs on {', '.join(other)}"
    lengths = sorted({c.rounds for c in runs.values()} - {reference.rounds}) if reference.rounds is not None else []
    if lengths:
        return (
            None,
            f"no paper table: the [reference] numbers ({reference.source}) are after {reference.rounds} rounds; this comparison runs {', '.join(map(str, lengths))}",
        )
    return reference, None


def reference_markdown(summaries: dict, curves: dict, reference) -> str:
    """The "beside the paper" table in Markdown ("" without a reference)."""
    if reference is None:
        return ""
    cols, rows = report.reference_table(summaries, curves, reference)
    return f"\n**Beside the paper** ({reference.source}):\n\n" + report.markdown_rows(cols, rows)


class ComparisonResult(NamedTuple):
    """What a comparison wrote, for the caller to print."""

    summaries: dict[str, dict]  # variant -> summary (mean and std over seeds with seeds)
    curves: dict[str, list[dict]]  # variant -> its records (the mean records with seeds)
    body: dict  # compare.json's content
    title: str | None  # the printed table's title
    plot: Path
    markdown: Path
    diverged: list[str]  # the diverged runs: "VARIANT", or "VARIANT (seed S)"
    shift: Any = None  # fedbayes.runs.shift.ShiftFiles, with shift=True
    overrides: Mapping[str, Sequence[str]] = {}  # variant -> its --set items (its rows are marked VARIANT*)


def run_comparison(
    runs: dict[str, RunConfig],
    out: Path,
    run_one: Callable[[RunConfig, Path, bool], dict],
    *,
    seeds: Sequence[int] | None = None,
    resume: bool = False,
    reference=None,
    threshold: float = 0.8,
    title: str = "comparison",
    say: Callable[[str], None] = print,
    shift: Sequence[str] | None = None,
    overrides: Mapping[str, Sequence[str]] | None = None,
    shift_progress: Callable[[int, int], None] = lambda done, total: None,
) -> ComparisonResult:
    """Runs every (variant, seed) not finished yet and writes the comparison's files.

    ``run_one(config, folder, resume)`` runs one config into its folder (``resume`` when the folder
    holds a checkpoint) and returns its summary, also for a run that diverged. ``say`` gets one
    line per run. A resume's conflicting folders are the caller's to refuse first
    (:func:`conflicts`). ``shift``: the shifts (:data:`fedbayes.data.shift.SHIFTS`) under which,
    after the runs, each run that did not diverge is evaluated (:func:`fedbayes.runs.shift.write_shift`);
    its datasets are checked first, and comparison.toml keeps them as its ``[shift]`` table.
    ``overrides``: each variant's ``--set`` items, kept as comparison.toml's ``[overrides]``; the
    Markdown table names a variant that has some ``VARIANT*``, with a note.
    ``shift_progress(done, total)``: after each evaluation under shift (:func:`fedbayes.runs.shift.evaluate_runs`).

    Raises:
      ConfigError, DatasetNotFoundError: a run's data check (:func:`check_data`), or with
        ``shift`` a dataset without images, before any run.
    """
    out = Path(out)
    planned = jobs(runs, out, seeds)
    done = {j: finished(j.config, j.folder) if resume else None for j in planned}
    todo = [j for j in planned if done[j] is None]
    label = (lambda j: f"variant {j.variant!r}") if seeds is None else (lambda j: f"variant {j.variant!r}, seed {j.seed}")
    check_data([(j, j.config) for j in todo], label)
    if shift:
        from fedbayes.runs.shift import check_configs

        check_configs(list(runs.values()))
    out.mkdir(parents=True, exist_ok=True)
    comparison: dict[str, Any] = {} if seeds is None else {"seeds": list(seeds)}
    comparison["variants"] = {name: cfg.model_dump(mode="json", exclude_none=True) for name, cfg in runs.items()}
    if reference is not None:
        comparison["reference"] = reference.model_dump(mode="json", exclude_none=True)
    if shift:
        comparison["shift"] = {"kinds": list(shift)}
    overrides = {name: list(items) for name, items in (overrides or {}).items() if items and name in runs}
    if overrides:
        comparison["overrides"] = overrides
    folder.write_atomic(out / folder.COMPARISON, "# written by `fedbayes compare`; `fedbayes resume` continues it\n" + toml_text(comparison))
    results: dict[str, dict[Any, dict]] = {}
    for j in planned:
        if done[j] is not None:
            say(f"== {j.label}: finished earlier, not rerun")
            results.setdefault(j.variant, {})[j.seed] = done[j]
            continue
        say(f"== {j.label} ({j.config.algorithm.name}, server {j.config.server.optimizer})")
        results.setdefault(j.variant, {})[j.seed] = run_one(j.config, j.folder, resume and folder.has_checkpoint(j.folder))
    curves = {j: folder.read_metrics(j.folder / folder.METRICS) for j in planned}
    task = "regression" if any(is_regression(c) for c in runs.values()) else "classification"
    from fedbayes.runs.plotting import plot_curves

    bayesian = bayesian_variants(runs)

    if seeds is None:  # each variant is its one run
        summaries = {j.variant: results[j.variant][None] for j in planned}
        records = {j.variant: curves[j] for j in planned}
        plot = plot_curves(out / folder.COMPARE_PLOT, records, title=title, task=task, bayesian=bayesian)
        md = _marked_markdown(summaries, threshold, records, overrides) + reference_markdown(summaries, records, reference)
        table_title = "fedbayes comparison" if len(summaries) > 1 else None
        diverged = [n for n, s in summaries.items() if s.get("diverged")]
    else:
        by_seed = {name: {j.seed: curves[j] for j in planned if j.variant == name} for name in runs}
        summaries = {name: sm.aggregate(name, results[name], by_seed[name], threshold) for name in runs}
        means = {name: sm.mean_curves([by_seed[name][s] for s in seeds if not results[name][s].get("diverged")]) for name in runs}
        records = {n: m for n, (m, _) in means.items()}
        plot = plot_curves(
            out / folder.COMPARE_PLOT,
            records,
            title=f"{title}, mean ± std over seeds {list(seeds)}",
            task=task,
            bands={n: sd for n, (_, sd) in means.items()},
            bayesian=bayesian,
        )
        note = f"\nMean±std over seeds {list(seeds)} (sample standard deviation); curve summaries as Swaroop et al. 2025 (ADMM and Bayes) report them.\n"
        md = _marked_markdown(summaries, threshold, records, overrides) + note + reference_markdown(summaries, records, reference)
        table_title = f"fedbayes comparison, mean±std over seeds {list(seeds)}"
        diverged = [f"{n} (seed {s})" for n in runs for s in seeds if results[n][s].get("diverged")]
    folder.write_atomic(out / folder.COMPARE_MD, md)
    body = {n: without_numbers(s) for n, s in summaries.items()}
    folder.write_atomic(out / folder.COMPARE_JSON, dumps_record(body, indent=2) + "\n")
    shifted = None
    if shift:
        from fedbayes.runs.shift import write_shift

        fine = {j: results[j.variant][j.seed] for j in planned}
        folders = {}
        for j in planned:
            if not fine[j].get("diverged"):
                folders.setdefault(j.variant, {})[j.seed] = j.folder
        shifted = write_shift(out, folders, seeds=seeds, kinds=shift, title=f"{title} under dataset shift", say=say, progress=shift_progress)
    return ComparisonResult(summaries, records, body, table_title, plot, out / folder.COMPARE_MD, diverged, shifted, overrides)


def _marked_markdown(summaries: dict, threshold: float, records: dict, overrides: Mapping[str, Sequence[str]]) -> str:
    note = overrides_note(overrides, list(summaries))
    table = report.markdown(marked(summaries, overrides), threshold=threshold, curves=marked(records, overrides))
    return table + (f"\n{note}\n" if note else "")
