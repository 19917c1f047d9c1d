"""What every settings section shares: the one-line error an operator sees, and a section
that refuses keys it does not know (a typo in the TOML file is an error, not a default);
and the HTTPS files that the box's `[server]` and the controller's `[http]` both take."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from edge_agent.tls import TLSFiles

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


class HTTPSFiles(_Section):
    """A listener's HTTPS, served by `edge_agent.tls.ServerTLS` on the section's own port."""

    tls_cert_file: Path | None = Field(
        None,
        description="PEM certificate (chain, leaf first) to serve HTTPS with, on the same "
        "port; with tls_key_file. Read again at SIGHUP (systemctl reload).",
    )
    tls_key_file: Path | None = Field(
        None, description="PEM private key of tls_cert_file, unencrypted; must be owner-only "
        "(0600) or the service does not start.",
    )
    tls_client_ca_file: Path | None = Field(
        None,
        description="PEM CA(s) for mutual TLS: a client must present a certificate one of "
        "them signed, or gets no connection. Needs tls_cert_file.",
    )

    @field_validator("tls_cert_file", "tls_key_file", "tls_client_ca_file")
    @classmethod
    def _absolute_file(cls, path: Path | None) -> Path | None:
        """Pinned to where the command ran: the service works from its state dir."""
        return None if path is None else path.expanduser().absolute()

    @model_validator(mode="after")
    def _tls_pair(self) -> HTTPSFiles:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and "
                             "tls_key_file")
        return self

    @property
    def tls(self) -> TLSFiles | None:
        """The HTTPS files, or None: plain HTTP."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        return TLSFiles(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    @property
    def scheme(self) -> str:
        return "https" if self.tls is not None else "http"
