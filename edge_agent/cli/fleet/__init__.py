"""`edge-agent fleet`: the central side of the fleet link — run the controller, see the
devices and their metrics, provision the broker, send signed commands. Its rooms mirror
`edge_agent.fleet.controller`: rollouts in waves (`rollout`), signed releases and their
keys (`release`), the API's operators and their tokens (`operators`), and the options they
share (`options`).

The controller has its own settings (`--config`, default
/etc/edge-agent-fleet/controller.toml if present) and state dir, apart from the agent's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from edge_agent.cli.common import EXIT_CHECK_FAILED, BadUsage, CheckFailed
from edge_agent.cli.fleet import (  # modules: their names stay theirs
    models,
    observability,
    operators,
    pki,
    release,
    review,
    rollout,
)
from edge_agent.cli.fleet.client import (
    ControllerClient,
    client_options,
    controller_client,
    segment,
    sending_client,
)
from edge_agent.cli.fleet.options import controller_options, controller_settings, files_options
from edge_agent.cli.output import echo_json, json_option, table
from edge_agent.netaddr import port_holder


@click.group()
def fleet() -> None:
    """The fleet controller: ingest, devices, metrics, broker provisioning."""


# Keys, signed model releases, rollouts in waves and operators: their own modules.
fleet.add_command(release.keygen)
fleet.add_command(release.release)
fleet.add_command(rollout.rollout)
fleet.add_command(operators.operators)
fleet.add_command(operators.audit)
fleet.add_command(models.models)
fleet.add_command(pki.pki)
fleet.add_command(observability.observability)
fleet.add_command(review.review)


@fleet.command("serve")
@controller_options
@click.option("--broker", help="mqtt://host[:port] or mqtts://host[:port].")
@click.option("--username", help="The controller's broker user (default controller).")
@click.option("--password-file", type=click.Path(path_type=Path, dir_okay=False),
              help="File holding the broker password.")
@click.option("--ca-file", type=click.Path(path_type=Path, dir_okay=False),
              help="PEM CA the broker's certificate is checked against (mqtts://).")
@click.option("--host", help="Address of /metrics and the read API (default 127.0.0.1).")
@click.option("--port", type=click.IntRange(0, 65535), help="Their port (default 9464).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True, help="Log level.")
def fleet_serve(broker: str | None, username: str | None, password_file: Path | None,
                ca_file: Path | None, host: str | None, port: int | None,
                log_level: str) -> None:
    """Ingest every device's messages into the store, acknowledge them, serve /metrics."""
    import logging

    from edge_agent.fleet.controller.service import serve

    settings = controller_settings(**{"broker.url": broker, "broker.username": username,
                            "broker.password_file": password_file, "broker.ca_file": ca_file,
                            "http.host": host, "http.port": port})
    if settings.broker.username and settings.broker.password_file is None:
        raise BadUsage(f"no broker password for user {settings.broker.username}: pass "
                       "--password-file (credentials/<user>.txt from fleet broker-config) or "
                       "set broker.password_file")
    settings.broker_password()  # an unreadable password file stops the start, with its name
    holder = port_holder(settings.http.host, settings.http.port)
    if holder is not None:
        raise CheckFailed(f"{settings.http.host}:{settings.http.port} is taken by {holder}: "
                          "stop it, or give fleet serve another --port")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not serve(settings, log_level="warning" if log_level != "debug" else "debug"):
        raise CheckFailed(f"the controller's HTTP server did not start on "
                          f"{settings.http.host}:{settings.http.port} (see the log above)")


