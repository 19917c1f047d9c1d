"""Logging: plain text or one JSON object per line, and one access line per request.

A request's id (its `X-Request-Id`, or a new one) rides in a context variable, so every
log line written while serving it carries it, and comes back in the `X-Request-Id`
response header. Access lines carry ids, model, status and timings — never prompt or
completion text. The client-supplied ones (trace id, model name, path) pass through a
`MetadataScrub` first, so a personal value a client put in them never reaches a log line
or the ledger.
"""

from __future__ import annotations

import contextvars
import json
import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
# Filled in while a request is served (model, TTFT …) and written out in its access line.
access_var: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "access", default=None)
_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
access_log = logging.getLogger("edge_agent.access")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", "") or request_id_var.get()
        if rid:
            entry["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update(fields)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def current_request_id() -> str:
    access = access_var.get()
    return str(access["id"]) if access else ""


def note(**fields: Any) -> None:
    """Adds fields (model, dialect, ttft_ms …) to the current request's access line."""
    access = access_var.get()
    if access is not None:
        access.update(fields)


# Requests that get a ledger row (generation and embeddings, rejected ones included).
LEDGER_PATHS = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings",
                          "/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def trace_id(headers: dict[bytes, bytes]) -> str:
    """The client's X-Request-Id, else the trace id of a W3C traceparent, else a new one."""
    given = headers.get(b"x-request-id", b"").decode("latin-1").strip()
    if _SAFE_ID.match(given):
        return given
    parent = _TRACEPARENT.match(headers.get(b"traceparent", b"").decode("latin-1").strip())
    return parent.group(1) if parent else uuid.uuid4().hex


class MetadataScrub(Protocol):
    """What `RequestContext` does to client-supplied metadata before writing it
    (`governance.redaction.MetadataRedactor`)."""

    def trace_id(self, value: str) -> str: ...

    def model(self, value: str) -> str: ...

    def path(self, value: str) -> str: ...


class RequestContext:
    """Pure ASGI middleware: trace id in, trace id out (`X-Request-Id`), and at the end of
    the response (after the last byte of a stream) one access line and, for generation and
    embedding requests, one ledger row. Both are assembled here, once, from scrubbed
    metadata; the response header carries the trace id as stored."""

    def __init__(self, app: ASGIApp, record: Callable[[dict[str, Any]], None] | None = None,
                 scrub: MetadataScrub | None = None) -> None:
        self.app = app
        self.record = record
        self.scrub = scrub

    def _scrubbed(self, what: str, value: str) -> str:
        """Never raises: a scrubber failure drops the value rather than the line."""
        if self.scrub is None:
            return value
        try:
            return str(getattr(self.scrub, what)(value))
        except Exception:
            logging.getLogger(__name__).exception("redacting the %s failed", what)
            return "<REDACTION_FAILED>"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = self._scrubbed("trace_id", trace_id(dict(scope["headers"])))
        token = request_id_var.set(rid)
        access: dict[str, Any] = {"id": uuid.uuid4().hex}  # the ledger's request id
        access_token = access_var.set(access)
        started_at = time.time()
        start = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            dialect = "openai" if scope["path"].startswith("/v1/") else "ollama"
            fields = {"method": scope["method"], "path": self._scrubbed("path", scope["path"]),
                      "status": status, "tenant": "local", "dialect": dialect, **access,
                      "total_ms": round((time.perf_counter() - start) * 1000, 1)}
            if isinstance(fields.get("model"), str):
                fields["model"] = self._scrubbed("model", fields["model"])
            access_log.info("%s %s %s", scope["method"], fields["path"], status,
                            extra={"fields": fields, "request_id": rid})
            if self.record is not None and scope["path"] in LEDGER_PATHS:
                self.record({**fields, "trace_id": rid, "ts": started_at,
                             "endpoint": scope["path"]})
            access_var.reset(access_token)
            request_id_var.reset(token)
