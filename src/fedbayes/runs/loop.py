"""One experiment from a validated config: build, run, record, resume (:func:`run_experiment`).

``run_experiment`` writes the run folder (:mod:`fedbayes.runs.folder` names every file):

* ``config.toml``: the resolved config (every default written out; ``fedbayes run`` accepts it);
* ``metrics.jsonl``: one line per evaluation, round 0 being the initial model: ``round``, the
  test metrics (``accuracy``, ``nll``, ``ece``, and ``accuracy_marg``, ``nll_marg``, ``ece_marg``
  for Bayesian methods; ``mse``, ``rmse`` for regression; with ``data.validation_fraction > 0``
  also ``val_accuracy``, ``val_nll``, ``val_ece`` (or ``val_mse``, ``val_rmse``) on the held-out
  split, :mod:`fedbayes.data.holdout`), ``train_loss`` (after round 0: the
  round's accepted clients' mean training loss, weighted by their example counts), after round 1
  ``posterior_change`` (the relative L2 change of the server posterior's mean, or of a point
  method's model, in the round) and for Bayesian methods ``posterior_var_change`` (the mean change
  of its log variances; :class:`fedbayes.runs.health.FixedPointCheck`), and four
  counters that are cumulative since round 0: ``seconds`` (training time: the wall time of the
  rounds up to the moment each round's outputs are ready, evaluation, checkpoints and JAX's
  compilation excluded (:mod:`fedbayes.runs.compile_clock`); no round is in flight while a round
  is evaluated or checkpointed, so none of its compute hides in the excluded time),
  ``bytes_up``, ``bytes_down`` and ``rejected`` (messages refused);
* ``clients.jsonl``: one line per sampled client and round (:class:`fedbayes.runs.loggers.ClientLog`);
* ``model.npz``: the final server parameters (and posterior) by tree path (:mod:`fedbayes.runs.export`);
* ``checkpoints/round_NNNNNN.npz``: atomic checkpoints every ``checkpoint_every`` rounds and at
  the end;
* ``summary.json`` and ``curves.png`` at the end; ``summary.json``'s ``warnings`` lists the run's
  warnings (a posterior too wide for the data; a run that ended before its fixed point), and its
  ``message_bytes`` the bytes of one client's message (``up``: what each client uploads per round;
  ``bytes_up`` is it times the messages received) and of one broadcast (``down``), the runner's
  ``message_bytes``;
* ``personal.json`` at the end with ``evaluation.personal_fraction`` (:mod:`fedbayes.runs.personal`);
* ``conformal.json`` at the end with ``evaluation.conformal_alpha`` (:mod:`fedbayes.runs.conformal`;
  its coverages and set sizes also go into ``summary.json``'s ``final``).

Rounds run pipelined (the runner's ``rounds``: round ``r + 1``'s host work overlaps round ``r``,
and so does its launch unless round ``r`` is evaluated or checkpointed: then round ``r + 1`` is
launched after the evaluation, so that the evaluation's time is its own); a :class:`RunRecorder`
records, checks for divergence (:mod:`fedbayes.runs.health`), checkpoints and reports them
strictly in round order. Results are bitwise those of one round at a time.

A run killed at any point and resumed (``resume=True``) continues from its newest intact
checkpoint, rewrites ``metrics.jsonl`` from the records the checkpoint holds, and ends with the same
metrics as a run that never stopped (same machine and seed): every random choice derives from
(seed, round, client). One process at a time writes a run folder (:mod:`fedbayes.runs.runlock`); a
resume refuses a config that differs from the checkpoint's unless each change is accepted
(:mod:`fedbayes.runs.resume`). Every JSON file is strict JSON (:mod:`fedbayes.runs.strictjson`).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedbayes.aggregators.dp import epsilon as privacy_epsilon
from fedbayes.algorithms import registry
from fedbayes.config.schema import ConfigError, RunConfig, to_toml
from fedbayes.errors import BadInputError
from fedbayes.runs import folder, health, runlock
from fedbayes.runs.build import Experiment, build_experiment
from fedbayes.runs.checkpoint import find_resume_checkpoint, load_checkpoint, save_checkpoint
from fedbayes.runs.compile_clock import CompileClock
from fedbayes.runs.export import save_model
from fedbayes.runs.loggers import ClientLog, PlainReporter, Reporter
from fedbayes.runs.plotting import plot_curves
from fedbayes.runs.resume import check_resume_config, check_store_dir, claim_store, config_hash, record_changes
from fedbayes.runs.strictjson import dumps_record, restore_record
from fedbayes.runs.summaries import summarize
from fedbayes.sim.compiled import release_if_crowded

__all__ = ["Pending", "RunRecorder", "run_experiment", "train_loss"]


def train_loss(info) -> float | None:
    """The round's training loss: the mean over its accepted clients of their mean minibatch loss,
    weighted by their example counts (``None`` when no client was accepted)."""
    c = info.clients
    w = np.where(c["accepted"], c["num_examples"], 0).astype(np.float64)
    if not w.sum():
        return None
    return float(np.sum(w * np.where(c["accepted"], c["loss"], 0.0)) / w.sum())


class Pending(NamedTuple):
    """A finished round and its evaluation's metrics (``None``: not an evaluation round)."""

    round: int
    info: Any
    evaluation: dict | None
    counters: dict
    bad: str | None  # non-finite parameters or training loss, found when the round finished


