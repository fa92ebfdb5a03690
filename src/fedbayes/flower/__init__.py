"""Deployment on Flower (the ``flower`` extra, in an environment of its own: :data:`INSTALL`):
every fedbayes algorithm across real Flower processes, equal to the simulator.

* :mod:`fedbayes.flower.codec`: pytrees <-> ``ArrayRecord`` by tree path, checked on decode;
* :mod:`fedbayes.flower.node`: one client's round on its node, its state on disk;
* :mod:`fedbayes.flower.nodedata`: where a node's examples come from (the node's setting, never the server's);
* :mod:`fedbayes.flower.executor`: the warm executor, one long-lived process per SuperNode;
* :mod:`fedbayes.flower.fastnode`: Flower's SuperNode with its idle sleeps capped (one machine only);
* :mod:`fedbayes.flower.rounds`: the server's rounds over Flower nodes (the simulator's interface);
* :mod:`fedbayes.flower.apps`: the ``ClientApp`` and ``ServerApp``;
* :mod:`fedbayes.flower.deploy`: ``fedbayes deploy``: a local federation of real processes, or
  the commands to start one on real machines.

The core package never imports this one; it needs ``flwr``.
"""

# The one install instruction (README, examples/flower/README.md and every error say the same):
# flwr pins older typer, rich and protobuf than the rest of fedbayes, hence an environment of its own.
INSTALL = "from the fedbayes clone: python -m venv .venv-flower && .venv-flower/bin/pip install -e '.[flower]' (then run .venv-flower/bin/fedbayes deploy)"
