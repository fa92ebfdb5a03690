"""Client inference methods: how a client turns its data and a server message into an estimate.

Point estimates (:mod:`~fedbayes.inference.sgd`, :mod:`~fedbayes.inference.iasg`) and the
approximations of a tilted distribution that share one protocol,
:class:`~fedbayes.inference.base.CavityInference` ``(key, start, cavity, data) -> (q, info)``:
FedEP's four methods (:mod:`~fedbayes.inference.tilted`), mean-field variational inference
(:mod:`~fedbayes.inference.vi`) and its full-covariance counterpart (:mod:`~fedbayes.inference.vi_full`). Diagonal curvature and the one pass over a client's data are
:mod:`~fedbayes.inference.curvature`'s.
"""

from fedbayes.inference.base import CavityInference
from fedbayes.inference.iasg import epoch_samples, iasg
from fedbayes.inference.sgd import LocalTrainer, run_sgd

__all__ = ["CavityInference", "LocalTrainer", "epoch_samples", "iasg", "run_sgd"]
