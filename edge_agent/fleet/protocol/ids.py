"""Every id and version the fleet's messages carry, each rule written once and checked
wherever the value enters (config, broker provisioning, the controller's API and ingest,
the box's command handlers, the release manifest).

A fleet, device, rollout or command id is a word of `[A-Za-z0-9_-]`, 1 to 64 characters:
it goes into topics, SQL rows and file names unquoted. A boot id is what a box makes at
each start (`uuid4().hex`). A release version names a folder of the release repository
(`gemma3/270m/<version>/model.gguf`), so it is the strictest: 1 to 32 of `[A-Za-z0-9._-]`,
starting with a letter or digit, and every other place that names a release's version
(a rollout, its command, the box's pull) takes exactly that — a version no release can
have is refused where it is typed, not found missing later.

The fleet and device rule lives in `edge_agent.names` (`check_fleet_id`), below config,
so that config can refuse a bad id at load without importing the fleet; this module is
the name the fleet code uses for it.
"""

from __future__ import annotations

import re
from typing import Any

from edge_agent.names import FLEET_ID as ID
from edge_agent.names import RESERVED_DEVICE_IDS as RESERVED
from edge_agent.names import check_fleet_id as check_id

__all__ = ["BOOT_ID", "COMMAND_ID", "ID", "RESERVED", "ROLLOUT_ID", "ROLLOUT_ID_RULE",
           "VERSION", "VERSION_RULE", "check_id", "release_version"]

ROLLOUT_ID = ID
COMMAND_ID = ID
ROLLOUT_ID_RULE = "1-64 of [A-Za-z0-9_-]"
BOOT_ID = re.compile(r"[0-9a-f]{32}")
VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")
VERSION_RULE = "1-32 of [A-Za-z0-9._-], starting with a letter or digit"


def release_version(value: Any) -> str:
    """A release's version as its text: a whole number (a command may carry `2`) or text
    of VERSION; ValueError naming the rule."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if not isinstance(value, str) or not VERSION.fullmatch(value):
        raise ValueError(f"version {str(value)[:40]!r}: a whole number or {VERSION_RULE}")
    return value
