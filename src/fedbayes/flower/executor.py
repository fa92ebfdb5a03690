"""A warm executor for one SuperNode: fedbayes's ClientApp served by one long-lived process.

Flower runs every ClientApp message as a task: its SuperExec polls the SuperNode's Runtime API
(``AcquireTask``) and starts a fresh ``flwr-clientapp`` process per task, which imports Python,
flwr, JAX and fedbayes, rebuilds the method and compiles its update before it computes a few
milliseconds (``flwr.supercore.superexec.run_superexec``; ``flwr.supernode.runtime.run_clientapp``).
A SuperNode started with ``--isolation process`` leaves the polling to whoever its operator
starts next to it. This module is that process: ``python -m fedbayes.flower.executor`` (``fedbayes deploy``
starts one per node) polls the node as Flower's SuperExec does and runs each task of
fedbayes's app *in this process*, with the same Runtime API calls as ``run_clientapp`` (Flower's
own client code: ``RuntimeHttpClient``, ``push_message``, ``push_task_output``, the object
pull, all reached through :mod:`fedbayes.flower.internals`), so the imports, each run's built client (:func:`fedbayes.flower.node.node_setup`) and its
compiled update stay warm across rounds and runs. A task of any other app goes to a fresh
``flwr-clientapp`` process, as Flower's own executor does (the first task of an app is pulled
to learn whose it is: that one runs here, loaded by Flower's loader).

What differs from ``run_clientapp`` and why:

* the message's objects are pulled with a short backoff (5 ms, capped at 50 ms) instead of
  Flower's 1 s doubling to 10 s: the SuperNode creates the task before it has pulled the
  message's objects from the SuperLink, so a fast executor asks for them early; and it waits
  for the message's root before it asks for the others
  (:func:`fedbayes.flower.internals.pull_task_input`, as the loopback SuperNode and the
  ServerApp pull). While the node pulls, every object of the message is unavailable: pulled
  concurrently and each retried on its own, a heavy-MLP round of three made 65 requests to the
  nodes for their 21 objects (loopback, docs/results/flower.md); waiting for one first, 28-38 for 18;
* the task heartbeat is stopped before the task output is pushed (a heartbeat for a finished
  task is refused), and a refused heartbeat is logged instead of raising SIGINT in a process
  that outlives the task;
* polling adapts: every ``poll`` seconds while tasks come, ``idle_poll`` after ``ACTIVE``
  seconds without one; after a task, the first wait is half the shortest of the last three
  spells between a task and the next (:class:`fedbayes.flower.fastnode.Rhythm`).

State across rounds is Flower's ``Context.state`` (pulled with every task, pushed back after
it) and the node's state folder, as on the stock path, so a restarted executor or SuperNode
continues where it was. Tested with flwr 1.41 and 1.42 (the Runtime API and the client code it
calls are unchanged between them). At start the executor checks the private names it needs
(:func:`fedbayes.flower.internals.available`): where one is missing (a later flwr), it says so
and runs Flower's own SuperExec instead (``flower-superexec``, a fresh ``flwr-clientapp`` per
task, :func:`stock_command`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fedbayes.flower import internals
from fedbayes.flower.fastnode import Rhythm

APP_REF = "fedbayes.flower.apps:clientapp"
ACTIVE = 10.0  # seconds after a task during which the executor polls at its fast rate

log = logging.getLogger("fedbayes.flower.executor")


def node_environment(state_dir: str | Path | None = None, env: dict | None = None) -> dict:
    """The environment a node's Flower processes need, set before any of them imports JAX: the
    persistent compilation cache in ``state_dir/jax_cache`` (every compile kept: fedbayes's
    updates compile in well under JAX's default 1 s minimum) and Flower's telemetry off."""
    out = dict(os.environ if env is None else env)
    if state_dir is not None:
        out.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(state_dir) / "jax_cache"))
    out.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    out.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    return out


class _Stop:
    def __init__(self):
        self.event = threading.Event()

    def __call__(self, *_):
        self.event.set()


class Executor:
    """Polls one SuperNode's Runtime API for ClientApp tasks and runs them (module docstring)."""

    def __init__(self, address: str, *, insecure: bool = True, root_certificates: str | None = None, auth_secret: bytes | None = None):
        self.address, self.insecure, self.root_certificates = address, insecure, root_certificates
        self.client = internals.runtime_client(address, insecure=insecure, root_certificates=root_certificates, auth_secret=auth_secret)
        self.apps: dict[str, bool] = {}  # FAB hash -> is fedbayes's app
        self.children: list[subprocess.Popen] = []

    def acquire(self):
        """``(token, task)`` of the next ClientApp task, or None."""
        return internals.acquire_task(self.client)

    def serve(self, poll: float = 0.05, idle_poll: float = 0.5, stop: threading.Event | None = None, max_tasks: int | None = None) -> int:
        """Runs tasks until ``stop`` is set (or ``max_tasks`` ran); returns the number run."""
        stop = stop or threading.Event()
        done, last = 0, time.monotonic()
        rhythm, after_task = Rhythm(), False
        while not stop.is_set() and (max_tasks is None or done < max_tasks):
            self.children = [p for p in self.children if p.poll() is None]
            got = self.acquire()
            if got is not None:
                rhythm.busy()
                token, task = got
                if self.apps.get(task.fab_hash) is False:
                    log.info("task %d: another app (FAB %s): started a fresh flwr-clientapp", task.task_id, task.fab_hash[:12])
                    self.children.append(self.spawn(token))
                else:
                    self.run_task(token, task)
                done, last, after_task = done + 1, time.monotonic(), True
                continue
            # the first empty poll after a task starts an idle spell: wait part of the recent ones first
            first = rhythm.idle() if after_task else 0.0
            after_task = False
            stop.wait(max(first, poll) if time.monotonic() - last < ACTIVE else idle_poll)
        return done

    def spawn(self, token: str) -> subprocess.Popen:
        """Another app's task in a fresh ``flwr-clientapp`` (what Flower's subprocess executor runs)."""
        cmd = [str(Path(sys.executable).parent / "flwr-clientapp"), "--runtime-api-address", self.address, "--token", token, "--parent-pid", str(os.getpid())]
        cmd += ["--insecure"] if self.insecure else (["--root-certificates", self.root_certificates] if self.root_certificates else [])
        return subprocess.Popen(cmd)

    def run_task(self, token: str, task) -> None:
        """One task, as ``run_clientapp`` runs it, in this process."""
        client = internals.runtime_client(self.address, insecure=self.insecure, root_certificates=self.root_certificates, token=token)
        heartbeat = internals.heartbeat(client, lambda: log.warning("the node refused the task heartbeat (the task expired)"))
        message = reply = context = None
        ok, details = False, "ClientApp task failed"
        try:
            message, context, run, fab = internals.pull_task_input(client)
            reply = self.handle(message, context, run, fab)
            ok, details = True, ""
        except Exception as exc:  # the node answers with an Error, as run_clientapp does
            log.exception("ClientApp raised an exception")
            details = f"{type(exc)}:<'{exc}'>"
            if message is not None:
                reply = internals.error_reply(message, details)
        finally:
            try:
                if reply is not None and context is not None:
                    internals.push_reply(client, reply, context)
            except Exception:
                log.exception("failed to push the reply")
            heartbeat.stop()  # before the output: a heartbeat for a finished task is refused
            internals.push_task_output(client, context, ok, details)
            client.close()

    def handle(self, message, context, run, fab):
        """The reply to ``message``: fedbayes's ClientApp here; another app's through Flower's loader."""
        if fab.hash_str not in self.apps:
            self.apps[fab.hash_str] = internals.fab_components(fab).get("clientapp") == APP_REF
        if self.apps[fab.hash_str]:
            from fedbayes.flower.apps import clientapp

            return clientapp(message=message, context=context)
        log.info("another app (FAB %s): its first task here, by Flower's loader; its next ones in a fresh flwr-clientapp", fab.hash_str[:12])
        return internals.load_client_app(run, fab)(message=message, context=context)

    def close(self) -> None:
        for p in self.children:
            p.wait()
        self.client.close()


def stock_command(args: argparse.Namespace) -> list[str]:
    """Flower's own SuperExec for the same node and options (the fallback where the warm
    executor's private names are missing): a fresh ``flwr-clientapp`` per task."""
    cmd = [str(Path(sys.executable).parent / "flower-superexec"), "--runtime-api-address", args.runtime_api_address]
    cmd += ["--root-certificates", args.root_certificates] if args.root_certificates else ["--insecure"]
    return cmd + (["--superexec-auth-secret-file", args.superexec_auth_secret_file] if args.superexec_auth_secret_file else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fedbayes.flower.executor", description="A warm executor for one SuperNode started with --isolation process."
    )
    parser.add_argument("--runtime-api-address", default="127.0.0.1:9094", help="the SuperNode's Runtime API (its --host:--port)")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (the SuperNode's default on loopback)")
    tls.add_argument("--root-certificates", help="CA of the Runtime API's certificate (the SuperNode's --appio-ssl-* options)")
    parser.add_argument("--superexec-auth-secret-file", help="the secret the SuperNode was given with the same option")
    parser.add_argument("--state-dir", help="the node's state folder (its XLA cache goes in state-dir/jax_cache)")
    parser.add_argument("--poll", type=float, default=0.05, help="seconds between polls while tasks come")
    parser.add_argument("--idle-poll", type=float, default=0.5, help="seconds between polls when idle")
    parser.add_argument("--max-tasks", type=int, help="exit after this many tasks (recycles the process; a new executor continues from the node's state)")
    args = parser.parse_args(argv)
    if args.max_tasks is not None and args.max_tasks < 1:
        parser.error(f"--max-tasks must be a positive integer; got {args.max_tasks}")
    os.environ.update(node_environment(args.state_dir))  # before JAX is imported
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    version = internals.flwr_version()
    if not internals.available("warm-executor"):  # said once, naming the symbol
        cmd = stock_command(args)
        log.warning("running Flower's own SuperExec instead: %s", " ".join(cmd))
        os.execv(cmd[0], cmd)
        return 0  # execv returns only where a test stands in for it
    secret = internals.load_auth_secret(args.superexec_auth_secret_file) if args.superexec_auth_secret_file else None
    import fedbayes.flower.apps  # noqa: F401  (the imports once, before the first task)
    import fedbayes.flower.node  # noqa: F401

    stop = _Stop()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    executor = Executor(args.runtime_api_address, insecure=args.root_certificates is None, root_certificates=args.root_certificates, auth_secret=secret)
    log.info("fedbayes warm executor (flwr %s) serving %s", version, args.runtime_api_address)
    try:
        done = executor.serve(args.poll, args.idle_poll, stop.event, args.max_tasks)
        if args.max_tasks is not None and done >= args.max_tasks:
            log.info("served %d tasks (--max-tasks): exiting", done)
    finally:
        executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
