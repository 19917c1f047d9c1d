"""What the rollout tests with real agents share, run as an operator runs them: the central
team's side (`fleet keygen`, `fleet release init|add`, `fleet serve` publishing the
repository and ingesting), boxes (`edge-agent serve` with the link on), and clients
streaming chat on the boxes all along.

Every agent runs with one thread and a small context (`ENV`): the controller and two boxes
share the two cores of a CI machine.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import free_port
from tests.support.brokers import FLEET, Mosquitto
from tests.support.fleetkit import wait_until

ROOT = Path(__file__).resolve().parents[2]
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
            template: str | None = None, parameters: Mapping[str, Any] | None = None,
            options: Sequence[str] = ()) -> None:
        """`fleet release add FILE --name NAME --version VERSION` with its gate, and the
        chat template and default parameters when given, each written to a file beside
        FILE as the central team would; `options`: more of the command's (its stage and
        materials)."""
        args = ["fleet", "release", "add", str(file), "--name", name, "--version", version,
                "--state-dir", str(self.ctl), "--keys", str(self.keys), *options]
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
            f'state_dir = "{self.ctl}"\ncommand_signing_key_file = "{self.keys / "command.pem"}"\n'
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


def controller_config(path: Path, *, state: Path, key: Path, broker: Mosquitto,
                      http: str, db: str | None = None, broker_lines: str = "") -> Path:
    """A controller.toml for `fleet serve` on `broker`, its rollout engine quick (0.3 s
    ticks); `http`: the lines of its [http] section; `db`: a store other than SQLite;
    `broker_lines`: more of its [broker] section."""
    path.write_text(
        f'state_dir = "{state}"\ncommand_signing_key_file = "{key}"\nrollout_tick_s = 0.3\n'
        + (f'db = "{db}"\n' if db is not None else "")
        + f'[broker]\nurl = "{broker.url}"\nusername = "controller"\n'
        f'password_file = "{broker.password_file("controller")}"\n{broker_lines}'
        f'[http]\n{http}\n')
    return path


@contextmanager
def serving(config: Path, log: Path, env: Mapping[str, str] = ENV
            ) -> Iterator[subprocess.Popen[bytes]]:
    """`fleet serve --config CONFIG` logging to `log`, stopped (SIGTERM) at the end."""
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "fleet", "serve",
                                 "--config", str(config), "--log-level", "info"],
                                env=dict(env), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
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
              tmp_path: Path, env: Mapping[str, str] | None = None, extra: str = "") -> Box:
    """`edge-agent serve` on `state` as device `name`, its link on: the controller's
    command key and TUF root provisioned, its releases fetched from `fleet serve`.
    `env`: more settings (EDGE_AGENT_…) for this box; `extra`: more tables of its config
    file, after its [fleet] (`[models."name"]` …)."""
    root = tmp_path / f"root-{name}.json"  # what the technician put on the box
    shutil.copyfile(central.ctl / "releases" / "metadata" / "1.root.json", root)
    config = tmp_path / f"{name}.toml"
    config.write_text(
        f'[fleet]\nenabled = true\nbroker = "{broker.url}"\nfleet_id = "{FLEET}"\n'
        f'device_id = "{name}"\nusername = "{name}"\n'
        f'password_file = "{broker.password_file(name)}"\n'
        f'command_public_key_file = "{central.keys / "command.pub.pem"}"\n'
        f'tuf_root_file = "{root}"\nartifacts_url = "{central.releases}"\n'
        "download_headroom_bytes = 0\nreconnect_min_s = 0.2\nreconnect_max_s = 1.0\n"
        + extra)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--config",
                             str(config), "--state-dir", str(state), "--port", str(port)],
                            env={**ENV, **(env or {})}, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return Box(name, proc, f"http://127.0.0.1:{port}", state)


# -- the clients --------------------------------------------------------------------------

Sent = tuple[str | None, str | None]  # a request's fingerprint and error, from a sender


@dataclass(frozen=True)
class Request:
    """One request of `Streams`, timed by `time.time()` (the clock of the rollout's
    reports, so a request can be placed in a box's switch): its start, its first token,
    its end; its error, if it failed; the version that served it where the dialect says
    (OpenAI's `system_fingerprint`, `fp_<digest[:12]>`)."""

    box: str
    client: str
    started: float
    first_token: float | None
    ended: float
    error: str | None = None
    fingerprint: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def duration_s(self) -> float:
        return self.ended - self.started


@dataclass
class Streams:
    """Clients streaming short chats to `model`, `per_box` of them on each box, from
    `start()` to `stop()`: each request that is not a 200 ending `done` without an error
    is a failure; `served` counts the others per box, `requests` holds every one.

    `clients`: what each client sends, in turn: `httpx` (Ollama's /api/chat, by hand),
    `openai` (the official client, no retries: a refused request counts) or `ollama` (the
    official client)."""

    model: str
    boxes: list[Box]
    per_box: int = 1
    num_predict: int = 8
    clients: tuple[str, ...] = ("httpx",)
    failures: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
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
        send = {kind: self._sender(kind, box) for kind in set(self.clients)}
        for kind in itertools.cycle(self.clients):
            if self._stop.is_set():
                return
            started = time.time()
            first: list[float] = []  # when the first text came, set by `send`
            try:
                fingerprint, error = send[kind](first)
            except Exception as exc:  # whatever the client raises: a failed request
                fingerprint, error = None, repr(exc)
            self.requests.append(Request(box.name, kind, started,
                                         first[0] if first else None, time.time(),
                                         error, fingerprint))
            if error is None:
                self.served[box.name] += 1
            else:
                self.failures.append(f"{box.name}: {error}")

    def _sender(self, kind: str, box: Box) -> Callable[[list[float]], Sent]:
        """One request of `kind` to `box`: (fingerprint, error), the time of the first
        text appended to the list it is given."""
        messages = [{"role": "user", "content": "Count to five."}]
        if kind == "openai":
            import openai

            chat = openai.OpenAI(base_url=f"{box.base}/v1", api_key="unused",
                                 max_retries=0, timeout=60)

            def send_openai(first: list[float]) -> Sent:
                fingerprint = finish = None
                for chunk in chat.chat.completions.create(
                        model=self.model, max_tokens=self.num_predict, stream=True,
                        messages=messages):
                    if not first and chunk.choices and chunk.choices[0].delta.content:
                        first.append(time.time())
                    fingerprint = chunk.system_fingerprint or fingerprint
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finish = chunk.choices[0].finish_reason
                return fingerprint, None if finish else "the stream ended without a finish"

            return send_openai
        if kind == "ollama":
            import ollama

            client = ollama.Client(host=box.base, timeout=60)

            def send_ollama(first: list[float]) -> Sent:
                done = False
                for part in client.chat(self.model, messages=messages, stream=True,
                                        options={"num_predict": self.num_predict}):
                    if not first and part.message.content:
                        first.append(time.time())
                    done = bool(part.done)
                return None, None if done else "the stream ended without done"

            return send_ollama
        assert kind == "httpx", kind

        def send_httpx(first: list[float]) -> Sent:
            lines: list[dict[str, Any]] = []
            with httpx.stream("POST", f"{box.base}/api/chat", timeout=60, json={
                    "model": self.model, "options": {"num_predict": self.num_predict},
                    "messages": messages}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(json.loads(line))
                        if not first and (lines[-1].get("message") or {}).get("content"):
                            first.append(time.time())
            if r.status_code != 200 or not lines[-1].get("done") or "error" in lines[-1]:
                return None, f"{r.status_code} {lines[-1] if lines else ''}"
            return None, None

        return send_httpx
