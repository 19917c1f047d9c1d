"""The controller's release routes: a release signed at a desk (`fleet release push`),
published here. The controller never signs a release: it takes the file, then the targets
metadata the desk signed with the targets key root trusts, and re-signs only snapshot
and timestamp (its online keys), as `fleet release timestamp` does.

    PUT  /release-files/{sha256}   the file, raw, with its Content-Length (at most 256 GiB,
                                   `access.BODY_LIMITS`): kept under incoming/ when its
                                   digest is the one named and it is a GGUF
                                   → 201 {"sha256", "length", "stored": true}
                                     (200, "stored": false, where it waits there already)
    POST /releases                 {"targets": the signed targets metadata, TUF's JSON}
                                   → {"releases": [what `fleet release add --json` prints],
                                      "targets_version": N}

Both are operator writes on the audit trail (`release.upload`, `release.publish`), done
or refused. A refusal says what is wrong in the repository's words: unsigned or signed by
another key (400), not the next version (409: another push came first), a release changed
or dropped (409), a file not uploaded (400). The boxes fetch the result as before, from
the public `/releases/` tree, and verify it with their root.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from tuf.api.metadata import Metadata, Targets

from edge_agent.errors import EdgeAgentError, InvalidRequest, NotFound
from edge_agent.fleet.controller.access import actor
from edge_agent.fleet.controller.audit import Action, audited
from edge_agent.fleet.controller.releases.repository import (
    ReleaseRepository,
    Upload,
    releases_dir,
)
from edge_agent.fleet.controller.store import ControllerStore


class ReleasePublish(BaseModel):
    """The signed targets metadata, as python-tuf writes `N.targets.json`."""

    model_config = ConfigDict(extra="forbid")

    targets: dict[str, Any]


def release_router(store: ControllerStore, state_dir: Path | None) -> APIRouter:
    router = APIRouter()

    def repository() -> ReleaseRepository:
        repo = None if state_dir is None else ReleaseRepository(releases_dir(state_dir))
        if repo is None or not repo.exists():
            raise NotFound("this controller has no release repository (edge-agent "
                                "fleet release init on its host creates it)")
        return repo

    @router.put("/release-files/{sha256}", status_code=201)
    async def upload(sha256: str, request: Request) -> Any:
        length = int(request.headers["content-length"])  # `access` checked it is there
        action = Action(store.audit, action="release.upload", target=sha256[:64],
                        request={"length": length}, **actor(request))
        up: Upload | None = None
        try:
            up = await run_in_threadpool(Upload, repository(), sha256, length)
            async for chunk in request.stream():
                await run_in_threadpool(up.write, chunk)
            stored = await run_in_threadpool(up.finish)
        except EdgeAgentError as exc:
            await run_in_threadpool(action.refused, exc)
            raise
        except ClientDisconnect:
            await run_in_threadpool(action.record, 499, "the client went away mid-upload")
            raise
        finally:
            if up is not None:
                await run_in_threadpool(up.discard)
        await run_in_threadpool(action.record, 200, "stored" if stored else "there already")
        return JSONResponse({"sha256": sha256, "length": length, "stored": stored},
                            status_code=201 if stored else 200)

    @router.post("/releases")
    def publish(body: ReleasePublish, request: Request) -> dict[str, Any]:
        signed = body.targets.get("signed")
        version = signed.get("version") if isinstance(signed, dict) else None
        with audited(store.audit, action="release.publish", target=None,
                     request={"version": version if isinstance(version, int) else None},
                     **actor(request)) as action:
            try:
                md = Metadata[Targets].from_dict(dict(body.targets))
            except Exception as exc:  # python-tuf raises what the shape makes it raise
                raise InvalidRequest(f"targets: not TUF targets metadata: "
                                     f"{type(exc).__name__}: {exc}") from None
            repo = repository()
            added = repo.publish_signed(md, repo.default_keys())
            action.target = ", ".join(e.manifest.ref for e in added)[:200]
        return {"releases": [e.to_json() for e in added],
                "targets_version": md.signed.version}

    return router
