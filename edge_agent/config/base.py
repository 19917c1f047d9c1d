"""What every settings section shares: the one-line error an operator sees, and a section
that refuses keys it does not know (a typo in the TOML file is an error, not a default)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(Exception):
    """A configuration problem, reported to the operator as one line (exit 2)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")
