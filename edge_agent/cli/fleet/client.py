"""The one path of every `edge-agent fleet …` command that reads or changes the fleet: the
controller's API (`fleet.controller.api`), reached one of two ways.

- From a desk: `--controller https://HOST:9464` (or `EDGE_AGENT_CONTROLLER`, or `url` in
  the `[controller]` section of the file --config names) with an operator token
  (`--token-file`, `EDGE_AGENT_CONTROLLER_TOKEN_FILE`, `token_file`) and, for a CA of the
  site's own, `--ca-file` (`EDGE_AGENT_CONTROLLER_CA_FILE`, `ca_file`): HTTPS to the running
  `fleet serve`, the token's role deciding what it may do.
- On the controller host, with no `--controller`: the same app, built in this process over
  the store the controller settings name (`--config`, `--state-dir`, `--db`), as
  `local:<unix user>` with the role `host`. It works while `fleet serve` is stopped, as the
  commands always have; `fleet send` signs with the host's command key.

Either way the request goes through the same routes, rules, error text and audit trail: the
CLI has no second, direct-to-the-store implementation of a command. An answer that is an
error becomes the command's failure: 400 a usage error (exit 2), anything else exit 1, in
the API's own words.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import click
import httpx

from edge_agent.cli.common import BadUsage, CheckFailed, F
from edge_agent.cli.fleet.options import controller_options, controller_settings, open_existing

if TYPE_CHECKING:
    from edge_agent.config.controller import ControllerSettings
    from edge_agent.fleet.controller.commands import CommandSender
    from edge_agent.fleet.controller.store import ControllerStore

_META = "edge_agent.fleet.client."
TIMEOUT_S = 90.0  # a send waits up to 60 s for results on the controller's side


def _remember(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    ctx.meta[f"{_META}{param.name}"] = value
    return value


_CONTROLLER = click.option(
    "--controller", envvar="EDGE_AGENT_CONTROLLER", expose_value=False, callback=_remember,
    metavar="URL", help="The controller's API (https://HOST:PORT) to act through, from "
    "another machine; unset: this host's controller store, in-process.")
_TOKEN_FILE = click.option(
    "--token-file", envvar="EDGE_AGENT_CONTROLLER_TOKEN_FILE", expose_value=False,
    callback=_remember, type=click.Path(path_type=Path, dir_okay=False),
    help="File holding the operator token for --controller (fleet operators create).")
_CA_FILE = click.option(
    "--ca-file", "controller_ca_file", envvar="EDGE_AGENT_CONTROLLER_CA_FILE",
    expose_value=False, callback=_remember, type=click.Path(path_type=Path, dir_okay=False),
    help="PEM CA the controller's certificate is checked against (default: the system's).")


def client_options(fn: F) -> F:
    """--controller, --token-file, --ca-file, and the controller options for the local
    way; `controller_client()` reads them."""
    return controller_options(_CONTROLLER(_TOKEN_FILE(_CA_FILE(fn))))


def remote() -> str | None:
    """The controller URL this command goes to (--controller, EDGE_AGENT_CONTROLLER or the
    settings' [controller] url), if any."""
    return click.get_current_context().meta.get(f"{_META}controller") or \
        controller_settings().controller.url


def segment(value: str) -> str:
    """A word of the command line as one path segment of a route."""
    return quote(value, safe="")


class InProcess(httpx.BaseTransport):
    """An ASGI app in this process, reached synchronously: each request runs the app in
    an event loop of its own (a CLI makes a handful)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self._transport = httpx.ASGITransport(app=app, client=("cli", 0))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def run() -> httpx.Response:
            response = await self._transport.handle_async_request(request)
            body = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers,
                                  content=body)
        return asyncio.run(run())


class ControllerClient:
    """The API as the commands use it: JSON in, JSON out, errors as the command's failure."""

    def __init__(self, http: httpx.Client) -> None:
        self._http = http

    @property
    def http(self) -> httpx.Client:
        """The client itself, for what reads the controller's public files (`push`)."""
        return self._http

    def put_file(self, path: str, file: Path) -> Any:
        """`file` as the raw body, streamed, with its length."""
        with file.open("rb") as body:
            size = os.fstat(body.fileno()).st_size
            return self._answer(self._call("PUT", path, content=body,
                                           headers={"content-length": str(size),
                                                    "content-type": "application/octet-stream"}))

    def get(self, path: str, **params: Any) -> Any:
        return self._answer(self._call("GET", path,
                                       params={k: v for k, v in params.items() if v is not None}))

    def post(self, path: str, body: Mapping[str, Any] | None = None) -> Any:
        return self._answer(self._call("POST", path, json=dict(body or {})))

    def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            return self._http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise CheckFailed(f"cannot reach the controller at {self._http.base_url}: "
                              f"{exc}") from None

    @staticmethod
    def _answer(response: httpx.Response) -> Any:
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code < 400:
            return body
        message = body.get("error") if isinstance(body, dict) else None
        message = str(message or f"the controller answered {response.status_code}")
        if response.status_code == 400:
            raise BadUsage(message)
        raise CheckFailed(message)


@contextmanager
def controller_client(*, settings: ControllerSettings | None = None,
                      commands: CommandSender | None = None,
                      create: bool = False) -> Iterator[ControllerClient]:
    """The API, the way this command was told (module docstring). `settings`, `commands`:
    the local app's, when the command built them itself (`fleet send`, which alone signs,
    with its --key and broker flags); `create`: the local store may be made (the first
    operator)."""
    meta = click.get_current_context().meta
    settings = settings or controller_settings()
    client = settings.controller  # a desk's file: [controller]; the flags win over it
    url = meta.get(f"{_META}controller") or client.url
    if url:
        with _remote(url, meta.get(f"{_META}token_file") or client.token_file,
                     meta.get(f"{_META}controller_ca_file") or client.ca_file) as http:
            yield ControllerClient(http)
        return
    store = _local_store(settings, create=create)
    try:
        with httpx.Client(transport=InProcess(_local_app(settings, store, commands)),
                          base_url="http://controller.local", timeout=TIMEOUT_S) as http:
            yield ControllerClient(http)
    finally:
        store.close()


@contextmanager
def _remote(url: str, token_file: Path | None, ca_file: Path | None
            ) -> Iterator[httpx.Client]:
    if not url.startswith(("https://", "http://")):
        raise BadUsage(f"--controller {url!r}: https://HOST:PORT")
    if token_file is None:
        raise BadUsage("--controller needs an operator token: --token-file FILE (or "
                       "EDGE_AGENT_CONTROLLER_TOKEN_FILE)")
    try:
        token = token_file.read_text().strip()
    except OSError as exc:
        raise BadUsage(f"cannot read the token file {token_file}: {exc.strerror}") from None
    if not token:
        raise BadUsage(f"the token file {token_file} is empty")
    verify: Any = True
    if ca_file is not None:
        if not os.access(ca_file, os.R_OK):
            raise BadUsage(f"cannot read the CA file {ca_file}")
        verify = str(ca_file)
    with httpx.Client(base_url=url.rstrip("/"), verify=verify, timeout=TIMEOUT_S,
                      headers={"Authorization": f"Bearer {token}"}) as http:
        yield http


def _local_store(settings: ControllerSettings, *, create: bool) -> ControllerStore:
    from edge_agent.fleet.controller.store import DB_FILE, open_store

    if not create:
        return open_existing(settings)
    if settings.db is None and not (settings.state_dir / DB_FILE).exists():
        click.echo(f"creating the controller store {settings.state_dir / DB_FILE}", err=True)
    return open_store(settings.db, settings.state_dir)


def _local_app(settings: ControllerSettings, store: ControllerStore,
               commands: CommandSender | None) -> Any:
    from edge_agent.fleet.controller.api import create_app
    from edge_agent.fleet.controller.audit import local_operator
    from edge_agent.fleet.controller.metrics import ControllerMetrics
    from edge_agent.fleet.controller.operators import HOST, Operator
    from edge_agent.fleet.controller.rings import Rings

    return create_app(store, ControllerMetrics(store), state_dir=settings.state_dir,
                      commands=commands, local=Operator(local_operator(), HOST, ""),
                      rings=Rings.of(settings.stages), slo=settings.slo)


def sending_client(key_file: Path | None, broker: str | None, username: str | None,
                    password_file: Path | None) -> AbstractContextManager[ControllerClient]:
    """Through --controller, the controller signs and publishes; on its host, this command
    does, with the key and broker its flags or the controller's settings name."""
    from edge_agent.fleet.controller.commands import CommandSender
    from edge_agent.fleet.protocol.signing import load_private

    if remote():
        given = [flag for flag, value in (("--key", key_file), ("--broker", broker),
                                          ("--username", username),
                                          ("--password-file", password_file)) if value]
        if given:
            raise BadUsage(f"{', '.join(given)}: through --controller, the controller signs "
                           "and publishes with its own key and broker connection")
        return controller_client()
    settings = controller_settings(**{"broker.url": broker, "broker.username": username,
                                      "broker.password_file": password_file})
    key_path = key_file or settings.command_signing_key_file
    if key_path is None:
        raise BadUsage("no signing key: pass --key or set command_signing_key_file "
                       "(edge-agent fleet keygen makes one)")
    return controller_client(settings=settings,
                             commands=CommandSender(settings, load_private(key_path)))
