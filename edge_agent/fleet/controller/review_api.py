"""The periodic review's routes (`review`): what is due for each production model, and
asking a sample of boxes whether its rollback target is still there and would start.

    GET  /review                  {"models": [...], "reviewed_at"} (viewer)
    POST /review/verify           {"sample": 3, "wait_s": 30} (operator): a signed
                                  `model.verify` of each production model's rollback target
                                  to up to `sample` online boxes that serve the model;
                                  → {"sent": [{"device", "name", "version", "command"}],
                                     "models": the review once the answers are in}

Each verify is on the audit trail, as every `fleet send` is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from edge_agent.config import ConfigError
from edge_agent.config.controller import SLOSettings
from edge_agent.errors import EdgeAgentError, ServiceUnavailable
from edge_agent.fleet.controller import commands
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.audit import audited
from edge_agent.fleet.controller.releases.repository import (
    ReleaseEntry,
    ReleaseRepository,
    releases_dir,
)
from edge_agent.fleet.controller.review import VERIFY, review, verify_sample
from edge_agent.fleet.controller.store import ControllerStore

MAX_WAIT_S = 60.0


class VerifyAsk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sample: int = Field(3, ge=1, le=100, description="Boxes asked per model.")
    wait_s: float = Field(30.0, ge=0, le=MAX_WAIT_S)


def published(state_dir: Path | None) -> list[ReleaseEntry]:
    if state_dir is None or not (releases_dir(state_dir) / "metadata").is_dir():
        return []
    try:
        return ReleaseRepository(releases_dir(state_dir)).releases()
    except (ConfigError, EdgeAgentError, OSError, ValueError):
        return []


def reviewed(store: ControllerStore, state_dir: Path | None, settings: SLOSettings
             ) -> dict[str, Any]:
    now = time.time()
    return {"reviewed_at": now,
            "models": review(store, published(state_dir), compare_s=settings.compare_s,
                             now=now)}


def review_router(store: ControllerStore, state_dir: Path | None, settings: SLOSettings,
                  sender: commands.CommandSender | None) -> APIRouter:
    router = APIRouter()

    @router.get("/review")
    def get_review() -> dict[str, Any]:
        return reviewed(store, state_dir, settings)

    @router.post("/review/verify")
    def verify(body: VerifyAsk, request: Request) -> dict[str, Any]:
        sent = []
        for device, fleet, args in verify_sample(store, published(state_dir), body.sample):
            with audited(store.audit, action="command.send", target=device,
                         request={"type": VERIFY, "args": args}, **actor(request)):
                if sender is None:
                    raise ServiceUnavailable("this controller has no "
                                             "command_signing_key_file: it cannot sign "
                                             "commands")
                done = sender.send(store, fleet=fleet, device=device, type_=VERIFY,
                                   args=args)
            sent.append((done, {"device": device, **args, "command": done.command["id"]}))
        deadline = time.monotonic() + body.wait_s
        for done, _ in sent:
            commands.wait(store, done, max(0.0, deadline - time.monotonic()))
        return {"sent": [s for _, s in sent], **reviewed(store, state_dir, settings)}

    return router
