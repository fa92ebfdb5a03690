"""Trained runs evaluated under dataset shift: accuracy, NLL and ECE per shift and level.

Ovadia et al. 2019, "Can You Trust Your Model's Uncertainty? Evaluating Predictive Uncertainty Under
Dataset Shift", compare methods by how their accuracy and calibration degrade as the test set moves
away from the training distribution. Here each finished run folder's ``model.npz`` is evaluated on
the shifted test sets of :mod:`fedbayes.data.shift` by the very evaluator the run used
(:func:`fedbayes.runs.build.build_evaluator`, with the run's ``[evaluation]`` settings and the key of
its last evaluated round): the point metrics of ``params``; for a method with a posterior
(``posterior_mean`` and ``posterior_variance`` in the archive) also the marginalised ``*_marg``
ones; for a variational model its metrics, which are all those of its marginalised predictive. So
level 0 reproduces the run's last row of ``metrics.jsonl``. A run with conformal sets
(``evaluation.conformal_alpha``) also gets their ``coverage`` and ``set_size`` (``*_marg``) under
each shift, calibrated on the clean calibration examples: what a federation calibrated before a
shift would see.

Every run sees the same shifted images (the noise's seed is :data:`NOISE_SEED`, not the run's).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedbayes.config.schema import ConfigError, RunConfig, load_config
from fedbayes.data import registry as data_registry
from fedbayes.data import shift as shifts
from fedbayes.errors import DataError
from fedbayes.runs import folder, report
from fedbayes.runs.build import DataSpec, build_evaluator, build_model, build_predictive, client_splits, load_data, personal_split
from fedbayes.runs.export import load_model
from fedbayes.runs.strictjson import dumps_record

__all__ = [
    "CONFORMAL_METRICS",
    "METRICS",
    "NOISE_SEED",
    "SHIFT_JSON",
    "SHIFT_MD",
    "SHIFT_PLOT",
    "ShiftFiles",
    "check_configs",
    "evaluate_runs",
    "mean_over_seeds",
    "shift_body",
    "write_shift",
]

SHIFT_MD = "shift.md"
SHIFT_JSON = "shift.json"
SHIFT_PLOT = "shift.png"
NOISE_SEED = 0
METRICS = ("accuracy", "nll", "ece", "accuracy_marg", "nll_marg", "ece_marg")
CONFORMAL_METRICS = ("coverage", "set_size", "coverage_marg", "set_size_marg")  # a run with evaluation.conformal_alpha


def _data_key(config: RunConfig) -> tuple:
    """What decides the test set: the dataset and where it is read from (a fraction subsamples
    only the training set), and the seed of a dataset generated from it (its spec's ``generated``
    trait)."""
    d = config.data
    return (
        d.dataset,
        d.data_dir,
        d.num_classes,
        d.num_clients,
        d.dim,
        d.synthetic_alpha,
        d.synthetic_beta,
        config.seed if data_registry.get(d.dataset).generated else None,
    )


def check_configs(configs: Sequence[RunConfig]) -> None:
    """Loads each distinct dataset once and refuses, in one line, one that holds no images (or no
    classes), before any run trains.

    Raises:
      ConfigError: ``config error: --shift: ...`` naming the dataset.
    """
    seen = set()
    for cfg in configs:
        key = _data_key(cfg)
        if key in seen:
            continue
        seen.add(key)
        dataset = load_data(cfg)
        try:
            shifts.check_images(dataset.x_test, dataset.name)
        except DataError as exc:
            raise ConfigError(f"config error: --shift: {exc}") from None
        if dataset.task != "classification":
            raise ConfigError(f"config error: --shift: dataset {dataset.name!r} is a {dataset.task} task; the shift table needs classification")


class _Run:
    """A finished run folder ready to evaluate: its config, model parts and saved model."""

    def __init__(self, run_dir: Path, dataset):
        self.folder = Path(run_dir)
        for name in (folder.CONFIG, folder.MODEL):
            if not (self.folder / name).is_file():
                raise FileNotFoundError(f"{self.folder} holds no {name}; is it a finished fedbayes run folder?")
        self.config = load_config(self.folder / folder.CONFIG)
        self.model = build_model(self.config, DataSpec.of(dataset))
        saved = load_model(self.folder / folder.MODEL)
        params = saved["params"]
        posterior = (saved["posterior_mean"], saved["posterior_variance"]) if "posterior_variance" in saved else None
        # build_evaluator asks an algorithm for the server state's params and posterior; the saved
        # model answers for any state.
        self.algorithm = types.SimpleNamespace(
            server_params=lambda state: params,
            server_posterior=None if posterior is None else (lambda state: posterior),
            server_precision=(lambda state: saved["posterior_precision"]) if "posterior_precision" in saved else None,  # a dense posterior's draws
        )
        records = folder.read_metrics(self.folder / folder.METRICS)
        self.round = int(records[-1]["round"]) if records else self.config.rounds  # the key of the last evaluation

        self.thresholds = None  # the conformal sets' thresholds, calibrated on the clean data once

    def evaluate(self, dataset) -> dict[str, float]:
        evaluate = build_evaluator(self.config, self.algorithm, dataset, self.model)
        out = {k: v for k, v in evaluate(None, self.round).items() if k in METRICS}
        if self.config.evaluation.conformal_alpha is not None:
            out.update(self._conformal(dataset))
        return out

    def _conformal(self, dataset) -> dict[str, float]:
        """The coverage and mean size of the run's conformal sets on ``dataset``'s (shifted) test
        set, each predictive's threshold from the clients' clean calibration examples
        (:mod:`fedbayes.runs.conformal`)."""
        from fedbayes.runs import conformal

        if self.thresholds is None:
            parts, validation, calibration = client_splits(self.config, dataset)
            parts, _ = personal_split(self.config, parts)
            held_out = None if validation is None else dataclasses.replace(dataset, x_test=dataset.x_train[validation], y_test=dataset.y_train[validation])
            self.predictives = build_predictive(self.config, self.algorithm, self.model, held_out, int(sum(map(len, parts))))(None, self.round)
            self.thresholds = {s: conformal.calibrate(self.config, p, dataset.x_train, dataset.y_train, calibration) for s, p in self.predictives.items()}
        out = {}
        for suffix, q in self.thresholds.items():
            record = conformal.sets_record(self.config, self.predictives[suffix], q, dataset.x_test, dataset.y_test)
            out[f"coverage{suffix}"], out[f"set_size{suffix}"] = record["coverage"], record["set_size"]
        return out


def evaluate_runs(
    run_dirs: Sequence[Path],
    *,
    kinds: Sequence[str] = shifts.SHIFTS,
    levels: Sequence[int] | None = None,
    say: Callable[[str], None] = lambda s: None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> list[list[dict]]:
    """Each run folder's records under shift, in the order given: one record per (shift, level)
    with ``shift``, ``level``, ``intensity`` and the metrics. Each shifted test set is made once
    and serves every run on that dataset. ``levels``: only these levels of each shift (default
    all). ``progress(done, total)`` after each evaluation of a run on a shifted test set.

    Raises:
      ConfigError: a run's dataset holds no images (:func:`check_configs`).
      FileNotFoundError: a folder holds no finished run.
    """
    configs = [load_config(Path(d) / folder.CONFIG) for d in run_dirs]
    check_configs(configs)
    out: list[list[dict]] = [[] for _ in run_dirs]
    groups: dict[tuple, list[int]] = {}
    for i, cfg in enumerate(configs):
        groups.setdefault(_data_key(cfg), []).append(i)
    count = lambda kind: len(shifts.levels(kind) if levels is None else levels)  # noqa: E731
    total, done = sum(count(kind) for kind in kinds) * len(run_dirs), 0
    progress(done, total)
    for members in groups.values():
        dataset = load_data(configs[members[0]])
        runs = {i: _Run(run_dirs[i], dataset) for i in members}
        for kind in kinds:
            say(
                f"== shift {kind}: levels {', '.join(_fmt(shifts.intensity(kind, lv)) for lv in shifts.levels(kind))} ({shifts.UNITS[kind]}), {len(runs)} run(s)"
            )
            for level in shifts.levels(kind) if levels is None else levels:
                x = shifts.shift_images(dataset.x_test, kind, level, seed=NOISE_SEED, name=dataset.name)
                shifted = dataclasses.replace(dataset, x_test=x)
                for i, run in runs.items():
                    record = {"shift": kind, "level": level, "intensity": shifts.intensity(kind, level)}
                    out[i].append(record | run.evaluate(shifted))
                    done += 1
                    progress(done, total)
    return out


def _fmt(v: float) -> str:
    return f"{v:g}"


def mean_over_seeds(per_seed: Sequence[Sequence[dict]]) -> list[dict]:
    """The records of several seeds' runs (same shifts and levels) as one list: each metric's mean,
    and its sample standard deviation as ``<metric>_std`` when there are two seeds or more."""
    out = []
    for rows in zip(*per_seed):
        record = {k: rows[0][k] for k in ("shift", "level", "intensity")}
        for k in METRICS + CONFORMAL_METRICS:
            values = [r[k] for r in rows if k in r]
            if values:
                record[k] = float(np.mean(values))
                if len(values) > 1:
                    record[f"{k}_std"] = float(np.std(values, ddof=1))
        out.append(record)
    return out


def shift_body(
    records: dict[str, list[dict]],
    variational: dict[str, bool],
    dataset: str,
    seeds: Sequence[int] | None,
    per_seed: dict[str, Any] | None = None,
    kinds: Sequence[str] = shifts.SHIFTS,
) -> dict:
    """``shift.json``'s content: the shifts and their intensities, and each method's records
    (means over seeds with seeds, each seed's own under ``runs``)."""
    body: dict[str, Any] = {
        "source": 'Ovadia et al. 2019, "Can You Trust Your Model\'s Uncertainty?": metrics per shift and level (fedbayes.data.shift)',
        "dataset": dataset,
        "noise_seed": NOISE_SEED,
        "shifts": {k: {"unit": shifts.UNITS[k], "intensities": [shifts.intensity(k, lv) for lv in shifts.levels(k)]} for k in kinds},
        "methods": {name: {"variational": variational[name], "records": recs} for name, recs in records.items()},
    }
    if seeds is not None:
        body["seeds"] = list(seeds)
        for name, runs in (per_seed or {}).items():
            body["methods"][name]["runs"] = runs
    return body


class ShiftFiles(NamedTuple):
    """What :func:`write_shift` wrote."""

    markdown: Path
    json: Path
    plot: Path
    body: dict


def write_shift(
    out: Path,
    runs: dict[str, dict[int | None, Path]],
    *,
    seeds: Sequence[int] | None = None,
    kinds: Sequence[str] = shifts.SHIFTS,
    title: str = "",
    say: Callable[[str], None] = lambda s: None,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> ShiftFiles:
    """Evaluates the run folders ``runs`` (variant -> seed (None without seeds) -> folder) under
    every shift and writes ``OUT/shift.md``, ``OUT/shift.json`` and ``OUT/shift.png``. Variants
    with seeds show the mean over their seeds. ``say`` and ``progress``: as :func:`evaluate_runs`'s.

    Raises:
      ConfigError: a run's dataset holds no images.
      FileNotFoundError: a folder holds no finished run.
    """
    out = Path(out)
    flat = [(name, seed, Path(d)) for name, by_seed in runs.items() for seed, d in by_seed.items()]
    results = evaluate_runs([d for _, _, d in flat], kinds=kinds, say=say, progress=progress)
    by_variant: dict[str, dict] = {}
    for (name, seed, _), recs in zip(flat, results):
        by_variant.setdefault(name, {})[seed] = recs
    configs = {name: load_config(Path(next(iter(by_seed.values()))) / folder.CONFIG) for name, by_seed in runs.items()}
    records = {name: mean_over_seeds(list(s.values())) if seeds is not None else s[None] for name, s in by_variant.items()}
    per_seed = {name: {str(k): v for k, v in s.items()} for name, s in by_variant.items()} if seeds is not None else None
    datasets = sorted({c.data.dataset for c in configs.values()})
    body = shift_body(records, {n: c.model.variational for n, c in configs.items()}, ", ".join(datasets), seeds, per_seed, kinds)
    from fedbayes.runs.plotting import plot_shift

    md = folder.write_atomic(out / SHIFT_MD, report.shift_markdown(body))
    js = folder.write_atomic(out / SHIFT_JSON, dumps_record(body, indent=2) + "\n")
    plot = plot_shift(out / SHIFT_PLOT, body, title=title)
    return ShiftFiles(md, js, plot, body)
