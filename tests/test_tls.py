"""HTTPS on the box: the official clients against it with the store's CA (chat, streaming),
mutual TLS, the private key's mode, and a reload at SIGHUP that new connections see while a
stream already running completes on the old connection.

The CA and the certificates are made in the test (`tests.support.certs.StoreCA`)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from click.testing import CliRunner

from edge_agent.cli import main
from edge_agent.config import ConfigError, load_settings
from edge_agent.doctor import _port
from edge_agent.tls import ServerTLS, TLSFileError, TLSFiles, fingerprint, served_certificate
from tests.conftest import (
    DEFAULT_MODEL,
    NO_EOS,
    LiveServer,
    clone_state,
    free_port,
    start_server,
)
from tests.support.certs import Issued, StoreCA


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> StoreCA:
    return StoreCA(tmp_path_factory.mktemp("ca"))


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> bytes:
    """A TLS handshake in memory, as a new connection would make it: the certificate the
    server presented (DER)."""
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    cli = client.wrap_bio(c_in, c_out, server_hostname="localhost")
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, end in (("c", cli), ("s", srv)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            break
    der = cli.getpeercert(binary_form=True)
    assert der is not None
    return der


# -- the context and its files, no server -------------------------------------------------

def test_a_key_open_to_other_users_is_refused(ca: StoreCA) -> None:
    pair = ca.issue("open-key")
    pair.key.chmod(0o640)
    with pytest.raises(TLSFileError, match=r"0640, open to other users.*chmod 600"):
        ServerTLS(TLSFiles(pair.cert, pair.key))


def test_a_key_of_another_certificate_is_refused(ca: StoreCA) -> None:
    a, b = ca.issue("pair-a"), ca.issue("pair-b")
    with pytest.raises(TLSFileError, match="does not belong to the certificate"):
        ServerTLS(TLSFiles(a.cert, b.key))


def test_the_context_asks_tls_1_2_at_least_and_serves_http_1_1(ca: StoreCA) -> None:
    pair = ca.issue("floor")
    tls = ServerTLS(TLSFiles(pair.cert, pair.key))
    assert tls.context.minimum_version == ssl.TLSVersion.TLSv1_2
    assert tls.context.verify_mode == ssl.CERT_NONE
    mutual = ServerTLS(TLSFiles(pair.cert, pair.key, ca.cert))
    assert mutual.context.verify_mode == ssl.CERT_REQUIRED


def test_a_reload_serves_the_new_pair_and_a_broken_one_keeps_the_old(ca: StoreCA,
                                                                    tmp_path: Path) -> None:
    first, second, stray = ca.issue("r1"), ca.issue("r2"), ca.issue("r3")
    cert, key = tmp_path / "box.pem", tmp_path / "box.key"
    _install(first, cert, key)
    tls = ServerTLS(TLSFiles(cert, key))
    client = ca.client_context()
    assert fingerprint(_handshake(tls.context, client)) == fingerprint(first.cert)
    _install(second, cert, key)
    assert tls.reload() == fingerprint(second.cert)
    assert fingerprint(_handshake(tls.context, client)) == fingerprint(second.cert)
    os.replace(_copy(stray.key, tmp_path / "k.tmp"), key)  # a key without its certificate
    with pytest.raises(TLSFileError, match="does not belong"):
        tls.reload()
    assert fingerprint(_handshake(tls.context, client)) == fingerprint(second.cert)


def test_settings_take_the_cert_and_key_together(ca: StoreCA, tmp_path: Path) -> None:
    pair = ca.issue("settings")
    with pytest.raises(ConfigError, match="tls_cert_file and tls_key_file go together"):
        load_settings(None, state_dir=tmp_path, **{"server.tls_cert_file": str(pair.cert)})
    with pytest.raises(ConfigError, match="tls_client_ca_file .* needs tls_cert_file"):
        load_settings(None, state_dir=tmp_path, **{"server.tls_client_ca_file": str(ca.cert)})
    settings = load_settings(None, state_dir=tmp_path, **{
        "server.tls_cert_file": str(pair.cert), "server.tls_key_file": str(pair.key)})
    assert settings.server.scheme == "https"
    assert settings.server.tls == TLSFiles(pair.cert, pair.key, None)


def test_serve_refuses_a_key_open_to_others_with_one_line(ca: StoreCA, tmp_path: Path) -> None:
    pair = ca.issue("serve-open")
    pair.key.chmod(0o644)
    result = CliRunner().invoke(main, [
        "serve", "--state-dir", str(tmp_path), "--port", str(free_port())],
        env={"EDGE_AGENT_SERVER__TLS_CERT_FILE": str(pair.cert),
             "EDGE_AGENT_SERVER__TLS_KEY_FILE": str(pair.key)})
    assert result.exit_code == 2
    assert result.output.startswith("edge-agent: cannot serve HTTPS: ")
    assert "owner-only" in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.integration
def test_serve_on_the_lan_without_tls_warns_and_starts(model_cache: Path,
                                                      tmp_path: Path) -> None:
    """A warning, not a refusal: a box set up before TLS goes on serving. (It starts until
    it meets the port, taken here, so that the test ends there.)"""
    state = clone_state(model_cache, tmp_path / "s")
    config = tmp_path / "edge-agent.toml"
    config.write_text('[tenants.tills]\nmodels = ["*"]\n')
    created = CliRunner().invoke(main, ["keys", "create", "--tenant", "tills", "--config",
                                        str(config), "--state-dir", str(state)])
    assert created.exit_code == 0, created.output
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        result = CliRunner().invoke(main, [
            "serve", "--config", str(config), "--state-dir", str(state), "--host", "0.0.0.0",
            "--port", str(taken.getsockname()[1])])
    assert "serving on 0.0.0.0 without TLS: API keys and prompts cross the network in " \
           "clear" in result.output
    assert result.exit_code != 0  # uvicorn's own exit when the port is taken


def _install(pair: Issued, cert: Path, key: Path) -> None:
    """The pair put in place as a technician or the role does: each file replaced whole."""
    os.replace(_copy(pair.cert, cert.with_suffix(".new")), cert)
    os.replace(_copy(pair.key, key.with_suffix(".new")), key)


def _copy(src: Path, dest: Path) -> Path:
    dest.write_bytes(src.read_bytes())
    dest.chmod(0o600)
    return dest


# -- the live box over HTTPS --------------------------------------------------------------

@pytest.fixture(scope="module")
def https_box(model_cache: Path, tmp_path_factory: pytest.TempPathFactory,
              ca: StoreCA) -> Iterator[LiveServer]:
    pair = ca.issue("box")
    state = clone_state(model_cache, tmp_path_factory.mktemp("https") / "state")
    settings = load_settings(None, state_dir=state, **{
        "server.port": free_port(), "runtime.context_length": 1024,
        "server.tls_cert_file": str(pair.cert), "server.tls_key_file": str(pair.key)})
    live = start_server(settings, verify=ca.client_context())
    yield live
    live.stop()


@pytest.mark.integration
def test_the_openai_client_chats_and_streams_over_https(https_box: LiveServer,
                                                         ca: StoreCA) -> None:
    assert https_box.openai_url.startswith("https://127.0.0.1:")
    with httpx.Client(verify=ca.client_context()) as http:
        client = openai.OpenAI(base_url=https_box.openai_url, api_key="unused", max_retries=0,
                               http_client=http)
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=8,
            messages=[{"role": "user", "content": "Say hello."}])
        assert reply.choices[0].message.content
        chunks = list(client.chat.completions.create(
            model=DEFAULT_MODEL, max_tokens=8, stream=True,
            messages=[{"role": "user", "content": "Say hello."}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.integration
def test_the_ollama_client_chats_and_streams_over_https(https_box: LiveServer,
                                                         ca: StoreCA) -> None:
    client = ollama.Client(host=https_box.ollama_url, verify=ca.client_context())
    reply = client.chat(model=DEFAULT_MODEL, options={"num_predict": 8},
                        messages=[{"role": "user", "content": "Say hello."}])
    assert reply.message.content
    parts = list(client.chat(model=DEFAULT_MODEL, options={"num_predict": 8}, stream=True,
                             messages=[{"role": "user", "content": "Say hello."}]))
    assert parts[-1].done and "".join(p.message.content or "" for p in parts)


MANUAL = Path(__file__).resolve().parents[1] / "docs" / "operate" / "tls.md"
MANUAL_BOX = "https://box.store042.lan:11434"
MANUAL_CA = "/etc/ssl/store042-ca.pem"


@pytest.mark.integration
def test_the_manuals_client_blocks_run_against_an_https_box(
        https_box: LiveServer, ca: StoreCA, capsys: pytest.CaptureFixture[str]) -> None:
    """The manual's openai and ollama blocks, as a store's developer copies them, on this
    test's box and CA (those with a client certificate are for a mutual-TLS box)."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", MANUAL.read_text(), re.S)
              if MANUAL_BOX in b and "load_cert_chain" not in b]
    assert len(blocks) == 2
    for block in blocks:
        code = block.replace(MANUAL_BOX, https_box.base_url).replace(MANUAL_CA, str(ca.cert))
        exec(compile(code, str(MANUAL), "exec"), {})
        assert capsys.readouterr().out.strip(), block