class RunRecorder:
    """Records one run's rounds strictly in order: metric records (``metrics.jsonl``), the
    divergence guard, checkpoints and progress.

    Round ``r``'s evaluation runs before round ``r + 1`` is launched (round ``r + 1``'s host work
    is already done). It runs on the loop's thread: two threads dispatching multi-device
    programs can queue them in different orders on different devices, and their all-reduces then
    deadlock (seen: XLA:CPU aborted in a rendezvous).
    """

    def __init__(
        self,
        config: RunConfig,
        out: Path,
        exp: Experiment,
        reporter: Reporter,
        warn: Callable[[str], None],
        records: list[dict],
        last_checkpoint: int | None,
        runner=None,
        client_log: ClientLog | None = None,
        message_bytes: tuple[int, int] | None = None,
    ):
        self.config, self.out, self.reporter, self.warn = config, out, reporter, warn
        runner = runner if runner is not None else exp.simulator
        self.algorithm, self.server_params = runner.algorithm, runner.server_params  # what the fixed-point check reads
        self.num_clients = len(exp.federation.sizes)
        self.task = exp.dataset.task
        self.records = records
        self.last_checkpoint = last_checkpoint  # the round of the newest checkpoint written or resumed from
        self.warned = False  # a divergence was reported (on_divergence = "warn"): no more checkpoints
        self.metrics = folder.MetricsWriter(out / folder.METRICS)
        self.calibration = health.make_calibration_check(config)
        self.learning = health.make_learning_check(config)
        self.stop_reason: str | None = None  # the learning check's, for the round just recorded
        self.learning_warned = False
        self.fixed_point = health.FixedPointCheck(config.name, config.rounds)
        self.rejections = health.RejectionStreak(config.server.max_rejected_rounds)
        self.client_log = client_log  # its text so far goes into each checkpoint
        self.message_bytes = None if message_bytes is None else {"up": int(message_bytes[1]), "down": int(message_bytes[0])}
        self.meta = {"name": config.name, "config": config.model_dump(mode="json"), "config_hash": config_hash(config)}

    def is_checkpoint_round(self, r: int) -> bool:
        """Whether the state after round ``r`` (1-based: the state's round) is checkpointed."""
        c = self.config
        return r == c.rounds or bool(c.checkpoint_every and r % c.checkpoint_every == 0)

    def record(self, round_idx: int, evaluated: dict, snapshot: dict, info=None) -> dict:
        """Appends round ``round_idx``'s metric record (evaluation, counters, epsilon, training loss,
        and the damping a site method's clients used)."""
        r = {"round": round_idx, **evaluated, **snapshot}
        if self.config.privacy.clip is not None:
            p = self.config.privacy
            r["epsilon"] = privacy_epsilon(p.noise_multiplier, self.num_clients, self.config.server.clients_per_round, round_idx, p.delta)
        if info is not None:
            r["train_loss"] = train_loss(info)
            r.update(self.fixed_point.change)
            if info.server and "damping" in info.server:  # the damping this round's clients used
                r["damping"] = round(float(info.server["damping"]), 6)
        r["seconds"] = round(r["seconds"], 3)
        self.calibration.check(r)
        self.stop_reason = self.learning.check(r, log=False)
        if self.learning.message and not self.learning_warned:
            self.warn(f"warning: {self.learning.message}")
            self.learning_warned = True
        self.records.append(r)
        self.metrics.append(r)
        return r

    def start(self, evaluate_initial: Callable[[], dict], counters: dict, done: int) -> None:
        """Starts the progress display; a fresh run records the initial model as round 0."""
        self.reporter.start(self.config.name, self.config.rounds, done)
        if done == 0 and not self.records:
            self.reporter.update(0, self.config.rounds, self.record(0, evaluate_initial(), dict(counters)))

    def settle(self, e: Pending, state) -> None:
        """Records round ``e`` (``state``: the state after it), checks it for divergence,
        checkpoints and reports it.

        Raises:
          health.Diverged: a quantity turned non-finite and ``server.on_divergence = "stop"``;
            ``summary.json`` then records ``diverged`` (round, metric, last good checkpoint).
        """
        config = self.config
        self.observe(e.round, state)
        self.stop_reason = None
        rec = self.record(e.round, e.evaluation, e.counters, e.info) if e.evaluation is not None else None
        streak = self.rejections.update(e.info) if e.info is not None else None
        bad = e.bad or health.non_finite(rec, None) or streak or self.stop_reason
        if bad is not None and not self.warned:
            message = health.divergence_message(config, e.round, bad, self.out, self.last_checkpoint)
            metric = health.STOPPED_LEARNING if bad == self.stop_reason else bad
            if config.server.on_divergence == "stop":
                summary = {**self.summary(), "diverged": {"round": e.round, "metric": metric, "checkpoint": self.last_checkpoint}}
                folder.write_json(self.out / folder.SUMMARY, summary)
                raise health.Diverged(message, e.round, metric, self.last_checkpoint)
            self.warn(f"warning: {message}")
            self.warned = True
        if not self.warned and self.is_checkpoint_round(e.round):
            assert e.round == state.round, "a checkpoint round is settled before the next round starts"
            self.checkpoint(state, e.counters)
        self.reporter.update(e.round, config.rounds, rec)

    def resume(self, state, meta: dict) -> None:
        """Continues the health checks from a checkpoint (``meta``: its metadata with its extra
        arrays), so a resumed run warns and stops exactly where an uninterrupted one would."""
        self.calibration.replay(self.records)
        self.learning.replay(self.records)
        self.learning_warned = self.learning.message is not None
        self.rejections.count = int(meta.get("health", {}).get("rejected_streak", 0))
        snapshot = health.posterior_snapshot(self.algorithm, state.server_state, self.server_params(state))
        self.fixed_point.restore(meta.get("extra", {}), int(state.round), snapshot)

    def observe(self, round_idx: int, state) -> None:
        """Hands the server posterior after round ``round_idx`` to the fixed-point check (``state``: a
        simulator or runner state, whose ``server_state`` is read)."""
        self.fixed_point.observe(round_idx, health.posterior_snapshot(self.algorithm, state.server_state, self.server_params(state)))

    def summary(self) -> dict:
        """``summary.json`` of the records so far (:func:`fedbayes.runs.summaries.summarize`) with
        the run's ``message_bytes``."""
        summary = summarize(self.config, self.records, self.task)
        if self.message_bytes is not None:
            summary["message_bytes"] = self.message_bytes
        return summary

    def checkpoint(self, state, counters: dict) -> None:
        """Saves ``state`` with the run's metadata, counters and every record so far (strict JSON)."""
        strict = [json.loads(dumps_record(x)) for x in self.records]
        extra = self.fixed_point.saved()
        if self.client_log is not None:
            extra["clients"] = self.client_log.saved()
        meta = {**self.meta, "counters": counters, "metrics": strict, "health": {"rejected_streak": self.rejections.count}}
        save_checkpoint(self.out / folder.CHECKPOINTS, state, meta, extra=extra)
        self.last_checkpoint = int(state.round)

    def finish(self, algorithm, server_state, conformal: Callable[[Any], dict] | None = None, personal: Callable[[], dict] | None = None) -> dict:
        """Writes ``model.npz``, ``summary.json`` and ``curves.png`` (and ``conformal.json`` from
        ``conformal(server_state)``, ``personal.json`` from ``personal()``); returns the summary."""
        config, out = self.config, self.out
        summary = self.summary()
        save_model(out / folder.MODEL, algorithm, server_state)
        if conformal is not None:
            from fedbayes.runs.conformal import summary_fields

            body = conformal(server_state)
            folder.write_json(out / folder.CONFORMAL, body)
            summary["final"].update(summary_fields(body))
            summary["conformal"] = {k: body[k] for k in ("alpha", "nominal", "bound", "score", "calibration_examples")}
        if personal is not None:
            from fedbayes.runs import personal as personal_json

            body = personal()
            folder.write_json(out / folder.PERSONAL, body)
            summary["final"].update(personal_json.summary_fields(body))
            summary["personal"] = {k: body[k] for k in ("personalisation", "fraction", "weight", "epochs", "clients") if k in body}
        warnings = [m for m in (self.learning.message, self.calibration.finish(), self.fixed_point.finish()) if m]
        if self.fixed_point.message:
            self.warn(f"warning: {self.fixed_point.message}")
        if self.fixed_point.result is not None:
            summary["fixed_point"] = self.fixed_point.result
        if warnings:
            summary["warnings"] = warnings
        folder.write_json(out / folder.SUMMARY, summary)
        bayesian = (config.name,) if registry.get(config.algorithm.name).bayesian else ()
        plot_curves(out / folder.CURVES, {config.name: self.records}, title=config.name, task=self.task, bayesian=bayesian)
        return summary