@fleet.command("serve-releases")
@files_options
@click.option("--host", help="Address the boxes reach it on (default 0.0.0.0).")
@click.option("--port", type=click.IntRange(1, 65535), help="Its port (default 9465).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True, help="Log level.")
def fleet_serve_releases(host: str | None, port: int | None, log_level: str) -> None:
    """Serve the release repository (state_dir/releases) read-only to the boxes, on a
    listener of its own ([releases]: HTTPS with tls_cert_file and tls_key_file)."""
    import logging

    from edge_agent.fleet.controller.service import serve_releases

    settings = controller_settings(**{"releases.host": host, "releases.port": port})
    holder = port_holder(settings.releases.host, settings.releases.port)
    if holder is not None:
        raise CheckFailed(f"{settings.releases.host}:{settings.releases.port} is taken by "
                          f"{holder}: stop it, or give serve-releases another --port")
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not serve_releases(settings, log_level="warning" if log_level != "debug" else "debug"):
        raise CheckFailed(f"the release server did not start on {settings.releases.host}:"
                          f"{settings.releases.port} (see the log above)")


def _ago(ts: float | None) -> str:
    if ts is None:
        return "-"
    age = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if age >= size:
            return f"{age / size:.0f}{unit} ago"
    return f"{age:.0f}s ago"


@fleet.group("devices", invoke_without_command=True)
@client_options
@json_option()
@click.pass_context
def fleet_devices(ctx: click.Context, as_json: bool) -> None:
    """Devices: online or offline (or retired), last seen, versions, loss accounting (seqs
    missing and duplicates dropped, over every boot; the outbox backlog the box last
    reported), active models (name@digest, as the box last said: its birth, or a
    models.state event after any change). --json has the ranges per boot: highest seq,
    gaps, dropped, retired. `retire` and `restore` take a box out of service and back;
    `register` lists boxes expected before they report (never seen, until they do)."""
    if ctx.invoked_subcommand is not None:
        return
    with controller_client() as api:
        devices = api.get("/devices")["devices"]
    if as_json:
        echo_json(devices)
        return
    table([("DEVICE", "<20"), ("FLEET", "<12"), ("STATUS", "<8"), ("LAST SEEN", "<10"),
           ("AGENT", "<8"), ("LLAMA.CPP", "<10"), ("LOSS", "<22"), ("OUTBOX", "<8"),
           ("ACTIVE MODELS", "")],
          ([d["device"], d["fleet"],
            _status(d),
            _ago(d["last_seen"]), d["agent_version"] or "-", d["llama_cpp_version"] or "-",
            _loss(d["loss"]), str((d["loss"]["outbox"] or {}).get("depth", "-")),
            ",".join(f"{m['name']}@{m['digest'][:12]}" for m in d["models"]
                     if m.get("active")) or "-"] for d in devices))
    gapped = [d["device"] for d in devices if d["loss"]["missing"]]
    if gapped:
        click.echo(f"\n{len(gapped)} device(s) with gaps (messages lost): {', '.join(gapped)}; "
                   "fleet devices --json lists the ranges per boot")


@fleet_devices.command("agents")
@client_options
@json_option()
def devices_agents(as_json: bool) -> None:
    """Which boxes run which agent: the devices counted by agent and llama.cpp version (as
    each last said at its birth), online ones apart; retired boxes left out."""
    with controller_client() as api:
        devices = api.get("/devices")["devices"]
    counts: dict[tuple[str, str], list[int]] = {}
    for d in devices:
        if d.get("retired") or d.get("never_seen"):
            continue
        key = (d["agent_version"] or "-", d["llama_cpp_version"] or "-")
        seen = counts.setdefault(key, [0, 0])
        seen[0] += 1
        seen[1] += bool(d["online"])
    rows = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[0]))
    if as_json:
        echo_json([{"agent_version": a, "llama_cpp_version": ll, "devices": n,
                    "online": on} for (a, ll), (n, on) in rows])
        return
    table([("AGENT", "<12"), ("LLAMA.CPP", "<10"), ("DEVICES", ">8"), ("ONLINE", ">8")],
          ([a, ll, n, on] for (a, ll), (n, on) in rows))


def _status(d: dict[str, Any]) -> str:
    if d.get("never_seen"):
        return "never seen"
    return "retired" if d.get("retired") else "online" if d["online"] else "offline"


@fleet_devices.command("register")
@client_options
@click.argument("devices", nargs=-1, required=True)
@click.option("--fleet", "fleet_id", default="default", show_default=True,
              help="The fleet they are configured with (as fleet broker-config's --fleet).")
@json_option()
def devices_register(devices: tuple[str, ...], fleet_id: str, as_json: bool) -> None:
    """Expect DEVICE(s) before they first report (admin): listed as never seen until
    their first birth, rollouts take them from then on. A registration already there is
    kept as it was."""
    with controller_client(create=True) as api:  # before the first start, as operators
        answer = api.post("/devices", {"devices": list(devices), "fleet": fleet_id})
    if as_json:
        echo_json(answer)
        return
    click.echo(f"registered {len(answer['registered'])} device(s) in fleet {fleet_id}"
               + (f": {', '.join(answer['registered'])}" if answer["registered"] else "")
               + (f"; registered already: {', '.join(answer['known'])}"
                  if answer["known"] else ""))


