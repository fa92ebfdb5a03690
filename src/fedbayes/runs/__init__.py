"""Runs: the run-folder format, building a run from a config, the loop, resume, health guards,
checkpoints, exports, loggers, summaries, reports, plots, comparisons and sweeps."""
