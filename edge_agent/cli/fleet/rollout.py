"""`edge-agent fleet rollout …`: a release to the fleet in waves, with an abort threshold.

    fleet rollout start NAME@VERSION | --agent VERSION [--devices SELECTOR] --waves 1,10%,50%,100%
                        [--abort-above 10%] [--min-executed 3] [--soak 10m]
                        [--device-timeout 2h] [--rollback-on-abort] [--id ID]
                        [--capacity parallel=8,context_length=2048]
    fleet rollout status [ID] [--json] [--watch [SECONDS]]
    fleet rollout pause|resume|abort|rollback ID

These commands go through the controller's API (`client`: to a remote `fleet serve` with
--controller, or in-process on the controller host) and only write its store: the running
`fleet serve` signs and publishes the rollout.* commands (with `command_signing_key_file`),
starts each wave, watches the boxes' reports, soaks, aborts. A rollout written while `fleet
serve` is down starts when it comes back. Thin: the rules are `fleet.controller.waves` and
`fleet.controller.rollouts.operations`, the routes `fleet.controller.rollouts.api`.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click

from edge_agent.cli.common import BadUsage
from edge_agent.cli.fleet.client import (
    ControllerClient,
    client_options,
    controller_client,
    remote,
    segment,
)
from edge_agent.cli.fleet.options import controller_settings, given_options
from edge_agent.cli.output import (
    echo_json,
    is_terminal,
    json_option,
    table,
    transfer_figures,
)

SELECTOR_HELP = ("all (default), fleet:ID, a glob on device ids (store-0*), or device ids; "
                 "comma-separated, their union.")


@click.group("rollout")
def rollout() -> None:
    """Roll a published release out to the fleet in waves (driven by `fleet serve`)."""


def _when(ts: float | None) -> str:
    return "-" if ts is None else time.strftime("%H:%M:%S", time.localtime(ts))


@rollout.command("start")
@client_options
@click.argument("ref", metavar="NAME@VERSION", required=False)
@click.option("--agent", "agent", metavar="VERSION",
              help="An agent release (`fleet release add-agent`) in place of NAME@VERSION: "
                   "edge-agent and its llama.cpp, installed beside the running version, "
                   "switched to, gated, and put back by each box where the gate fails.")
@click.option("--devices", "selector", default="all", show_default=True, help=SELECTOR_HELP)
@click.option("--waves", required=True, metavar="SPEC",
              help="Cumulative targets, counts or percentages of the selected devices, the "
                   "last 100%: 1,10%,50%,100%.")
@click.option("--abort-above", default="10%", show_default=True, metavar="PCT",
              help="Abort once more than this share of the finished devices failed…")
@click.option("--min-executed", type=click.IntRange(min=1), default=3, show_default=True,
              help="…and at least this many devices finished.")
@click.option("--soak", default="0s", show_default=True, metavar="DURATION",
              help="How long a wave's devices stay ACTIVE before the next wave starts "
                   "(90s, 10m, 1h).")
@click.option("--device-timeout", default="2h", show_default=True, metavar="DURATION",
              help="A device with no final state this long after its command was published "
                   "counts as failed (longer than the boxes' maintenance window or "
                   "defer_deadline_s).")
@click.option("--rollback-on-abort", is_flag=True,
              help="On abort, also roll back the devices that switched already.")
@click.option("--id", "rollout_id", help="The rollout's id (default: ro-<random>).")
@click.option("--capacity", metavar="KEY=VALUE,...",
              help="A capacity release: these runtime settings (parallel, context_length, "
                   "threads, prompt_lookup, kv_cache_type, draft_model, draft_tokens), "
                   "staged on the boxes that serve NAME@VERSION and gated by its golden set "
                   "against their own baseline; a failing gate restores the previous "
                   "settings.")
@json_option()
def rollout_start(ref: str | None, agent: str | None, selector: str, waves: str,
                  abort_above: str, min_executed: int, soak: str, device_timeout: str,
                  rollback_on_abort: bool, rollout_id: str | None, capacity: str | None,
                  as_json: bool) -> None:
    """Start rolling NAME@VERSION out (with --capacity: a capacity change gated by it; with
    --agent VERSION: an agent release): written to the store, driven by `fleet serve`."""
    from edge_agent.fleet.controller.waves import parse_waves, wave_sizes

    with controller_client() as api:
        if (ref is None) == (agent is None):
            raise BadUsage("give NAME@VERSION or --agent VERSION, one of the two")
        record = api.post("/rollouts", {
            "release": ref, "agent": agent, "devices": selector, "waves": waves,
            "abort_above": abort_above,
            "min_executed": min_executed, "soak": soak, "device_timeout": device_timeout,
            "rollback_on_abort": rollback_on_abort, "id": rollout_id, "capacity": capacity})
    if as_json:
        echo_json(record)
        return
    sizes = wave_sizes(parse_waves(waves), record["devices_total"])
    click.echo(f"rollout {record['id']}: {record['name']}@{record['version']}"
               f"{_capacity(record)} to "
               f"{record['devices_total']} device(s) in {len(sizes)} wave(s) "
               f"({', '.join(str(n) for n in sizes)}); RUNNING")
    if not remote() and controller_settings().command_signing_key_file is None:
        click.echo("warning: no command_signing_key_file in the controller's settings: fleet serve "
                   "cannot sign the rollout's commands until it has one", err=True)
    click.echo(f"fleet serve drives it; follow it with: edge-agent fleet rollout status "
               f"{record['id']} {given_options()}".rstrip())


WATCH_S, MIN_WATCH_S = 2.0, 0.5


def _watch_args(rollout_id: str | None, watch: str | None) -> tuple[str | None, float | None]:
    """(ID, seconds): `--watch ID` reads as `ID --watch` (an optional value takes the next
    word, and an ID is not a number)."""
    if watch is None:
        return rollout_id, None
    try:
        seconds = float(watch)
    except ValueError:
        if rollout_id is not None:
            raise BadUsage(f"--watch takes seconds, not {watch!r}") from None
        rollout_id, seconds = watch, WATCH_S
    if not MIN_WATCH_S <= seconds < float("inf"):
        raise BadUsage(f"--watch takes at least {MIN_WATCH_S:g} seconds, not {watch}")
    if rollout_id is None:
        raise BadUsage("--watch follows one rollout: give its ID")
    return rollout_id, seconds


@rollout.command("status")
@client_options
@click.argument("rollout_id", metavar="[ID]", required=False)
@json_option()
@click.option("--watch", "watch_arg", is_flag=False, flag_value=str(WATCH_S), default=None,
              metavar="[SECONDS]",
              help=f"Follow one rollout until it ends: redrawn every SECONDS (default "
                   f"{WATCH_S:g}, at least {MIN_WATCH_S:g}) in a terminal; elsewhere (a pipe, "
                   "--json) printed once it has ended.")
def rollout_status(rollout_id: str | None, as_json: bool, watch_arg: str | None) -> None:
    """Rollouts (newest first), or one rollout: counts per state, per wave, per device,
    and the download progress of devices in DOWNLOADING."""
    rollout_id, watch = _watch_args(rollout_id, watch_arg)
    redraw = watch is not None and not as_json and is_terminal(sys.stdout)
    with controller_client() as api:
        if rollout_id is None:
            reports = api.get("/rollouts", limit=50)["rollouts"]
        elif watch is not None:
            reports = [_watch(api, rollout_id, watch, redraw=redraw)]
        else:
            reports = [_report(api, rollout_id)]
    if as_json:
        echo_json(reports if rollout_id is None else reports[0])
        return
    if rollout_id is None:
        table([("ID", "<18"), ("RELEASE", "<24"), ("STATE", "<12"), ("WAVE", "<6"),
               ("DEVICES", ">7"), ("ACTIVE", ">7"), ("FAILED", ">7"), ("CREATED", "")],
              ([r["id"], f"{r['name']}@{r['version']}{' capacity' if r.get('config') else ''}",
                r["state"],
                f"{r['wave']}/{r['waves_total']}", r["devices_total"],
                r["phases"]["succeeded"], r["phases"]["failed"],
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created_at"]))]
               for r in reports))
        return
    if not redraw:  # else the last redraw shows it
        _show(reports[0])


def _report(api: ControllerClient, rollout_id: str) -> dict[str, Any]:
    report: dict[str, Any] = api.get(f"/rollouts/{segment(rollout_id)}")
    return report


def _watch(api: ControllerClient, rollout_id: str, every_s: float, *, redraw: bool
           ) -> dict[str, Any]:
    """The rollout's report once it has ended (no longer RUNNING or PAUSED, and `fleet
    serve` done with it); with `redraw`, the screen shows each report meanwhile."""
    while True:
        report = _report(api, rollout_id)
        if redraw:
            click.clear()
            _show(report)
        if report["settled"] and not report["live"]:
            return report
        time.sleep(every_s)


def _capacity(r: dict[str, Any]) -> str:
    """` capacity parallel=8,context_length=2048` for a capacity release, else nothing."""
    config = r.get("config")
    if not config:
        return ""
    return " capacity " + ",".join(f"{k}={v}" for k, v in config.items())


def _show(r: dict[str, Any]) -> None:
    p = r["policy"]
    why = (r["waiting_for"] or r["reason"]) if r["state"] == "RUNNING" else r["reason"]
    click.echo(f"rollout {r['id']}: {r['name']}@{r['version']}{_capacity(r)}  {r['state']}  wave "
               f"{r['wave']}/{r['waves_total']}" + (f"  ({why})" if why else ""))
    click.echo(f"  devices {r['devices_total']} ({r['selector']}); waves {p['waves']}; "
               f"succeeds unless more than {p['abort_above']} of the finished devices fail "
               f"(judged once {p['judged_after']} finished: --min-executed "
               f"{p['min_executed']}, capped by the devices) and at least one is ACTIVE; soak "
               f"{p['soak']}; device timeout {p['device_timeout']}"
               f"{'; rollback on abort' if p['rollback_on_abort'] else ''}")
    phases = ", ".join(f"{k} {v}" for k, v in r["phases"].items() if v)
    click.echo(f"  {phases}; failed share {r['failed_share']:.0%} of {r['finished']} "
               "finished")
    click.echo("  states: " + ", ".join(f"{k} {v}" for k, v in r["states"].items()))
    for w in r["waves_detail"]:
        click.echo(f"  wave {w['wave']}: {w['devices']} device(s): " + ", ".join(
            f"{k} {v}" for k, v in w["phases"].items()))
    for a in r.get("actions", ()):
        click.echo(f"  {_when(a['at'])} {a['action'].removeprefix('rollout.')} by "
                   f"{a['operator']} ({a['role']}, {a['source']}): "
                   + ("done" if a["status"] < 300 else f"refused {a['status']}: {a['outcome']}"))
    click.echo("")
    table([("DEVICE", "<24"), ("WAVE", ">4"), ("STATE", "<12"), ("PHASE", "<10"),
           ("SENT", "<9"), ("ACTIVE", "<9"), ("PROGRESS", "<25"), ("REASON", "")],
          ([d["device"], d["wave"], (d["outcome"] or d["state"]).upper(), d["phase"],
            _when(d["started_at"]), _when(d["active_at"]), _progress(d["progress"]),
            (d["reason"] or "")[:80]]
           for d in r["devices"]))


def _progress(p: dict[str, Any] | None) -> str:
    """A DOWNLOADING device's latest report: `42%  3.1 MB/s  ETA 0:06`."""
    if p is None:
        return ""
    return transfer_figures(p["bytes"], p["total"], p["rate_bps"], p["eta_s"], sizes=False)


def _act(action: str, rollout_id: str, as_json: bool) -> None:
    with controller_client() as api:
        record = api.post(f"/rollouts/{segment(rollout_id)}/{action}")
    if as_json:
        echo_json(record)
        return
    click.echo(f"rollout {record['id']}: {record['state']} ({record['reason']}); fleet serve "
               "acts on it at its next pass")


def _action(name: str, doc: str) -> None:
    @rollout.command(name, help=doc)
    @client_options
    @click.argument("rollout_id", metavar="ID")
    @json_option()
    def command(rollout_id: str, as_json: bool) -> None:
        _act(name, rollout_id, as_json)


_action("pause", "Start no further wave (devices already sent carry on).")
_action("resume", "Carry on with a paused rollout.")
_action("abort", "Stop: no further wave, devices not yet sent skipped, devices not yet "
                 "switched cancelled (rolled back too with --rollback-on-abort).")
_action("rollback", "Stop, and send rollout.rollback to every device that got the "
                    "release (ACTIVE ones switch back to their previous version).")
