"""`edge-agent models`: install, inspect, verify, switch and remove models.

Each command is a thin layer over `ModelOps`, the same facade the HTTP handlers and the
fleet link use: it takes its arguments, calls one operation and prints the result. A
missing or broken model comes back as an EdgeAgentError, which the root group reports
(exit 1). Changes are recorded in the name's history as `cli:<user>`.
"""

from __future__ import annotations

import getpass
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from edge_agent.cli.common import (
    EXIT_CHECK_FAILED,
    MODEL_NAME,
    BadUsage,
    common_options,
    load,
)
from edge_agent.cli.output import echo_json, json_option, progress, table, transfer_bar
from edge_agent.errors import InvalidRequest, ModelNotFound
from edge_agent.names import ModelName

if TYPE_CHECKING:
    from edge_agent.config import Settings
    from edge_agent.engine.modelops import ModelOps


def _ops() -> ModelOps:
    return _ops_for(load())


def _ops_for(settings: Settings) -> ModelOps:
    from edge_agent.engine.modelops import ModelOps

    return ModelOps.for_settings(settings)


@contextmanager
def _by_hand(settings: Settings, name: str, change: str, force: bool) -> Iterator[None]:
    """The change under the name's claim, refused while a fleet rollout of the name is
    live on this box (`fleet.device.rollout.name_claim.by_hand`)."""
    from edge_agent.fleet.device.rollout.name_claim import by_hand

    with by_hand(settings.state_dir, name, change, force=force):
        yield


force_option = click.option(
    "--force", is_flag=True,
    help="Even while a fleet rollout of the name is under way on this box (its health "
    "gate, if it is switching, may still switch back).")


def _by() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no user name (a container's bare uid)
        return "cli"


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


@click.group()
def models() -> None:
    """Install, inspect, verify, switch and remove models."""


@models.command("list")
@common_options
@json_option()
def models_list(as_json: bool) -> None:
    """List installed models (their active digest) and catalog entries not yet installed."""
    ops = _ops()
    installed = {m.name: m for m in ops.installed()}
    rows: list[dict[str, Any]] = []
    for m in installed.values():
        rows.append({"name": m.name, "installed": True, "size": m.size, "digest": m.digest,
                     "quantization": m.quantization, "tier": m.tier})
    for name, entry in ops.catalog().items():
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
@click.argument("name", type=MODEL_NAME)
@click.option("--template", "only_template", is_flag=True,
              help="Print only the chat template (e.g. for `fleet release add --template`); "
                   "a name not installed here: the catalog's.")
@click.option("--parameters", "only_parameters", is_flag=True,
              help="Print only the default parameters, as JSON (for `--parameters`); a name "
                   "not installed here: the catalog's.")
@json_option()
def models_show(name: ModelName, only_template: bool, only_parameters: bool, as_json: bool) -> None:
    """Show the manifest of a model's active version."""
    if only_template and only_parameters:
        raise BadUsage("--template and --parameters print one thing each; pick one")
    ops = _ops()
    from_catalog = False
    try:
        data = json.loads(ops.show(name).model_dump_json())
    except ModelNotFound:
        # A desk that publishes a catalog model's release installs no model: the template
        # and parameters it needs are the catalog's, which the package carries.
        entry = ops.catalog().get(name)
        if entry is None or not (only_template or only_parameters):
            raise
        data = {"chat_template": entry.chat_template, "parameters": entry.parameters}
        from_catalog = True
    if only_template:
        if not data.get("chat_template") and from_catalog:
            raise InvalidRequest(f"{name}: the catalog gives no chat template: its GGUF "
                                 "carries its own, so its release needs no --template")
        if not data.get("chat_template"):
            raise InvalidRequest(f"{name} has no chat template")
        click.echo(data["chat_template"], nl=not data["chat_template"].endswith("\n"))
        return
    if only_parameters:
        echo_json(data.get("parameters") or {})
        return
    if as_json:
        echo_json(data)
        return
    for key, value in data.items():
        if key == "chat_template" and value:
            value = f"({len(value)} characters, from {data['template_source']})"
        click.echo(f"{key:<18} {value}")


@models.command("pull")
@common_options
@click.argument("name", metavar="NAME[@VERSION]")
@click.option("--activate/--no-activate", default=True, show_default=True,
              help="Make it the version the name serves (else keep it staged).")
@force_option
@json_option()
def models_pull(name: str, activate: bool, force: bool, as_json: bool) -> None:
    """Install NAME from the catalog's package (no network), or the signed release
    NAME@VERSION from the fleet's repository (fleet.artifacts_url, verified through TUF
    against fleet.tuf_root_file; a cut download resumes). In a terminal a bar on stderr
    shows the bytes, the rate and the ETA."""
    if "@" in name:
        _pull_release(*name.rsplit("@", 1), activate=activate, as_json=as_json, force=force)
        return
    key = ModelName.parse(name)
    settings = load()
    with _by_hand(settings, key, "models pull", force):
        m = _ops_for(settings).install_catalog(
            key, progress=None if as_json else progress(f"copying {name}"), by=_by(),
            activate=activate)
    if as_json:
        echo_json({"name": m.name, "digest": m.digest, "size": m.size, "active": activate,
                   "origin": m.origin})
        return
    click.echo(f"installed {m.name} sha256:{m.digest[:12]} ({m.size / 1e6:.0f} MB)"
               + ("" if activate else ", not active"))


def _pull_release(name: str, version: str, *, activate: bool, as_json: bool,
                  force: bool) -> None:
    from edge_agent.fleet.device.release.pull import pull

    settings = load()
    ops = _ops_for(settings)
    bar = transfer_bar(f"{name}@{version}", quiet=as_json)
    try:
        pulled = pull(settings, ops, name, version, by=_by(), activate=activate,
                      progress=bar, force=force)
    finally:
        if bar is not None:
            bar.close()
    m = pulled.model
    if as_json:
        echo_json({"name": m.name, "digest": m.digest, "size": m.size,
                   "release": pulled.ref, "downloaded": pulled.downloaded,
                   "active": pulled.active, "origin": m.origin})
        return
    click.echo(f"{'installed' if pulled.downloaded else 'already installed'} {pulled.ref} "
               f"sha256:{m.digest[:12]} ({m.size / 1e6:.0f} MB)"
               + (", active" if pulled.active else ", not active"))


@models.command("import")
@common_options
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--name", required=True, type=MODEL_NAME,
              help="Name to serve it under, as name:tag.")