@fleet_devices.command("unregister")
@client_options
@click.argument("device")
def devices_unregister(device: str) -> None:
    """Expect DEVICE no more (admin); its history, if it reported, stays."""
    with controller_client() as api:
        api.post(f"/devices/{segment(device)}/unregister")
    click.echo(f"unregistered {device}")


def _retirement(device: str, retire: bool) -> None:
    with controller_client() as api:
        found = api.post(f"/devices/{segment(device)}/{'retire' if retire else 'restore'}")
    if retire:
        click.echo(f"retired {device}: kept in the store, left out of every rollout; its "
                   "broker password still works until the broker's files are made again "
                   "without it (fleet broker-config)")
    else:
        click.echo(f"restored {device}: {'online' if found['online'] else 'offline'}, "
                   "selectable by rollouts again")


@fleet_devices.command("retire")
@client_options
@click.argument("device")
def devices_retire(device: str) -> None:
    """Take DEVICE out of service (admin): its history stays, rollouts leave it out."""
    _retirement(device, True)


@fleet_devices.command("restore")
@client_options
@click.argument("device")
def devices_restore(device: str) -> None:
    """Put a retired DEVICE back in service (admin)."""
    _retirement(device, False)


def _loss(loss: dict[str, Any]) -> str:
    """The LOSS column: `none`, or the seqs missing, and the duplicates dropped."""
    missing = f"{loss['missing']} MISSING" if loss["missing"] else "none"
    return f"{missing}, {loss['duplicates']} dup" if loss["duplicates"] else missing


