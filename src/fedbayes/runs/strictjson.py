"""JSON that every reader accepts: no bare ``NaN`` or ``Infinity`` in any file fedbayes writes.

Python's ``json`` writes non-finite floats as ``NaN``/``Infinity``, which is not JSON (RFC 8259)
and breaks other readers. A metric record or summary with a non-finite value is written with
``null`` in its place and the names of those fields in ``"nonfinite"``; :func:`loads_record`
restores them as ``nan`` so that reading back what was written is exact for finite values and
keeps the non-finite ones visible.
"""

from __future__ import annotations

import json
import math
from typing import Any

NONFINITE = "nonfinite"


def _clean(obj: Any, path: str, bad: list[str]) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        bad.append(path)
        return None
    if isinstance(obj, dict):
        return {k: _clean(v, f"{path}.{k}" if path else str(k), bad) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v, f"{path}[{i}]", bad) for i, v in enumerate(obj)]
    if hasattr(obj, "item") and hasattr(obj, "dtype") and getattr(obj, "shape", None) == ():
        return _clean(obj.item(), path, bad)  # numpy / jax scalars
    return obj


def sanitize(obj: Any) -> tuple[Any, list[str]]:
    """``obj`` with every non-finite float replaced by ``None``, and the dotted paths replaced."""
    bad: list[str] = []
    return _clean(obj, "", bad), bad


def dumps_record(record: dict, **kwargs) -> str:
    """One metric record (or a summary) as strict JSON: non-finite values become ``null`` and
    their keys are listed under ``"nonfinite"``."""
    clean, bad = sanitize({k: v for k, v in record.items() if k != NONFINITE})
    if bad:
        clean[NONFINITE] = bad
    return json.dumps(clean, allow_nan=False, **kwargs)


def _reject_constant(name: str):
    raise ValueError(f"non-standard JSON constant {name}")


def loads_strict(text: str) -> Any:
    """Parses JSON, rejecting ``NaN``/``Infinity`` (which Python's parser accepts by default)."""
    return json.loads(text, parse_constant=_reject_constant)


def restore_record(record: dict) -> dict:
    """The record as written by :func:`dumps_record`: top-level flagged keys back to ``nan``."""
    bad = record.pop(NONFINITE, None)
    for key in bad or ():
        if key in record and record[key] is None:
            record[key] = float("nan")
    return record