@click.option("--activate/--no-activate", default=True, show_default=True,
              help="Make it the version the name serves (else keep it staged).")
@force_option
def models_import(path: Path, name: ModelName, activate: bool, force: bool) -> None:
    """Import a local GGUF file; its header is checked before anything is copied. Under a
    name already installed it becomes a new version of that name."""
    settings = load()
    with _by_hand(settings, name, "models import", force):
        m = _ops_for(settings).import_file(path, name,
                                           progress=progress(f"importing {path.name}"),
                                           by=_by(), activate=activate)
    click.echo(f"imported {m.name} sha256:{m.digest[:12]} ({m.architecture}, "
               f"context {m.context_length}, {m.quantization})"
               + ("" if activate else ", not active"))


@models.command("verify")
@common_options
@click.argument("name", type=MODEL_NAME, required=False)
@click.pass_context
def models_verify(ctx: click.Context, name: ModelName | None) -> None:
    """Check digests and GGUF headers of installed versions (exit 1 on any failure)."""
    failed = 0
    for result in _ops().verify(name):
        m = result.model
        label = m.name if result.active else f"{m.name}@{m.digest[:12]}"
        if result.error is None:
            click.echo(f"ok    {label} sha256:{m.digest[:12]}")
        else:
            failed += 1
            click.echo(f"FAIL  {label}: {result.error}")
    if failed:
        ctx.exit(EXIT_CHECK_FAILED)


@models.command("rm")
@common_options
@click.argument("name", type=MODEL_NAME)
@click.option("--digest", default=None,
              help="Remove only this inactive version (12+ hex digits), not the whole name.")
@force_option
def models_rm(name: ModelName, digest: str | None, force: bool) -> None:
    """Remove an installed model, or one of its versions (a blob goes when no other name
    uses it)."""
    settings = load()
    with _by_hand(settings, name, "models rm", force):
        m = _ops_for(settings).remove(name, digest, by=_by())
    click.echo(f"removed {m.name}" + (f"@{m.digest[:12]}" if digest else ""))


@models.command("activate")
@common_options
@click.argument("name", type=MODEL_NAME)
@click.argument("digest")
@force_option
def models_activate(name: ModelName, digest: str, force: bool) -> None:
    """Switch NAME to an installed DIGEST (in full or 12+ hex digits). Requests already
    running finish on the old version; the next ones get this one."""
    settings = load()
    ops = _ops_for(settings)
    before = ops.show(name).digest
    with _by_hand(settings, name, "models activate", force):
        m = ops.activate(name, digest, by=_by())
    if m.digest == before:
        click.echo(f"{m.name} already serves sha256:{m.digest[:12]}")
    else:
        click.echo(f"{m.name} now serves sha256:{m.digest[:12]} (was {before[:12]})")


@models.command("rollback")
@common_options
@click.argument("name", type=MODEL_NAME)
@force_option
def models_rollback(name: ModelName, force: bool) -> None:
    """Switch NAME back to the version that was active before the current one."""
    settings = load()
    ops = _ops_for(settings)
    before = ops.show(name).digest
    with _by_hand(settings, name, "models rollback", force):
        m = ops.rollback(name, by=_by())
    click.echo(f"{m.name} rolled back to sha256:{m.digest[:12]} (was {before[:12]})")


@models.command("history")
@common_options
@click.argument("name", type=MODEL_NAME)
@click.option("-n", "limit", type=click.IntRange(min=1), default=None,
              help="Only the newest N entries.")