def _flatten(value: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(value, dict):
        return [kv for key, sub in value.items()
                for kv in _flatten(sub, f"{prefix}.{key}" if prefix else str(key))]
    return [(prefix, json.dumps(value) if isinstance(value, (list, type(None))) else value)]


@fleet.command("controllers")
@client_options
@json_option()
def fleet_controllers(as_json: bool) -> None:
    """Every `fleet serve` of the store: which leads (runs the rollout engine and
    retention) and since when, which follow, which stopped answering."""
    with controller_client() as api:
        found = api.get("/controllers")["controllers"]
    if as_json:
        echo_json(found)
        return
    table([("CONTROLLER", "<24"), ("STATE", "<9"), ("SINCE", "<10"), ("LAST SEEN", "<10"),
           ("HOST", "<16"), ("PID", "")],
          ([c["controller"], c["state"],
            _ago(c["leader_since"] if c["state"] == "leader" else c["started"]),
            _ago(c["last_seen"]), c["host"] or "-", c["pid"] or "-"] for c in found))
    if not found:
        click.echo("no controller has run on this store yet (fleet serve)")


@fleet.command("metrics")
@client_options
@click.argument("device", required=False)
@click.option("--all", "all_devices", is_flag=True, help="Every device's latest metrics.")
@json_option()
def fleet_metrics(device: str | None, all_devices: bool, as_json: bool) -> None:
    """A device's latest metrics message (or every device's with --all)."""
    with controller_client() as api:  # the settings first: their errors before the usage's
        if (device is None) == (not all_devices):
            raise BadUsage("name one DEVICE, or --all")
        if device is not None:
            found = api.get(f"/devices/{segment(device)}/metrics", limit=1)["metrics"]
            latest: list[dict[str, Any]] = [{"device": device,
                                             "metrics": found[0] if found else None}]
        else:
            latest = api.get("/latest-metrics")["devices"]
    if as_json:
        echo_json(latest if all_devices else latest[0])
        return
    for entry in latest:
        found = entry["metrics"]
        if found is None:
            click.echo(f"{entry['device']}: no metrics yet")
            continue
        click.echo(f"{entry['device']}  (boot {found['boot_id'][:8]}, seq {found['seq']}, "
                   f"{_ago(found['ts'])})")
        for key, value in _flatten(found["body"]):
            click.echo(f"  {key:<40} {value}")


@fleet.command("feedback")
@client_options
@click.option("--since", default="1d", show_default=True,
              help="Only verdicts since then: 1h (ago), 2026-12-01T08:00, or Unix seconds.")
@click.option("--device", help="Only this device's.")
@json_option()
def fleet_feedback(since: str, device: str | None, as_json: bool) -> None:
    """The verdicts apps sent back on the boxes' answers (good, bad), per device and
    model, as the boxes' metrics messages carried them."""
    start = operators.since_time(since)
    with controller_client() as api:
        found = api.get("/feedback", since=start, device=device)["feedback"]
    if as_json:
        echo_json(found)
        return
    table([("DEVICE", "<24"), ("FLEET", "<12"), ("MODEL", "<32"), ("GOOD", ">6"),
           ("BAD", ">6"), ("BAD %", ">6")],
          ([f["device"], f["fleet"], f["model"], f["good"], f["bad"],
            f"{100 * f['bad'] / (f['good'] + f['bad']):.0f}"] for f in found))
    if not found:
        click.echo("no verdicts in that window")


@fleet.command("broker-config")
@click.option("--devices", "devices_file", required=True,
              type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Text file: one device id per line (# comments, blank lines ignored).")
@click.option("--out", required=True, type=click.Path(path_type=Path, file_okay=False),
              help="Folder for passwd, acl, mosquitto.conf and credentials/.")
@click.option("--fleet", "fleet_id", default="default", show_default=True,
              help="The fleet id the devices are configured with.")
@click.option("--controller-user", default="controller", show_default=True,
              help="The controller's broker user (read-write edge/v1/#).")
@click.option("--tls-cert", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Server certificate (PEM): adds a TLS listener.")
@click.option("--tls-key", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="Its private key (PEM).")
@click.option("--ca", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="CA for client certificates on the TLS listener: every client there "
                   "must show one it signed, besides its password (optional).")
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="Address of the plain listener (passwords cross it in clear).")
@click.option("--port", type=click.IntRange(1, 65535), default=1883, show_default=True,
              help="Port of the plain listener.")
@click.option("--tls-bind", default="", help="Address of the TLS listener (default: all).")
@click.option("--tls-port", type=click.IntRange(1, 65535), default=8883, show_default=True,
              help="Port of the TLS listener.")
@click.option("--data-dir", type=click.Path(path_type=Path, file_okay=False),
              default=Path("/var/lib/mosquitto"), show_default=True,
              help="Mosquitto's persistence folder.")
@click.option("--autosave-interval", type=click.IntRange(1), default=60, show_default=True,
              help="Seconds between Mosquitto's saves of its queues.")
@click.option("--conf-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Where passwd and acl will be on the broker host (default: --out).")
@click.option("--region", "regions", multiple=True, metavar="USER=DEVICES_FILE",
              help="The central broker: a region's bridge user and its devices (they "
                   "connect to the region's broker, bridged here). Repeatable.")
@click.option("--uplink", metavar="URL", help="A region's broker: the central broker "
              "(mqtt://HOST:PORT or mqtts://…) to bridge to.")
@click.option("--uplink-user", help="The bridge's user on the central broker (its --region).")
@click.option("--uplink-password-file", type=click.Path(path_type=Path, dir_okay=False,
                                                        exists=True),
              help="Its password (credentials/USER.txt of the central broker's run).")
@click.option("--uplink-ca", type=click.Path(path_type=Path, dir_okay=False, exists=True),
              help="The central broker's CA for mqtts:// (default: the system's).")
@json_option()
def fleet_broker_config(devices_file: Path, out: Path, fleet_id: str, controller_user: str,
                        tls_cert: Path | None, tls_key: Path | None, ca: Path | None,
                        bind: str, port: int, tls_bind: str, tls_port: int, data_dir: Path,
                        autosave_interval: int, conf_dir: Path | None,
                        regions: tuple[str, ...], uplink: str | None, uplink_user: str | None,
                        uplink_password_file: Path | None, uplink_ca: Path | None,
                        as_json: bool) -> None:
    """Write a Mosquitto passwd, ACL and config for a fleet, and each device's password;
    for a central broker, its regions' bridge users (--region); for a region's broker, its
    bridge to the central one (--uplink)."""
    from edge_agent.fleet.controller.broker import (
        BrokerPlan,
        TLSFiles,
        check_plan,
        read_devices,
        uplink_of,
        write_broker_config,
    )

    if (tls_cert is None) != (tls_key is None):
        raise BadUsage("--tls-cert and --tls-key go together")
    if ca is not None and tls_cert is None:
        raise BadUsage("--ca needs --tls-cert and --tls-key")
    tls = None if tls_cert is None or tls_key is None else TLSFiles(
        tls_cert.absolute(), tls_key.absolute(), ca.absolute() if ca else None)
    bridged = []
    for region in regions:
        user, sep, devices_path = region.partition("=")
        if not sep or not user or not devices_path:
            raise BadUsage(f"--region {region!r}: USER=DEVICES_FILE")
        bridged.append((user, read_devices(Path(devices_path))))
    up = None
    if uplink is not None or uplink_user is not None or uplink_password_file is not None:
        if uplink is None or uplink_user is None or uplink_password_file is None:
            raise BadUsage("--uplink, --uplink-user and --uplink-password-file go together")
        up = uplink_of(uplink, uplink_user, uplink_password_file, uplink_ca)
    plan = BrokerPlan(fleet=fleet_id, devices=read_devices(devices_file),
                      controller_user=controller_user, bind=bind, port=port, tls=tls,
                      tls_bind=tls_bind, tls_port=tls_port, data_dir=data_dir.absolute(),
                      autosave_interval=autosave_interval,
                      conf_dir=conf_dir.absolute() if conf_dir else None,
                      regions=tuple(bridged), uplink=up)
    check_plan(plan)  # before anything is written
    files = write_broker_config(plan, out)
    summary = {"fleet": fleet_id, "devices": list(plan.devices), "passwd": str(files.passwd),
               "acl": str(files.acl), "conf": str(files.conf),
               "credentials": {u: str(p) for u, p in files.credentials.items()},
               "new_passwords": files.new_passwords}
    address, listen = (tls_bind, tls_port) if tls else (bind, port)
    holder = port_holder(address or "0.0.0.0", listen)
    if holder is not None:  # Debian's mosquitto.service, most often: say so before it bites
        click.echo(f"note: {address or '*'}:{listen} is taken by {holder}; a broker started "
                   "with this config would fail to listen. Stop that one (Debian's: systemctl "
                   "disable --now mosquitto) or write the config again with another --port",
                   err=True)
    if as_json:
        echo_json(summary)
        return
    click.echo(f"fleet {fleet_id}: {len(plan.devices)} devices and user {controller_user}; "
               f"{len(files.new_passwords)} new passwords")
    for user, devices in plan.regions:
        click.echo(f"region bridge user {user}: {len(devices)} devices, through its "
                   "region's broker (fleet broker-config there with --uplink)")
    if up is not None:
        click.echo(f"bridged to {uplink} as {up.user} (mosquitto.conf holds its password: "
                   "mode 0600)")
    for path in (files.passwd, files.acl, files.conf):
        click.echo(f"wrote {path}")
    click.echo(f"wrote {out.absolute() / 'credentials'}/<user>.txt (mode 0600): copy each "
               "device's file to its box, as fleet.password_file")
    click.echo("a running broker reads passwd and acl again on SIGHUP: kill -HUP $(pidof "
               "mosquitto); a changed listener, TLS or persistence line needs a restart "
               "(passwd, acl and mosquitto.conf keep the owner and mode they had)")
    scheme, listen = ("mqtts", tls_port) if tls else ("mqtt", port)
    click.echo(f"\non each box ([fleet] in its config.toml):\n  enabled = true\n"
               f"  broker = \"{scheme}://<broker host>:{listen}\"\n  fleet_id = \"{fleet_id}\"\n"
               f"  device_id = \"<its id>\"\n  username = \"<its id>\"\n"
               f"  password_file = \"/etc/edge-agent/fleet/password\"")


class _ListsCommandTypes(click.Command):
    """`fleet send`'s help ends with the command types, read from their registry when the
    help is shown (so a type added there is listed, and `edge-agent` starts no slower)."""

    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from edge_agent.fleet.protocol.command_types import COMMAND_TYPES, shape

        with formatter.section("Types (args; the least role that may send it)"):
            formatter.write_dl([
                (t.name, f"{t.description} Args {shape(t.args)}; {t.role}.")
                for t in COMMAND_TYPES.values()])


@fleet.command("send", cls=_ListsCommandTypes)
@client_options
@click.argument("words", nargs=-1, required=True, metavar="DEVICE|--all TYPE")
@click.option("--all", "all_devices", is_flag=True,
              help="The whole fleet (its `all` stream); waits for every online device.")
@click.option("--fleet", "fleet_id", help="The fleet (default: the device's, as it reported).")
@click.option("--arg", "args", multiple=True, metavar="KEY=VALUE",
              help="A command argument; VALUE is read as JSON when it parses, else text.")
@click.option("--args-json", help="All arguments as one JSON object.")
@click.option("--ungated", is_flag=True,
              help="config.patch only: let it set capacity settings (parallel, "
                   "context_length, …) outside the release gate; marked so in the box's "
                   "evidence and the audit trail. Without it they are refused: ship them "
                   "with fleet rollout start --capacity.")
@click.option("--key", "key_file", type=click.Path(path_type=Path, dir_okay=False),
              help="The signing key (default: command_signing_key_file in the controller "
                   "config); on the controller host only: through --controller, the "
                   "controller signs with its own.")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=30.0,
              show_default=True, help="Seconds to wait for results (0: do not wait).")
@click.option("--broker", help="mqtt://host[:port] or mqtts://host[:port] (controller host).")
@click.option("--username", help="The controller's broker user (default controller).")
@click.option("--password-file", type=click.Path(path_type=Path, dir_okay=False),
              help="File holding that user's password.")
@json_option()
@click.pass_context
def fleet_send(ctx: click.Context, words: tuple[str, ...], all_devices: bool,
               fleet_id: str | None, args: tuple[str, ...], args_json: str | None,
               ungated: bool, key_file: Path | None, wait_s: float, broker: str | None,
               username: str | None, password_file: Path | None, as_json: bool) -> None:
    """Sign a command of TYPE, publish it to DEVICE (or --all) and print the results the
    boxes send back (exit 1 unless every awaited box answered ok). Results are stored by the
    running `fleet serve`. The types are listed below."""
    client = sending_client(key_file, broker, username, password_file)  # settings first
    if len(words) != (1 if all_devices else 2):
        raise BadUsage("name one DEVICE (or --all), then the command's TYPE")
    device, type_ = (None, words[0]) if all_devices else (words[0], words[1])
    command_args = _command_args(args, args_json)
    if ungated:
        if type_ != "config.patch":
            raise BadUsage("--ungated is for config.patch only")
        command_args["ungated"] = True
    body = {"device": device, "all": all_devices, "type": type_,
            "args": command_args, "fleet": fleet_id, "wait_s": 0}
    with client as api:
        sent = api.post("/commands", body)
        results = _results(api, sent, wait_s)
    target = "all" if all_devices else str(device)
    missing = sorted(set(sent["missing"]) - {r["device"] for r in results})
    if as_json:
        echo_json({"command": sent["command"], "results": results, "missing": missing})
    else:
        click.echo(f"sent {type_} {sent['command']['id']} (seq {sent['command']['seq']}) to "
                   f"{target} in fleet {sent['command']['fleet']}")
        for r in results:
            detail = r["reason"] or json.dumps(r["result"], sort_keys=True)
            click.echo(f"{r['device']:<24} {r['status']:<8} {detail}")
        for name in missing:
            click.echo(f"{name:<24} {'no answer' if wait_s else 'not awaited'}")
    if wait_s and (missing or any(r["status"] != "ok" for r in results)):
        ctx.exit(EXIT_CHECK_FAILED)


def _results(api: ControllerClient, sent: dict[str, Any], wait_s: float,
             poll_s: float = 0.2) -> list[dict[str, Any]]:
    """The results stored so far, once every awaited device answered or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    expected = set(sent["missing"])
    while True:
        if not wait_s:
            return []
        results: list[dict[str, Any]] = api.get(
            f"/commands/{segment(sent['command']['id'])}")["results"]
        if {r["device"] for r in results} >= expected or time.monotonic() >= deadline:
            return results
        time.sleep(poll_s)


def _command_args(pairs: tuple[str, ...], raw: str | None) -> dict[str, Any]:
    args: dict[str, Any] = {}
    if raw is not None:
        try:
            parsed = json.loads(raw)
        except ValueError as exc:
            raise BadUsage(f"--args-json is not JSON: {exc}") from None
        if not isinstance(parsed, dict):
            raise BadUsage("--args-json must be a JSON object")
        args.update(parsed)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise BadUsage(f"--arg {pair!r} is not KEY=VALUE")
        try:
            args[key] = json.loads(value)
        except ValueError:
            args[key] = value
    return args
