"""What a resume checks before it continues a run: the config against the checkpoint's, and the
disk client store's folder.

A checkpoint records the resolved config and its hash (:func:`config_hash`). A resume with a
config that differs is refused, naming every changed key with both values, unless each change is
accepted on purpose (``accept_changes``, the CLI's ``resume DIR --set key=value``); accepted
changes are recorded in ``resume_changes.jsonl`` (:data:`fedbayes.runs.folder.RESUME_CHANGES`) and
stay accepted for later resumes from the same checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fedbayes.config.schema import ConfigError, RunConfig, resolved
from fedbayes.errors import BadInputError
from fedbayes.runs import folder

__all__ = ["check_resume_config", "check_store_dir", "config_hash", "record_changes"]


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
    """Refuses a disk client store folder that is a file (before anything is built)."""
    if config.store != "disk":
        return
    store = Path(config.store_dir) if config.store_dir else out / folder.CLIENT_STORE
    if store.exists() and not store.is_dir():
        raise BadInputError(f"config error: store_dir: {store} is a file, not a folder")
