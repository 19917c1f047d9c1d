"""The controller's rollout routes: read them (viewer), start one and pause, resume, abort or
roll one back (operator).

    GET  /rollouts                    {"rollouts": [rollout, ...]} newest first (no devices)
    GET  /rollouts/{id}               one rollout as `fleet rollout status ID --json` prints it
    GET  /model-history?name=N        every rollout of model N, newest first, with its actions
    POST /rollouts                    start: `fleet rollout start`'s options as JSON fields
    POST /rollouts/{id}/pause|resume|abort|rollback

A write is checked by the same rules as the CLI's (`rollouts.operations`, the same error text),
answers the JSON `fleet rollout start|pause|… --json` prints, and is on the audit trail
with its operator, done or refused. Like the CLI, it only writes the store: the rollout
engine (on the leader) signs and publishes the commands.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from edge_agent.config import ConfigError
from edge_agent.errors import InvalidRequest, NotFound, ServiceUnavailable
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.audit import audited
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.rollout_records import RolloutRecord
from edge_agent.fleet.controller.rollouts import operations as rollout_ops
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.names import ModelName


class RolloutStart(BaseModel):
    """`fleet rollout start NAME@VERSION …`'s options, by the same names."""

    model_config = ConfigDict(extra="forbid")

    release: str | None = Field(None, max_length=200,
                                description="NAME@VERSION, published already.")
    agent: str | None = Field(None, max_length=40,
                              description="An agent release's VERSION (`fleet release "
                              "add-agent`), in place of `release`.")
    devices: str = Field("all", max_length=10_000, description="The selector.")
    waves: str = Field(max_length=1000, description="Cumulative targets: 1,10%,50%,100%.")
    abort_above: str = Field("10%", max_length=20)
    min_executed: int = Field(3, ge=1, le=1_000_000)
    soak: str = Field("0s", max_length=40)
    device_timeout: str = Field("2h", max_length=40)
    rollback_on_abort: bool = False
    id: str | None = Field(None, max_length=64)
    capacity: str | None = Field(None, max_length=1000,
                                 description="A capacity release: KEY=VALUE,… of "
                                 "parallel, context_length, threads, prompt_lookup, "
                                 "draft_model, draft_tokens.")


def start_rollout(store: ControllerStore, state_dir: Path | None, body: RolloutStart,
                  who: Mapping[str, str], rings: Rings | None = None) -> RolloutRecord:
    """A rollout started by `who` (`access.actor`) and put on the audit trail, done or
    refused: the API's and the console's one way (`rings`: where each stage may go)."""
    # A model release's trail as before; a capacity or agent release's names them.
    request = body.model_dump(exclude={k for k in ("capacity", "agent", "release")
                                       if getattr(body, k) is None})
    with audited(store.audit, action="rollout.start", target=body.id, request=request,
                 **who) as action:
        if state_dir is None:
            raise NotFound("this controller has no release repository")
        policy = rollout_ops.policy(
            body.waves, abort_above=body.abort_above, min_executed=body.min_executed,
            soak=body.soak, device_timeout=body.device_timeout,
            rollback_on_abort=body.rollback_on_abort)
        capacity = rollout_ops.parse_capacity(body.capacity) \
            if body.capacity is not None else None
        if (body.release is None) == (body.agent is None):
            raise InvalidRequest("give a release (NAME@VERSION) or an agent release "
                                 "(--agent VERSION), one of the two", param="release")
        if body.agent is not None and capacity is not None:
            raise InvalidRequest("--capacity goes with a model release, not --agent",
                                 param="capacity")
        try:
            if body.agent is not None:
                record = rollout_ops.start_agent(store, state_dir, body.agent, body.devices,
                                                 policy, now=time.time(), rollout_id=body.id)
            else:
                assert body.release is not None
                record = rollout_ops.start(store, state_dir, body.release, body.devices,
                                           policy, now=time.time(), rollout_id=body.id,
                                           capacity=capacity, rings=rings)
        except ConfigError as exc:  # the repository is not there: the controller's to fix
            raise ServiceUnavailable(str(exc)) from exc
        action.target = record.id
    return record


def act_on_rollout(store: ControllerStore, rollout_id: str, verb: str,
                   who: Mapping[str, str]) -> RolloutRecord:
    """pause, resume, abort or rollback by `who`, on the audit trail, done or refused."""
    with audited(store.audit, action=f"rollout.{verb}", target=rollout_id, request={}, **who):
        return rollout_ops.act(store, rollout_id, verb, now=time.time(), by=who["operator"])


def rollout_router(store: ControllerStore, state_dir: Path | None,
                   rings: Rings | None = None) -> APIRouter:
    """`state_dir`: the controller's, where the release repository a rollout must name is
    (None: every release is unknown); `rings`: which fleets each stage may go to (None:
    every fleet takes every stage)."""
    router = APIRouter()

    @router.get("/rollouts")
    def rollouts(limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        now = time.time()
        out = []
        for r in store.rollouts.rollouts(limit=limit):
            full = rollout_ops.report(r, store.rollouts.rollout_devices(r.id), now)
            full.pop("devices")
            out.append(full)
        return {"rollouts": out}

    @router.get("/model-history")
    def model_history(name: str = Query(max_length=300),
                      limit: int = Query(50, ge=1, le=1000)) -> dict[str, Any]:
        """Every rollout of a model, newest first, each with who acted on it."""
        model = ModelName.parse(name)
        now = time.time()
        out = []
        for r in store.rollouts.rollouts(name=model, limit=limit):
            full = rollout_ops.report(r, store.rollouts.rollout_devices(r.id), now,
                                      store.audit.actions(target=r.id))
            full.pop("devices")
            out.append(full)
        return {"name": model, "rollouts": out}

    @router.get("/rollouts/{rollout_id}")
    def rollout(rollout_id: str) -> dict[str, Any]:
        found = store.rollouts.rollout(rollout_id)
        if found is None:
            raise NotFound(f"no rollout {rollout_id}")
        return rollout_ops.report(found, store.rollouts.rollout_devices(rollout_id), time.time(),
                                  store.audit.actions(target=rollout_id))

    @router.post("/rollouts", status_code=201)
    def start(body: RolloutStart, request: Request) -> dict[str, Any]:
        return start_rollout(store, state_dir, body, actor(request), rings).to_json()

    def act(verb: str) -> None:
        def acted(rollout_id: str, request: Request) -> dict[str, Any]:
            return act_on_rollout(store, rollout_id, verb, actor(request)).to_json()

        router.add_api_route(f"/rollouts/{{rollout_id}}/{verb}", acted, methods=["POST"],
                             name=f"rollout_{verb}")

    for verb in rollout_ops.ACTIONS:
        act(verb)
    return router
