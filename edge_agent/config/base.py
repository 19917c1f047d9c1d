"""What every settings section shares: the one-line error an operator sees, and a section
that refuses keys it does not know (a typo in the TOML file is an error, not a default)."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict

# The bounds of the box's periodic work (a hardware sample, a metrics or ledger summary
# over the fleet link): more often than once a second floods the link (a metrics interval
# of 1e-6 s measured 151-469 messages a second) or takes a core on an idle box (a sampling
# interval of 1e-6 s: 0.3-0.8 of one); less often than once a day is no longer telemetry,
# and far beyond it a thread's wait overflows (`threading.TIMEOUT_MAX`). The same bounds
# hold for the config file, the environment and `config.patch`, since all three are
# checked by the one model.
MIN_INTERVAL_S = 1.0
MAX_INTERVAL_S = 86400.0
# Most prompt-lookup draft tokens a step: a pass of 1 + 32 rows of one sequence is still one
# llama.cpp micro-batch, and longer guesses are rarely confirmed whole.
MAX_DRAFT = 32
DRAFT_MODEL_TOKENS = 4  # a draft model's guesses a step, unless [models."x"] draft_tokens


class ConfigError(Exception):
    """A configuration problem, reported to the operator as one line (exit 2)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


# The renamed keys already warned of (`renamed_key`), once a process each.
_warned: set[str] = set()


def renamed_key(data: Any, old: str, new: str, where: str) -> Any:
    """`data` (a section's raw input) with `old` moved to `new`, and one warning a process
    that the old name is deprecated. Both given: ValueError, since which one is meant is
    not known."""
    if not isinstance(data, dict) or old not in data:
        return data
    if new in data:
        raise ValueError(f"{where}{old} is the old name of {where}{new}: set only {new}")
    if where + old not in _warned:
        _warned.add(where + old)
        logging.getLogger("edge_agent.config").warning(
            "%s%s is deprecated and will stop being read in the next release: rename it to "
            "%s%s", where, old, where, new)
    data = dict(data)
    data[new] = data.pop(old)
    return data
