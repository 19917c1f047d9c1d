"""The operator's side of controller rollouts: select the devices, check the release,
write a new rollout into the store; pause, resume, abort, roll back; and the status report.

These only write the store: the rollout engine inside the running `fleet serve`
(`controller.rollouts`) signs and publishes every command at its next tick. So
`fleet rollout …` works the same from any machine that reaches the store, and a rollout
written while `fleet serve` is down starts when it comes back.

A release's stage limits the selection (`controller.rings`): a rollout that would reach a
box of a fleet its stage may not go to is refused, naming the boxes, never narrowed.

Selectors (`--devices`), comma-separated, their union; a retired box is never selected:
    all          every device that ever reported to this controller (the default)
    fleet:ID     the devices of fleet ID
    store-0*     a glob on device ids (`*`, `?`, `[…]`)
    store-042    a device id (one this controller knows)
"""

from __future__ import annotations

import fnmatch
import re
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from edge_agent.errors import Conflict, InvalidRequest
from edge_agent.fleet.controller.audit import AuditEntry
from edge_agent.fleet.controller.releases.readiness import refusal
from edge_agent.fleet.controller.releases.repository import ReleaseRepository, releases_dir
from edge_agent.fleet.controller.rings import Rings
from edge_agent.fleet.controller.rollout_records import DeviceRecord, NewRollout, RolloutRecord
from edge_agent.fleet.controller.store import ControllerStore
from edge_agent.fleet.controller.waves import (
    ABORTED,
    COMPLETED,
    LIVE,
    PAUSED,
    RUNNING,
    Policy,
    assign_waves,
    decide,
    device_counts,
    format_duration,
    needed_to_judge,
    parse_duration,
    parse_share,
    parse_waves,
    phase,
    tally,
)
from edge_agent.fleet.protocol.agent_release import AGENT_NAME, is_agent_name
from edge_agent.fleet.protocol.command_types import CAPACITY_KEYS, BadArgs, lookup
from edge_agent.fleet.protocol.ids import ROLLOUT_ID, ROLLOUT_ID_RULE, VERSION, check_id
from edge_agent.fleet.protocol.rollout_states import ROLLED_BACK
from edge_agent.names import ModelName

_GLOB = re.compile(r"[*?\[]")

# action: (the state it leads to, the states it applies to)
ACTIONS: dict[str, tuple[str, frozenset[str]]] = {
    "pause": (PAUSED, frozenset({RUNNING})),
    "resume": (RUNNING, frozenset({PAUSED})),
    "abort": (ABORTED, frozenset({RUNNING, PAUSED})),
    "rollback": (ROLLED_BACK, frozenset({RUNNING, PAUSED, ABORTED, COMPLETED})),
}


def parse_ref(ref: str) -> tuple[str, str]:
    """`gemma3:270m@2` → ("gemma3:270m", "2"), the name normalized."""
    name, sep, version = ref.rpartition("@")
    if not sep or not name or not VERSION.fullmatch(version):
        raise InvalidRequest(f"{ref!r} is not NAME@VERSION (e.g. gemma3:270m@2)",
                             param="release")
    return ModelName.parse(name), version


