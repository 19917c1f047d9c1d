"""The controller's command route: `fleet send` for an operator at a desk.

    POST /commands   {"device": ID | null, "all": false, "type": "ping", "args": {},
                      "fleet": null, "wait_s": 30}
                     → {"command": signed, "results": [...], "missing": [...]}
    GET  /commands/{id}  {"command": signed, "results": [...]} as stored so far

The type, the operator's role and the args are checked against the registry of command
types (`protocol.command_types`) first: an unknown type or args that do not fit its schema
are refused 400 and a role below the type's 403, before anything is signed. The
controller then signs with its own command key (`command_signing_key_file`, which never
leaves its host), records the command and publishes it, then waits up to `wait_s` (at most
60) for the boxes' results, as `fleet send --json` does and prints. Without a key it
answers 503. Each send is on the audit trail with its operator, done or refused.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from edge_agent.errors import Forbidden, InvalidRequest, NotFound, ServiceUnavailable
from edge_agent.fleet.controller import commands
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.audit import audited
from edge_agent.fleet.controller.operators import Operator, may
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.protocol import command_types
from edge_agent.fleet.protocol.ids import check_id

MAX_WAIT_S = 60.0


class CommandSend(BaseModel):
    """`fleet send DEVICE|--all TYPE`'s words and options, by the same names."""

    model_config = ConfigDict(extra="forbid")

    device: str | None = Field(None, max_length=64)
    all: bool = False
    type: str = Field(min_length=1, max_length=64)
    args: dict[str, Any] = Field(default_factory=dict)
    fleet: str | None = Field(None, max_length=64)
    wait_s: float = Field(30.0, ge=0, le=MAX_WAIT_S)


def command_router(store: ControllerStore, sender: commands.CommandSender | None) -> APIRouter:
    router = APIRouter()

    @router.post("/commands")
    def send(body: CommandSend, request: Request) -> dict[str, Any]:
        target = commands.ALL if body.all else body.device
        # Capacity settings outside the release gate: marked on the trail as such.
        ungated = body.type == "config.patch" and body.args.get("ungated") is True
        with audited(store.audit, action="command.send.ungated" if ungated else "command.send",
                     target=target,
                     request=body.model_dump(), **actor(request)):
            if (body.device is None) != body.all:
                raise InvalidRequest("name one device, or all", param="device")
            for kind, value in (("device", body.device), ("fleet", body.fleet)):
                if value is not None:
                    try:
                        check_id(kind, value)
                    except ValueError as exc:
                        raise InvalidRequest(str(exc), param=kind) from None
            _check_command(body.type, body.args, request.state.operator)
            if sender is None:
                raise ServiceUnavailable("this controller has no command_signing_key_file: "
                                         "it cannot sign commands")
            fleet = body.fleet or commands.fleet_of(store, body.device)
            sent = sender.send(store, fleet=fleet, device=str(target), type_=body.type,
                               args=body.args)
        results = commands.wait(store, sent, body.wait_s) if body.wait_s else []
        missing = sorted(set(sent.expected) - {r["device"] for r in results})
        return {"command": sent.command, "results": results, "missing": missing}

    @router.get("/commands/{command_id}")
    def command(command_id: str) -> dict[str, Any]:
        found = store.command(command_id)
        if found is None:
            raise NotFound(f"no command {command_id}")
        return {"command": found, "results": store.command_results(command_id)}

    return router


def _check_command(type_: str, args: dict[str, Any], operator: Operator | None) -> None:
    """The type is registered, `operator` may send it and `args` fit its schema; the
    refusal names what does not, as the body's own checks do (`args.prefix: …`)."""
    try:
        spec = command_types.lookup(type_)
    except command_types.UnknownType as exc:
        raise InvalidRequest(f"type: {exc}", param="type") from None
    if operator is not None and not may(operator.role, spec.role):
        raise Forbidden(f"operator {operator.name!r} is a {operator.role}: {spec.name} "
                        f"needs {spec.role}")
    try:
        spec.check_args(args)
    except command_types.BadArgs as exc:
        raise InvalidRequest(str(exc), param="args") from None
