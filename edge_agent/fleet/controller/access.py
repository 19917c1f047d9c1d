"""Who may call which route of the controller's HTTP side: one rule per route, one check
before anything else runs, one refusal shape.

Every route is named in `RULES` (method and path template → the role it needs, or
`SCRAPE` for `/metrics` and `/healthz`, or `PUBLIC` for the boxes' `/releases/`), and the
check answers 404 or 405 itself for what no rule names: a route added without a rule is
unreachable, and the test that compares the app's routes with the rules fails until it
is written. The check is an ASGI middleware matching the rules' own path templates (not
the framework's route objects, whose shape changes between FastAPI releases): it runs
before a body is read or parsed, so a caller without a token costs one store lookup at
most and never reaches a handler; a write's body must also say its length, at most
`MAX_BODY_BYTES` (411, 413), before it is read.

A token is `Authorization: Bearer eop_…` (`operators`), or on the console's pages the
session cookie that holds it (`console.session`; a console GET without one is sent to the
login page); it is looked up in the store on each request, so a revocation holds from the
next request on. Refusals are the controller's `{"error": "..."}`: 401 (no token, a
malformed or unknown or revoked one, with `WWW-Authenticate: Bearer`) or 403 (a role below
the route's). Every write by a known operator that is refused (403 here, 411/413 for its
body, or a 4xx from its handler) or fails is on the audit trail: recorded by the code that
did it when that code got so far (`audit.audited`), else here, as the method and path
tried, filed under the object the path names (`_TARGETS`: a rollout, a device …), so
`fleet audit --target ID` and a rollout's page show it. A caller with no valid token
is not: the trail says who did what, and an anonymous flood must not fill it.

The CLI on the controller host builds the same app in its own process (`local`: its
user, who has the store in reach anyway) and reaches it with no socket and no token.

Without any operator, a controller bound to loopback answers reads as before (its host's
users are the only callers) and refuses every write; bound elsewhere it answers nothing but
what `SCRAPE` and `PUBLIC` allow. `/metrics` and `/healthz` are open on a loopback bind and
need a viewer's token elsewhere, unless `http.metrics_open` says otherwise.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.routing import compile_path

from edge_agent.fleet.controller.audit import recording
from edge_agent.fleet.controller.operators import Operator, may

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from edge_agent.fleet.controller.store import ControllerStore

PUBLIC = "public"  # the boxes' release downloads: integrity is the signatures' (TUF)
SCRAPE = "scrape"  # Prometheus and health checks: see `metrics_open`

RULES: Mapping[tuple[str, str], str] = {
    ("GET", "/metrics"): SCRAPE,
    ("GET", "/healthz"): SCRAPE,
    ("GET", "/fleet-metrics"): SCRAPE,
    ("GET", "/slo"): "viewer",
    ("GET", "/slo/rollouts/{rollout_id}"): "viewer",
    ("GET", "/console/slo"): "viewer",
    ("GET", "/review"): "viewer",
    ("POST", "/review/verify"): "operator",
    ("GET", "/console/review"): "viewer",
    ("GET", "/openapi.json"): "viewer",
    ("HEAD", "/openapi.json"): "viewer",
    ("GET", "/devices"): "viewer",
    ("GET", "/controllers"): "viewer",
    ("GET", "/devices/{device_id}"): "viewer",
    ("GET", "/devices/{device_id}/metrics"): "viewer",
    ("POST", "/devices/{device_id}/retire"): "admin",
    ("POST", "/devices/{device_id}/restore"): "admin",
    ("POST", "/devices"): "admin",
    ("POST", "/devices/{device_id}/unregister"): "admin",
    ("GET", "/latest-metrics"): "viewer",
    ("GET", "/feedback"): "viewer",
    ("GET", "/audit"): "viewer",
    ("POST", "/commands"): "operator",
    ("GET", "/commands/{command_id}"): "viewer",
    ("GET", "/operators"): "admin",
    ("POST", "/operators"): "admin",
    ("POST", "/operators/{name}/revoke"): "admin",
    ("GET", "/rollouts"): "viewer",
    ("GET", "/model-history"): "viewer",
    ("GET", "/rollouts/{rollout_id}"): "viewer",
    ("POST", "/rollouts"): "operator",
    ("POST", "/rollouts/{rollout_id}/pause"): "operator",
    ("POST", "/rollouts/{rollout_id}/resume"): "operator",
    ("POST", "/rollouts/{rollout_id}/abort"): "operator",
    ("POST", "/rollouts/{rollout_id}/rollback"): "operator",
    ("PUT", "/release-files/{sha256}"): "operator",
    ("POST", "/releases"): "operator",
    # The console (`console`): its pages read like the API's GETs, its forms act like
    # its POSTs; the login page and the static files are for anyone.
    ("GET", "/"): "viewer",
    ("GET", "/console/login"): PUBLIC,
    ("POST", "/console/login"): PUBLIC,
    ("POST", "/console/logout"): PUBLIC,
    ("GET", "/console/static/{name}"): PUBLIC,
    ("GET", "/console/rollouts"): "viewer",
    ("POST", "/console/rollouts"): "operator",
    ("GET", "/console/rollouts/{rollout_id}"): "viewer",
    ("POST", "/console/rollouts/{rollout_id}/{verb}"): "operator",
    ("GET", "/console/releases"): "viewer",
    ("GET", "/console/audit"): "viewer",
    ("GET", "/releases/{path:path}"): PUBLIC,
    ("HEAD", "/releases/{path:path}"): PUBLIC,
}

MAX_BODY_BYTES = 256 * 1024  # a rollout, a command (64 KiB signed at most), a form
# Writes whose body may be larger: a release's file, and the targets metadata listing
# every release ever published, with its manifest and chat template (`release_api`).
BODY_LIMITS: Mapping[tuple[str, str], int] = {
    ("PUT", "/release-files/{sha256}"): 256 << 30,
    ("POST", "/releases"): 16 << 20,
}

# Who calls without a token on a loopback controller that has no operator yet.
HOST_USER = Operator("host", "viewer", "")


class AccessRefused(Exception):
    def __init__(self, status: int, message: str,
                 headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or []


def actor(request: Request) -> dict[str, str]:
    """Who made a request that passed the check, as the audit trail records them: the
    operator, their role and the caller's address (`cli` for the CLI's own app)."""
    operator: Operator = request.state.operator
    return {"operator": operator.name, "role": operator.role,
            "source": request.client.host if request.client else "unknown"}


def bearer(headers: Mapping[str, str]) -> str | None:
    """The token of `Authorization: Bearer …`, None without the header; AccessRefused (401)
    for any other scheme or an empty one."""
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AccessRefused(401, "the Authorization header must be 'Bearer <operator token>'")
    return token.strip()


class AccessControl:
    """The middleware: finds the route the request would reach, its rule, and the operator
    the token names; refuses or passes on, with `request.state.operator` set."""

    def __init__(self, app: ASGIApp, *, store: ControllerStore, loopback: bool,
                 metrics_open: bool | None = None, local: Operator | None = None) -> None:
        self.app = app
        self.store = store
        self.loopback = loopback
        self.local = local
        self.metrics_open = loopback if metrics_open is None else metrics_open
        self._compiled = [(compile_path(path)[0], method, rule,
                           BODY_LIMITS.get((method, path), MAX_BODY_BYTES))
                          for (method, path), rule in RULES.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            rule, limit, target = self._rule(scope)
            operator = await self._check(scope, rule, target)
            unreadable = _unreadable(scope)
            if unreadable is not None:
                if operator is not None and scope["method"] not in ("GET", "HEAD"):
                    await self._audit(scope, operator, target, 400, unreadable)
                raise AccessRefused(400, unreadable)
        except AccessRefused as refused:
            if refused.status == 401 and is_console(scope["path"]) and scope["method"] == "GET":
                await _to_login(send, scope)
            else:
                await _refuse(send, refused)
            return
        write = scope["method"] not in ("GET", "HEAD")
        if write:
            too_much = _body_refused(scope, limit)
            if too_much is not None:
                if operator is not None:
                    await self._audit(scope, operator, target, too_much.status,
                                      str(too_much))
                await _refuse(send, too_much)
                return
        scope.setdefault("state", {})["operator"] = operator
        if not write or operator is None:
            await self.app(scope, receive, send)
            return
        answer = _Answer(send)
        with recording() as recorded:
            try:
                await self.app(scope, receive, answer.send)
            except Exception as exc:  # answered 500 further out; on the trail first
                if not recorded:
                    await self._audit(scope, operator, target, 500,
                                      f"failed: {type(exc).__name__}")
                raise
        if answer.status >= 400 and not recorded:
            await self._audit(scope, operator, target, answer.status, answer.error())

    def _rule(self, scope: Scope) -> tuple[str, int, str | None]:
        """The rule of the method and path, its body limit, and the object the path names
        (a rollout, a device, an operator …: what the audit trail files an action under);
        AccessRefused 404 (no rule's path) or 405 (another method's): the app never sees a
        request no rule names."""
        allowed = []
        for regex, method, rule, limit in self._compiled:
            found = regex.match(scope["path"])
            if found:
                if method == scope["method"]:
                    return rule, limit, _target(found.groupdict())
                allowed.append(method)
        if allowed:
            raise AccessRefused(405, f"{scope['method']} is not allowed here (only "
                                     f"{', '.join(sorted(allowed))})",
                                headers=[(b"allow", ", ".join(sorted(allowed)).encode())])
        raise AccessRefused(404, f"no route {scope['path']}")

    async def _audit(self, scope: Scope, operator: Operator, target: str | None, status: int,
                     outcome: str) -> None:
        """A write refused (or failed) before the code that does it recorded it: on the
        trail as the method and path tried, filed under the object the path names."""
        client = scope.get("client")
        await run_in_threadpool(functools.partial(
            self.store.audit.record_action, at=time.time(), operator=operator.name,
            role=operator.role, source=client[0] if client else "unknown",
            action=f"{scope['method']} {scope['path']}", target=target, request={},
            status=status, outcome=outcome))

    async def _check(self, scope: Scope, rule: str, target: str | None) -> Operator | None:
        if rule == PUBLIC or (rule == SCRAPE and self.metrics_open):
            return None
        if self.local is not None:  # the CLI's own app, in its process: no socket to reach
            return self.local
        needed = "viewer" if rule == SCRAPE else rule
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        token = bearer(headers)
        console = is_console(scope["path"])
        if token is None and console:  # a browser: the session cookie (console.session)
            token = _cookie(headers.get("cookie", ""))
        if token is None:
            if (self.loopback and needed == "viewer"
                    and not await run_in_threadpool(self.store.operators.any_operator)):
                return HOST_USER
            raise AccessRefused(401, "an operator token is needed (Authorization: Bearer …); "
                                     "one is made on the controller host with `edge-agent "
                                     "fleet operators create NAME --role "
                                     "viewer|operator|admin`")
        operator = await run_in_threadpool(self.store.operators.operator_for_token, token)
        if operator is None:
            raise AccessRefused(401, "the operator token is unknown or revoked")
        if not may(operator.role, needed):
            refused = AccessRefused(403, f"operator {operator.name!r} is a {operator.role}: "
                                         f"{scope['method']} {scope['path']} needs {needed}")
            if scope["method"] not in ("GET", "HEAD"):  # a write tried: on the trail too
                await self._audit(scope, operator, target, 403, str(refused))
            raise refused
        return operator


_CONTROL = re.compile("[\x00-\x1f\x7f]")


def _unreadable(scope: Scope) -> str | None:
    """Why the path or query cannot be taken, if it cannot: no id, name or filter of the
    controller holds a control character, and NUL (`%00`) is one neither database stores;
    refused here once rather than in every handler that looks a value up."""
    if _CONTROL.search(scope["path"]):
        return "the path holds a control character"
    query = scope.get("query_string", b"")
    if b"\x00" in query or b"%00" in query:
        return "the query holds a NUL (%00)"
    return None


# The path parameters that name what a route acts on, in the order tried: the target an
# action is filed under (`fleet audit --target`, a rollout's "Operator actions").
_TARGETS = ("rollout_id", "device_id", "command_id", "name", "sha256")


def _target(params: Mapping[str, str]) -> str | None:
    return next((params[key] for key in _TARGETS if params.get(key)), None)


class _Answer:
    """The status and the start of the body of a write's answer, passed on unchanged: what
    a refusal the handler did not record says, for the trail."""

    LIMIT = 4096

    def __init__(self, send: Send) -> None:
        self._send = send
        self.status = 0
        self._body = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and self.status >= 400:
            self._body = (self._body + message.get("body", b""))[:self.LIMIT]
        await self._send(message)

    def error(self) -> str:
        """The refusal's `{"error": ...}` message, or its status when there is none."""
        try:
            said = json.loads(self._body).get("error")
        except (ValueError, AttributeError):
            said = None
        return said if isinstance(said, str) and said else f"refused with {self.status}"


