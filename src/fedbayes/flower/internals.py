"""The one wall around Flower's internals: every private ``flwr`` name fedbayes uses, and every
patch it makes to ``flwr``, in this module only.

The rest of :mod:`fedbayes.flower` imports Flower's public API (:data:`PUBLIC_MODULES`) and this
module; ``tests/flower/test_internals.py`` checks both (it parses every import of ``src/fedbayes``).

Each private name is a :class:`Symbol` of :data:`SYMBOLS`: a module of Flower, an attribute path
in it and, for a function, the parameters fedbayes passes it. :func:`lookup` imports it and checks
it against the installed flwr (the attribute exists; a function accepts those parameters; the
SuperNode's ``time`` is the ``time`` module). Each feature of :data:`FEATURES` needs a set of
symbols: when one of them fails its check (a symbol moved in a later flwr), :func:`available`
says so once, in a warning of the ``fedbayes.flower.internals`` logger naming the symbol, and the
feature falls back to Flower's stock per-message path (no patch):

* ``node-sleeps``: the loopback SuperNode's idle sleeps capped (:func:`patch_node_sleeps`);
  fallback: Flower's 3 s sleep after an empty pull, 0.5 s waits;
* ``node-object-pulls``, ``server-object-pulls``: a message's objects pulled with a short
  backoff, the root first (:func:`short_object_pulls` on the SuperNode's and on the ServerApp
  grid's ``pull_objects``); fallback: Flower's 1 s backoff doubling to 10 s;
* ``warm-executor``: the Runtime API client and Flower's client code the warm executor calls
  (:mod:`fedbayes.flower.executor`); fallback: the executor runs Flower's own SuperExec
  (``flower-superexec``, a fresh ``flwr-clientapp`` per task) with the same options;
* ``executor-object-pulls``: the warm executor's own pull of a task's message
  (:func:`pull_task_input`, Flower's ``run_clientapp.pull_task_input`` with a short backoff, and
  the message id set on the pulled message); fallback: Flower's ``pull_task_input``;
* ``no-id-recompute``: a reply's object ids computed once while it is pushed; fallback: Flower
  recomputes them (the same ids, more CPU);
* ``error-codes``: which errors of the SuperLink mean that a node is gone
  (:func:`unavailable_codes`); fallback: none does (a node is asked again every round);
* ``chunk-size``: Flower's chunk size for an ``Array`` (:func:`chunk_size`); fallback: 5 MB.

Tested with the flwr releases of :data:`TESTED`; on another one the checks decide, and
:func:`flwr_version` says once that the release is untested. docs/flower.md lists what each patch
does and what Flower would need for it to become unnecessary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import time
import types
from collections.abc import Callable

log = logging.getLogger("fedbayes.flower.internals")

TESTED = ("1.41.", "1.42.")  # the flwr releases fedbayes is tested with (pyproject pins flwr>=1.41,<1.43)

# Flower's public API: what fedbayes may import outside this module (anything else of flwr, and any
# name that starts with "_", is private).
PUBLIC_MODULES = ("flwr", "flwr.app", "flwr.clientapp", "flwr.serverapp", "flwr.simulation")

PULL_BACKOFF = (0.005, 0.05)  # initial, cap (seconds): a retry of an object not yet pushed
DEFAULT_CHUNK_BYTES = 5 * 1024 * 1024  # Flower's Array chunk size in flwr 1.41 and 1.42


@dataclasses.dataclass(frozen=True)
class Symbol:
    """A private name of Flower: ``name`` (an attribute path, empty for the module itself) in
    ``module``; ``params``: the parameters a callable must accept; ``kind``: ``"module"`` when
    the attribute must be that module (the SuperNode's ``time``)."""

    module: str
    name: str = ""
    params: tuple[str, ...] = ()
    kind: str = ""

    @property
    def path(self) -> str:
        return f"{self.module}.{self.name}" if self.name else self.module


_PULL = ("object_ids", "pull_object_fn", "max_time", "max_tries_per_object", "initial_backoff", "backoff_cap")
_SCI = "flwr.supernode.start_client_internal"
_INFLATABLE = "flwr.supercore.inflatable.inflatable_utils"
_RUN_CLIENTAPP = "flwr.supernode.runtime.run_clientapp"

SYMBOLS: dict[str, Symbol] = {
    # the SuperNode (the loopback one of fedbayes.flower.fastnode)
    "supernode.time": Symbol(_SCI, "time", kind="time"),
    "supernode.pull_objects": Symbol(_SCI, "pull_objects", _PULL),
    # the ServerApp's grid
    "grid.pull_objects": Symbol("flwr.superlink.grid.http_grid", "pull_objects", _PULL),
    # the Runtime API client (the warm executor)
    "RuntimeHttpClient": Symbol(
        "flwr.supercore.runtime", "RuntimeHttpClient.from_server_address", ("server_address", "insecure", "root_certificates", "interceptors", "retry_invoker")
    ),
    "RuntimeVersionHttpInterceptor": Symbol("flwr.supercore.interceptors", "RuntimeVersionHttpInterceptor", ("component_name",)),
    "RuntimeTokenHttpInterceptor": Symbol("flwr.supercore.interceptors", "RuntimeTokenHttpInterceptor"),
    "SuperExecAuthHttpInterceptor": Symbol("flwr.supercore.interceptors", "SuperExecAuthHttpInterceptor", ("master_secret", "protected_methods")),
    "make_simple_http_retry_invoker": Symbol("flwr.supercore.retry", "make_simple_http_retry_invoker"),
    "load_superexec_auth_secret": Symbol("flwr.supercore.auth.superexec_secret", "load_superexec_auth_secret", ("secret_file",)),
    "AcquireTaskRequest": Symbol("flwr.proto.runtime_pb2", "AcquireTaskRequest"),
    "PullTaskInputRequest": Symbol("flwr.proto.runtime_pb2", "PullTaskInputRequest"),
    "PullAppMessagesRequest": Symbol("flwr.proto.runtime_pb2", "PullAppMessagesRequest"),
    "SendTaskHeartbeatRequest": Symbol("flwr.proto.runtime_pb2", "SendTaskHeartbeatRequest"),
    "TaskType.CLIENT_APP": Symbol("flwr.supercore.constant", "TaskType.CLIENT_APP"),
    "SubStatus": Symbol("flwr.common.constant", "SubStatus"),
    "ErrorCode.CLIENT_APP_RAISED_EXCEPTION": Symbol("flwr.common.constant", "ErrorCode.CLIENT_APP_RAISED_EXCEPTION"),
    "HeartbeatSender": Symbol("flwr.supercore.heartbeat", "HeartbeatSender", ("heartbeat_fn",)),
    "run_clientapp.pull_task_input": Symbol(_RUN_CLIENTAPP, "pull_task_input", ("client",)),
    "run_clientapp.push_message": Symbol(_RUN_CLIENTAPP, "push_message", ("client", "message", "context")),
    "run_clientapp.push_task_output": Symbol(_RUN_CLIENTAPP, "push_task_output", ("client", "context", "sub_status", "details")),
    "get_fab_config": Symbol("flwr.common.config", "get_fab_config", ("fab_file",)),
    "install_from_fab": Symbol("flwr.cli.install", "install_from_fab", ("fab_file", "skip_prompt")),
    "get_load_client_app_fn": Symbol("flwr.clientapp.utils", "get_load_client_app_fn", ("default_app_ref", "app_path", "multi_app")),
    # the warm executor's pull of a task's message (a fork of run_clientapp.pull_task_input)
    "context_from_proto": Symbol("flwr.common.serde", "context_from_proto"),
    "run_from_proto": Symbol("flwr.common.serde", "run_from_proto"),
    "fab_from_proto": Symbol("flwr.common.serde", "fab_from_proto"),
    "Node": Symbol("flwr.proto.node_pb2", "Node"),
    "inflatable_utils.pull_objects": Symbol(_INFLATABLE, "pull_objects", _PULL),
    "pull_and_inflate_object_from_tree": Symbol(
        _INFLATABLE,
        "pull_and_inflate_object_from_tree",
        ("object_tree", "pull_object_fn", "confirm_object_received_fn", "return_type", "initial_backoff", "backoff_cap"),
    ),
    "ObjectUnavailableError": Symbol(_INFLATABLE, "ObjectUnavailableError"),
    "make_pull_object_fn_protobuf": Symbol("flwr.supercore.inflatable.inflatable_protobuf_utils", "make_pull_object_fn_protobuf"),
    "make_confirm_message_received_fn_protobuf": Symbol("flwr.supercore.inflatable.inflatable_protobuf_utils", "make_confirm_message_received_fn_protobuf"),
    # a Message's id is read-only (Metadata.message_id reads Metadata.__dict__["_message_id"])
    "Metadata._message_id": Symbol("flwr.app", "Metadata.message_id", kind="message_id"),
    "no_object_id_recompute": Symbol("flwr.supercore.inflatable.inflatable_object", "no_object_id_recompute"),
    # the rounds and the codec
    "ErrorCode.NODE_UNAVAILABLE": Symbol("flwr.common.constant", "ErrorCode.NODE_UNAVAILABLE"),
    "ErrorCode.MESSAGE_UNAVAILABLE": Symbol("flwr.common.constant", "ErrorCode.MESSAGE_UNAVAILABLE"),
    "ErrorCode.REPLY_MESSAGE_UNAVAILABLE": Symbol("flwr.common.constant", "ErrorCode.REPLY_MESSAGE_UNAVAILABLE"),
    "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE": Symbol("flwr.common.constant", "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE"),
}

# feature -> the symbols it needs (module docstring)
FEATURES: dict[str, tuple[str, ...]] = {
    "node-sleeps": ("supernode.time",),
    "node-object-pulls": ("supernode.pull_objects",),
    "server-object-pulls": ("grid.pull_objects",),
    "warm-executor": (
        "RuntimeHttpClient",
        "RuntimeVersionHttpInterceptor",
        "RuntimeTokenHttpInterceptor",
        "SuperExecAuthHttpInterceptor",
        "make_simple_http_retry_invoker",
        "load_superexec_auth_secret",
        "AcquireTaskRequest",
        "SendTaskHeartbeatRequest",
        "TaskType.CLIENT_APP",
        "SubStatus",
        "ErrorCode.CLIENT_APP_RAISED_EXCEPTION",
        "HeartbeatSender",
        "run_clientapp.pull_task_input",
        "run_clientapp.push_message",
        "run_clientapp.push_task_output",
        "get_fab_config",
        "install_from_fab",
        "get_load_client_app_fn",
    ),
    "executor-object-pulls": (
        "PullTaskInputRequest",
        "PullAppMessagesRequest",
        "context_from_proto",
        "run_from_proto",
        "fab_from_proto",
        "Node",
        "inflatable_utils.pull_objects",
        "pull_and_inflate_object_from_tree",
        "make_pull_object_fn_protobuf",
        "make_confirm_message_received_fn_protobuf",
        "Metadata._message_id",
    ),
    "no-id-recompute": ("no_object_id_recompute",),
    "error-codes": ("ErrorCode.NODE_UNAVAILABLE", "ErrorCode.MESSAGE_UNAVAILABLE", "ErrorCode.REPLY_MESSAGE_UNAVAILABLE"),
    "chunk-size": ("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE",),
}

# Flower's internal modules this wall owns (no other module of fedbayes imports them)
INTERNAL_MODULES = tuple(sorted({s.module for s in SYMBOLS.values()} - set(PUBLIC_MODULES)))

_said: set[tuple] = set()  # what was said once: (feature, symbol path, problem), the untested release


def _once(key: tuple, text: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.warning(text, *args)


@functools.cache
def _resolve(symbol: Symbol) -> tuple[object, str | None]:
    """``(object, None)``, or ``(None, the reason it fails its check)``."""
    try:
        obj = importlib.import_module(symbol.module)
    except ImportError as exc:
        return None, f"no module {symbol.module} ({exc})"
    where = symbol.module
    for part in filter(None, symbol.name.split(".")):
        if not hasattr(obj, part):
            return None, f"{where} has no {part}"
        obj, where = getattr(obj, part), f"{where}.{part}"
    if symbol.kind == "time" and obj is not time:
        return None, "not the time module (the module no longer sleeps through time.sleep)"
    if symbol.kind == "message_id":
        return _check_message_id(obj)
    if symbol.params:
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            return None, "not a function with a signature"
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            lacking = [p for p in symbol.params if p not in params]
            if lacking:
                return None, f"takes no {', '.join(lacking)}"
    return obj, None


def _check_message_id(prop) -> tuple[object, str | None]:
    """A message's id is the ``_message_id`` slot of its metadata's ``__dict__``, read by the
    ``Metadata.message_id`` property (the only way to set it on a pulled message)."""
    from flwr.app import Metadata

    if not isinstance(prop, property):
        return None, "Metadata.message_id is not a property"
    try:
        fields = dict(run_id=0, message_id="", src_node_id=0, dst_node_id=0, reply_to_message_id="", group_id="", created_at=0.0, ttl=1.0, message_type="query")
        metadata = Metadata(**fields)
    except TypeError as exc:
        return None, f"Metadata takes other arguments ({exc})"
    if "_message_id" not in vars(metadata):
        return None, "Metadata keeps no _message_id"
    vars(metadata)["_message_id"] = "probe"
    return (prop, None) if metadata.message_id == "probe" else (None, "Metadata.message_id does not read _message_id")


def lookup(key: str):
    """The private symbol ``SYMBOLS[key]`` of the installed flwr, or None when it fails its check."""
    return _resolve(SYMBOLS[key])[0]


def problem(key: str) -> str | None:
    """Why ``SYMBOLS[key]`` fails its check against the installed flwr (None: it passes)."""
    return _resolve(SYMBOLS[key])[1]


def missing(feature: str) -> dict[str, str]:
    """``{symbol path: problem}`` of the symbols of ``FEATURES[feature]`` that fail their check."""
    out = {}
    for key in FEATURES[feature]:
        why = problem(key)
        if why is not None:
            out[SYMBOLS[key].path] = why
    return out


def available(feature: str) -> bool:
    """Whether every symbol ``feature`` needs passes its check; when one does not, says once
    (a warning naming the symbol) that the feature falls back to Flower's stock path."""
    flwr_version()
    gone = missing(feature)
    for path, why in gone.items():
        _once((feature, path, why), "flwr %s: %s: %s; fedbayes's %s falls back to Flower's stock path (no patch)", flwr_version(), path, why, feature)
    return not gone


def flwr_version() -> str:
    """The installed flwr's version; says once when it is not one of :data:`TESTED`."""
    import flwr

    version = flwr.__version__
    if not version.startswith(TESTED):
        _once(
            ("untested", version),
            "flwr %s is not a release fedbayes is tested with (%s); each patch runs only where its checks pass",
            version,
            ", ".join(v + "x" for v in TESTED),
        )
    return version


# ----- patches ------------------------------------------------------------------------------------
def short_object_pulls(module, initial: float = PULL_BACKOFF[0], cap: float = PULL_BACKOFF[1]) -> bool:
    """Makes ``module.pull_objects`` (Flower's ``supercore.inflatable.inflatable_utils.pull_objects``,
    imported by the module that pulls a message's objects) retry an object that is not there yet
    after ``initial`` seconds doubling to ``cap``, instead of Flower's 1 s doubling to 10 s.

    A message is announced before all its objects are pushed, so the first pull often finds an
    object missing; at Flower's backoff that costs about a second each way of a round
    (docs/results/flower.md). The number of tries is left unbounded and Flower's overall time
    limit (``max_time``) kept, so a slow link waits as long as before. The root of the object list
    (the message, last in Flower's post-order, and pushed last) is pulled first and alone, then the
    others: retried each on its own while the sender pushes, every object costs a request per
    retry. Returns whether ``module`` was changed (False: no ``pull_objects`` there, or already)."""
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


def _module_of(key: str) -> types.ModuleType:
    return importlib.import_module(SYMBOLS[key].module)


def patch_node_sleeps(stand_in) -> bool:
    """Replaces the ``time`` module of Flower's SuperNode loop (``start_client_internal``) by
    ``stand_in`` (:func:`fedbayes.flower.fastnode.capped_time`); False (nothing changed) when the
    loop no longer sleeps through ``time`` or was patched already."""
    if not available("node-sleeps") or _module_of("supernode.time").time is not time:
        return False
    _module_of("supernode.time").time = stand_in
    return True


def shorten_node_pulls() -> bool:
    """:func:`short_object_pulls` on the SuperNode's pull of a message's objects from the SuperLink."""
    return available("node-object-pulls") and short_object_pulls(_module_of("supernode.pull_objects"))


def shorten_server_pulls() -> bool:
    """:func:`short_object_pulls` on the ServerApp grid's pull of its replies' objects."""
    return available("server-object-pulls") and short_object_pulls(_module_of("grid.pull_objects"))


# ----- the Runtime API (the warm executor) ----------------------------------------------------------
def runtime_client(address: str, *, insecure: bool, root_certificates: str | None = None, auth_secret: bytes | None = None, token: str | None = None):
    """A client of a SuperNode's Runtime API as Flower's SuperExec (no ``token``) or a
    ``flwr-clientapp`` of the task ``token`` makes one."""
    version = lookup("RuntimeVersionHttpInterceptor")
    interceptors = [version(component_name="flwr-clientapp" if token else "SuperExec")]
    if token:
        interceptors.append(lookup("RuntimeTokenHttpInterceptor")(token))
    elif auth_secret:
        interceptors.append(lookup("SuperExecAuthHttpInterceptor")(master_secret=auth_secret, protected_methods=frozenset({"/flwr.proto.Runtime/AcquireTask"})))
    return lookup("RuntimeHttpClient")(
        server_address=address,
        insecure=insecure,
        root_certificates=root_certificates,
        interceptors=interceptors,
        retry_invoker=lookup("make_simple_http_retry_invoker")(),
    )


def load_auth_secret(path: str) -> bytes | None:
    """The SuperExec's shared secret from ``path`` (exact raw bytes, as Flower reads it)."""
    return lookup("load_superexec_auth_secret")(path)


def acquire_task(client):
    """``(token, task)`` of the node's next ClientApp task, or None."""
    request = lookup("AcquireTaskRequest")(supported_task_types=[lookup("TaskType.CLIENT_APP")])
    res = client.AcquireTask(request)
    return (res.token, res.task) if res.HasField("task") and res.token else None


def heartbeat(client, on_refused: Callable[[], None]):
    """Flower's task heartbeat (started), without its SIGINT on a refused heartbeat:
    ``on_refused`` is called instead (the task is over)."""
    import httpx

    request = lookup("SendTaskHeartbeatRequest")

    def beat() -> bool:
        try:
            if not client.SendTaskHeartbeat(request()).success:
                on_refused()
        except httpx.TransportError:
            return False
        return True

    sender = lookup("HeartbeatSender")(beat)
    sender.start()
    return sender


def pull_task_input(client):
    """``(message, context, run, fab)`` of the client's task: ``run_clientapp.pull_task_input`` of
    flwr (Apache-2.0, Flower Labs) with the short object-pull backoff of :data:`PULL_BACKOFF` (the
    SuperNode creates the task before it has pulled the message's objects from the SuperLink) and
    the root pulled first (:func:`short_object_pulls`); Flower's own where ``executor-object-pulls``
    is not available."""
    if not available("executor-object-pulls"):
        return lookup("run_clientapp.pull_task_input")(client)
    from flwr.app import Message

    utils = _module_of("inflatable_utils.pull_objects")
    short_object_pulls(utils)  # what pull_and_inflate_object_from_tree calls (once a process)
    res = client.PullTaskInput(lookup("PullTaskInputRequest")())
    context, run, fab = lookup("context_from_proto")(res.context), lookup("run_from_proto")(res.run), lookup("fab_from_proto")(res.fab)
    pulled = client.PullMessages(lookup("PullAppMessagesRequest")())
    if not pulled.messages_list:
        raise RuntimeError("no message for this task from the Runtime API")
    node, tree = lookup("Node")(node_id=context.node_id), pulled.message_object_trees[0]
    message = lookup("pull_and_inflate_object_from_tree")(
        tree,
        lookup("make_pull_object_fn_protobuf")(client.PullObject, node, context.run_id),
        lookup("make_confirm_message_received_fn_protobuf")(client.ConfirmMessageReceived, node, context.run_id),
        return_type=Message,
        initial_backoff=PULL_BACKOFF[0],
        backoff_cap=PULL_BACKOFF[1],
    )
    vars(message.metadata)["_message_id"] = tree.object_id  # the deflated message lacks its own id (as Flower sets it)
    return message, context, run, fab


def error_reply(message, details: str):
    """The reply Flower's ``run_clientapp`` gives to a ClientApp that raised."""
    from flwr.app import Error, Message

    return Message(Error(code=lookup("ErrorCode.CLIENT_APP_RAISED_EXCEPTION"), reason=details), reply_to=message)


def push_reply(client, reply, context) -> None:
    """Pushes the reply (Flower's ``push_message``) with every object's id computed once: Flower
    recomputes an id (deflate and hash the object) on every access outside
    ``no_object_id_recompute``, and a ``ConfigRecord`` carrying the reply's arrays inline is
    deflated about six times in ``push_message`` otherwise."""
    once = lookup("no_object_id_recompute") if available("no-id-recompute") else contextlib.nullcontext
    with once():
        lookup("run_clientapp.push_message")(client, reply, context)


def push_task_output(client, context, ok: bool, details: str = "") -> None:
    """Ends the task (Flower's ``push_task_output``): completed, or failed with ``details``."""
    status = lookup("SubStatus")
    lookup("run_clientapp.push_task_output")(client=client, context=context, sub_status=status.COMPLETED if ok else status.FAILED, details=details)


def fab_components(fab) -> dict:
    """The ``[tool.flwr.app.components]`` of a FAB (its ``pyproject.toml``)."""
    return lookup("get_fab_config")(fab.content).get("tool", {}).get("flwr", {}).get("app", {}).get("components", {})


def load_client_app(run, fab):
    """Another app's ``ClientApp``, installed from its FAB and loaded as Flower's loader does."""
    lookup("install_from_fab")(fab.content, skip_prompt=True)
    load = lookup("get_load_client_app_fn")(default_app_ref="", app_path=None, multi_app=True)
    return load(run.fab_id, run.fab_version, fab.hash_str)


# ----- the rounds and the codec -----------------------------------------------------------------------
def unavailable_codes() -> tuple[int, ...]:
    """The error codes the SuperLink gives a message whose node went away (not a ClientApp's
    error); empty where ``error-codes`` is not available (no node is taken for gone)."""
    if not available("error-codes"):
        return ()
    return tuple(int(lookup(key)) for key in FEATURES["error-codes"])


def chunk_size() -> int:
    """Flower's chunk size for an ``Array`` (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``), or
    :data:`DEFAULT_CHUNK_BYTES` where ``chunk-size`` is not available."""
    return int(lookup("FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE")) if available("chunk-size") else DEFAULT_CHUNK_BYTES
