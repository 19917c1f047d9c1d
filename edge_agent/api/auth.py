"""Authentication for both dialects: `Authorization: Bearer <key>` → tenant."""

from __future__ import annotations

from fastapi import Request

from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import note


async def authenticate(request: Request) -> TenantContext:
    governor = request.app.state.parts.governor
    ctx: TenantContext = governor.authenticate(request.headers.get("authorization"))
    request.state.tenant = ctx
    note(tenant=ctx.name, key_prefix=ctx.key_prefix)
    return ctx
