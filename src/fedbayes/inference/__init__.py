"""Client inference methods: how a client turns its data and a server message into an estimate."""

from fedbayes.inference.iasg import epoch_samples, iasg
from fedbayes.inference.sgd import LocalTrainer, run_sgd

__all__ = ["LocalTrainer", "epoch_samples", "iasg", "run_sgd"]