@pytest.mark.integration
def test_plain_http_and_an_untrusting_client_get_nothing(https_box: LiveServer) -> None:
    """No answer in clear on the HTTPS port, and no connection for a client that does not
    trust the store's CA (here: the system's CAs only)."""
    plain = https_box.base_url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"{https_box.base_url}/health", timeout=5)


@pytest.mark.integration
def test_mutual_tls_serves_only_clients_with_a_certificate_of_its_ca(
        model_cache: Path, tmp_path: Path, ca: StoreCA) -> None:
    pair, app = ca.issue("mtls-box"), ca.issue("pos-app", client=True)
    stranger = StoreCA(tmp_path / "other", name="not the store").issue("x", client=True)
    settings = load_settings(None, state_dir=clone_state(model_cache, tmp_path / "s"), **{
        "server.port": free_port(), "runtime.context_length": 512,
        "server.tls_cert_file": str(pair.cert), "server.tls_key_file": str(pair.key),
        "server.tls_client_ca_file": str(ca.cert)})
    live = start_server(settings, verify=ca.client_context(app))
    try:
        client = ollama.Client(host=live.ollama_url, verify=ca.client_context(app))
        reply = client.chat(model=DEFAULT_MODEL, options={"num_predict": 4},
                            messages=[{"role": "user", "content": "Hi"}])
        assert reply.done
        for ctx in (ca.client_context(), ca.client_context(stranger)):
            with pytest.raises(httpx.TransportError):
                httpx.get(f"{live.base_url}/health", verify=ctx, timeout=5)
        port = _port(settings)  # doctor has no client certificate: the served one tells
        assert port.status == "ok", port
        assert "asks client certificates" in port.detail and "configured certificate" in \
            port.detail
    finally:
        live.stop()


