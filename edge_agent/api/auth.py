"""Authentication for both dialects: `Authorization: Bearer <key>` → tenant."""

from __future__ import annotations

from fastapi import Request

from edge_agent.governance.tenants import TenantContext
from edge_agent.logs import note


async def authenticate(request: Request) -> TenantContext:
    """Every header named Authorization goes to the governor, so that two of them (which
    one wins differs between proxies and servers) are refused instead of one being picked."""
    governor = request.app.state.parts.governor
    ctx: TenantContext = governor.authenticate(request.headers.getlist("authorization"))
    request.state.tenant = ctx
    note(tenant=ctx.name, key_prefix=ctx.key_prefix)
    return ctx


def tenant_of(request: Request) -> TenantContext | None:
    """The tenant `authenticate` found for this request (None where no route needed one)."""
    return getattr(request.state, "tenant", None)


def authenticated(request: Request) -> TenantContext:
    """The tenant of a route behind `authenticate` (there is always one)."""
    ctx: TenantContext = request.state.tenant
    return ctx
