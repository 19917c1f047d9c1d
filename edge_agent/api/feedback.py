"""The box's own namespace (`/edge/v1`), for what neither dialect has: an app's verdict on
an answer it got, `POST /edge/v1/feedback`.

    {"request_id": "<ledger row id>" | "chatcmpl-<ledger row id>" | "cmpl-<ledger row id>",
     "rating": "good" | "bad", "reason": "wrong" | "unsafe" | "format" | "incomplete" |
     "slow" | "other" (optional)}

The id is the request's ledger row id, which every generation and embedding answer
carries in `X-Edge-Request-Id` and an OpenAI answer also in its `id` after the prefix (so
an app may send back the `id` it holds); the trace id (`X-Request-Id`) is the client's and
may name many requests, so it is not accepted. Authenticated as every other route, and a
tenant rates only its own requests. Errors are OpenAI's shape (`api.errors`), as on
`/v1`: a bad body is a 400 naming the field, an unknown request a 404. The work is
`gateway.feedback`'s.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from edge_agent.api.auth import authenticate, authenticated
from edge_agent.api.body import read_json, validate
from edge_agent.api.errors import EDGE_PREFIX
from edge_agent.api.openapi import request_body
from edge_agent.api.state import Parts
from edge_agent.gateway.feedback import give_feedback
from edge_agent.ledger.feedback import Rating, Reason

router = APIRouter(prefix=EDGE_PREFIX, dependencies=[Depends(authenticate)])
# An OpenAI answer's id is its kind's prefix and the request's ledger row id.
ANSWER_PREFIXES = ("chatcmpl-", "cmpl-")


class FeedbackBody(BaseModel):
    """A verdict: words from closed sets only, so no app's or user's text is stored."""

    model_config = ConfigDict(extra="forbid")

    request_id: str = Field(min_length=1, max_length=128, description=(
        "The request's ledger row id: the answer's `X-Edge-Request-Id` header, or an "
        "OpenAI answer's `id` (`chatcmpl-…`, `cmpl-…`) as it came."))
    rating: Rating = Field(description="The app's verdict on the answer.")
    reason: Reason | None = Field(None, description="Why, from a closed set (no free text).")


def row_id(request_id: str) -> str:
    """The ledger row id in what the app sent: an OpenAI answer's id without its prefix."""
    for prefix in ANSWER_PREFIXES:
        if request_id.startswith(prefix):
            return request_id.removeprefix(prefix)
    return request_id


@router.post("/feedback", openapi_extra=request_body(FeedbackBody))
async def feedback(request: Request, parts: Parts) -> dict[str, Any]:
    """Keeps the verdict on the request's ledger row (a second one replaces the first:
    `replaced` says so) and counts it; 404 for a request this tenant did not make."""
    body = validate(FeedbackBody, await read_json(request, parts.settings.server.max_body_bytes))
    rated = await give_feedback(parts.ledger, parts.metrics, authenticated(request),
                                row_id(body.request_id), body.rating, body.reason)
    return {"object": "feedback", "request_id": rated.request_id, "model": rated.model,
            "rating": rated.rating, "reason": rated.reason, "created": int(rated.at),
            "replaced": rated.replaced}