@pytest.mark.integration
def test_doctor_probes_the_https_port_and_sees_a_certificate_not_yet_reloaded(
        https_box: LiveServer, live_server: LiveServer, ca: StoreCA) -> None:
    box = https_box.settings
    port = _port(box)
    assert port.status == "ok", port
    assert port.detail.startswith("edge-agent 0.") and "https://127.0.0.1:" in port.detail
    other = ca.issue("installed-not-reloaded")
    pending = load_settings(None, state_dir=box.state_dir, **{
        "server.port": box.server.port, "server.tls_cert_file": str(other.cert),
        "server.tls_key_file": str(other.key)})
    port = _port(pending)
    assert port.status == "warn" and "another certificate than" in port.detail
    assert port.fix.startswith("systemctl reload edge-agent")
    plain = load_settings(None, state_dir=box.state_dir, **{
        "server.port": live_server.settings.server.port,
        "server.tls_cert_file": str(other.cert), "server.tls_key_file": str(other.key)})
    port = _port(plain)  # configured for TLS, still serving the old way
    assert port.status == "warn" and "plain HTTP, not HTTPS" in port.detail


@pytest.mark.integration
def test_a_tls_client_that_stops_reading_its_stream_frees_its_slot(
        model_cache: Path, tmp_path: Path, ca: StoreCA) -> None:
    """The stall watchdog (tests/test_connections.py) sees through TLS: it reads the raw
    socket's acknowledged bytes under the TLS transport."""
    stall_s, slack_s = 3.0, 1.5
    pair = ca.issue("stall-box")
    settings = load_settings(None, state_dir=clone_state(model_cache, tmp_path / "s"), **{
        "server.port": free_port(), "runtime.context_length": 2048,
        "server.stall_timeout_s": stall_s,
        "server.tls_cert_file": str(pair.cert), "server.tls_key_file": str(pair.key)})
    live = start_server(settings, verify=ca.client_context())
    try:
        model = next(m for m in live.app.state.parts.registry.loaded()
                     if m.info.name == DEFAULT_MODEL)
        body = json.dumps({
            "model": DEFAULT_MODEL, "stream": True, "max_tokens": 1900, "temperature": 1.0,
            "logit_bias": NO_EOS,
            "messages": [{"role": "user", "content": "Write a very long story."}]}).encode()
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        raw.settimeout(10)
        raw.connect(("127.0.0.1", settings.server.port))
        sock = ca.client_context().wrap_socket(raw, server_hostname="localhost")
        sent = time.monotonic()
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n" * 4
                     + b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(body), body))
        while model.worker.running == 0:  # the generation holds a slot
            assert time.monotonic() - sent < stall_s, "the generation did not start in time"
            time.sleep(0.01)
        while model.in_use and time.monotonic() - sent < stall_s + slack_s:
            time.sleep(0.02)
        assert model.in_use == 0, "the stream held its model for a client that reads nothing"
        sock.close()
    finally:
        live.stop()


