"""`edge-agent keys`: create, list and revoke API keys."""

from __future__ import annotations

import time

import click

from edge_agent.cli.common import BadUsage, CheckFailed, common_options, load
from edge_agent.cli.output import echo_json, json_option, table


@click.group()
def keys() -> None:
    """Create, list and revoke API keys (stored only as hashes)."""


@keys.command("create")
@common_options
@click.option("--tenant", required=True, help="A tenant defined under [tenants.NAME].")
@click.option("--admin", is_flag=True,
              help="An operator key: may also delete, unload and load any model.")
def keys_create(tenant: str, admin: bool) -> None:
    """Create a key for a tenant and print it once; only its hash is kept."""
    from edge_agent.governance.keys import KeyStore

    settings = load()
    if tenant not in settings.tenants:
        known = ", ".join(sorted(settings.tenants)) or "none"
        raise BadUsage(f"tenant '{tenant}' is not in the configuration (tenants: {known})")
    key, record = KeyStore(settings.state_dir).create(tenant, admin=admin)
    click.echo(key)
    kind = "operator key" if admin else "key"
    click.echo(f"created {kind} {record.prefix} for tenant {tenant}; it is shown only once",
               err=True)


@keys.command("list")
@common_options
@json_option()
def keys_list(as_json: bool) -> None:
    """List keys: prefix, tenant, operator (admin) or not, created, last used, revoked."""
    from edge_agent.governance.keys import KeyStore

    records = KeyStore(load().state_dir).list()
    if as_json:
        echo_json([r.__dict__ for r in records])
        return

    def when(ts: float | None) -> str:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "-"

    table([("PREFIX", "<10"), ("TENANT", "<16"), ("ADMIN", "<6"), ("CREATED", "<17"),
           ("LAST USED", "<17"), ("REVOKED", "")],
          ([r.prefix, r.tenant, "yes" if r.admin else "no", when(r.created),
            when(r.last_used), when(r.revoked)] for r in records))


@keys.command("revoke")
@common_options
@click.argument("prefix")
def keys_revoke(prefix: str) -> None:
    """Revoke a key by its prefix (a running server stops accepting it within seconds)."""
    from edge_agent.governance.keys import KeyStore

    if not KeyStore(load().state_dir).revoke(prefix):
        raise CheckFailed(f"no active key with prefix {prefix}")
    click.echo(f"revoked {prefix}")
