"""The box's table of command handlers, held to the registry of command types
(`protocol.command_types`): each registered type is run by exactly one handler, and no
handler runs a type the registry does not hold.

The handlers come from several parts (the link's own `ping` and `rebirth`, the box's
`handlers`, the rollout runner's `rollout.*`), each built where its dependencies are, so
the table is checked where they meet (`service.FleetDevice`). A type handled twice or not
registered is a wiring mistake: `box_dispatch` raises, and the link does not start with
it. A registered type without a handler is allowed at run time (a part that could not be
built: the box refuses its commands as `unknown_type`, and says so in the log), and
`tests/fleet/protocol/test_command_types.py` holds the whole box's table to the registry.
"""

from __future__ import annotations

from collections.abc import Mapping

from edge_agent.fleet.device.link.command_gate import Handler
from edge_agent.fleet.device.link.core import OWN_TYPES
from edge_agent.fleet.protocol.command_types import COMMAND_TYPES

__all__ = ["box_dispatch", "unhandled"]


def box_dispatch(*parts: Mapping[str, Handler]) -> dict[str, Handler]:
    """The handlers of `parts` as one table, for the link (which adds its own,
    `OWN_TYPES`). ValueError for a type handled twice (by two parts, or by a part and the
    link) or one the registry does not hold."""
    table: dict[str, Handler] = {}
    for part in parts:
        for name, handler in part.items():
            if name in table or name in OWN_TYPES:
                raise ValueError(f"two handlers for the command type {name!r}")
            if name not in COMMAND_TYPES:
                raise ValueError(f"a handler for {name!r}, which is no registered command "
                                 "type (edge_agent.fleet.protocol.command_types)")
            table[name] = handler
    return table


def unhandled(table: Mapping[str, Handler]) -> list[str]:
    """The registered types that neither `table` nor the link itself runs."""
    return [name for name in COMMAND_TYPES if name not in table and name not in OWN_TYPES]