# -- reload at SIGHUP, in a real `edge-agent serve` -----------------------------------------

@pytest.mark.integration
def test_sighup_serves_the_new_certificate_while_a_stream_goes_on(
        model_cache: Path, tmp_path: Path, ca: StoreCA) -> None:
    old, new, stray = ca.issue("old"), ca.issue("new"), ca.issue("stray")
    cert, key = tmp_path / "tls" / "box.pem", tmp_path / "tls" / "box.key"
    cert.parent.mkdir()
    _install(old, cert, key)
    port = free_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "EDGE_AGENT_RUNTIME__CONTEXT_LENGTH": "1024",
           "EDGE_AGENT_TELEMETRY__HARDWARE": "false",
           "EDGE_AGENT_SERVER__TLS_CERT_FILE": str(cert),
           "EDGE_AGENT_SERVER__TLS_KEY_FILE": str(key)}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "serve", "--state-dir",
                                 str(clone_state(model_cache, tmp_path / "s")), "--port",
                                 str(port)], env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"https://127.0.0.1:{port}"
    trust = ca.client_context()
    try:
        _wait(lambda: _ready(url, trust) or proc.poll() is not None, 120)
        assert proc.poll() is None, log.read_text()
        assert fingerprint(served_certificate("127.0.0.1", port) or b"") == \
            fingerprint(old.cert)
        with httpx.Client(verify=trust, timeout=120) as http:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                   http_client=http)
            stream = client.chat.completions.create(
                model=DEFAULT_MODEL, max_tokens=300, stream=True, temperature=1.0,
                logit_bias=NO_EOS, messages=[{"role": "user", "content": "Tell a story."}])
            first = next(iter(stream))
            assert first.choices
            _install(new, cert, key)
            proc.send_signal(signal.SIGHUP)
            _wait(lambda: served_certificate("127.0.0.1", port) is not None and fingerprint(
                served_certificate("127.0.0.1", port) or b"") == fingerprint(new.cert), 10)
            # A new connection, verified against the store's CA, gets the new certificate.
            fresh = ollama.Client(host=url, verify=trust).chat(
                model=DEFAULT_MODEL, options={"num_predict": 2},
                messages=[{"role": "user", "content": "Hi"}])
            assert fresh.done
            rest = list(stream)  # the stream opened before the reload, on its connection
        assert rest and rest[-1].choices[0].finish_reason == "length"
        # A key without its certificate: refused, the new certificate still served.
        os.replace(_copy(stray.key, tmp_path / "k.tmp"), key)
        proc.send_signal(signal.SIGHUP)
        _wait(lambda: b"TLS reload refused" in log.read_bytes(), 10)
        assert fingerprint(served_certificate("127.0.0.1", port) or b"") == \
            fingerprint(new.cert)
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=90)
    text = log.read_text()
    assert "TLS certificate reloaded" in text and f"https://127.0.0.1:{port}" in text


def _ready(url: str, trust: ssl.SSLContext) -> bool:
    try:
        return httpx.get(f"{url}/ready", verify=trust, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _wait(condition: object, timeout: float) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
