"""Shared fixtures: the real default model in a session state dir, and a live server;
for the fleet link, a private Mosquitto and a private PostgreSQL (tests/support/brokers.py).

The server is the real app under uvicorn on a free port, in a thread of the test process,
so tests can drive it with the official clients and still look at its scheduler state.
"""

from __future__ import annotations

import shutil
import socket
import sqlite3
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from edge_agent.app import create_app
from edge_agent.config import Settings, load_settings
from edge_agent.engine.models.catalog import ModelStore
from edge_agent.server import uvicorn_config
from tests.support.brokers import Mosquitto, Postgres, find_mosquitto, find_postgres_bin


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The provisioning modules first. `make test` runs on two workers, a module at a time
    each (`-n 2 --dist loadfile --no-loadscope-reorder`: a module's servers start once, its
    tests keep their order, and the modules keep this one). These modules are the longest
    and spend most of their time waiting on a container's systemd (boots, restart delays,
    watchdog timeouts) at well under a core: started first, they end with the rest rather
    than after it.

    xdist hands tests out by node id, so of several tests with one id only the first would
    run, silently. schemathesis gives every operation of a document the same id, which is
    why `make test` runs tests/test_fuzz_schemathesis.py on its own; a worker that collects
    such ids fails the one test of them it runs, saying so."""
    items.sort(key=lambda item: item.get_closest_marker("provision") is None)
    if hasattr(config, "workerinput"):
        ids = Counter(item.nodeid for item in items)
        for item in items:
            if ids[item.nodeid] > 1:
                item.add_marker(pytest.mark.shared_nodeid(ids[item.nodeid]))


@pytest.fixture(autouse=True)
def _one_test_per_nodeid(request: pytest.FixtureRequest) -> None:
    shared = request.node.get_closest_marker("shared_nodeid")
    if shared is not None:
        pytest.fail(f"{shared.args[0]} tests share the node id {request.node.nodeid}, and on "
                    "pytest-xdist's workers only the first of them runs: run this module "
                    "without -n", pytrace=False)


DEFAULT_MODEL = "smollm2:135m"
# The default model's end-of-generation tokens, biased away where a test needs a long output.
NO_EOS = {"0": -100, "2": -100, "4": -100}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A state dir holding the real default model, pulled once per session."""
    state = tmp_path_factory.mktemp("model-cache")
    store = ModelStore(state)
    store.pull(DEFAULT_MODEL)
    store.close()  # models.db checkpointed: clones copy one file
    return state


@pytest.fixture(scope="module")
def model_path(model_cache: Path) -> Path:
    """The default model's GGUF, for tests that build their own llama.cpp objects."""
    return ModelStore(model_cache).get(DEFAULT_MODEL).blob_path(model_cache)


def clone_state(src: Path, dest: Path) -> Path:
    """A fresh state dir sharing the cached blobs by hard link (no 100 MB copies); the
    rest (models.db, manifests) is copied, so the clone's changes stay its own. SQLite's
    shared-memory index is left behind: the clone's first connection rebuilds it."""
    shutil.copytree(src, dest, copy_function=_link_or_copy,
                    ignore=shutil.ignore_patterns("*-shm"))
    return dest


def _link_or_copy(src: str, dst: str) -> None:
    if Path(src).parent.name != "blobs":
        shutil.copy2(src, dst)
        return
    try:
        Path(dst).hardlink_to(src)
    except OSError:
        shutil.copy2(src, dst)


@dataclass
class LiveServer:
    app: FastAPI
    settings: Settings
    base_url: str
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def ollama_url(self) -> str:
        return self.base_url

    @property
    def openai_url(self) -> str:
        return f"{self.base_url}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def ledger_row(self, trace_id: str) -> dict[str, Any]:
        """A request's ledger row, once written (a row is queued after the last byte)."""
        deadline = time.monotonic() + 10
        while True:
            assert self.app.state.parts.ledger.flush()
            db = sqlite3.connect(self.settings.state_dir / "ledger.db")
            db.row_factory = sqlite3.Row
            row = db.execute("SELECT * FROM requests WHERE trace_id = ?",
                             [trace_id]).fetchone()
            db.close()
            if row is not None:
                return dict(row)
            assert time.monotonic() < deadline, f"no ledger row for {trace_id}"
            time.sleep(0.05)


def start_server(settings: Settings, *, wait_for_model: str | None = DEFAULT_MODEL,
                 preload: bool = True, verify: ssl.SSLContext | None = None) -> LiveServer:
    """`verify`: how the wait for /ready trusts an HTTPS box (its CA, and the client's
    certificate where it asks one)."""
    app = create_app(settings, preload=preload)
    server = uvicorn.Server(uvicorn_config(app, settings, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    live = LiveServer(app, settings, f"{settings.server.scheme}://{settings.server.host}:"
                                     f"{settings.server.port}", server, thread)
    if wait_for_model:  # the default model: /ready says when it is loaded (no key needed)
        while httpx.get(f"{live.base_url}/ready", verify=verify or True).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{wait_for_model} did not load")
            time.sleep(0.1)
    return live


@pytest.fixture(scope="session")
def live_server(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[LiveServer]:
    state = clone_state(model_cache, tmp_path_factory.mktemp("live") / "state")
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "server.max_body_bytes": 256 * 1024,
        "runtime.context_length": 2048})
    live = start_server(settings)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def fuzz_live(model_cache: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[LiveServer]:
    """A server of the fuzz module's own, on which fuzzing stays cheap (tests/fuzzing.py)."""
    from tests.fuzzing import start_fuzz_server  # imported here: it imports this module

    live = start_fuzz_server(model_cache, tmp_path_factory.mktemp("fuzz") / "state")
    yield live
    live.stop()


# -- The fleet link's real servers (tests/support/brokers.py) -------------------------------

@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    """The session's broker, configured by `fleet broker-config` for fleet `f1` and the
    devices in `tests.support.brokers.DEVICES`, with a TLS listener (CA made in the test). Shared:
    never kill it; take `mosquitto_factory` for a broker of your own."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    broker = Mosquitto(tmp_path_factory.mktemp("mosquitto"), tls=True).start()
    yield broker
    broker.stop()


@pytest.fixture
def mosquitto_factory(tmp_path: Path) -> Iterator[Callable[..., Mosquitto]]:
    """Brokers of the test's own (`make(devices=..., tls=...)`, not started), stopped at the
    end: for the tests that kill the broker and start it again on the same port and data."""
    if find_mosquitto() is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto)")
    made: list[Mosquitto] = []

    def make(**kwargs: Any) -> Mosquitto:
        broker = Mosquitto(tmp_path / f"broker{len(made)}", **kwargs)
        made.append(broker)
        return broker

    yield make
    for broker in made:
        broker.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    """A private PostgreSQL for the session (initdb + pg_ctl in a temp dir), skipped with
    the reason where the server binaries are not installed."""
    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) in PATH, /usr/local/bin "
                    "or /usr/lib/postgresql/*/bin")
    server = Postgres(bindir)
    try:
        yield server.start()
    finally:
        server.remove()


@pytest.fixture
def postgres_url(postgres_server: Postgres) -> str:
    """A fresh, empty database on the session's PostgreSQL."""
    return postgres_server.create_database()
