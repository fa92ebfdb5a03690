"""Hyperparameters as frozen, validated records (pfl-research's and fedjax's habit).

One declaration serves the config file, the builder and the method: a method's settings are a
subclass of :class:`HParams` (a pydantic model: unknown keys, wrong types and impossible values are
rejected with the field's name), the TOML config section is parsed into it, and the builder and
the method read its attributes. Instances are immutable and hashable, so they can sit in the
closures of compiled functions.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["HParams"]


class HParams(BaseModel):
    """Base of every settings record: unknown keys are errors, instances are frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)
