"""Federated algorithms, each a small set of pure functions (see :mod:`fedbayes.algorithms.base`)."""

from fedbayes.algorithms.admm import admm
from fedbayes.algorithms.base import Algorithm
from fedbayes.algorithms.fedavg import fedavg
from fedbayes.algorithms.feddyn import feddyn
from fedbayes.algorithms.fedep import fedep, fedsep
from fedbayes.algorithms.fedlap import fedlap
from fedbayes.algorithms.fedlap_cov import fedlap_cov
from fedbayes.algorithms.fedlap_func import fedlap_func
from fedbayes.algorithms.fedpa import fedpa, shrinkage_delta
from fedbayes.algorithms.fedprox import fedprox
from fedbayes.algorithms.pvi import pvi
from fedbayes.algorithms.server_opt import make_server_optimizer, scale_by_reddi

__all__ = [
    "Algorithm",
    "admm",
    "fedavg",
    "feddyn",
    "fedep",
    "fedlap",
    "fedlap_cov",
    "fedlap_func",
    "fedpa",
    "fedprox",
    "fedsep",
    "make_server_optimizer",
    "pvi",
    "scale_by_reddi",
    "shrinkage_delta",
]
