"""Evaluation: metrics computed on the devices, and the point, sampled and linearised predictives."""