def select_devices(known: Iterable[Mapping[str, Any]], selector: str) -> dict[str, str]:
    """The devices a selector names (module docstring), each with its fleet."""
    retired = {str(d["device"]) for d in known if d.get("retired")}
    fleets = {str(d["device"]): str(d["fleet"]) for d in known if str(d["device"]) not in retired}
    chosen: set[str] = set()
    unknown: list[str] = []
    items = [item.strip() for item in selector.split(",")]
    if not selector.strip() or any(not item for item in items):
        raise InvalidRequest(f"--devices {selector!r}: all, fleet:ID, a glob or ids, "
                             "comma-separated", param="devices")
    for item in items:
        if item == "all":
            chosen.update(fleets)
        elif item.startswith("fleet:"):
            fleet = item.removeprefix("fleet:")
            chosen.update(d for d, f in fleets.items() if f == fleet)
        elif _GLOB.search(item):
            chosen.update(fnmatch.filter(fleets, item))
        else:
            try:
                check_id("device", item)
            except ValueError as exc:
                raise InvalidRequest(str(exc), param="devices") from None
            if item in fleets:
                chosen.add(item)
            elif item in retired:
                raise InvalidRequest(f"{item} is retired (fleet devices restore {item} first)",
                                     param="devices")
            else:
                unknown.append(item)
    if unknown:
        raise InvalidRequest(f"never reported to this controller: {', '.join(unknown)}",
                             param="devices")
    if not chosen:
        raise InvalidRequest(f"--devices {selector!r} selects no device", param="devices")
    return {d: fleets[d] for d in sorted(chosen)}


def policy(waves: str, *, abort_above: str = "10%", min_executed: int = 3, soak: str = "0s",
           device_timeout: str = "2h", rollback_on_abort: bool = False) -> Policy:
    """A rollout's policy from the words an operator gives (`fleet rollout start`'s options,
    the API's fields), checked by one set of rules: InvalidRequest naming the option."""
    return Policy(parse_waves(waves), parse_share(abort_above), min_executed,
                  parse_duration(soak), parse_duration(device_timeout, param="device_timeout"),
                  rollback_on_abort)


def parse_capacity(text: str) -> dict[str, int | str]:
    """`parallel=8,context_length=2048` → {"parallel": 8, "context_length": 2048}: the
    capacity settings a capacity release ships (`protocol.command_types.CAPACITY_KEYS`), a
    whole number read as one; their bounds are the box's to check."""
    out: dict[str, int | str] = {}
    for item in (p.strip() for p in text.split(",")):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise InvalidRequest(f"--capacity {text!r}: KEY=VALUE,… such as "
                                 "parallel=8,context_length=2048", param="capacity")
        if key not in CAPACITY_KEYS:
            raise InvalidRequest(f"--capacity: {key!r} is not a capacity setting (one of "
                                 f"{', '.join(CAPACITY_KEYS)})", param="capacity")
        if key in out:
            raise InvalidRequest(f"--capacity: {key} given twice", param="capacity")
        out[key] = int(value) if re.fullmatch(r"\d{1,12}", value) else value
    try:
        lookup("rollout.start").check_args({"rollout_id": "r", "name": "m", "version": "1",
                                            "config": out})
    except BadArgs as exc:
        raise InvalidRequest(f"--capacity: {exc}", param="capacity") from None
    return out


def start(store: ControllerStore, state_dir: Path, ref: str, selector: str, policy: Policy, *,
          now: float, rollout_id: str | None = None,
          capacity: Mapping[str, Any] | None = None, rings: Rings | None = None
          ) -> RolloutRecord:
    """A new RUNNING rollout of a published release (ModelNotFound if the controller's
    repository does not list it; RolloutConflict while another of the name is live);
    with `capacity`, a capacity release of those settings, gated by that release's
    golden set on the boxes that serve it. Refused (Conflict, naming what is wrong) when
    the release lacks what its stage asks (`releases.readiness`: a release published
    before the rule, or whose rollback target is gone) or the selection reaches a box its
    stage may not go to (`rings`: `[stages]` of the settings, None: every fleet takes every
    stage)."""
    name, version = parse_ref(ref)
    if is_agent_name(name):
        raise InvalidRequest(f"{AGENT_NAME.given} is an agent release: --agent {version}",
                             param="release")
    repo = ReleaseRepository(releases_dir(state_dir))
    manifest = repo.get(name, version).manifest
    unready = refusal(manifest, {e.target_path for e in repo.releases()})
    if unready is not None:
        raise Conflict(unready)

    def stage_allows(devices: Mapping[str, str]) -> None:
        outside = (rings or Rings()).refusal(manifest.ref, manifest.stage, selector, devices)
        if outside is not None:
            raise Conflict(outside)

    return _create(store, name, version, selector, policy, now=now, rollout_id=rollout_id,
                   capacity=capacity, allowed=stage_allows)