def _body_refused(scope: Scope, limit: int) -> AccessRefused | None:
    """A write's body must say its length (411 otherwise), and that length be at most the
    route's limit (413: MAX_BODY_BYTES, small JSON or a form, unless BODY_LIMITS says
    otherwise), before a byte of it is read."""
    length = None
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            length = value
    if length is None:
        return AccessRefused(411, "a request with a body must give its Content-Length")
    try:
        size = int(length)
    except ValueError:
        return AccessRefused(400, "Content-Length is not a number")
    if size < 0:
        return AccessRefused(400, "Content-Length is negative")
    if size > limit:
        return AccessRefused(413, f"the body is {size} bytes; at most {limit}")
    return None


def is_console(path: str) -> bool:
    return path == "/" or path.startswith("/console/")


def _cookie(header: str) -> str | None:
    from http.cookies import CookieError, SimpleCookie

    from edge_agent.fleet.controller.console.session import COOKIE

    try:
        jar = SimpleCookie(header)
    except CookieError:
        return None
    found = jar.get(COOKIE)
    return found.value if found is not None and found.value else None


async def _to_login(send: Send, scope: Scope) -> None:
    """A browser without a session: to the login page, back here after it."""
    target = "/console/login?" + urlencode({"next": scope["path"]})
    await send({"type": "http.response.start", "status": 303,
                "headers": [(b"location", target.encode()), (b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


async def _refuse(send: Send, refused: AccessRefused) -> None:
    body = json.dumps({"error": str(refused)}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if refused.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="edge-agent fleet"'))
    headers += refused.headers
    await send({"type": "http.response.start", "status": refused.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
