"""Logging: plain text or one JSON object per line, and one access line per request.

A request's id (its `X-Request-Id`, or a new one) rides in a context variable, so every
log line written while serving it carries it, and comes back in the `X-Request-Id`
response header. Access lines carry ids, model, status and timings — never prompt or
completion text. The client-supplied ones (trace id, model name, path) pass through a
`MetadataScrub` first, so a personal value a client put in them never reaches a log line
or the ledger.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
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


def scrubbed(scrub: MetadataScrub | None, what: str, value: str) -> str:
    """`value` through the scrubber's `what` (trace_id, model, path). Never raises: a
    scrubber failure drops the value rather than the line."""
    if scrub is None:
        return value
    try:
        return str(getattr(scrub, what)(value))
    except Exception:
        logging.getLogger(__name__).exception("redacting the %s failed", what)
        return "<REDACTION_FAILED>"


@dataclass
class Served:
    """What one request's context knows while it is served: its trace id, the fields its
    handlers noted (`access`), and its status once known (None: nothing to write, as for a
    batch line that will run again)."""

    rid: str
    access: dict[str, Any]
    status: int | None = 500
    started_at: float = field(default_factory=time.time)
    start: float = field(default_factory=time.perf_counter)


@contextlib.contextmanager
def request_context(rid: str, method: str, path: str, *,
                    record: Callable[[dict[str, Any]], None] | None = None,
                    scrub: MetadataScrub | None = None, access: dict[str, Any] | None = None,
                    status: int | None = 500, extra: dict[str, Any] | None = None,
                    label: str = "") -> Iterator[Served]:
    """The context one request is served in, for the HTTP middleware (`RequestContext`)
    and the batch runner alike: its trace id and access fields in the context variables
    while it runs, then one access line and, for generation and embedding endpoints, one
    ledger row, both assembled here from scrubbed metadata. `access` starts the fields
    (the batch's tenant); `extra` joins both line and row (`batch_id`); `label` ends the
    access line's message."""
    served = Served(rid, {"id": uuid.uuid4().hex, **(access or {})}, status)
    token = request_id_var.set(rid)
    access_token = access_var.set(served.access)
    try:
        yield served
    finally:
        try:
            if served.status is not None:
                _write(served, method, path, record, scrub, extra or {}, label)
        finally:
            access_var.reset(access_token)
            request_id_var.reset(token)


def _write(served: Served, method: str, path: str,
           record: Callable[[dict[str, Any]], None] | None, scrub: MetadataScrub | None,
           extra: dict[str, Any], label: str) -> None:
    dialect = "openai" if path.startswith("/v1/") else "ollama"
    fields = {"method": method, "path": scrubbed(scrub, "path", path),
              "status": served.status, "tenant": "local", "dialect": dialect,
              **served.access,
              "total_ms": round((time.perf_counter() - served.start) * 1000, 1), **extra}
    if isinstance(fields.get("model"), str):
        fields["model"] = scrubbed(scrub, "model", fields["model"])
    message = f"{method} {fields['path']} {served.status}" + (f" ({label})" if label else "")
    access_log.info("%s", message, extra={"fields": fields, "request_id": served.rid})
    if record is not None and path in LEDGER_PATHS:
        record({**fields, "trace_id": served.rid, "ts": served.started_at, "endpoint": path})


class RequestContext:
    """Pure ASGI middleware: trace id in, trace id out (`X-Request-Id`), and the request
    served in its `request_context`, whose access line and ledger row are written at the
    end of the response (after the last byte of a stream); the response header carries
    the trace id as stored. A request that gets a ledger row is also told the row's id
    (`X-Edge-Request-Id`): the trace id is the client's and may name many requests (every
    request of one W3C trace shares it), the row id names this one, for the app's verdict
    on the answer (`POST /edge/v1/feedback`)."""

    def __init__(self, app: ASGIApp, record: Callable[[dict[str, Any]], None] | None = None,
                 scrub: MetadataScrub | None = None) -> None:
        self.app = app
        self.record = record
        self.scrub = scrub

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = scrubbed(self.scrub, "trace_id", trace_id(dict(scope["headers"])))
        with request_context(rid, scope["method"], scope["path"], record=self.record,
                             scrub=self.scrub) as served:

            async def send_with_id(message: Message) -> None:
                if message["type"] == "http.response.start":
                    served.status = message["status"]
                    message.setdefault("headers", [])
                    message["headers"] = [*message["headers"],
                                          (b"x-request-id", rid.encode())]
                    if scope["path"] in LEDGER_PATHS:
                        message["headers"].append(
                            (b"x-edge-request-id", str(served.access["id"]).encode()))
                await send(message)

            await self.app(scope, receive, send_with_id)
