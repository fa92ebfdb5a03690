"""fedbayes: federated learning as Bayesian inference, in JAX."""

__version__ = "0.1.0"


def load_run(run_dir):
    """``(config, params, metrics)`` of a finished run folder (see :mod:`fedbayes.runs.export`)."""
    from fedbayes.runs.export import load_run as _load_run

    return _load_run(run_dir)
