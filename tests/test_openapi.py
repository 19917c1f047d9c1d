"""The OpenAPI document describes the request bodies the handlers really read."""

from __future__ import annotations

from edge_agent.app import create_app
from edge_agent.config import load_settings


def test_every_body_taking_route_documents_its_body() -> None:
    doc = create_app(load_settings(None), preload=False).openapi()
    with_body = {f"{method.upper()} {path}": op for path, item in doc["paths"].items()
                 for method, op in item.items() if "requestBody" in op}
    assert {"POST /api/chat", "POST /api/generate", "POST /api/embed", "POST /api/embeddings",
            "POST /api/show", "POST /api/pull", "DELETE /api/delete",
            "POST /v1/chat/completions", "POST /v1/completions",
            "POST /v1/embeddings"} <= set(with_body)
    chat = with_body["POST /v1/chat/completions"]["requestBody"]["content"]
    schema = chat["application/json"]["schema"]
    assert {"model", "messages"} <= set(schema["required"])
    assert "response_format" in schema["properties"]
