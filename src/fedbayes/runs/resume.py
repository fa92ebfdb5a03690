"""What a resume checks before it continues a run: the config against the checkpoint's, and the
disk client store's folder.

A checkpoint records the resolved config and its hash (:func:`config_hash`). A resume with a
config that differs is refused, naming every changed key with both values, unless each change is
accepted on purpose (``accept_changes``, the CLI's ``resume DIR --set key=value``); accepted
changes are recorded in ``resume_changes.jsonl`` (:data:`fedbayes.runs.folder.RESUME_CHANGES`) and
stay accepted for later resumes from the same checkpoint.

A run that finished is resumed only where one of its files is damaged (:func:`finished_intact`):
every file is checked against the final checkpoint, which carries what they hold, and a damaged one
is named in one line and rebuilt by resuming from that checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fedbayes.config.schema import ConfigError, RunConfig, resolved
from fedbayes.errors import BadInputError
from fedbayes.runs import folder

__all__ = ["OWNER", "check_resume_config", "check_store_dir", "claim_store", "config_hash", "finished", "finished_intact", "record_changes"]

OWNER = ".fedbayes_owner"  # in a store_dir of a disk client store: the run folder it belongs to

PNG_HEAD, PNG_TAIL = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"  # a PNG file's signature and its last chunk


def config_hash(config: RunConfig) -> str:
    """SHA-256 of the resolved config (every default included), as a checkpoint records it."""
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        out.update(_flat(v, key + ".") if isinstance(v, dict) else {key: v})
    return out


def check_resume_config(config: RunConfig, meta: dict, out: Path, accept_changes=()) -> dict[str, list]:
    """Compares the config to resume with against the checkpoint's; returns the accepted changes.

    Raises:
      ConfigError: a key differs and is not in ``accept_changes``; the message names every such
        key with both values and the command that accepts them.
    """
    if meta.get("config_hash") == config_hash(config):
        return {}
    old, new = _flat(resolved(meta.get("config") or {})), _flat(config.model_dump(mode="json"))
    changed = {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
    accepted = set(accept_changes)
    log = out / folder.RESUME_CHANGES
    for line in log.read_text().splitlines() if log.is_file() else []:  # accepted before, from this checkpoint
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("round") == meta["round"]:
            accepted |= {k for k, (_, v) in rec.get("changed", {}).items() if k in changed and changed[k][1] == v}
    refused = [k for k in changed if k not in accepted]
    if refused:
        what = ", ".join(f"{k} ({json.dumps(changed[k][0])} -> {json.dumps(changed[k][1])})" for k in refused)
        sets = " ".join(f"--set {k}={json.dumps(changed[k][1])}" for k in refused)
        raise ConfigError(
            f"config error: {out / folder.CONFIG} differs from the run's checkpoint (round {meta['round']}) in {what}; "
            f"put it back, or make the change on purpose with `fedbayes resume {out} {sets}`"
        )
    return changed


def record_changes(out: Path, round_idx: int, changes: dict[str, list]) -> None:
    """Appends the changes accepted on resuming from round ``round_idx`` to ``resume_changes.jsonl``."""
    folder.append_jsonl(out / folder.RESUME_CHANGES, {"round": round_idx, "changed": changes})


def check_store_dir(config: RunConfig, out: Path) -> None:
    """Refuses a disk client store folder that is a file (before anything is built); see also
    :func:`claim_store`."""
    if config.store != "disk":
        return
    store = Path(config.store_dir) if config.store_dir else out / folder.CLIENT_STORE
    if store.exists() and not store.is_dir():
        raise BadInputError(f"config error: store_dir: {store} is a file, not a folder")


@contextlib.contextmanager
def claim_store(config: RunConfig, out: Path, resume: bool) -> Iterator[None]:
    """Holds a disk client store outside the run folder (``store_dir``) for the run's life: its
    lock (a second run on the same store fails at once, naming the holder's pid) and its owner
    (the run folder, recorded in :data:`OWNER`). A store inside the run folder needs neither: the
    folder's own lock covers it, and a copy of the folder carries its own copy of it.

    Raises:
      RunFolderBusyError: another process holds the store (exit 5).
      BadInputError: a fresh run asks for the store of another run that still has checkpoints (exit 2).
      RunFolderError: a resume from a folder whose store belongs to another run folder (a copy of
        it: resuming would move the other run's store forward; exit 4).
    """
    from fedbayes.errors import RunFolderError
    from fedbayes.runs import runlock

    if config.store != "disk" or not config.store_dir:
        yield
        return
    store, me = Path(config.store_dir), str(out.resolve())
    check_store_dir(config, out)
    with runlock.hold(store, "store"):
        try:
            owner = (store / OWNER).read_text().strip()
        except OSError:
            owner = None
        if owner is not None and owner != me:
            if resume:
                raise RunFolderError(
                    f"{out}: its client store {store} belongs to the run in {owner} (is this folder a copy of it?); resume that run, "
                    f"or start this one afresh with a store of its own: fedbayes run {out / folder.CONFIG} --out {out} --overwrite --set store_dir=..."
                )
            if folder.has_checkpoint(owner):
                raise BadInputError(f"config error: store_dir: {store} holds the client store of the run in {owner}; give this run a store_dir of its own")
        folder.write_atomic(store / OWNER, me + "\n")
        yield


def finished(config: RunConfig, out: str | Path, warn: Callable[[str], None] | None = None) -> dict | None:
    """The summary of a run already finished in ``out`` with this very config whose files are all
    intact, else None (:func:`finished_intact`; a damaged file is named through ``warn``, default
    stderr: resuming the run rebuilds it)."""
    return finished_intact(config, out, warn if warn is not None else _stderr)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def finished_intact(config: RunConfig, out: str | Path, warn=None) -> dict | None:
    """The summary of a run finished in ``out`` with this very config, all of whose files are intact
    (a run that diverged: its summary as it stands); None when the run did not finish, or when a file
    is damaged, missing or does not match the final checkpoint (``warn`` then gets one line naming
    it, except the two logs, which the resume names as it rewrites them: resuming the run from its
    final checkpoint rebuilds every file exactly).

    Checked: ``summary.json`` (strict JSON, this run's), ``metrics.jsonl`` and ``clients.jsonl`` (the
    text the final checkpoint carries), ``model.npz`` (every array readable) and ``curves.png`` (whole).
    """
    import numpy as np

    from fedbayes.config.schema import same_config
    from fedbayes.runs.checkpoint import CheckpointError, extra_arrays, latest_checkpoint, read_checkpoint
    from fedbayes.runs.strictjson import dumps_record, loads_strict, restore_record

    out = Path(out)

    def damaged(name: str, what: str) -> None:
        if warn is not None:
            warn(f"warning: {out / name}: {what}; resuming the run from its checkpoints rebuilds it")

    if not same_config(out / folder.CONFIG, config):
        return None
    if not (out / folder.SUMMARY).exists():
        return None  # not finished (or killed as it finished): the resume writes it, nothing to name

    try:
        summary = loads_strict((out / folder.SUMMARY).read_text())
    except (OSError, ValueError) as exc:
        return damaged(folder.SUMMARY, f"damaged ({type(exc).__name__})")
    if not isinstance(summary, dict) or summary.get("name") != config.name:
        return damaged(folder.SUMMARY, "not this run's summary")
    if summary.get("diverged"):
        return summary
    ckpt = latest_checkpoint(out / folder.CHECKPOINTS)
    try:
        arrays, meta = read_checkpoint(ckpt) if ckpt is not None else (None, None)
    except CheckpointError as exc:
        return damaged(folder.CHECKPOINTS, str(exc).removeprefix(str(out / folder.CHECKPOINTS) + "/"))
    if meta is None or int(meta["round"]) != config.rounds:
        return damaged(folder.CHECKPOINTS, f"the final checkpoint (round {config.rounds}) is missing")
    metrics = "".join(dumps_record(restore_record(dict(r))) + "\n" for r in meta["metrics"])
    if folder.damage(out / folder.METRICS, metrics) is not None:
        return None  # the resume names the damage as it rewrites the file
    saved = extra_arrays(arrays).get("clients")
    if saved is not None:
        import zlib

        if folder.damage(out / folder.CLIENTS, zlib.decompress(saved.tobytes()).decode()) is not None:
            return None  # the resume names it too
    try:
        with np.load(out / folder.MODEL, allow_pickle=False) as z:
            for k in z.files:
                z[k]  # reading checks each member's CRC
    except Exception as exc:  # BadZipFile, EOFError, OSError, ValueError: all mean damaged
        return damaged(folder.MODEL, f"damaged or missing ({type(exc).__name__})")
    try:
        png = (out / folder.CURVES).read_bytes()
    except OSError:
        png = b""
    if not (png.startswith(PNG_HEAD) and png.endswith(PNG_TAIL)):
        return damaged(folder.CURVES, "damaged or missing")
    return summary
