"""``python -m fedbayes.flower.fastnode <flower-supernode options>``: Flower's SuperNode with its
idle sleeps capped, for a federation on one machine.

Flower's SuperNode sleeps a fixed 3 s after every pull that finds no message, and waits in steps
of 0.5 s for its ClientApp's reply and then for each of the reply's objects
(Flower's SuperNode loop, flwr 1.41 and 1.42; none is configurable). Right
after a reply it pulls, finds nothing (the ServerApp is still aggregating) and sleeps 3 s: a
floor of about 3 s per round whatever the ClientApp costs. This wrapper runs Flower's own
``flower-supernode`` with the ``time`` module of that one Flower module replaced by a copy whose
``sleep`` is capped (:func:`capped_time`, patched in by :func:`fedbayes.flower.internals.patch_node_sleeps`): the 3 s sleep at ``FEDBAYES_NODE_SLEEP`` seconds
(default 0.05), since each wake-up is a request to the SuperLink (about 20 a second per idle
node, fine on loopback); the 0.5 s waits at ``FEDBAYES_NODE_WAIT`` (default 0.005), since they
look at the node's own memory only. At a 50 ms cap the node found a reply's object 3 ms after it
went to sleep and woke 47 ms later (loopback, docs/results/flower.md). On real machines
``fedbayes deploy --print-commands`` prints the stock ``flower-supernode``. Where the wall's checks
fail (a flwr whose loop no longer sleeps through ``time``), it runs the stock SuperNode unchanged
and says so once. It also pulls a message's objects from the SuperLink with a short backoff
(:func:`fedbayes.flower.internals.short_object_pulls`), as fedbayes's ServerApp pulls its replies' objects.
"""

from __future__ import annotations

import collections
import os
import sys
import time
import types

from fedbayes.flower.internals import patch_node_sleeps, short_object_pulls, shorten_node_pulls

__all__ = ["Rhythm", "capped_time", "main", "short_object_pulls"]  # short_object_pulls: the wall's, named here as before


class Rhythm:
    """The first wait of an idle spell, learnt from the last ones: a poller (a SuperNode polling
    the SuperLink, an executor polling its node) that has just finished a task knows that the next
    one comes no sooner than the rest of the round (the other clients, the server's step): polled
    every 50 ms meanwhile, the three nodes of a heavy-MLP round on loopback polled the SuperLink 13
    times a round, each poll a request served on the same two cores as the clients' updates
    (docs/results/flower.md). The wait :meth:`idle` returns is ``fraction`` of the shortest of the last
    ``keep`` spells (at most ``most`` seconds; none before a spell was seen), after which the
    poller polls at its usual rate, so a round that comes sooner than the shortest recent one
    waits at most that fraction of it, and a slower one costs nothing."""

    def __init__(self, fraction: float = 0.5, most: float = 1.0, keep: int = 3, clock=time.monotonic):
        self.fraction, self.most, self.clock = fraction, most, clock
        self.spells: collections.deque[float] = collections.deque(maxlen=keep)
        self.idle_since: float | None = None

    def idle(self) -> float:
        """An idle spell starts (a poll found nothing after a task): the seconds to wait first."""
        self.idle_since = self.clock()
        return min(self.most, self.fraction * min(self.spells)) if self.spells else 0.0

    def busy(self) -> None:
        """The spell, if one started, is over: a task came."""
        if self.idle_since is not None:
            self.spells.append(self.clock() - self.idle_since)
            self.idle_since = None

    @property
    def idling(self) -> bool:
        return self.idle_since is not None


def capped_time(cap: float, wait_cap: float | None = None, rhythm: Rhythm | None = None) -> types.SimpleNamespace:
    """A stand-in for the ``time`` module whose ``sleep`` sleeps at most ``cap`` seconds, and a
    sleep of under 1 s (the SuperNode's waits on its own state) at most ``wait_cap`` (default: ``cap``).
    With a ``rhythm``, the first sleep after an empty pull that follows a message sleeps
    :meth:`Rhythm.idle`'s wait when it is longer than ``cap`` (the SuperNode sleeps 3 s after an
    empty pull, and waits in steps of 0.5 s once it has pulled a message)."""
    names = {k: getattr(time, k) for k in dir(time) if not k.startswith("__")}
    short = cap if wait_cap is None else wait_cap

    def sleep(s: float) -> None:
        if s < 1:  # a message was pulled: the node waits for its ClientApp's reply
            if rhythm is not None:
                rhythm.busy()
            time.sleep(min(s, short))
        elif rhythm is not None and not rhythm.idling:
            time.sleep(min(s, max(cap, rhythm.idle())))
        else:
            time.sleep(min(s, cap))

    return types.SimpleNamespace(**{**names, "sleep": sleep})


def main() -> None:
    from importlib.metadata import entry_points

    (supernode,) = entry_points(group="console_scripts", name="flower-supernode")  # Flower's own SuperNode
    patch_node_sleeps(capped_time(float(os.environ.get("FEDBAYES_NODE_SLEEP", "0.05")), float(os.environ.get("FEDBAYES_NODE_WAIT", "0.005")), Rhythm()))
    shorten_node_pulls()
    sys.argv[0] = "flower-supernode"
    supernode.load()()


if __name__ == "__main__":
    main()
