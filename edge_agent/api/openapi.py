"""Request bodies in the OpenAPI document, from the same pydantic models that validate them.

Bodies are read and validated by hand (`edge_agent.api.body`), so that every failure is a 400
in the dialect's own shape; FastAPI therefore sees no body parameter and would publish none.
`request_body` puts the model's JSON schema back into the route's `openapi_extra`, so the
document at /openapi.json describes what the server really accepts: clients can generate
code from it and the fuzz tests generate requests from it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

_DEFS = "$defs"
_REF_PREFIX = f"#/{_DEFS}/"


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema with its `$defs` written in place.

    Pydantic refers to nested models as `#/$defs/Name`; inside an OpenAPI document `#`
    is the document, not the schema, so the references would dangle. The body models are
    not recursive, which makes inlining safe and keeps each operation self-contained (the
    two dialects have models of the same name). Keys whose value is null (`"default":
    null`) are left out, as FastAPI leaves them out of the published document.
    """
    schema = model.model_json_schema(mode="validation")
    defs = schema.pop(_DEFS, {})
    return _inline(schema, defs, ())


def _inline(node: Any, defs: dict[str, Any], seen: tuple[str, ...]) -> Any:
    if isinstance(node, list):
        return [_inline(v, defs, seen) for v in node]
    if not isinstance(node, dict):
        return node
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith(_REF_PREFIX):
        name = ref.removeprefix(_REF_PREFIX)
        if name in seen:
            raise ValueError(f"recursive body model {name} cannot be inlined")
        rest = {k: v for k, v in node.items() if k != "$ref"}
        return {**_inline(defs[name], defs, (*seen, name)), **_inline(rest, defs, seen)}
    return {k: _inline(v, defs, seen) for k, v in node.items() if v is not None}


def request_body(model: type[BaseModel], *, required: bool = True) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body `model` validates."""
    return {"requestBody": {"required": required, "content": {
        "application/json": {"schema": body_schema(model)}}}}
