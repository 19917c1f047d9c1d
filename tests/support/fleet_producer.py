"""A fleet link in a process of its own, emitting metrics as fast as asked: what the
kill -9 tests kill mid-flush. Prints `boot <id>` once connected, `emitted <n>` every 100
messages, and `drained` when the controller has acknowledged everything (then stops
cleanly).

    python -m tests.support.fleet_producer BROKER_URL DEVICE PASSWORD_FILE STATE_DIR COUNT RATE
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from edge_agent.config import FleetSettings
from edge_agent.fleet.device.link.link import Link, LinkOptions


def main(argv: list[str]) -> int:
    url, device, password_file, state, count, rate = argv
    fleet = FleetSettings(enabled=True, broker=url, fleet_id="f1", device_id=device,
                          username=device, password_file=Path(password_file),
                          reconnect_min_s=0.1, reconnect_max_s=0.5)
    link = Link(fleet, Path(state), facts=lambda: {"agent_version": "producer"},
                options=LinkOptions(ack_timeout_s=3.0, death_wait_s=1.0))
    link.start()
    if not link.wait_connected(15):
        print("not connected", flush=True)
        return 1
    print("boot", link.boot_id, flush=True)
    start, n, per_s = time.monotonic(), int(count), float(rate)
    for i in range(n):
        link.emit("metrics", "metrics", {"i": i, "pad": "x" * 100})
        if (i + 1) % 100 == 0:
            print("emitted", i + 1, flush=True)
        delay = start + (i + 1) / per_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stats = link.outbox_stats()
        if stats is not None and stats.depth == 0 and stats.buffered == 0:
            print("drained", flush=True)
            break
        time.sleep(0.05)
    link.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
