"""``python -m fedbayes.flower.fastnode <flower-supernode options>``: Flower's SuperNode with its
idle sleeps capped, for a federation on one machine.

Flower's SuperNode sleeps a fixed 3 s after every pull that finds no message, and checks every
0.5 s for a reply to send (``flwr.supernode.start_client_internal``, flwr 1.41 and 1.42; neither
is configurable). Right after a reply it pulls, finds nothing (the ServerApp is still
aggregating) and sleeps 3 s: a floor of about 3 s per round whatever the ClientApp costs. This
wrapper runs Flower's own ``flower-supernode`` with the ``time`` module of that one Flower module
replaced by a copy whose ``sleep`` is capped at ``FEDBAYES_NODE_SLEEP`` seconds (default 0.05).
It costs polling (about 20 requests a second per idle node), fine on loopback; on real machines
``fedbayes deploy --print-commands`` prints the stock ``flower-supernode``. With another flwr
release than those tested, or if that module no longer sleeps through ``time``, it runs the stock
SuperNode unchanged.
"""

from __future__ import annotations

import os
import sys
import time
import types

TESTED = ("1.41.", "1.42.")


def capped_time(cap: float) -> types.SimpleNamespace:
    """A stand-in for the ``time`` module whose ``sleep`` sleeps at most ``cap`` seconds."""
    names = {k: getattr(time, k) for k in dir(time) if not k.startswith("__")}
    return types.SimpleNamespace(**{**names, "sleep": lambda s: time.sleep(min(s, cap))})


def main() -> None:
    import flwr
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if flwr.__version__.startswith(TESTED) and start_client_internal.time is time:
        start_client_internal.time = capped_time(float(os.environ.get("FEDBAYES_NODE_SLEEP", "0.05")))
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
