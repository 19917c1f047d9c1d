"""The controller's web console, served by `fleet serve` at `/`: the fleet, its rollouts,
releases and audit trail for people who would rather look than read, and the operator's
actions (start from a release, pause, resume, abort, roll back) for those whose role allows.

Server-rendered HTML (Jinja2 templates beside this module), one small script of its own
(`static/console.js`, no build step, nothing fetched from elsewhere: the controller may
have no internet): each page's live part (`data-live`) is fetched again every two seconds
and swapped in, so a rollout's progress moves without a reload. Plain forms and tables,
labelled, usable from the keyboard.

Who may see and do what is the API's rule (`access.RULES`: pages as reads, forms as
writes); a viewer's page has no action buttons, and the route refuses the action anyway.
A form's action is the API's own (`rollouts.api.start_rollout`, `act_on_rollout`): the same
checks, error text and audit trail. Sign-in is a token (`session`); forms carry the CSRF
token.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlencode

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from edge_agent import __version__
from edge_agent.config import ConfigError
from edge_agent.config.controller import SLOSettings
from edge_agent.errors import EdgeAgentError, NotFound, PayloadTooLarge
from edge_agent.fleet.controller import registrations
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.console.charts import service_levels
from edge_agent.fleet.controller.console.session import (
    close_session,
    csrf_for,
    csrf_ok,
    open_session,
    session_token,
)
from edge_agent.fleet.controller.leadership import presence_state
from edge_agent.fleet.controller.operators import Operator, may
from edge_agent.fleet.controller.releases.repository import ReleaseRepository, releases_dir
from edge_agent.fleet.controller.review_api import reviewed
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.rollouts import operations as rollout_ops
from edge_agent.fleet.controller.rollouts.api import RolloutStart, act_on_rollout, start_rollout
from edge_agent.fleet.controller.slo_api import window_s
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.controller.waves import format_duration
from edge_agent.fleet.protocol.rollout_states import FILE_IN_PLACE

HERE = Path(__file__).resolve().parent
STATIC = {"console.js": "text/javascript", "console.css": "text/css"}
LIVE_HEADER = "x-console-part"  # console.js asks for the live part only
LIVE_PAGES = frozenset({"fleet", "rollouts", "rollout"})  # each has a `<name>_live.html`
FORM_LIMIT = 64 * 1024


def _ago(ts: float | None, now: float) -> str:
    if ts is None:
        return "-"
    age = max(0.0, now - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if age >= size:
            return f"{age / size:.0f} {unit} ago"
    return f"{age:.0f} s ago"


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


async def _form(request: Request) -> dict[str, str]:
    """An urlencoded form (the console's only kind), each field once; bounded."""
    body = await request.body()
    if len(body) > FORM_LIMIT:
        raise PayloadTooLarge(f"the form is {len(body)} bytes; at most {FORM_LIMIT}")
    fields = parse_qs(body.decode("utf-8", errors="replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items()}


def _local(target: str | None) -> str:
    """Where a sign-in may send the browser back to: a path of this site, else `/`."""
    if not target or not target.startswith("/") or target.startswith("//") or "\\" in target:
        return "/"
    return target


def console_router(store: ControllerStore, state_dir: Path | None,
                   rings: Rings | None = None, *,
                   slo: SLOSettings | None = None) -> APIRouter:
    targets = slo or SLOSettings.model_validate({})
    router = APIRouter(include_in_schema=False)
    templates = Jinja2Templates(env=jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True))
    templates.env.globals.update(version=__version__, when=_when)

    def page(request: Request, name: str, **context: Any) -> Response:
        operator: Operator | None = getattr(request.state, "operator", None)
        token = session_token(request)
        live = request.headers.get(LIVE_HEADER) == "live" and name in LIVE_PAGES
        status = int(context.pop("status", 200))
        return templates.TemplateResponse(
            request, f"{name}{'_live' if live else ''}.html",
            {"operator": operator,
             "may_act": operator is not None and may(operator.role, "operator"),
             "csrf": csrf_for(token) if token else "",
             "ago": lambda ts: _ago(ts, time.time()), **context},
            status_code=status, headers={"cache-control": "no-store"})

    @router.get("/console/static/{name}")
    def static(name: str) -> Response:
        if name not in STATIC:
            raise NotFound(f"no file {name}")
        return FileResponse(HERE / "static" / name, media_type=STATIC[name],
                            headers={"cache-control": "no-cache"})

    @router.get("/console/login")
    def login_page(request: Request, next: str = "/") -> Response:
        return page(request, "login", next=_local(next), error=None)

    @router.post("/console/login")
    async def login(request: Request) -> Response:
        form = await _form(request)
        token = form.get("token", "").strip()
        target = _local(form.get("next"))
        operator = (await run_in_threadpool(store.operators.operator_for_token, token)
                    if token else None)
        if operator is None:
            return page(request, "login", next=target, status=401,
                        error="That token is unknown or revoked.")
        response = RedirectResponse(target, status_code=303)
        open_session(response, request, token)
        return response

    @router.post("/console/logout")
    async def logout(request: Request) -> Response:
        response = RedirectResponse("/console/login", status_code=303)
        close_session(response)
        return response

    @router.get("/")
    def fleet(request: Request, prefix: str = "", state: str = "") -> Response:
        devices = []
        for d in registrations.listed(store):
            if prefix and not d["device"].startswith(prefix):
                continue
            if state in ("online", "offline") and d["online"] != (state == "online"):
                continue
            devices.append({**d, "last_error": store.last_error(d["device"])})
        # A box says which digest is active; the repository says which release that is.
        versions = {e["sha256"]: e["version"] for e in _releases()}
        now = time.time()
        controllers = [{**c, "state": presence_state(c, now)} for c in store.controllers()]
        agents = collections.Counter(
            (d["agent_version"] or "-", d["llama_cpp_version"] or "-") for d in devices
            if not d.get("retired") and not d.get("never_seen"))
        return page(request, "fleet", devices=devices, prefix=prefix, state=state,
                    controllers=controllers,
                    agents=[{"agent": a, "llama": ll, "count": n}
                            for (a, ll), n in agents.most_common()],
                    online=sum(1 for d in devices if d["online"]),
                    version_of=lambda digest: versions.get(
                        str(digest or "").removeprefix("sha256:")))

    @router.get("/console/rollouts")
    def rollouts(request: Request) -> Response:
        return page(request, "rollouts", **_rollouts_context())

    def _rollouts_context(error: str | None = None,
                          form: dict[str, str] | None = None) -> dict[str, Any]:
        now = time.time()
        listed = []
        for r in store.rollouts.rollouts(limit=100):
            full = rollout_ops.report(r, store.rollouts.rollout_devices(r.id), now)
            full.pop("devices")
            listed.append(full)
        return {"rollouts": listed, "releases": _releases(), "error": error,
                "form": form or {}}

    def _releases() -> list[dict[str, Any]]:
        if state_dir is None or not (releases_dir(state_dir) / "metadata").is_dir():
            return []
        try:
            entries = ReleaseRepository(releases_dir(state_dir)).releases()
        except (ConfigError, EdgeAgentError, OSError, ValueError):
            return []
        return [e.to_json() for e in entries]

    @router.post("/console/rollouts")
    async def start(request: Request) -> Response:
        form = await _form(request)
        if not csrf_ok(request, form.get("csrf")):
            return _csrf_refused()
        fields: dict[str, Any] = {k: form[k] for k in ("release", "devices", "waves",
                                                       "abort_above", "soak", "device_timeout")
                                  if form.get(k)}
        fields["rollback_on_abort"] = "rollback_on_abort" in form
        try:
            body = RolloutStart.model_validate(fields)
            record = await run_in_threadpool(start_rollout, store, state_dir, body,
                                             actor(request), rings)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return page(request, "rollouts", status=400,
                        **_rollouts_context(f"{where}: {first['msg']}", form))
        except EdgeAgentError as exc:
            return page(request, "rollouts", status=exc.status_code,
                        **_rollouts_context(exc.message, form))
        return RedirectResponse(f"/console/rollouts/{record.id}", status_code=303)

    @router.get("/console/rollouts/{rollout_id}")
    def rollout(request: Request, rollout_id: str, error: str | None = None) -> Response:
        found = store.rollouts.rollout(rollout_id)
        if found is None:
            return page(request, "missing", status=404, what=f"no rollout {rollout_id}")
        report = rollout_ops.report(found, store.rollouts.rollout_devices(rollout_id), time.time(),
                                    store.audit.actions(target=rollout_id))
        evidence = {d["device"]: _evidence(d["device"], rollout_id)
                    for d in report["devices"]}
        impact = store.slo.release_impact(rollout_id, window_s=targets.compare_s)
        return page(request, "rollout", r=report, evidence=evidence, error=error,
                    impact=impact, compare=format_duration(targets.compare_s),
                    file_in_place=FILE_IN_PLACE,
                    verbs=[v for v, (_, allowed) in rollout_ops.ACTIONS.items()
                           if report["state"] in allowed])

    def _evidence(device: str, rollout_id: str) -> dict[str, Any] | None:
        """The box's latest gate evidence for the rollout (checks and figures), if any."""
        for m in store.messages(device, kind="rollout", limit=50, newest_first=True):
            body = m.get("body") or {}
            if body.get("event") == "rollout.evidence" and body.get("rollout_id") == rollout_id:
                return dict(body)
        return None

    @router.post("/console/rollouts/{rollout_id}/{verb}")
    async def act(request: Request, rollout_id: str, verb: str) -> Response:
        form = await _form(request)
        if not csrf_ok(request, form.get("csrf")):
            return _csrf_refused()
        if verb not in rollout_ops.ACTIONS:
            raise NotFound(f"no action {verb}")
        target = f"/console/rollouts/{rollout_id}"
        try:
            await run_in_threadpool(act_on_rollout, store, rollout_id, verb, actor(request))
        except EdgeAgentError as exc:
            target += "?" + urlencode({"error": exc.message})
        return RedirectResponse(target, status_code=303)

    @router.get("/console/releases")
    def releases(request: Request) -> Response:
        return page(request, "releases", releases=_releases())

    @router.get("/console/slo")
    def service_levels_page(request: Request, window: str = "6h", model: str = "",
                            device: str = "", fleet: str = "") -> Response:
        form = {"window": window, "model": model, "device": device, "fleet": fleet}
        try:
            span = window_s(window)
        except EdgeAgentError as exc:
            return page(request, "slo", status=400, error=exc.message, form=form,
                        charts=[], series=None, targets=targets)
        until = time.time()
        series = store.slo.series(since=until - span, until=until, model=model or None,
                                  device=device or None, fleet=fleet or None).to_json()
        return page(request, "slo", error=None, form=form, series=series,
                    charts=service_levels(series), targets=targets)

    @router.get("/console/review")
    def review_page(request: Request) -> Response:
        return page(request, "review", **reviewed(store, state_dir, targets))

    @router.get("/console/audit")
    def audit(request: Request, operator: str = "") -> Response:
        actions = store.audit.actions(operator=operator or None, limit=500)
        return page(request, "audit", actions=list(reversed(actions)), operator_filter=operator)

    return router


def _csrf_refused() -> Response:
    return HTMLResponse("<!doctype html><title>Refused</title><p>This form is not from this "
                        "console session (CSRF check failed). Go back, reload and try again.",
                        status_code=403)
