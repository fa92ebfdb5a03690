"""``python -m fedbayes.flower.fastnode <flower-supernode options>``: Flower's SuperNode with its
idle sleeps capped, for a federation on one machine.

Flower's SuperNode sleeps a fixed 3 s after every pull that finds no message, and waits in steps
of 0.5 s for its ClientApp's reply and then for each of the reply's objects
(``flwr.supernode.start_client_internal``, flwr 1.41 and 1.42; none is configurable). Right
after a reply it pulls, finds nothing (the ServerApp is still aggregating) and sleeps 3 s: a
floor of about 3 s per round whatever the ClientApp costs. This wrapper runs Flower's own
``flower-supernode`` with the ``time`` module of that one Flower module replaced by a copy whose
``sleep`` is capped (:func:`capped_time`): the 3 s sleep at ``FEDBAYES_NODE_SLEEP`` seconds
(default 0.05), since each wake-up is a request to the SuperLink (about 20 a second per idle
node, fine on loopback); the 0.5 s waits at ``FEDBAYES_NODE_WAIT`` (default 0.005), since they
look at the node's own memory only. At a 50 ms cap the node found a reply's object 3 ms after it
went to sleep and woke 47 ms later (loopback, 2026-11-27). On real machines
``fedbayes deploy --print-commands`` prints the stock ``flower-supernode``. With another flwr
release than those tested, or if that module no longer sleeps through ``time``, it runs the stock
SuperNode unchanged. It also pulls a message's objects from the SuperLink with a short backoff
(:func:`short_object_pulls`), as fedbayes's ServerApp pulls its replies' objects.
"""

from __future__ import annotations

import collections
import functools
import inspect
import os
import sys
import time
import types

TESTED = ("1.41.", "1.42.")


class Rhythm:
    """The first wait of an idle spell, learnt from the last ones: a poller (a SuperNode polling
    the SuperLink, an executor polling its node) that has just finished a task knows that the next
    one comes no sooner than the rest of the round (the other clients, the server's step): polled
    every 50 ms meanwhile, the three nodes of a heavy-MLP round on loopback polled the SuperLink 13
    times a round, each poll a request served on the same two cores as the clients' updates
    (2026-11-28). The wait :meth:`idle` returns is ``fraction`` of the shortest of the last
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


PULL_BACKOFF = (0.005, 0.05)  # initial, cap (seconds): a retry of an object not yet pushed


def short_object_pulls(module, initial: float = PULL_BACKOFF[0], cap: float = PULL_BACKOFF[1]) -> bool:
    """Makes ``module.pull_objects`` (Flower's ``supercore.inflatable.inflatable_utils.pull_objects``,
    imported by the module that pulls a message's objects) retry an object that is not there yet
    after ``initial`` seconds doubling to ``cap``, instead of Flower's 1 s doubling to 10 s.

    A message is announced before all its objects are pushed, so the first pull often finds an
    object missing; at Flower's backoff that costs about a second each way of a round (measured on
    loopback, 2026-11-27: the warm logistic-regression round's message took 1.26 s to reach the
    handler and its reply 1.16 s to come back, for an 8 ms update). The number of tries is left
    unbounded and Flower's overall time limit (``max_time``) kept, so a slow link waits as long as
    before. The root of the object list (the message, last in Flower's post-order, and pushed last)
    is pulled first and alone, then the others: retried each on its own while the sender pushes,
    every object costs a request per retry (a heavy-MLP round on loopback, 2026-11-28: 19 object
    requests to the SuperLink for the 9 objects of three messages). Returns whether ``module`` was
    changed (False: no ``pull_objects`` there, or already)."""
    original = getattr(module, "pull_objects", None)
    if original is None or getattr(original, "short_backoff", False):
        return False

    param = inspect.signature(original).parameters.get("max_time")  # Flower's overall limit, when the caller gives none
    default_limit = None if param is None or param.default is inspect.Parameter.empty else param.default

    @functools.wraps(original)
    def pull_objects(object_ids, pull_object_fn, **kwargs):
        kwargs.setdefault("initial_backoff", initial)
        kwargs.setdefault("backoff_cap", cap)
        kwargs.setdefault("max_tries_per_object", None)
        ids = list(object_ids)
        if len(ids) < 2:
            return original(ids, pull_object_fn, **kwargs)
        # the message's root first, alone: it is pushed last (post-order), so while it is missing
        # every object may be, and retrying each on its own cost a request per object per retry
        limit, start = kwargs.get("max_time", default_limit), time.monotonic()
        got = original(ids[-1:], pull_object_fn, **kwargs)
        if limit is not None:  # one overall limit for both calls, as Flower's one call has
            kwargs["max_time"] = max(limit - (time.monotonic() - start), 0.0)
        return {**original(ids[:-1], pull_object_fn, **kwargs), **got}

    pull_objects.short_backoff = True
    module.pull_objects = pull_objects
    return True


def main() -> None:
    import flwr
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli.flower_supernode import flower_supernode

    if flwr.__version__.startswith(TESTED) and start_client_internal.time is time:
        start_client_internal.time = capped_time(
            float(os.environ.get("FEDBAYES_NODE_SLEEP", "0.05")), float(os.environ.get("FEDBAYES_NODE_WAIT", "0.005")), Rhythm()
        )
        short_object_pulls(start_client_internal)
    sys.argv[0] = "flower-supernode"
    flower_supernode()


if __name__ == "__main__":
    main()
