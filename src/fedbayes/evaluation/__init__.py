"""Evaluation: metrics computed on the devices (:mod:`~fedbayes.evaluation.metrics`), the point,
sampled and linearised predictives (:mod:`~fedbayes.evaluation.evaluators`) and a variational
network's marginalised predictive (:mod:`~fedbayes.evaluation.variational`)."""
