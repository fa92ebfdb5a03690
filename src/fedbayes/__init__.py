"""fedbayes: federated learning as Bayesian inference, in JAX."""

__version__ = "0.1.0"
