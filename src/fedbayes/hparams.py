"""Hyperparameters as frozen, validated records (pfl-research's and fedjax's habit).

One declaration serves the config file, the builder and the method: a method's settings are a
subclass of :class:`HParams` (a pydantic model: unknown keys, wrong types and impossible values are
rejected with the field's name), the TOML config section is parsed into it, and the builder and
the method read its attributes. Instances are immutable and hashable, so they can sit in the
closures of compiled functions.
"""

from __future__ import annotations

import typing
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["HParams"]


INT_MAX = 2**63 - 1  # the largest integer NumPy (int64) and JAX's seeds take


class HParams(BaseModel):
    """Base of every settings record: unknown keys are errors, instances are frozen, every float
    is finite (``lr = inf`` is an error, not a run of rejected messages), a boolean is never
    read as a number (TOML's ``rounds = true`` is not 1 round) and an integer fits in 64 bits
    (:data:`INT_MAX`: NumPy's and JAX's limit).

    ``section`` is the dotted prefix that names the record's keys in error messages
    (``"algorithm."`` for a method's settings)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    section: ClassVar[str] = "algorithm."

    @model_validator(mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, data):
        if isinstance(data, dict):
            for key, v in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                items = v if isinstance(v, (list, tuple)) else (v,)
                if field is not None and any(isinstance(x, bool) for x in items) and not _takes_bool(field.annotation):
                    raise ValueError(f"{cls.section}{key}: must be a number, not a boolean; got {v!r}")
                if (
                    field is not None
                    and any(isinstance(x, int) and not isinstance(x, bool) and abs(x) > INT_MAX for x in items)
                    and _takes(field.annotation, int)
                ):
                    raise ValueError(f"{cls.section}{key}: must be at most 2**63 - 1 (what NumPy and JAX take as an integer); got {v!r}")
        return data


def _takes_bool(annotation) -> bool:
    return _takes(annotation, bool)


def _takes(annotation, kind: type) -> bool:
    return annotation is kind or any(_takes(a, kind) for a in typing.get_args(annotation))
