"""Runs: everything between a validated config and a run folder on disk.

* :mod:`~fedbayes.runs.folder`: the run-folder format (every file name, ``read_metrics``, the
  metrics writer, atomic writes); :mod:`~fedbayes.runs.strictjson`: strict JSON;
* :mod:`~fedbayes.runs.build`: config -> data, model, algorithm and aggregator, evaluator;
* :mod:`~fedbayes.runs.loop`: ``run_experiment`` (a :class:`~fedbayes.runs.loop.RunRecorder`
  records, checks, checkpoints and reports the rounds in order);
* :mod:`~fedbayes.runs.resume` (resume checks), :mod:`~fedbayes.runs.health` (divergence and
  calibration guards), :mod:`~fedbayes.runs.checkpoint`, :mod:`~fedbayes.runs.runlock`;
* outputs: :mod:`~fedbayes.runs.export` (``model.npz``, ``load_run``), :mod:`~fedbayes.runs.loggers`
  (reporters and loggers), :mod:`~fedbayes.runs.summaries`, :mod:`~fedbayes.runs.report`,
  :mod:`~fedbayes.runs.plotting`;
* several runs: :mod:`~fedbayes.runs.compare` and :mod:`~fedbayes.runs.sweep`.

Reading a run folder (``folder``, ``export``, ``strictjson``) imports neither the simulator nor
the loop.
"""