def run_experiment(
    config: RunConfig,
    out_dir: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    data=None,
    model=None,
    reporter=None,
    accept_changes=(),
    warn=None,
    rounds=None,
) -> dict:
    """Runs (or resumes) one experiment and returns its summary (see the module docstring).

    As ``fedbayes run`` does, it refuses a folder that is not empty unless told to ``resume`` the
    run there (from its newest checkpoint) or to ``overwrite`` it.

    ``data``: your own data, with ``data.dataset = "arrays"``: a
    :class:`~fedbayes.data.dataset.Dataset`, a pair ``(x, y)``, or a mapping with ``x``, ``y`` and
    optionally ``x_test``, ``y_test``, ``client_ids``, ``test_client_ids``
    (:func:`fedbayes.data.user.from_arrays`; without a test split, ``data.test_fraction`` of each
    client's examples is held out, seeded by ``config.seed``). ``model``: your own
    ``flax.linen.Module``, with ``model.name = "module"`` (parameters only: see
    :mod:`fedbayes.models.imported`). To resume such a run, pass the same data and model again.
    ``accept_changes``: dotted config keys that may differ from the checkpoint's on resume.
    ``warn``: where one-line warnings go (a damaged checkpoint skipped); default stderr.
    ``rounds``: ``Experiment -> runner`` (a :class:`fedbayes.protocol.Runner`: ``init``, ``place``,
    ``rounds``, ``server_params``, ``algorithm``, ``counts_dropped``) that runs the rounds instead of
    ``exp.simulator`` (the Flower deployment, :class:`fedbayes.flower.rounds.FlowerRounds`);
    ``None``: the simulator.

    A process that has run many experiments may hold the compiled programs of all of them; where
    they crowd the kernel's cap on memory mappings, the run first releases them
    (:func:`fedbayes.sim.compiled.release_if_crowded`).
    """
    out = Path(out_dir)
    if not (resume or overwrite) and out.is_dir() and any(p.name != runlock.LOCK_NAME for p in out.iterdir()):
        raise BadInputError(
            f"error: {out} is not empty (an earlier run?); pass overwrite=True to replace it, resume=True to continue it, or choose another folder"
        )
    given = _given_dataset(config, data)
    # A process that runs experiment after experiment keeps the compiled programs of each; before
    # they reach the kernel's cap on memory mappings (a crash, not an error), let them go.
    release_if_crowded()
    with runlock.hold(out_dir), claim_store(config, out, resume):
        return _run_experiment(config, out, resume, reporter or PlainReporter(), tuple(accept_changes), warn or _stderr, rounds, given, model)


