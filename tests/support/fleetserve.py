"""`python -m edge_agent fleet serve --config …` as a child process: started once its
`/healthz` says the broker is connected, stopped with SIGTERM, or killed (SIGKILL) the way a
host dies; what its `/healthz` says about leadership. For the tests that drive a real
controller (rollouts in waves, two controllers on one store)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import psutil

from tests.support.fleetkit import wait_until

ROOT = Path(__file__).resolve().parents[2]


class FleetServe:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FleetServe:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "edge_agent", "fleet", "serve", "--config",
                 str(self.config), "--log-level", "info"],
                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                stdout=subprocess.DEVNULL, stderr=out)
        assert wait_until(lambda: self.health() is not None, 60, 0.2), \
            self.log.read_text()[-3000:]
        return self

    def health(self) -> dict[str, Any] | None:
        """`/healthz` once the broker is connected, else None."""
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2)
            body: dict[str, Any] = r.json()
            return body if r.status_code == 200 and body["broker_connected"] else None
        except (httpx.HTTPError, ValueError):
            return None

    def leads(self) -> bool:
        found = self.health()
        return bool(found and found["controller"]["leader"])

    def cpu_s(self) -> float:
        assert self.proc is not None
        t = psutil.Process(self.proc.pid).cpu_times()
        return float(t.user + t.system)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc = None
