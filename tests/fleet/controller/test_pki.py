"""The fleet's own CA (`fleet pki`): its certificates pass strict verification in real TLS
handshakes (a server's for its names only, a box's as a client for mutual TLS), keys stay
owner-only, `renew` reissues exactly what ends within its window, and the CLI says where
each file goes. (The private brokers and controllers of the other fleet tests are served
with certificates of this CA too: `fleet.sim.testbed.make_tls`.)"""

from __future__ import annotations

import json
import socket
import ssl
import stat
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography import x509

from edge_agent.cli import main
from edge_agent.errors import Conflict, InvalidRequest, NotFound
from edge_agent.fleet.controller.pki import FleetCA


def _client(ca: FleetCA, cert: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca.cert_file))
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    if cert is not None:
        ctx.load_cert_chain(cert, cert.with_suffix(".key"))
    return ctx


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
               hostname: str) -> str | None:
    """One real TLS handshake over loopback: the client's error, or None; the server side
    reads the peer's certificate when it asks for one."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        peer: dict[str, object] = {}

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                with server_ctx.wrap_socket(conn, server_side=True) as tls:
                    peer["cert"] = tls.getpeercert()
                    tls.sendall(b"ok")
            except (ssl.SSLError, OSError) as exc:
                peer["error"] = exc

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        try:
            with socket.create_connection(listener.getsockname(), timeout=10) as raw, \
                    client_ctx.wrap_socket(raw, server_hostname=hostname) as tls:
                assert tls.recv(2) == b"ok"
        except (ssl.SSLError, OSError) as exc:
            return str(exc)
        finally:
            thread.join(10)
        return None


def _server(ca: FleetCA, name: str, *, clients: bool = False) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ca.folder / f"{name}.pem", ca.folder / f"{name}.key")
    if clients:  # mutual TLS: only this CA's clients
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=str(ca.cert_file))
    return ctx


def test_a_servers_certificate_passes_strict_verification_for_its_names_only(
        tmp_path: Path) -> None:
    ca = FleetCA.init(tmp_path / "pki", name="acme fleet CA")
    issued = ca.issue("broker", "broker", dns=["broker.acme.example", "Broker-2.acme.example."],
                      ips=["127.0.0.1", "::1"])
    assert issued.dns == ("broker.acme.example", "broker-2.acme.example")
    assert _handshake(_server(ca, "broker"), _client(ca), "broker.acme.example") is None
    assert _handshake(_server(ca, "broker"), _client(ca), "127.0.0.1") is None
    wrong = _handshake(_server(ca, "broker"), _client(ca), "other.acme.example")
    assert wrong is not None and "match" in wrong.lower()
    stranger = FleetCA.init(tmp_path / "other")
    refused = _handshake(_server(ca, "broker"), _client(stranger), "broker.acme.example")
    assert refused is not None and "certificate verify failed" in refused
    cert = x509.load_pem_x509_certificate((ca.folder / "broker.pem").read_bytes())
    assert cert.issuer.rfc4514_string() == "CN=acme fleet CA"
    assert 396 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 398


def test_a_boxs_certificate_is_taken_for_mutual_tls_and_a_strangers_is_not(
        tmp_path: Path) -> None:
    ca = FleetCA.init(tmp_path / "pki")
    ca.issue("broker", "broker", dns=["localhost"])
    ca.issue("store-001", "box")
    server = _server(ca, "broker", clients=True)
    assert _handshake(server, _client(ca, ca.folder / "store-001.pem"), "localhost") is None
    stranger = FleetCA.init(tmp_path / "other")
    stranger.issue("store-001", "box")
    assert _handshake(server, _client(ca, stranger.folder / "store-001.pem"),
                      "localhost") is not None
    # A client's certificate is no server's: a box cannot pose as the broker.
    posing = _handshake(_server(ca, "store-001"), _client(ca), "store-001")
    assert posing is not None


def test_keys_are_owner_only_and_the_ca_is_made_once(tmp_path: Path) -> None:
    ca = FleetCA.init(tmp_path / "pki")
    ca.issue("controller", "controller", dns=["controller.example"])
    for key in ("ca.key", "controller.key"):
        assert stat.S_IMODE((ca.folder / key).stat().st_mode) == 0o600
    with pytest.raises(Conflict, match="one CA a fleet"):
        FleetCA.init(tmp_path / "pki")
    with pytest.raises(InvalidRequest, match="needs the names clients reach it by"):
        ca.issue("releases", "releases")
    with pytest.raises(InvalidRequest, match="kind"):
        ca.issue("x", "laptop", dns=["x"])
    with pytest.raises(InvalidRequest, match="not a DNS name"):
        ca.issue("x", "broker", dns=["bad name"])
    with pytest.raises(ValueError, match="holds"):
        ca.issue("../escape", "box")
    with pytest.raises(NotFound, match="fleet pki init"):
        FleetCA(tmp_path / "none").issue("b", "broker", dns=["b"])


def test_renew_reissues_what_ends_within_its_window_with_a_new_key(tmp_path: Path) -> None:
    ca = FleetCA.init(tmp_path / "pki")
    short = ca.issue("bridge-eu", "bridge", days=10)
    ca.issue("broker", "broker", dns=["broker.example"])
    old_key = (ca.folder / "bridge-eu.key").read_bytes()
    renewed = ca.renew(within_days=30)
    assert [i.name for i in renewed] == ["bridge-eu"]
    assert renewed[0].serial != short.serial and renewed[0].days == 10
    assert (ca.folder / "bridge-eu.key").read_bytes() != old_key
    later = time.time() + 380 * 86400  # a year on: the broker's too
    assert {i.name for i in ca.renew(within_days=30, now=later)} == {"bridge-eu", "broker"}
    assert {i.name: i.kind for i in ca.issued()} == {"bridge-eu": "bridge", "broker": "broker"}


def test_the_cli_makes_lists_and_renews_and_says_where_each_file_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    run = CliRunner()
    made = run.invoke(main, ["fleet", "pki", "init"])
    assert made.exit_code == 0, made.output
    assert "pki/ca.pem" in made.output and "0600" in made.output
    out = run.invoke(main, ["fleet", "pki", "issue", "controller", "--kind", "controller",
                            "--dns", "controller.example", "--ip", "10.0.0.5"])
    assert out.exit_code == 0, out.output
    assert "tls_cert_file = pki/controller.pem" in out.output
    assert "--ca-file pki/ca.pem" in out.output
    box = run.invoke(main, ["fleet", "pki", "issue", "store-001", "--kind", "box",
                            "--days", "20", "--json"])
    assert json.loads(box.output)["kind"] == "box"
    listed = json.loads(run.invoke(main, ["fleet", "pki", "list", "--json"]).output)
    assert [c["name"] for c in listed["certificates"]] == ["controller", "store-001"]
    text = run.invoke(main, ["fleet", "pki", "list"]).output
    assert "store-001" in text and "renew" in text  # 20 days left
    renewed = json.loads(run.invoke(main, ["fleet", "pki", "renew", "--json"]).output)
    assert [r["name"] for r in renewed["renewed"]] == ["store-001"]
    bad = run.invoke(main, ["fleet", "pki", "renew", "--within", "soon"])
    assert bad.exit_code == 2 and "--within" in bad.output
    again = run.invoke(main, ["fleet", "pki", "init"])
    assert again.exit_code == 1 and "holds a CA already" in again.output