def start_agent(store: ControllerStore, state_dir: Path, version: str, selector: str,
                policy: Policy, *, now: float, rollout_id: str | None = None
                ) -> RolloutRecord:
    """A new RUNNING rollout of a published agent release, under the reserved name
    (`protocol.agent_release.AGENT_NAME`: one agent rollout live at a time). Each box
    checks the release against its own platform before it downloads anything."""
    ReleaseRepository(releases_dir(state_dir)).agent(version)
    return _create(store, AGENT_NAME, version, selector, policy, now=now,
                   rollout_id=rollout_id)


def _create(store: ControllerStore, name: str, version: str, selector: str, policy: Policy,
            *, now: float, rollout_id: str | None,
            capacity: Mapping[str, Any] | None = None,
            allowed: Callable[[Mapping[str, str]], None] | None = None) -> RolloutRecord:
    """`allowed`: raises where the release may not go to a device selected (device ->
    fleet)."""
    rid = rollout_id or f"ro-{uuid.uuid4().hex[:12]}"
    if not ROLLOUT_ID.fullmatch(rid):
        raise InvalidRequest(f"a rollout id is {ROLLOUT_ID_RULE}", param="id")
    devices = select_devices(store.devices(), selector)
    if allowed is not None:
        allowed(devices)
    waves = assign_waves(rid, devices, policy.steps)
    return store.rollouts.create_rollout(NewRollout(
        rid, name, version, selector,
        policy, {d: (fleet, waves[d]) for d, fleet in devices.items()},
        dict(capacity) if capacity else None), now)


def act(store: ControllerStore, rollout_id: str, action: str, *, now: float,
        by: str = "the operator") -> RolloutRecord:
    """pause, resume, abort or rollback (RolloutConflict where the state does not allow it;
    NotFound for an unknown id); the rollout's reason names who (`by`)."""
    to, allowed = ACTIONS[action]
    return store.rollouts.set_rollout_state(rollout_id, to, allowed, reason=f"{action} by {by}",
                                            now=now)


def report(r: RolloutRecord, devices: list[DeviceRecord], now: float,
           actions: Sequence[AuditEntry] | None = None) -> dict[str, Any]:
    """What `fleet rollout status ID --json` prints: the rollout, its policy, counts by
    recorded state and by phase, per wave, every device and, given them, the operators'
    actions on it (`audit`)."""
    views = [d.view() for d in devices]
    t = tally(views)
    # What the engine waits for (its own decision, read only): "wave 2 soaking, 540s left".
    waiting_for = decide(r.state, r.wave, r.policy(), views, now).waiting_for \
        if r.state in LIVE else None
    waves = []
    for wave in range(1, r.waves_total + 1):
        mine = [v for v in views if v.wave == wave]
        waves.append({"wave": wave, "devices": len(mine),
                      "phases": {k: v for k, v in tally(mine).counts.items() if v}})
    return {
        **r.to_json(),
        "policy": {"waves": r.waves, "abort_above": f"{r.abort_above:.0%}",
                   "min_executed": r.min_executed,
                   "judged_after": needed_to_judge(t, r.policy()),
                   "soak": format_duration(r.soak_s),
                   "device_timeout": format_duration(r.device_timeout_s),
                   "rollback_on_abort": r.rollback_on_abort},
        "waiting_for": waiting_for,
        "states": device_counts(views),
        "phases": dict(t.counts),
        "finished": t.finished,
        "failed_share": round(t.failed_share, 4),
        "waves_detail": waves,
        "devices": [{**d.to_json(), "phase": phase(d.view())} for d in devices],
        **({} if actions is None else {"actions": [
            a.to_json() for a in actions if a.action.startswith("rollout.")]}),
        "as_of": now,
    }
