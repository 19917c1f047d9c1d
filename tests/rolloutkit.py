"""What the rollout tests with real agents share, run as an operator runs them: the central
team's side (`fleet keygen`, `fleet release init|add`, `fleet serve` publishing the
repository and ingesting), boxes (`edge-agent serve` with the link on), and clients
streaming chat on the boxes all along.

Every agent runs with one thread and a small context (`ENV`): the controller and two boxes
share the two cores of a CI machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.brokers import FLEET, Mosquitto
from tests.conftest import free_port
from tests.fleetkit import wait_until

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "512",
       "EDGE_AGENT_TELEMETRY__HARDWARE": "false", "EDGE_AGENT_RUNTIME__THREADS": "1"}
# A gate any model passes: one short answer, no speed floor (two versions measured on a
# shared CI core would make one).
PASSING = {"prompts": [{"id": "hello", "prompt": "Hello", "max_tokens": 4,
                        "expect": {"max_output_tokens": 4}}],
           "tokens_per_s_floor": None}


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, "-m", "edge_agent", *args], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert not check or done.returncode == 0, done.stdout + done.stderr
    return done


def get_json(url: str) -> Any:
    """The JSON of a 200 answer, else None (not up yet, or not found)."""
    try:
        r = httpx.get(url, timeout=5)
        return r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


# -- the controller -----------------------------------------------------------------------

@dataclass(frozen=True)
class Controller:
    config: Path  # fleet serve's, for `fleet send` and `fleet rollout`
    keys: Path
    ctl: Path  # its state dir
    releases: str  # the repository's URL, the boxes' artifacts_url
    api: str


@dataclass(frozen=True)
class Repository:
    """A controller state dir with its keys and an initialised release repository."""

    ctl: Path
    keys: Path

    @classmethod
    def create(cls, tmp_path: Path) -> Repository:
        repo = cls(tmp_path / "controller", tmp_path / "keys")
        cli("fleet", "keygen", "--out", str(repo.keys))
        cli("fleet", "release", "init", "--state-dir", str(repo.ctl), "--keys",
            str(repo.keys))
        return repo

    def add(self, file: Path, name: str, version: str, *, gate: Mapping[str, Any],
            template: str | None = None, parameters: Mapping[str, Any] | None = None
            ) -> None:
        """`fleet release add FILE --name NAME --version VERSION` with its gate, and the
        chat template and default parameters when given, each written to a file beside
        FILE as the central team would."""
        args = ["fleet", "release", "add", str(file), "--name", name, "--version", version,
                "--state-dir", str(self.ctl), "--keys", str(self.keys)]
        for flag, text, suffix in (
                ("gate", json.dumps(gate), "json"), ("template", template, "jinja"),
                ("parameters", None if parameters is None else json.dumps(parameters), "json")):
            if text is not None:
                path = file.with_name(f"{file.stem}.{flag}.{suffix}")
                path.write_text(text)
                args += [f"--{flag}", str(path)]
        cli(*args)

    @contextmanager
    def serve(self, broker: Mosquitto, tmp_path: Path, settings: str = ""
              ) -> Iterator[Controller]:
        """`fleet serve` on this repository and the broker (`settings`: more top-level
        lines of its config), stopped at the end."""
        port = free_port()
        config = tmp_path / "controller.toml"
        config.write_text(
            f'state_dir = "{self.ctl}"\ncommand_key_file = "{self.keys / "command.pem"}"\n'
            f'{settings}[broker]\nurl = "{broker.url}"\nusername = "controller"\n'
            f'password_file = "{broker.password_file("controller")}"\n'
            f'[http]\nport = {port}\n')
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "fleet", "serve",
                                 "--config", str(config)], env=ENV, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        api = f"http://127.0.0.1:{port}"
        try:
            assert wait_until(lambda: get_json(f"{api}/healthz"), 60, 0.2)
            yield Controller(config, self.keys, self.ctl, f"{api}/releases/", api)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


# -- the boxes ----------------------------------------------------------------------------

@dataclass
class Box:
    name: str
    proc: subprocess.Popen[bytes]
    base: str
    state: Path

    def digest(self, model: str) -> str:
        """The digest the box's /api/tags gives for `model` (its active version)."""
        tags = httpx.get(f"{self.base}/api/tags", timeout=10).json()["models"]
        return str(next(m["digest"] for m in tags if m["name"] == model))

    def wait_ready(self, central: Controller) -> None:
        """Serving (its default model loaded) and online at the controller."""
        assert wait_until(lambda: get_json(f"{self.base}/ready") is not None, 120, 0.2)
        assert wait_until(lambda: (get_json(f"{central.api}/devices/{self.name}") or {})
                          .get("online"), 30, 0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_box(name: str, broker: Mosquitto, central: Controller, state: Path,
              tmp_path: Path, env: Mapping[str, str] | None = None) -> Box:
    """`edge-agent serve` on `state` as device `name`, its link on: the controller's
    command key and TUF root provisioned, its releases fetched from `fleet serve`.
    `env`: more settings (EDGE_AGENT_…) for this box."""
    root = tmp_path / f"root-{name}.json"  # what the technician put on the box
    shutil.copyfile(central.ctl / "releases" / "metadata" / "1.root.json", root)
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[fleet]\nenabled = true\nbroker = "{broker.url}"\nfleet_id = "{FLEET}"\n'
        f'device_id = "{name}"\nusername = "{name}"\n'
        f'password_file = "{broker.password_file(name)}"\n'
        f'command_key_file = "{central.keys / "command.pub.pem"}"\n'
        f'tuf_root_file = "{root}"\nartifacts_url = "{central.releases}"\n'
        "download_headroom_bytes = 0\nreconnect_min_s = 0.2\nreconnect_max_s = 1.0\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                             str(config), "--state-dir", str(state), "--port", str(port)],
                            env={**ENV, **(env or {})}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return Box(name, proc, f"http://127.0.0.1:{port}", state)


# -- the clients --------------------------------------------------------------------------

@dataclass
class Streams:
    """Clients streaming short chats to `model`, `per_box` of them on each box, from
    `start()` to `stop()`: each request that is not a 200 ending `done` without an error
    is a failure; `served` counts the others per box."""

    model: str
    boxes: list[Box]
    per_box: int = 1
    num_predict: int = 8
    failures: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        self.served.update((box.name, 0) for box in self.boxes)
        self._threads = [threading.Thread(target=self._client, args=(box,))
                         for box in self.boxes for _ in range(self.per_box)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _client(self, box: Box) -> None:  # a store's assistant, streaming all along
        while not self._stop.is_set():
            try:
                with httpx.stream("POST", f"{box.base}/api/chat", timeout=60, json={
                        "model": self.model, "options": {"num_predict": self.num_predict},
                        "messages": [{"role": "user", "content": "Count to five."}]}) as r:
                    lines = [json.loads(x) for x in r.iter_lines() if x]
                if r.status_code != 200 or not lines[-1].get("done") or "error" in lines[-1]:
                    self.failures.append(f"{box.name}: {r.status_code} "
                                         f"{lines[-1] if lines else ''}")
                else:
                    self.served[box.name] += 1
            except httpx.HTTPError as exc:
                self.failures.append(f"{box.name}: {exc!r}")
