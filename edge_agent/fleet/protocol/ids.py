"""Fleet and device ids: the one rule, checked wherever an id enters (config, broker
provisioning, the controller reading a topic).

The rule itself lives in `edge_agent.names` (`check_fleet_id`), below config, so that
config can refuse a bad id at load without importing the fleet link; this module is the
name the fleet code uses for it.
"""

from __future__ import annotations

from edge_agent.names import FLEET_ID as ID
from edge_agent.names import RESERVED_DEVICE_IDS as RESERVED
from edge_agent.names import check_fleet_id as check_id

__all__ = ["ID", "RESERVED", "check_id"]
