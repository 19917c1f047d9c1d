"""[upstreams.NAME] and [routing]: OpenAI-compatible servers the box may send requests to
(the central team's GPU pool: vLLM, SGLang, TGI, llama.cpp's server, another box), and
when it may.

What an upstream serves is declared, not guessed: `models` maps the names clients use to
the upstream's own, and `json_schema`, `tools` and `streaming` say what it honours, so that
a request the upstream would answer otherwise than asked stays on the box. Where a request
may run is `route` ([routing] for every model, a model's [models."name"] and a tenant's
[tenants.NAME] over it), and whether its data may leave the box at all is the tenant's
`egress` (on a box without keys, the tenant `local`'s): `never` unless an operator says
otherwise.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from edge_agent.config.base import _Section

Route = Literal["local", "local, then upstream", "upstream, then local"]
Egress = Literal["never", "redacted", "allowed"]


class UpstreamSettings(_Section):
    """One upstream under [upstreams.NAME]."""

    base_url: str = Field(description="The upstream's OpenAI-compatible API, ending in /v1 "
                          "(https://gpu-pool.example/v1).")
    api_key_file: Path | None = Field(
        None, description="A file holding the upstream's API key (sent as a Bearer token); "
        "must be owner-only (0600). Unset: no key.")
    ca_file: Path | None = Field(
        None, description="PEM CA the upstream's certificate is checked against; unset: the "
        "system's trust store.")
    models: dict[str, str] = Field(
        default_factory=dict, description="The model names clients use (smollm2:135m) to the "
        "upstream's own names (HuggingFaceTB/SmolLM2-135M-Instruct); only these go there.")
    context_length: int | None = Field(
        None, ge=64, description="The upstream's context in tokens: a prompt over the box's "
        "own context goes there only if it fits this; unset: the upstream's is not known, "
        "and no prompt goes there for its length.")
    json_schema: bool = Field(
        False, description="The upstream honours response_format json_schema: requests "
        "with a schema may go there (the answer is still checked against the schema).")
    tools: bool = Field(False, description="The upstream honours tools: requests with tools "
                        "may go there.")
    streaming: bool = Field(True, description="The upstream streams (SSE); without it the "
                            "box asks for whole answers and streams them on itself.")
    connect_timeout_s: float = Field(2.0, gt=0, le=60, description="Seconds to connect.")
    first_token_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Seconds from the request to its first token (or "
        "its whole answer, not streamed).")
    read_timeout_s: float = Field(30.0, gt=0, le=3600, description="Most seconds between "
                                  "two chunks of a streamed answer.")
    max_concurrency: int = Field(8, ge=1, le=1024, description="Requests in flight to it at "
                                 "once; more are not sent there.")
    max_response_bytes: int = Field(
        8 * 1024 * 1024, ge=1024, description="Most bytes of one answer read from it; past "
        "them the answer fails (502).")
    failures_to_open: int = Field(
        3, ge=1, le=100, description="Consecutive failures (connection, timeout, 5xx, a "
        "broken answer) that open its circuit breaker: no request goes there until a probe "
        "succeeds.")
    open_s: float = Field(15.0, gt=0, le=3600, description="Seconds an open breaker waits "
                          "before its half-open probe (GET /models).")

    @field_validator("base_url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")) or not url.endswith("/v1"):
            raise ValueError(f"base_url must be an http(s) URL ending in /v1, not {url!r}")
        return url

    @field_validator("api_key_file", "ca_file")
    @classmethod
    def _absolute_file(cls, path: Path | None) -> Path | None:
        return None if path is None else path.expanduser().absolute()

    @field_validator("models")
    @classmethod
    def _model_names(cls, models: dict[str, str]) -> dict[str, str]:
        from edge_agent.errors import InvalidRequest
        from edge_agent.names import ModelName

        for name in models:
            try:
                ModelName.parse(name)
            except InvalidRequest as exc:
                raise ValueError(exc.message) from None
        return models

    def api_key(self) -> str | None:
        """The key, read where it is used; a file others may read is refused (a key in a
        world-readable file is a key given away)."""
        if self.api_key_file is None:
            return None
        mode = self.api_key_file.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"{self.api_key_file} must be owner-only (chmod 600): it "
                                  "holds an upstream's API key")
        return self.api_key_file.read_text().strip() or None


class RoutingSettings(_Section):
    """[routing]: the defaults of where a request may run."""

    route: Route = Field(
        "local, then upstream", description="Where a request may run unless its model "
        "([models.\"name\"] route) or tenant says otherwise: only here; here, then an "
        "upstream when the box cannot serve it as asked (saturated, the model not "
        "installed, the prompt over its context); or an upstream first, here when none "
        "can take it. Nothing leaves a tenant whose egress is `never`.")
    saturated: Literal["upstream", "fallback"] = Field(
        "upstream", description="On a saturated box, for a normal-tier request, which comes "
        "first: an upstream serving the model asked, or the model's smaller local fallback "
        "([models.\"name\"] fallback); the other is tried next.")
