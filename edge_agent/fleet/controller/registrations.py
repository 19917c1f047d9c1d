"""Boxes an admin expects before they first report (`fleet devices register`, from the
inventory the controller's Ansible role provisions the broker with): the fleet's list is
the boxes seen and those still awaited, so a store whose box never came up shows as
`never seen` instead of not at all.

A registration changes nothing a box does, nor who may connect (the broker's passwords
decide that): it is the central team's expectation, shown beside what arrived. A rollout
selects only boxes that have reported (a never-seen one has no broker session to take a
command, so it would only time out); a registered box joins the fleet's rollouts from its
first birth on. Must never: invent facts for a box that never reported (every reported
field of a never-seen box is empty).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from edge_agent.fleet.controller.store import ControllerStore


def never_seen(device: str, registration: Mapping[str, Any]) -> dict[str, Any]:
    """A registered box that never reported, in a device row's shape."""
    return {"device": device, "fleet": registration["fleet"], "online": False, "bdseq": None,
            "boot_id": None, "first_seen": None, "last_seen": None, "last_birth": None,
            "last_death": None, "agent_version": None, "llama_cpp_version": None,
            "config_fingerprint": None, "hardware": None, "tenants": None, "models": [],
            "active_models": [], "retired": None, "never_seen": True,
            "registered": _registered(registration)}


def listed(store: ControllerStore) -> list[dict[str, Any]]:
    """Every box seen (with its registration, if any) and every registered box not seen
    yet, by device id; each with its loss accounting."""
    registrations = store.registrations()
    seen = [with_registration(d, registrations.get(d["device"])) for d in store.devices()]
    known = {d["device"] for d in seen}
    awaited = [never_seen(device, reg) for device, reg in registrations.items()
               if device not in known]
    return [{**d, "loss": store.loss(d["device"])}
            for d in sorted(seen + awaited, key=lambda d: str(d["device"]))]


def one(store: ControllerStore, device: str) -> dict[str, Any] | None:
    """One box as `listed` shows it (with its message counts when seen); None if neither
    seen nor registered."""
    registration = store.registrations().get(device)
    found = store.device(device)
    if found is None:
        return None if registration is None else {
            **never_seen(device, registration), "loss": store.loss(device)}
    return {**with_registration(found, registration), "loss": store.loss(device)}


def with_registration(found: Mapping[str, Any],
                      registration: Mapping[str, Any] | None) -> dict[str, Any]:
    return {**found, "never_seen": False,
            "registered": None if registration is None else _registered(registration)}


def _registered(registration: Mapping[str, Any]) -> dict[str, Any]:
    return {"at": registration["at"], "by": registration["by"]}