def _given_dataset(config: RunConfig, data):
    """``data`` (a Dataset, ``(x, y)`` or a mapping of arrays) as a Dataset; ``None`` stays ``None``."""
    from fedbayes import protocol
    from fedbayes.data.dataset import Dataset
    from fedbayes.data.user import from_arrays

    if data is None or isinstance(data, Dataset):
        return data
    arrays = dict(zip(("x", "y"), data, strict=True)) if isinstance(data, tuple | list) else dict(data)
    d = config.data
    return from_arrays(**arrays, test_fraction=d.test_fraction, num_classes=d.num_classes, rng=protocol.test_split_rng(config.seed))


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run_experiment(config: RunConfig, out: Path, resume: bool, reporter: Reporter, accept_changes: tuple, warn, rounds=None, data=None, module=None) -> dict:
    ckpt_dir = out / folder.CHECKPOINTS
    found = find_resume_checkpoint(ckpt_dir, warn) if resume else None
    changes = check_resume_config(config, found[1], out, accept_changes) if found is not None else {}
    check_store_dir(config, out)
    exp = build_experiment(config, store_dir=out / folder.CLIENT_STORE, data=data, module=module)
    runner = exp.simulator if rounds is None else rounds(exp)
    if exp.personalise is not None and rounds is not None and runner.algorithm.personal_posterior is not None and config.evaluation.personal_by == "site":
        raise ConfigError(
            "config error: evaluation.personal_by: a deployment's client sites stay on its nodes; personalise a site method in simulation, or set 'fine_tune' (the default)"
        )
    ckpt = found[0] if found is not None else None
    if ckpt is None:
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # before a new disk client store replaces the old one
    state = runner.init(exp.params, resume=ckpt is not None)  # resume: open the disk store, not rewrite it
    counters = {"seconds": 0.0, "bytes_up": 0, "bytes_down": 0, "rejected": 0}
    if config.server.dropout > 0 or config.server.deadline is not None or runner.counts_dropped:
        counters.update(dropped=0, late=0)
    records: list[dict] = []
    if ckpt is not None:
        state, meta = load_checkpoint(ckpt, state)
        state = state._replace(server_state=runner.place(state.server_state))
        counters = meta["counters"]
        records = [restore_record(dict(r)) for r in meta["metrics"]]  # metrics.jsonl is rewritten from these
        if changes:
            record_changes(out, state.round, changes)
    else:
        for stale in (folder.SUMMARY, folder.CURVES):  # a killed fresh run must not look finished
            (out / stale).unlink(missing_ok=True)
    folder.write_atomic(out / folder.CONFIG, to_toml(config))
    client_log = ClientLog(out / folder.CLIENTS, exp.federation.sizes)
    recorder = RunRecorder(
        config, out, exp, reporter, warn, records, int(state.round) if ckpt is not None else None, runner, client_log, runner.message_bytes(state)
    )
    if ckpt is not None:
        recorder.resume(state, meta)
        kept = "".join(dumps_record(r) + "\n" for r in records)
        damage = folder.damage(out / folder.METRICS, kept, more=True)
        if damage is not None:
            warn(f"warning: {out / folder.METRICS}: {damage}; rebuilt from the run's checkpoint (round {state.round})")
    else:
        recorder.observe(int(state.round), state)
    recorder.metrics.rewrite(records)
    client_log.restart(state.round, meta.get("extra", {}).get("clients") if ckpt is not None else None, warn)
    recorder.start(lambda: exp.evaluate(state.server_state, 0), counters, state.round)

    def evaluates(r: int) -> bool:
        return r % config.eval_every == 0 or r == config.rounds

    def quiet(r: int) -> bool:
        """Whether the state after round ``r`` is evaluated or checkpointed: the next round is then
        launched only after that (``keep``), so nothing computes while it is done."""
        return evaluates(r) or recorder.is_checkpoint_round(r)

    try:
        # ``seconds`` counts wall time from each round's start to its outputs being ready; the time
        # after a quiet round's results (evaluation, checkpoint, records) is excluded, and nothing
        # runs on the devices then. After any other round the next one is already running, so the
        # host's bookkeeping there overlaps training and counts.
        # Compilation inside those windows (the first rounds' programs) is left out too
        # (fedbayes.runs.compile_clock): it does not grow with the rounds.
        with CompileClock() as compiling:
            clock, compiled = time.perf_counter(), 0.0
            for state, info in runner.rounds(state, config.rounds, donate=True, keep=lambda r: quiet(r + 1)):
                ready, compiled_by_then = time.perf_counter(), compiling.seconds
                counters["seconds"] += max(0.0, ready - clock - (compiled_by_then - compiled))
                counters["bytes_up"] += info.bytes_up
                counters["bytes_down"] += info.bytes_down
                counters["rejected"] += len(info.rejected)
                if "dropped" in counters:
                    counters["dropped"] += len(info.dropped)
                    counters["late"] += len(info.late)
                client_log.write(info, state.round)
                r = state.round
                evaluation = exp.evaluate(state.server_state, r) if evaluates(r) else None
                recorder.settle(Pending(r, info, evaluation, dict(counters), health.non_finite(None, runner.server_params(state), train_loss(info))), state)
                clock, compiled = (time.perf_counter(), compiling.seconds) if quiet(r) else (ready, compiled_by_then)
    finally:
        reporter.stop()
    personal = None if exp.personalise is None else (lambda: exp.personalise(state.server_state, state.client_states, int(state.round)))
    return recorder.finish(runner.algorithm, state.server_state, _conformal(exp, int(state.round)), personal)


def _conformal(exp: Experiment, round_idx: int) -> Callable[[Any], dict] | None:
    """``server state -> conformal.json's body`` after round ``round_idx`` (None when off)."""
    if exp.predictive is None:
        return None
    from fedbayes.runs.conformal import conformal_body

    parts = exp.federation.client_indices
    return lambda server_state: conformal_body(exp.config, exp.predictive(server_state, round_idx), exp.dataset, parts, exp.calibration, round_idx)