@json_option()
def models_history(name: ModelName, limit: int | None, as_json: bool) -> None:
    """What happened to NAME, newest first: installs, switches (from which digest, when,
    by whom), copies, removals; the versions installed now; and the release evidence of
    each fleet rollout's activation (gate checks with their figures, outcome)."""
    from edge_agent.engine.modelops import ModelOps
    from edge_agent.fleet.protocol.agent_release import is_agent_name
    from edge_agent.ledger.evidence import evidence_for

    settings = load()
    if is_agent_name(name):  # agent releases: their evidence is all there is
        evidence = evidence_for(settings.state_dir / "ledger.db", name, limit)
        if as_json:
            echo_json({"name": name, "versions": [], "history": [], "evidence": evidence})
        else:
            _print_evidence(evidence)
        return
    ops = ModelOps.for_settings(settings)
    entries = ops.history(name, limit)
    try:
        versions = ops.versions(name)
    except ModelNotFound:  # a removed name keeps its history
        versions = []
    evidence = evidence_for(settings.state_dir / "ledger.db", entries[0].name, limit)
    if as_json:
        echo_json({
            "name": entries[0].name,
            "versions": [{"digest": v.digest, "active": v.active,
                          "last_active": v.last_active} for v in versions],
            "history": [{"at": e.at, "action": e.action, "digest": e.digest,
                         "previous": e.previous, "by": e.by, "detail": e.detail}
                        for e in entries],
            "evidence": evidence})
        return
    for v in versions:
        state = "active" if v.active else (
            f"kept, last active {_when(v.last_active)}" if v.last_active else "staged")
        click.echo(f"version sha256:{v.digest[:12]}  {state}")
    table([("WHEN", "<20"), ("ACTION", "<9"), ("DIGEST", "<13"), ("PREVIOUS", "<13"),
           ("BY", "<20"), ("DETAIL", "")],
          ([_when(e.at), e.action, e.digest[:12], (e.previous or "")[:12], e.by, e.detail]
           for e in entries))
    _print_evidence(evidence)


def _print_capacity(parameters: dict[str, Any]) -> None:
    """A capacity release's (or an ungated patch's) settings, before → after."""
    capacity = parameters.get("capacity") or (parameters if parameters.get("ungated") else {})
    before, after = capacity.get("before") or {}, capacity.get("after") or {}
    if not capacity:
        return
    changed = [f"{k} {before.get(k)}→{after.get(k)}" for k in after
               if before.get(k) != after.get(k)]
    label = "UNGATED " if parameters.get("ungated") else "capacity"
    click.echo(f"  {label}  {json.dumps(capacity.get('change'), sort_keys=True)}: "
               + (", ".join(changed) or "no effective change for this model"))


def _print_evidence(rows: list[dict[str, Any]]) -> None:
    """Each activation attempt: what replaced what, on what, how long each state took,
    and every gate check with its figure."""
    from edge_agent.fleet.protocol.rollout_states import STATES

    for ev in rows:
        click.echo("")
        click.echo(f"release evidence {ev['rollout_id']} (attempt {ev['attempt']}): "
                   f"{ev['name']} version {ev['version']} sha256:{ev['digest'][:12]} "
                   f"{ev['outcome']} at {_when(ev['ts'])}")
        if ev.get("reason"):
            click.echo(f"  reason    {ev['reason']}")
        click.echo(f"  previous  sha256:{(ev.get('previous_digest') or '-')[:12]}")
        hw = ev.get("hardware") or {}
        click.echo(f"  agent     {ev['agent_version']}, llama.cpp {ev['llama_cpp_version']}, "
                   f"{hw.get('cpu_count')} CPUs, {(hw.get('ram_bytes') or 0) / 2**30:.1f} GiB "
                   f"RAM, {hw.get('machine', '')}")
        _print_capacity(ev.get("parameters") or {})
        agent = (ev.get("parameters") or {}).get("agent")
        if agent:
            restored = "; ".join(f"{db} {what}" for db, what in
                                 (agent.get("restored") or {}).items())
            click.echo(f"  switch    {agent.get('from')} → {agent.get('to')} (previous "
                       f"{agent.get('previous') or 'the base install'}), "
                       f"{agent.get('boots') or 0} start(s)"
                       + (f", {agent['switch_s']:.0f} s from the switch"
                          if agent.get("switch_s") is not None else "")
                       + (f"; {restored}" if restored else ""))
        timings = ev.get("timings") or {}
        if timings:  # in the order the states come
            order = {state: i for i, state in enumerate(STATES)}
            steps = sorted(timings.items(), key=lambda kv: order.get(kv[0], len(order)))
            click.echo("  timings   " + ", ".join(f"{k} {v:.2f}s" for k, v in steps))
        for c in ev.get("checks") or []:
            limit = f" (limit {c['limit']})" if c.get("limit") is not None else ""
            detail = f"  {c['detail']}" if c.get("detail") else ""
            click.echo(f"  {'ok  ' if c['passed'] else 'FAIL'} {c['name']}: "
                       f"{c['figure']}{limit}{detail}")
