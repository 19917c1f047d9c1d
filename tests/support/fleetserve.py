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

from tests.conftest import free_port
from tests.support.fleetkit import wait_until

ROOT = Path(__file__).resolve().parents[2]


class FleetServe:
    def __init__(self, config: Path, port: int, log: Path) -> None:
        self.config, self.port, self.log = config, port, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> FleetServe:
        """Started and connected. A port another process took between `free_port()` and the
        bind (a race any busy machine can lose: the controller refuses a taken port before
        it starts) is replaced by a new free one in the config, and `port` follows."""
        for _ in range(3):
            with self.log.open("ab") as out:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "edge_agent", "fleet", "serve", "--config",
                     str(self.config), "--log-level", "info"],
                    env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
                    stdout=subprocess.DEVNULL, stderr=out)
            proc = self.proc

            def up_or_gone(proc: subprocess.Popen[bytes] = proc) -> bool:
                return self.health() is not None or proc.poll() is not None

            assert wait_until(up_or_gone, 60, 0.2), self.log.read_text()[-3000:]
            if proc.poll() is None:
                return self
            if f":{self.port} is taken by" not in self.log.read_text():
                break
            port = free_port()
            text = self.config.read_text()
            assert f"port = {self.port}\n" in text, text
            self.config.write_text(text.replace(f"port = {self.port}\n", f"port = {port}\n"))
            self.port = port
        raise AssertionError(f"fleet serve exited {self.proc.returncode}: "
                             + self.log.read_text()[-3000:])

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
