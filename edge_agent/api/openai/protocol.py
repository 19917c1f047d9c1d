"""The OpenAI dialect's wire shapes: request bodies as pydantic models, and the file,
batch and page objects of the Files and Batches resources.

Bodies forbid unknown fields, as OpenAI refuses unknown arguments; `null` is accepted
wherever OpenAI's spec makes a parameter nullable, and means its default. Nothing here
reads a request or knows a route: `serving` takes these bodies, `routes` and the batch
runner make them.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from edge_agent.config import Settings


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool | None = False
    include_obfuscation: bool | None = None


class JsonSchemaFormat(_Body):
    name: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None


class Sampling(_Body):
    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int | None = Field(1, ge=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id: recorded as a keyed digest
    # llama.cpp extensions, as its server accepts them
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repeat_penalty: float | None = Field(None, gt=0)
    timeout_ms: int | None = Field(None, gt=0)  # deadline for this request


class ChatBody(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    safety_identifier: str | None = None  # an end-user id: recorded as a keyed digest
    # Prompt caching: the box caches every prompt prefix in its sequences' KV cells anyway.
    prompt_cache_key: str | None = None  # a hint: prefer the sequence this key used last
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None  # accepted, as a hint
    prompt_cache_options: dict[str, Any] | None = None  # accepted; breakpoints are implicit
    verbosity: str | None = None
    moderation: dict[str, Any] | None = None


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]] | None
    max_tokens: int | None = Field(16, ge=0)
    suffix: str | None = None
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None


class EmbeddingBody(_Body):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, gt=0)
    user: str | None = None


ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class BatchBody(_Body):
    input_file_id: str = Field(min_length=1, max_length=200)
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict[str, Any] | None = None


def new_id(prefix: str) -> str:
    """An object's id as OpenAI's look: `file-…`, `batch_…`, `batch_req_…`."""
    return f"{prefix}{secrets.token_hex(12)}"


def expiry(settings: Settings, created: int) -> int:
    """When a file made at `created` expires: retention (`retention.batch_days`)."""
    return created + int(settings.retention.batch_days * 86400)


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"],
            "created_at": row["created_at"], "expires_at": row["expires_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None}


def batch_object(row: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's batch object from its row."""
    stamps = {key: row.get(key) for key in (
        "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at")}
    errors = json.loads(row["errors"]) if row.get("errors") else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": errors, "input_file_id": row["input_file_id"],
            "completion_window": row["completion_window"], "status": row["status"],
            "output_file_id": row.get("output_file_id"),
            "error_file_id": row.get("error_file_id"), "created_at": row["created_at"],
            "expires_at": row["expires_at"], **stamps,
            "request_counts": {"total": row["total"], "completed": row["completed"],
                               "failed": row["failed"]},
            "metadata": json.loads(row["metadata"]) if row.get("metadata") else None}


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor page: the items after the one with id `after`, `limit` of them."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1:] if after in ids else []
    limit = max(1, min(limit, 10000))
    shown = items[:limit]
    return {"object": "list", "data": shown,
            "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}
