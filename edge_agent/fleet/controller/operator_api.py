"""The controller's routes about the people who use it: their tokens (admin) and what they
did (viewer).

    GET  /operators                  [operator, ...] every token made (never the token)
    POST /operators                  {"name": N, "role": R} → the operator and its token, once
    POST /operators/{name}/revoke    the record, revoked; refused from the next request on
    GET  /audit                      {"actions": [...]} oldest first (?since=&operator=&target=)

Each change is on the audit trail; the trail itself has no route that changes it.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from edge_agent.errors import InvalidRequest, NotFound
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.audit import audited
from edge_agent.fleet.controller.operators import check_name, check_role
from edge_agent.fleet.controller.store import ControllerStore


class OperatorCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64)
    role: str = Field(max_length=16)


def operator_router(store: ControllerStore) -> APIRouter:
    router = APIRouter()

    @router.get("/operators")
    def operators() -> list[dict[str, Any]]:
        return [r.to_json() for r in store.operators.operators()]

    @router.post("/operators", status_code=201)
    def create(body: OperatorCreate, request: Request) -> dict[str, Any]:
        with audited(store.audit, action="operators.create", target=body.name,
                     request={"role": body.role}, **actor(request)):
            try:
                check_name(body.name)
                check_role(body.role)
            except ValueError as exc:
                raise InvalidRequest(str(exc)) from None
            token, record = store.operators.create_operator(body.name, body.role, time.time())
        return {**record.to_json(), "token": token}

    @router.post("/operators/{name}/revoke")
    def revoke(name: str, request: Request) -> dict[str, Any]:
        with audited(store.audit, action="operators.revoke", target=name, request={},
                     **actor(request)):
            record = store.operators.revoke_operator(name, time.time())
            if record is None:
                raise NotFound(f"operator {name!r} has no live token")
        return record.to_json()

    @router.get("/audit")
    def audit(since: float | None = None, operator: str | None = Query(None, max_length=64),
              target: str | None = Query(None, max_length=64),
              limit: int = Query(1000, ge=1, le=100_000)) -> dict[str, Any]:
        return {"actions": [a.to_json() for a in store.audit.actions(
            since=since, operator=operator, target=target, limit=limit)]}

    return router
